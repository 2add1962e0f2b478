"""ORTModule: the wrapped model trains in step with eager PyTorch under torch optimizers, gives the
same input gradients and output structures, honours train/eval and no_grad, falls back to PyTorch
as ORTMODULE_FALLBACK_POLICY says, and refuses bad options by name."""
import contextlib
import copy
import json
import logging
import os
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path

import onnx
import pytest
import torch
import torch.nn as nn

from ort_trainer.ortmodule import DebugOptions, LogLevel, ORTModule
from ort_trainer.ortmodule._wrapper import MAX_CACHED_GRAPHS

from . import models

STEPS = 20


def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _comparable(name, tensor):
    """Without the attention key bias (the middle third of nn.MultiheadAttention's and GPT-2's
    query-key-value bias): its true gradient is zero (softmax ignores a shift shared by all keys),
    so Adam turns float noise into lr-sized steps in either framework."""
    if name.endswith(("self_attn.in_proj_bias", "attn.c_attn.bias")):
        third = tensor.numel() // 3
        return torch.cat([tensor[:third], tensor[2 * third:]])
    return tensor


def _train(model, batches, make_optimizer, step_loss, clip=None, scheduler=None):
    """A plain PyTorch loop; returns the loss of every step."""
    optimizer = make_optimizer(model.parameters())
    schedule = scheduler(optimizer) if scheduler else None
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = step_loss(model, batch)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if schedule is not None:
            schedule.step()
        losses.append(loss.item())
    return losses


def assert_trains_like_eager(model, batches, make_optimizer, step_loss, **loop):
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    expected = _train(eager, batches, make_optimizer, step_loss, **loop)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ORTModule")  # a fallback to PyTorch would warn
        losses = _train(wrapped, batches, make_optimizer, step_loss, **loop)
    for step, (loss, want) in enumerate(zip(losses, expected)):
        assert abs(loss - want) <= 1e-4 * abs(want), (step, loss, want)
    trained = dict(wrapped.named_parameters())
    assert trained.keys() == dict(eager.named_parameters()).keys()
    for name, want in eager.named_parameters():
        assert _relative(_comparable(name, trained[name].detach()), _comparable(name, want.detach())) <= 1e-4, name
    return wrapped


# ---------------------------------------------------------------- parity, 20 steps

def test_mlp_trains_like_eager_with_sgd():
    batches = [models.mlp_batch(step) for step in range(STEPS)]
    wrapped = assert_trains_like_eager(
        models.mlp(), batches, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        lambda model, batch: models.mlp_loss(model(batch[0]), batch[1]))
    assert len(wrapped._graphs) == 1  # one signature, one graph


def test_seed_transformer_trains_like_eager_with_adam_clip_and_scheduler():
    batches = [models.transformer_batch(step) for step in range(STEPS)]
    assert_trains_like_eager(
        models.transformer(), batches, lambda p: torch.optim.Adam(p, lr=0.01),
        lambda model, batch: models.transformer_loss(model(batch[0]), batch[1]),
        clip=0.5, scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 5, gamma=0.5))


def test_two_inputs_two_outputs_train_like_eager_with_adamw():
    batches = [models.two_tower_batch(step) for step in range(STEPS)]

    def step_loss(model, batch):
        loss, prediction = model(batch[0], b=batch[1])  # by position and by keyword
        return loss + 0.1 * prediction.sum()

    model = models.two_tower()
    model.left.bias.requires_grad_(False)  # frozen: read, never differentiated
    wrapped = assert_trains_like_eager(model, batches, lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
                                       step_loss)
    assert wrapped.left.bias.grad is None and torch.equal(wrapped.left.bias, model.left.bias)


def test_hugging_face_gpt2_trains_like_eager_and_returns_its_model_output():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(3, 96, (3, 10), generator=generator), torch.randint(3, 96, (3, 10), generator=generator))
               for _ in range(STEPS)]
    outputs = []

    def step_loss(model, batch):
        output = model(input_ids=batch[0], labels=batch[1], use_cache=False)
        outputs.append(output)
        return output.loss

    assert_trains_like_eager(model, batches, lambda p: torch.optim.Adam(p, lr=1e-3), step_loss)
    eager, ours = outputs[0], outputs[STEPS]
    assert type(ours) is type(eager) and list(ours.keys()) == ["loss", "logits"]
    assert _relative(ours.logits, eager.logits) <= 1e-5


