"""ORTModule composed with what wraps, checks or shards a model: the wrapper is an instance of the
model's class; FSDP2's fully_shard on ORTModule-wrapped blocks (and on a model holding them) and
ZeroRedundancyOptimizer with DistributedDataParallel train in step with the same runs without
ORTModule (2 gloo processes); what cannot work is refused by name."""
import pickle
from copy import deepcopy

import onnx
import pytest
import torch
import torch.nn as nn

from ort_trainer._graph.backward_weights import weights_read_in_backward
from ort_trainer.ortmodule import ORTModule

from . import ortmodule_fsdp_worker as worker


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every scenario of the worker, run once on 2 processes: {(scenario, run): result} per rank."""
    directory = tmp_path_factory.mktemp("fsdp")
    for rank, (returncode, stderr) in enumerate(worker.launch(directory)):
        assert returncode == 0, f"rank {rank} exited with {returncode}:\n{stderr[-3000:]}"
    return [torch.load(directory / f"rank{rank}.pt") for rank in range(worker.WORLD_SIZE)]


@pytest.mark.parametrize("scenario", sorted(worker.SCENARIOS))
def test_sharded_training_with_ortmodule_is_in_step_with_the_same_run_without(ranks, scenario):
    for run in ranks:
        eager, ort = run[(scenario, "eager")], run[(scenario, "ort")]
        assert ort["graphs"] == {"fsdp_nested": 2, "fsdp_nested_kept": 2}.get(scenario, 1)  # one per ORTModule
        # fully_shard's default below the root: the blocks' parameters freed after the forward, gathered again
        assert ort["freed"] == eager["freed"] == {"fsdp_nested": [True, True], "fsdp_nested_kept": [False, False]}.get(
            scenario, [])
        for step, (loss, want) in enumerate(zip(ort["losses"], eager["losses"], strict=True)):
            assert abs(loss - want) <= 1e-5 * abs(want), (step, loss, want)
        assert ort["weights"].keys() == eager["weights"].keys()
        for name, want in eager["weights"].items():
            got = ort["weights"][name]
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5, name


def test_sharded_submodules_and_foreign_dtensors_are_refused(ranks):
    for run in ranks:
        assert run["refusals"] == {
            "sharded blocks": "ORTModule: submodules ['blocks.1'] of the FSDPStack are sharded by FSDP2's fully_shard on "
            "their own, and their hooks would run inside the graph's traced forward: shard the model as a whole "
            "(ORTModule(fully_shard(model))), or wrap each block before sharding it: fully_shard(ORTModule(block))",
            "sharded parameters": "ORTModule: parameters ['up.weight'] of the Block are DTensors (sharded by FSDP2's "
            "fully_shard or tensor parallelism), while the graph reads plain tensors; wrap the model before sharding "
            "it: fully_shard(ORTModule(model))"}


class Folded(nn.Module):
    """A LayerNorm (its gradient reads its weight) and a product with a reshaped parameter (the
    product's gradient reads the reshape, a view of the parameter's memory in ONNX Runtime)."""

    def __init__(self):
        super().__init__()
        self.norm, self.folded = nn.LayerNorm(8), nn.Parameter(torch.randn(2, 4, 6) / 3)

    def forward(self, x):
        return torch.matmul(self.norm(x), self.folded.reshape(8, 6)).tanh()


def _gathered_again(parameter, values):
    """What FSDP2 does to a gathered parameter between the forward and the backward: its memory freed
    (and taken by something else: the NaNs returned), allocated again and filled (here with `values`),
    the tensor and its version unchanged. The new memory is allocated while the old is still held, so
    it never lands at the old address (a freed block handed straight back would hide a stale read)."""
    storage = parameter.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(nbytes + 64)
    taken = [torch.full((nbytes // values.element_size(),), float("nan")) for _ in range(4)]
    taken.append(torch.full((4096,), float("nan")))
    with torch.no_grad():
        torch.empty(0).set_(storage, 0, parameter.shape, parameter.stride()).copy_(values)
    return taken


def test_the_backward_reads_the_parameters_as_they_are_when_it_runs_as_eager_autograd_does():
    """Parameters freed and gathered again, into new memory and with new values, between the forward
    and the backward: the gradients are eager autograd's, which reads them as they are then."""
    torch.manual_seed(0)
    eager = Folded()
    wrapped = ORTModule(deepcopy(eager))
    x = torch.randn(5, 8)
    inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outputs, taken = [eager(inputs[0]), wrapped(inputs[1])], []
    for model in (eager, wrapped):
        for parameter in model.parameters():
            address = parameter.data_ptr()
            taken.append(_gathered_again(parameter, parameter.detach() * 2 + 0.1))
            assert parameter.data_ptr() != address
    for output in outputs:
        (output ** 2).sum().backward()
    torch.testing.assert_close(inputs[1].grad, inputs[0].grad)
    for (name, want), got in zip(eager.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)