def test_outputs_are_not_overwritten_by_their_backward_or_later_calls():
    model = ORTModule(models.transformer())
    kept = []
    for step in range(3):
        src, targets = models.transformer_batch(step)
        output = model(src)
        models.transformer_loss(output, targets).backward()
        kept.append((output, output.detach().clone()))
    unbackwarded = model(models.transformer_batch(3)[0])
    expected = unbackwarded.detach().clone()
    models.transformer_loss(model(models.transformer_batch(4)[0]), models.transformer_batch(4)[1]).backward()
    for output, expected_output in [*kept, (unbackwarded, expected)]:
        assert torch.equal(output, expected_output)
    assert len({output.data_ptr() for output, _ in kept}) == len(kept)


class WithLoss(nn.Module):
    """The seed transformer with its loss inside the wrapped module (as Hugging Face models have)."""

    def __init__(self):
        super().__init__()
        self.model = models.transformer()

    def forward(self, src, targets):
        return models.transformer_loss(self.model(src), targets)


def test_a_loss_inside_the_model_trains_like_eager_on_the_threaded_softmax_cross_entropy(monkeypatch, tmp_path):
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    batches = [models.transformer_batch(step) for step in range(5)]
    eager = WithLoss()
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(save_onnx=True, onnx_prefix="seed"))
    expected = _train(eager, batches, lambda p: torch.optim.SGD(p, lr=0.1), lambda model, batch: model(*batch))
    losses = _train(wrapped, batches, lambda p: torch.optim.SGD(p, lr=0.1), lambda model, batch: model(*batch))
    assert max(abs(a - b) / b for a, b in zip(losses, expected)) <= 1e-5
    graph = onnx.load(tmp_path / "seed_optimized_training.onnx").graph
    op_types = {node.op_type for node in graph.node}
    assert "LogSoftmax" in op_types and not op_types & {"SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad"}


# ---------------------------------------------------------------- inputs and outputs

def test_gradients_of_the_inputs_that_require_them():
    model = models.two_tower()
    wrapped = ORTModule(copy.deepcopy(model))
    a, b = models.two_tower_batch(0)
    results = []
    for net in (model, wrapped):
        a_, b_ = a.clone().requires_grad_(), b.clone()
        loss, prediction = net(a_, b_)
        (loss + prediction.sum()).backward()
        results.append((a_.grad, b_.grad, [p.grad for p in net.parameters()]))
    (a_want, b_want, grads_want), (a_ours, b_ours, grads_ours) = results
    assert b_want is None and b_ours is None
    assert _relative(a_ours, a_want) <= 1e-5
    for ours, want in zip(grads_ours, grads_want):
        assert _relative(ours, want) <= 1e-5


class Structured(nn.Module):
    """Outputs in a nested structure, with constants, an integer output and one the loss skips."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, scale=2.0, tag=None):
        y = self.linear(x) * scale
        return {"pair": (y, y.exp()), "nothing": tag, "count": 7, "best": y.argmax(-1)}


def test_outputs_keep_their_structure_and_unused_outputs_get_no_gradient():
    model = Structured()
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(5, 4)
    want, ours = model(x, scale=3.0), wrapped(x, scale=3.0)
    assert type(ours) is dict and list(ours) == ["pair", "nothing", "count", "best"]
    assert type(ours["pair"]) is tuple and ours["nothing"] is None and ours["count"] == 7
    assert torch.equal(ours["best"], want["best"]) and not ours["best"].requires_grad
    for o, w in zip(ours["pair"], want["pair"]):
        assert _relative(o, w) <= 1e-5 and o.requires_grad
    ours["pair"][1].sum().backward()  # the first output of the pair gets no gradient
    want["pair"][1].sum().backward()
    for o, w in zip(wrapped.parameters(), model.parameters()):
        assert _relative(o.grad, w.grad) <= 1e-5
    assert _relative(wrapped(x, 0.5)["pair"][0], model(x, 0.5)["pair"][0]) <= 1e-5
    assert len(wrapped._graphs) == 2  # the constant is part of the signature


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.threshold = nn.Parameter(torch.zeros(3))

    def forward(self, x, gate):
        return self.linear(x) * (gate > self.threshold)


def test_inputs_and_parameters_without_a_differentiable_path_get_no_gradient(caplog):
    x, gate = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    model = Gated()
    wrapped = ORTModule(copy.deepcopy(model), DebugOptions(log_level=LogLevel.INFO))
    with warnings.catch_warnings(), caplog.at_level("INFO", logger="ort_trainer.ortmodule"):
        warnings.filterwarnings("error", message="ORTModule")  # no fallback: the graph is built without their gradients
        wrapped(x, gate).sum().backward()
    assert [record.getMessage().split(" in ")[0] for record in caplog.records] == [
        "ORTModule: compiled the training graph of Gated for inputs {'x': [4, 3], 'gate': [4, 3]}"]
    expected_x_grad = x.grad.clone()
    x.grad = None
    model(x, gate).sum().backward()
    assert gate.grad is None and wrapped.threshold.grad is None and model.threshold.grad is None
    assert _relative(expected_x_grad, x.grad) <= 1e-6
    assert _relative(wrapped.linear.weight.grad, model.linear.weight.grad) <= 1e-6


class Suffixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x, mode):
        return x * self.scale + (1 if mode == "shift" else -1)


def test_a_string_argument_is_a_constant_of_the_graph_and_says_so(caplog):
    """DebugOptions' log level decides, not the logger's (WARNING here: no caplog.at_level)."""
    x = torch.randn(3, 2)
    ORTModule(Suffixed())(x, "shift")  # the default WARNING: no line
    assert caplog.records == []
    wrapped = ORTModule(Suffixed(), DebugOptions(log_level=LogLevel.INFO))
    torch.testing.assert_close(wrapped(x, "shift"), x + 1)
    torch.testing.assert_close(wrapped(x, "other"), x - 1)  # another value: another graph
    lines = [record.getMessage() for record in caplog.records if "treated as a constant" in record.getMessage()]
    assert lines == [f"ORTModule: Received input of type <class 'str'> is treated as a constant by ORT by default. "
                     f"(argument 'mode': the graph has its value {value!r}; another value compiles another graph)"
                     for value in ("shift", "other")]


def test_changing_a_feed_in_place_before_backward_is_an_error():
    wrapped = ORTModule(models.mlp())
    x, _ = models.mlp_batch(0)
    out = wrapped(x)
    with torch.no_grad():
        wrapped.net[0].weight.add_(1.0)  # ONNX Runtime's state reads this memory in the backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


class TwoHeads(nn.Module):
    """A shared body and two heads; `shift` feeds the second head only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 16)
        self.first = nn.Linear(16, 3)
        self.second = nn.Linear(16, 5)

    def forward(self, x, shift):
        h = torch.relu(self.body(x))
        return self.first(h), self.second(h) + shift