def test_a_weight_a_backward_subgraph_reads_stays_read_in_place():
    """A weight read inside an If after the YieldOp keeps the forward's memory (the Function refuses
    it moving); one a backward node reads passes through the YieldOp and a PassThrough."""
    helper, floats = onnx.helper, onnx.TensorProto.FLOAT
    branch = helper.make_graph([helper.make_node("Identity", ["w"], ["read"])], "branch", [],
                               [helper.make_tensor_value_info("read", floats, [2])])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"]), helper.make_node("Mul", ["y", "v"], ["z"]),
         helper.make_node("YieldOp", ["z"], ["z_grad"], domain="com.microsoft", full_shape_outputs=[0]),
         helper.make_node("Mul", ["z_grad", "v"], ["y_grad"]),
         helper.make_node("If", ["c"], ["w_read"], then_branch=branch, else_branch=branch)],
        "training", [helper.make_tensor_value_info(name, floats, [2]) for name in ("x", "w", "v")]
        + [helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info(name, floats, [2]) for name in ("y_grad", "w_read")])
    model = helper.make_model(graph)
    assert weights_read_in_backward(model, ["w", "v"]) == (["v"], ["w"])
    yield_op, passed, product = model.graph.node[2:5]
    assert list(yield_op.input) == ["z", "v"] and list(yield_op.output) == ["z_grad", "v_backward_fed"]
    assert (passed.op_type, list(passed.input), list(passed.output)) == ("PassThrough", ["v_backward_fed"],
                                                                         ["v_backward"])
    assert list(product.input) == ["z_grad", "v_backward"]
    assert list(next(a for a in yield_op.attribute if a.name == "full_shape_outputs").ints) == [0, 1]


def test_an_input_whose_memory_moves_before_the_backward_is_refused_not_read_freed():
    wrapped = ORTModule(nn.LayerNorm(4))
    x = torch.randn(2, 4, requires_grad=True)
    output = wrapped(x)
    x.data = x.data.clone()  # the LayerNorm's gradient reads its input where the forward found it
    with pytest.raises(RuntimeError, match=r"the memory of \['input'\] moved between the forward and the backward"):
        output.sum().backward()


# ---------------------------------------------------------------- the wrapper is an instance of the model's class

class Scaled(nn.Linear):
    """A model class with a class attribute, a property and a helper whose self(...) runs the graph."""

    kind = "scaled"

    @property
    def fan_in(self):
        return self.in_features

    def twice(self, x):
        return 2 * self(x)


def test_the_wrapper_is_an_instance_of_the_models_class_and_keeps_what_it_promises():
    torch.manual_seed(0)
    model = Scaled(4, 3)
    wrapped = ORTModule(model)
    assert isinstance(wrapped, Scaled) and isinstance(wrapped, nn.Linear) and isinstance(wrapped, ORTModule)
    assert type(wrapped).__name__ == "ORTModule" and type(ORTModule(Scaled(4, 3))) is type(wrapped)
    assert not isinstance(ORTModule(nn.Linear(4, 3)), Scaled)
    assert wrapped.kind == type(wrapped).kind == "scaled" and wrapped.fan_in == 4
    assert list(wrapped.state_dict()) == ["weight", "bias"] and wrapped.weight is model.weight
    x = torch.randn(2, 4)
    torch.testing.assert_close(wrapped.twice(x), model.twice(x))
    assert len(wrapped._graphs) == 1  # the helper's self(x) ran the graph
    for copy in (pickle.loads(pickle.dumps(wrapped)), deepcopy(wrapped)):
        assert isinstance(copy, Scaled) and type(copy) is type(wrapped) and len(copy._graphs) == 0
        torch.testing.assert_close(copy(x), model(x))


def test_a_hugging_face_wrapper_is_a_pretrained_model_whose_library_methods_act_on_the_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50,
                                                                 n_positions=16))
    wrapped = ORTModule(model)
    assert isinstance(wrapped, transformers.GPT2LMHeadModel) and isinstance(wrapped, transformers.PreTrainedModel)
    assert wrapped.save_pretrained.__self__ is model and wrapped.generate.__self__ is model
    assert type(wrapped).config_class is transformers.GPT2Config and wrapped.device == torch.device("cpu")
    wrapped.save_pretrained(tmp_path)
    assert transformers.GPT2LMHeadModel.from_pretrained(tmp_path).config.n_embd == 16