def test_alternating_heads_train_like_eager_with_adamw():
    """The head the loss skips gets no gradient, so AdamW's weight decay and momentum leave it be."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=generator), torch.randn(5, generator=generator), step % 2)
               for step in range(6)]
    eager = TwoHeads()
    wrapped = ORTModule(copy.deepcopy(eager))
    losses = [_train(net, batches, lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
                     lambda model, batch: model(*batch[:2])[batch[2]].pow(2).mean()) for net in (eager, wrapped)]
    assert max(abs(a - b) / b for a, b in zip(losses[1], losses[0])) <= 1e-5
    for (name, want), ours in zip(eager.named_parameters(), wrapped.parameters()):
        assert _relative(ours.detach(), want.detach()) <= 1e-5, name


def test_parameters_and_inputs_only_an_unused_output_depends_on_get_no_gradient():
    model = TwoHeads()
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(4, 8)
    for head in (0, 1):
        results = []
        for net in (model, wrapped):
            net.zero_grad()
            shift = torch.zeros(5, requires_grad=True)
            (net(x, shift)[head] * 0).sum().backward()  # a zero gradient is not no gradient
            results.append((shift.grad, {name: p.grad for name, p in net.named_parameters()}))
        (shift_want, want), (shift_ours, ours) = results
        assert (shift_ours is None) == (shift_want is None) == (head == 0)
        unused = "second" if head == 0 else "first"
        for name, grad in want.items():
            if name.startswith(unused):
                assert grad is None and ours[name] is None, name
            else:
                assert torch.equal(ours[name], torch.zeros_like(grad)) and torch.equal(grad, ours[name]), name


def test_a_second_backward_through_one_call_is_an_error_not_a_crash():
    model = nn.Linear(4, 4)
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(2, 4)
    grads = []
    for net in (model, wrapped):
        y = net(x)
        first, second = y[:, :2].sum(), y[:, 2:].pow(2).sum()
        first.backward(retain_graph=True)
        grads.append(net.weight.grad.clone())
        if net is wrapped:
            with pytest.raises(RuntimeError, match=r"ORTModule: a second backward through the outputs of one call is "
                                                   r"not supported: ONNX Runtime frees the call's forward state in the "
                                                   r"first backward, which retain_graph=True does not keep. Sum the "
                                                   r"losses and call backward\(\) once, or call the model again for "
                                                   r"each backward"):
                second.backward()
        net.zero_grad()
        y = net(x)
        (y[:, :2].sum() + y[:, 2:].pow(2).sum()).backward()  # the way out
        grads.append(net.weight.grad.clone())
    assert _relative(grads[2], grads[0]) <= 1e-6 and _relative(grads[3], grads[1]) <= 1e-6


def test_inputs_computed_upstream_by_autograd_functions_do_not_make_the_model_fall_back():
    """Another ORTModule's output or a caller's custom Function: not the model's Functions."""
    torch.manual_seed(0)
    body, head = nn.Linear(6, 6), nn.Linear(6, 2)
    wrapped_body, wrapped_head = ORTModule(copy.deepcopy(body)), ORTModule(copy.deepcopy(head))
    x = torch.randn(3, 6)
    results = []
    for first, second in ((body, head), (wrapped_body, wrapped_head)):
        x_ = x.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="ORTModule")  # a fallback to PyTorch would warn
            stacked = second(first(x_))
            clamped = second(models.StraightThroughClamp.apply(x_ * 3))  # its own backward runs
        (stacked.pow(2).sum() + clamped.pow(2).sum()).backward()
        results.append([stacked, clamped, x_.grad, *(p.grad for p in (*first.parameters(), *second.parameters()))])
    for ours, want in zip(results[1], results[0]):
        assert _relative(ours, want) <= 1e-5
    for wrapped in (wrapped_body, wrapped_head):
        assert [getattr(graph, "kind", graph) for graph in wrapped._graphs._graphs.values()] == ["training"]


# ---------------------------------------------------------------- modes

class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(self.linear(x))


def test_train_and_eval_switch_dropout_and_no_grad_runs_the_forward_alone():
    torch.manual_seed(0)
    model = Noisy()
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(64, 16)
    full = model.linear(x)
    trained = wrapped(x)
    dropped = trained == 0
    assert 0.3 < dropped.float().mean().item() < 0.7  # ONNX Runtime's own dropout mask
    assert _relative(trained[~dropped], 2 * full[~dropped]) <= 1e-5
    trained.sum().backward()
    mask = (~dropped).float()
    assert _relative(wrapped.linear.bias.grad, 2 * mask.sum(0)) <= 1e-6

    wrapped.eval()
    assert not wrapped.training and not wrapped.module.training and not wrapped.dropout.training
    assert _relative(wrapped(x), full) <= 1e-5
    with torch.no_grad():
        evaluated = wrapped(x)
    assert not evaluated.requires_grad and _relative(evaluated, full) <= 1e-5
    kinds = sorted(graph.kind for graph in wrapped._graphs._graphs.values())
    assert kinds == ["inference", "training", "training"]


def test_one_graph_per_signature_in_a_bounded_cache():
    wrapped = ORTModule(models.mlp())
    for batch in range(1, MAX_CACHED_GRAPHS + 3):
        x, _ = models.mlp_batch(0, batch=batch)
        wrapped(x).sum().backward()
    assert len(wrapped._graphs) == MAX_CACHED_GRAPHS


# ---------------------------------------------------------------- the model's own API

def test_state_dict_parameters_and_pickling_are_the_models():
    model = models.transformer()
    wrapped = ORTModule(model)
    assert list(wrapped.state_dict()) == list(model.state_dict())
    assert [id(p) for p in wrapped.parameters()] == [id(p) for p in model.parameters()]
    assert wrapped.ninp == model.ninp  # the model's attributes
    src, _ = models.transformer_batch(0)
    expected = wrapped(src)
    plain = models.transformer(seed=1)
    plain.load_state_dict(wrapped.state_dict())
    assert _relative(plain(src), expected) <= 1e-5
    restored = pickle.loads(pickle.dumps(wrapped))  # what torch.save(wrapped) does
    assert isinstance(restored, ORTModule) and len(restored._graphs) == 0
    assert _relative(restored(src), expected) <= 1e-5


@pytest.mark.parametrize("table", ["_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"])
def test_the_shared_tables_are_replaced_in_both_or_not_at_all(table):
    """DeepSpeed ZeRO-3 replaces every module's _parameters by a table of its own class holding the
    same parameters (tests/test_deepspeed.py): the model's is replaced too, the wrapper and the model
    still share it. A table holding other entries is refused, the model's left as it was."""
    model = models.mlp()
    wrapped, before = ORTModule(model), getattr(model, table)
    other = {"other"} if table == "_non_persistent_buffers_set" else {"other": None}
    message = (f"ORTModule: its {table} table cannot be replaced by a builtins.{type(other).__name__} holding other "
               "entries: it is the model's (one holding the same entries, as DeepSpeed ZeRO stage 3's, replaces the "
               "model's too)")
    with pytest.raises(NotImplementedError, match=f"^{re.escape(message)}$"):
        setattr(wrapped, table, other)
    assert getattr(model, table) is before and getattr(wrapped, table) is before
    same = type(before)(before)
    setattr(wrapped, table, same)
    assert getattr(model, table) is same and getattr(wrapped, table) is same


class _IndexingFails(dict):
    """A parameter table whose indexing has effects (DeepSpeed's ZeROOrderedDict gathers the parameter)."""

    def __getitem__(self, key):
        raise AssertionError(f"indexed {key!r}")


def test_a_replacement_table_is_compared_without_indexing_it():
    model = nn.Linear(2, 3)
    wrapped, table = ORTModule(model), _IndexingFails(model._parameters)
    wrapped._parameters = table
    assert model._parameters is table and wrapped._parameters is table


def test_constructor_refusals():
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got function"):
        ORTModule(models.mlp)
    with pytest.raises(TypeError, match=r"module must be the model itself, got a DataParallel; wrap the model first"):
        ORTModule(nn.DataParallel(models.mlp()))
    with pytest.raises(TypeError, match="module must be the model itself, got a ORTModule"):
        ORTModule(ORTModule(models.mlp()))
    with pytest.raises(TypeError, match="debug_options must be a DebugOptions or None, got dict"):
        ORTModule(models.mlp(), {"save_onnx": True})
    with pytest.raises(ValueError, match="ORTModule.train: mode must be a bool, got 'no'"):
        ORTModule(models.mlp()).train("no")
    with pytest.raises(TypeError, match=f"^{re.escape(DATA_PARALLEL_REFUSED)}$"):
        ORTModule(models.mlp())._replicate_for_data_parallel()  # DataParallel's replicate, with several devices


DATA_PARALLEL_REFUSED = ("ORTModule does not support torch.nn.DataParallel (its replicas would share one model and its "
                         "ONNX Runtime graphs): use DistributedDataParallel(ORTModule(model)), one process per GPU "
                         "(torchrun)")