def test_transformers_trainer_checkpoints_the_wrapper_by_the_models_save_pretrained(tmp_path):
    """Trainer saves a PreTrainedModel by its save_pretrained: safetensors with GPT-2's tied weights
    and config.json, which from_pretrained loads."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50,
                                                                 n_positions=16))
    ids = torch.randint(0, 50, (8, 8), generator=torch.Generator().manual_seed(0))
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                               report_to=[], use_cpu=True, save_steps=2, disable_tqdm=True)
    trainer = transformers.Trainer(model=ORTModule(model), args=arguments,
                                   train_dataset=[{"input_ids": row, "labels": row} for row in ids])
    trainer.train()
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "checkpoint-2")
    assert (tmp_path / "checkpoint-2" / "model.safetensors").exists()
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, model.eval()(ids).logits)


# ---------------------------------------------------------------- caches and other containers among the outputs

def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _tiny_llama(transformers):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))


def test_a_peft_lora_llama_trains_only_its_adapters_in_step_with_eager_and_saves_them(tmp_path):
    """A PEFT-wrapped Llama returns its DynamicCache (its forward takes no use_cache): the cache comes
    back rebuilt around the graph's key and value tensors."""
    import peft
    import transformers

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(_tiny_llama(transformers), config)
    eager = deepcopy(model)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    wrapped = ORTModule(model)
    assert isinstance(wrapped, peft.PeftModelForCausalLM)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (2, 8), generator=generator) for _ in range(6)]

    def train(module):
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=0.01)
        losses = []
        for ids in batches:
            optimizer.zero_grad()
            output = module(input_ids=ids, labels=ids)
            output.loss.backward()
            optimizer.step()
            losses.append(output.loss.item())
        return losses, output

    (expected, eager_output), (losses, output) = train(eager), train(wrapped)
    for step, (loss, want) in enumerate(zip(losses, expected, strict=True)):
        assert abs(loss - want) <= 1e-4 * abs(want), (step, loss, want)
    trained = dict(eager.named_parameters())
    adapters = [name for name, p in wrapped.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in name for name in adapters)
    for name in adapters:
        assert _relative(dict(wrapped.named_parameters())[name], trained[name]) <= 1e-4, name
    for name, p in wrapped.named_parameters():
        if not p.requires_grad:
            assert p.grad is None and torch.equal(p, frozen[name]), name  # bit-unchanged
    assert len(wrapped._graphs) == 1

    cache, eager_cache = output.past_key_values, eager_output.past_key_values
    assert type(cache) is type(eager_cache) and cache.get_seq_length() == eager_cache.get_seq_length() == 8
    for layer, eager_layer in zip(cache.layers, eager_cache.layers, strict=True):
        assert type(layer) is type(eager_layer) and vars(layer).keys() == vars(eager_layer).keys()
        assert _relative(layer.keys, eager_layer.keys) <= 1e-5 and _relative(layer.values, eager_layer.values) <= 1e-5
    assert output.past_key_values is not wrapped(input_ids=batches[0]).past_key_values  # a new cache per call

    wrapped.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(_tiny_llama(transformers), tmp_path)
    with torch.no_grad():
        assert _relative(reloaded(input_ids=batches[0]).logits, wrapped(input_ids=batches[0]).logits) <= 1e-5


class WithCache(nn.Module):
    """Returns its projection and a DynamicCache holding it (a transformers cache is no pytree node)."""

    def __init__(self, odd=None):
        super().__init__()
        self.linear, self.odd = nn.Linear(4, 4), odd

    def forward(self, x):
        from transformers import DynamicCache

        y = self.linear(x)
        cache = DynamicCache()
        cache.update(y[None, None], 2 * y[None, None], 0)
        if self.odd is not None:
            cache.layers[0].origin = self.odd
        return y.sum(), cache


class Pair:
    def __init__(self, first, second):
        self.first, self.second = first, second


torch.utils._pytree.register_pytree_node(Pair, lambda pair: ([pair.first, pair.second], None),
                                         lambda children, _: Pair(*children))


class WithPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return Pair(y, {"scaled": 3 * y, "note": "kept"})


def test_caches_and_pytree_containers_are_rebuilt_around_the_graphs_tensors_which_get_gradients():
    pytest.importorskip("transformers")
    x = torch.randn(3, 4)
    for make, tensors in ((WithCache, lambda out: (out[0], out[1].layers[0].keys, out[1].layers[0].values)),
                          (WithPair, lambda out: (out.first, out.second["scaled"]))):
        torch.manual_seed(0)
        model = make()
        wrapped = ORTModule(deepcopy(model))
        eager_out, out = model(x), wrapped(x)
        assert type(out) is type(eager_out) and len(wrapped._graphs) == 1
        sum(t.sum() for t in tensors(eager_out)).backward()
        sum(t.sum() for t in tensors(out)).backward()
        for got, want in zip(tensors(out), tensors(eager_out), strict=True):
            torch.testing.assert_close(got, want)
        for name, p in model.named_parameters():
            torch.testing.assert_close(dict(wrapped.named_parameters())[name].grad, p.grad)
    assert out.second["note"] == "kept"


def test_a_cache_holding_more_than_plain_values_is_refused_by_name():
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"forward\(\) returned a Generator at output\[1\]\.layers\[0\]\.origin, "
                                         r"inside the cache output\[1\]: .* Call the model with use_cache=False"):
        ORTModule(WithCache(odd=torch.Generator()))(torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"forward\(\) returned a Generator at output\[1\]; .* register the type with "
                                         r"torch.utils._pytree.register_pytree_node, or leave it out of the outputs"):
        ORTModule(Returning(torch.Generator()))(torch.randn(3, 4))


class Returning(nn.Linear):
    def __init__(self, extra):
        super().__init__(4, 4)
        self.extra = extra

    def forward(self, x):
        return super().forward(x), self.extra