@pytest.mark.parametrize("inside", [False, True])
def test_data_parallel_on_cuda_around_an_ortmodule_is_refused(monkeypatch, inside):
    """torch.nn.DataParallel with one CUDA device calls the module without replicating it: refused
    there too, around the ORTModule or around a model holding one. Faked on the CPU: DataParallel's
    own forward with the devices a CUDA machine gives it (inputs scattered to the one device as they
    are); with no devices (the CPU) DataParallel calls the model as it is, which runs."""
    wrapped = ORTModule(models.mlp())
    model = nn.Sequential(wrapped, nn.ReLU()) if inside else wrapped
    x = torch.randn(8, 12)
    parallel = nn.DataParallel(model)
    assert parallel.device_ids == []
    torch.testing.assert_close(parallel(x), model(x))
    monkeypatch.setattr(sys.modules["torch.nn.parallel.data_parallel"], "scatter_kwargs",
                        lambda inputs, kwargs, device_ids, dim: ((inputs,), (kwargs or {},)))
    parallel.device_ids, parallel.src_device_obj, parallel.dim = [0], torch.device("cpu"), 0
    compiled = len(wrapped._graphs)
    with pytest.raises(TypeError, match=f"^{re.escape(DATA_PARALLEL_REFUSED)}$"):
        parallel(x)
    assert len(wrapped._graphs) == compiled


# ---------------------------------------------------------------- fallback

class Spectrum(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return torch.fft.rfft(self.linear(x)).abs()


class Product(nn.Module):
    def forward(self, *factors):
        return factors[0] * factors[1]


def test_fallback_runs_pytorch_with_a_warning_naming_the_cause():
    model = models.RunningNorm()
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(8, 4)
    with pytest.warns(UserWarning, match=r"RunningNorm runs in PyTorch for this input signature "
                                         r"\(FALLBACK_UNSUPPORTED_TORCH_MODEL\): NotImplementedError: the model "
                                         r"changes buffers \['instance.running_mean', 'instance.running_var'\] in its "
                                         r"forward, which an ONNX Runtime graph cannot write back \(BatchNorm running "
                                         r"statistics excepted\)"):
        out = wrapped(x)
    assert torch.equal(out, model(x))
    for name, buffer in model.named_buffers():  # PyTorch ran it: every buffer updated as torch does
        assert torch.equal(wrapped.get_buffer(name), buffer), name
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ORTModule")
        wrapped(x)  # the signature is known to run in PyTorch: no second export, no second warning

    with pytest.warns(UserWarning, match=r"\(FALLBACK_UNSUPPORTED_ONNX_MODEL\): ExportError: exporting the model to "
                                         r"ONNX failed at operator aten::fft_rfft"):
        ORTModule(Spectrum())(x).sum().backward()
    with pytest.warns(UserWarning, match=r"\(FALLBACK_UNSUPPORTED_DATA\): BindingError: argument 'factors_1' of "
                                         r"forward\(\*factors\) is a float passed by position; only tensors can be "
                                         r"passed by position here"):
        assert ORTModule(Product())(x, 2.0).equal(x * 2.0)
    with pytest.warns(UserWarning, match=r"\(FALLBACK_UNSUPPORTED_DATA\): BindingError: arguments \['tag'\] of "
                                         r"forward\(x, scale=2.0, tag=None\) are constants of the call that cannot be "
                                         r"compared with those of other calls \(unhashable\)"):
        assert ORTModule(Structured())(x, tag=["a"])["nothing"] == ["a"]


def test_the_exporters_graph_dump_goes_to_the_debug_log_not_stdout(capfd, caplog):
    """torch 2.13's exporter turns its log on for every export (and leaves it on), so a failing
    export printed the whole graph ("Torch IR graph at exception: ...") on stdout, twice with
    ORTTrainer's dynamic dims: it goes to the `ort_trainer.export` logger at DEBUG instead."""
    torch._C._jit_set_onnx_log_enabled(False)
    caplog.set_level(logging.DEBUG, logger="ort_trainer.export")
    capfd.readouterr()
    with pytest.warns(UserWarning, match=r"ExportError: exporting the model to ONNX failed at operator aten::fft_rfft"):
        ORTModule(Spectrum())(torch.randn(8, 4))
    assert capfd.readouterr().out == ""
    assert [record.levelno for record in caplog.records
            if "the exporter's log: Torch IR graph at exception: graph(" in record.getMessage()] == [logging.DEBUG]
    assert not torch._C._jit_is_onnx_log_enabled()  # as it was


@pytest.mark.parametrize("policy", ["FALLBACK_DISABLE", "FALLBACK_UNSUPPORTED_DEVICE|FALLBACK_UNSUPPORTED_DATA"])
def test_fallback_policy_raises_the_original_error(monkeypatch, policy):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", policy)
    wrapped = ORTModule(models.RunningNorm())
    before = {name: buffer.clone() for name, buffer in wrapped.named_buffers()}
    with pytest.raises(NotImplementedError, match=r"the model changes buffers \['instance.running_mean'"):
        wrapped(torch.randn(8, 4))
    for name, buffer in wrapped.named_buffers():  # a rejected call changes nothing, the BatchNorm's included
        assert torch.equal(buffer, before[name]), name


def test_model_errors_are_the_models_not_a_fallback():
    wrapped = ORTModule(models.mlp())
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        wrapped(torch.randn(3, 5))
    with pytest.raises(TypeError, match="missing a required argument: 'x'"):
        wrapped()


# ---------------------------------------------------------------- options

def test_opset_17_and_debug_options_save_every_model(monkeypatch, tmp_path):
    monkeypatch.setenv("ORTMODULE_ONNX_OPSET_VERSION", "17")  # LayerNormalization as one node
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "ERROR")
    monkeypatch.setenv("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "0")
    batches = [models.mlp_batch(step) for step in range(3)]
    wrapped = assert_trains_like_eager(
        models.mlp(), batches, lambda p: torch.optim.SGD(p, lr=0.1),
        lambda model, batch: models.mlp_loss(model(batch[0]), batch[1]))
    assert wrapped._settings.log_level == LogLevel.ERROR and not wrapped._settings.compute_optimizer
    ORTModule(models.mlp(), DebugOptions(save_onnx=True, onnx_prefix="mlp"))(batches[0][0])
    stages = ("execution_model", "optimized_pre_grad", "optimized", "torch_exported")  # the original's names
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"mlp_{stage}_training.onnx" for stage in stages]


@pytest.mark.parametrize("arguments, error, message", [
    (dict(log_level=3), TypeError, "DebugOptions: log_level must be a LogLevel, got 3"),
    (dict(save_onnx="yes"), TypeError, "DebugOptions: save_onnx must be a bool, got 'yes'"),
    (dict(onnx_prefix=None), TypeError, "DebugOptions: onnx_prefix must be a str, got None"),
    (dict(save_onnx=True), ValueError, r"DebugOptions: save_onnx=True needs an onnx_prefix \(the saved files' name "
                                       r"prefix\), got ''"),
])
def test_debug_options_refuse_bad_arguments(arguments, error, message):
    with pytest.raises(error, match=message):
        DebugOptions(**arguments)


@pytest.mark.parametrize("variable, value, message", [
    ("ORTMODULE_ONNX_OPSET_VERSION", "12", r"ORTMODULE_ONNX_OPSET_VERSION='12' must be an ONNX opset from 14 to 17"),
    ("ORTMODULE_LOG_LEVEL", "DEBUG", r"ORTMODULE_LOG_LEVEL='DEBUG' must be one of \['VERBOSE', 'INFO', 'WARNING', "
                                     r"'ERROR', 'FATAL'\]"),
    ("ORTMODULE_FALLBACK_POLICY", "FALLBACK_SOMETIMES", r"ORTMODULE_FALLBACK_POLICY='FALLBACK_SOMETIMES': "
                                                        r"'FALLBACK_SOMETIMES' is not one of \['FALLBACK_DISABLE'"),
    ("ORTMODULE_FALLBACK_POLICY", "FALLBACK_FORCE_TORCH_BACKWARD",
     r"FALLBACK_FORCE_TORCH_BACKWARD is not supported: a backward never falls back here"),
    ("ORTMODULE_FALLBACK_POLICY", "FALLBACK_BAD_INITIALIZATION",
     r"FALLBACK_BAD_INITIALIZATION is not supported: creating an ORTModule does no work that could fail"),
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "yes", r"ORTMODULE_ENABLE_COMPUTE_OPTIMIZER='yes' must be 0 or 1"),
    ("ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER", "2", r"ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER='2' must be 0 or 1"),
    ("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", "0", r"ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT='0' is not supported by "
                                                 r"ort_trainer's ORTModule: torch.utils.checkpoint always runs inside "
                                                 r"the graph here, its segments recomputed in the backward \(unset it, "
                                                 r"or set it to '1'\)"),
    ("ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT", "yes", r"ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT='yes' must be 0 "
                                                         r"or 1"),
    ("ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS", "a.B", r"ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS='a.B' is not supported by "
                                                    r"ort_trainer's ORTModule: every custom torch.autograd.Function "
                                                    r"runs its own forward and backward inside the graph"),
    ("ORTMODULE_ENABLE_SPARSE_OPTIMIZER", "1", r"ORTMODULE_ENABLE_SPARSE_OPTIMIZER='1' is not supported by "
                                               r"ort_trainer's ORTModule: the input-sparsity optimizations of this "
                                               r"older switch have a switch each here: "
                                               r"ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER and "
                                               r"ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER, both on by default"),
    ("ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER", "2",
     r"ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER='2' must be 0 or 1"),
    ("ORTMODULE_PRINT_MEMORY_STATS", "on", r"ORTMODULE_PRINT_MEMORY_STATS='on' must be 0 or 1"),
])
def test_environment_variables_refuse_bad_or_unsupported_values(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        ORTModule(models.mlp())


def test_environment_variables_at_supported_values_and_unknown_ones(monkeypatch, tmp_path):
    for variable, value in [("ORTMODULE_PRINT_MEMORY_STATS", "0"), ("ORTMODULE_ENABLE_SPARSE_OPTIMIZER", "0"),
                            ("ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT", "1"),
                            ("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", "1")]:
        monkeypatch.setenv(variable, value)
    ORTModule(models.mlp())
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_CONFIG", "plan.json")
    with pytest.warns(UserWarning, match=r"environment variables \['ORTMODULE_MEMORY_OPT_CONFIG'\] are not read by "
                                         r"ort_trainer's ORTModule"):
        ORTModule(models.mlp())
    monkeypatch.delenv("ORTMODULE_MEMORY_OPT_CONFIG")
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"ORTMODULE_SAVE_ONNX_PATH='.*missing' must be a writable directory for "
                                         r"DebugOptions\(save_onnx=True\)"):
        ORTModule(models.mlp(), DebugOptions(save_onnx=True, onnx_prefix="m"))


def test_benchmark_runs_on_a_tiny_configuration(tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/ortmodule_step.py", "--vocab", "40", "--bptt", "5", "--batch", "3", "--threads",
         "1", "--warmup", "1", "--rounds", "2", "--steps", "1", "--dropout", "0", "--json", str(out)],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert set(result["median_ms"]) == {"eager", "ortmodule", "ortmodule_loss", "ortrainer"}
    first = result["first_step_loss"]  # same model, same batch, no dropout: the same loss
    for engine in ("ortmodule", "ortmodule_loss"):
        assert abs(first[engine] - first["eager"]) <= 1e-4 * first["eager"]


@pytest.mark.parametrize("fails", [False, True])
def test_onnx_runtimes_output_during_a_build_is_shown_only_with_an_error(capfd, fails):
    from ort_trainer._graph.module_graph_builder import _native_output_held
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        with _native_output_held(hold=True):
            os.write(2, b"native warning\n")
            if fails:
                raise RuntimeError("the build failed")
    assert capfd.readouterr().err == ("native warning\n" if fails else "")
    with _native_output_held(hold=False):
        os.write(2, b"at INFO: shown\n")
    assert capfd.readouterr().err == "at INFO: shown\n"
