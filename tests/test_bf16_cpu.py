"""bf16 mixed precision on the CPU (`mixed_precision.dtype='bfloat16'`, ORTModule under
`torch.autocast('cpu', torch.bfloat16)`): the matrix products run torch's bf16 kernels inside the
graph (`_graph.bf16_products`), decided for CPUs with bf16 instructions (AMX, AVX512-BF16).

This CI machine may have none: the tests that train declare it has (the `bf16_cpu` fixture), which
changes the decision only; torch's bf16 kernels run here too, slowly, and the references run them
on the same machine.

Tolerances against torch.autocast: bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3);
the graph runs what follows a product (GELU, softmax, layer norm, the loss) in fp32 where autocast
runs some of it in bf16. Measured over 10 Adam steps: losses within 1.7e-4 relative of autocast's
(fp32 vs autocast: 2.2e-4, so these tolerances cannot tell bf16 from fp32). That the graph
computes its products in bf16 is pinned against a torch reference with the graph's rules: equal.
"""
import copy
import re
import warnings

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
from ort_trainer._graph import autocast
from ort_trainer._graph.autocast import lower_precision
from ort_trainer._runtime.product_kernels import product, product_gradients

from . import test_mixed_precision as mixed

STEPS = 10
LOSS_RTOL = 5e-4
_PRODUCT_OPS = {"MatMul", "Gemm", "FusedMatMul", "Conv", "ConvTranspose"}


@pytest.fixture
def bf16_cpu(monkeypatch):
    monkeypatch.setattr(autocast, "cpu_has_bf16_instructions", lambda: True)


# ---------------------------------------------------------------- the kernels

def _matmul(trans_a=False, trans_b=False, alpha=1.0):
    return {"kind": "matmul", "trans_a": trans_a, "trans_b": trans_b, "alpha": alpha}


def _gemm(trans_a=False, trans_b=False):
    return {"kind": "gemm", "trans_a": trans_a, "trans_b": trans_b, "alpha": 0.7, "beta": 1.3}


def _convolution(**attributes):
    return {"kind": "convolution", "transposed": False, "stride": [], "padding": [], "dilation": [],
            "output_padding": [], "groups": 1, **attributes}


KERNEL_CASES = {
    "matrices": (_matmul(), [(5, 7), (7, 3)]),
    "batch_times_weight": (_matmul(), [(2, 5, 7), (7, 3)]),
    "batch_times_weight_transposed": (_matmul(trans_b=True), [(2, 5, 7), (3, 7)]),
    "both_transposed_scaled": (_matmul(trans_a=True, trans_b=True, alpha=0.5), [(2, 7, 5), (2, 3, 7)]),
    "broadcast_batches": (_matmul(trans_a=True), [(4, 1, 7, 5), (3, 7, 2)]),
    "weight_times_batch": (_matmul(), [(6, 5), (2, 5, 3)]),
    "vector_times_batch": (_matmul(), [(7,), (2, 7, 3)]),
    "batch_times_vector": (_matmul(), [(2, 5, 7), (7,)]),
    "linear_on_sequences": (_matmul(trans_b=True), [(2, 5, 7), (3, 7), (3,)]),  # MatMul + its bias Add
    "batches_with_bias": (_matmul(), [(2, 5, 7), (2, 7, 3), (3,)]),
    "gemm_broadcast_bias": (_gemm(trans_b=True), [(5, 7), (3, 7), (3,)]),
    "gemm_transposed_a": (_gemm(trans_a=True), [(7, 5), (7, 3), (5, 3)]),
    "gemm_without_bias": (_gemm(), [(5, 7), (7, 3)]),
    "conv2d": (_convolution(stride=[2, 1], padding=[1, 0], dilation=[1, 2]), [(2, 4, 9, 8), (6, 4, 3, 3), (6,)]),
    "conv1d_groups": (_convolution(groups=2), [(2, 4, 9), (6, 2, 3)]),
    "conv_transpose2d": (_convolution(transposed=True, stride=[2, 2], padding=[1, 1], output_padding=[1, 1],
                                      groups=2), [(2, 4, 5, 5), (4, 3, 3, 3), (6,)]),
}


@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_the_gradient_node_gives_torch_autograd_of_the_bf16_product(case, seed):
    """The one gradient node (no forward recomputed, no operand converted again: it reads the bf16
    copies the forward read) against autograd of the forward kernel: equal for every operand,
    whichever it is asked for; the forward's output is fp32 holding bf16 values (unless scaled
    after, in fp32)."""
    params, shapes = KERNEL_CASES[case]
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(shape, generator=generator) for shape in shapes]
    order = list(reversed(range(len(inputs))))  # the torch node may list its operands reordered
    params = {**params, "operands": order}
    listed = [inputs[k] for k in order]
    leaves = [tensor.clone().requires_grad_(True) for tensor in listed]
    with torch.enable_grad():
        factors = [leaves[order.index(k)].bfloat16() for k in range(2)]  # the TO_BF16 nodes' copies
        output, = product([*leaves, *factors], params)
    assert output.dtype == torch.float32
    assert torch.equal(output, output.bfloat16().float()) or (params["alpha"] != 1.0 and len(inputs) == 2) \
        or case == "batches_with_bias"  # rounded, then its bias added
    grad = torch.randn(output.shape, generator=generator)
    expected = torch.autograd.grad(output, leaves, grad)
    feeds = [grad, *(factor.detach() for factor in factors), *inputs[2:]]
    for wanted in ([k] for k in range(len(listed))), [list(range(len(listed)))]:
        for ks in wanted:
            results = product_gradients(feeds, {**params, "wanted": ks})
            for k, result in zip(ks, results):
                assert result.dtype == torch.float32 and result.shape == listed[k].shape
                assert torch.equal(result, expected[k]), (case, k)


# ---------------------------------------------------------------- the graph's rules

class _Products(torch.nn.Module):
    """Every product form: a linear on a batch of sequences (MatMul + Add) and on rows (Gemm), a
    parameter times a batch (broadcast), attention-like scores (both operands computed, one
    transposed, scaled), a convolution and a transposed one."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.up = torch.nn.ConvTranspose2d(4, 2, 2, stride=2)
        self.mix = torch.nn.Parameter(torch.randn(5, 5) / 3)
        self.project = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(40, 3, bias=False)

    def forward(self, x):
        image = self.up(torch.tanh(self.conv(x)))  # [N, 2, 8, 8]
        sequence = image.reshape(x.shape[0], 16, 8)[:, :5]  # [N, 5, 8]
        sequence = torch.matmul(self.mix, self.project(sequence))
        scores = torch.matmul(sequence, sequence.transpose(1, 2)) * 0.125
        mixed = torch.matmul(torch.softmax(scores, dim=-1), sequence)
        return self.head(mixed.reshape(x.shape[0], 40))


PRODUCTS_DESC = {"inputs": [("x", ["batch", 2, 4, 4]), ("target", ["batch"])],
                 "outputs": [("loss", [], True), ("out", ["batch", 3])]}


class _GraphRules(torch.overrides.TorchFunctionMode):
    """Torch with the graph's bf16 rules: each product's inputs cast to bf16, the product in bf16,
    its output back to fp32; everything else in fp32."""

    PRODUCTS = (F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, F.conv2d, F.conv_transpose2d)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.PRODUCTS:
            return func(*args, **kwargs)
        bf16 = [a.bfloat16() if isinstance(a, torch.Tensor) else a for a in args]
        return func(*bf16, **{k: v.bfloat16() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}).float()


def _products_batch(step, rows=6):
    generator = torch.Generator().manual_seed(70 + step)
    return torch.randn(rows, 2, 4, 4, generator=generator), torch.randint(0, 3, (rows,), generator=generator)


def _bf16_trainer(model, desc, loss_fn, *, graph_path=None, dtype="bfloat16"):
    options = {"utils": {"grad_norm_clip": False}}
    if dtype is not None:
        options["mixed_precision"] = {"enabled": True, "dtype": dtype}
    if graph_path is not None:
        options["debug"] = {"graph_save_paths": {"model_with_training_graph_path": str(graph_path)}}
    return ORTTrainer(model, desc, optim.SGDConfig(lr=0.05), loss_fn=loss_fn, options=ORTTrainerOptions(options))


@pytest.mark.parametrize("dtype, loss_only", [("bfloat16", False), ("bfloat16", True), (None, False)],
                         ids=["bf16", "bf16_loss_only", "fp32"])
def test_every_product_computes_as_torch_bf16_kernels(bf16_cpu, tmp_path, dtype, loss_only):
    """4 SGD steps (then one at another batch size, one eval) against torch with the graph's rules:
    outputs and weights equal, losses within 1e-6 (ONNX Runtime's softmax cross-entropy). The fp32
    graph's are not (so the test tells them apart), and the bf16 training graph has no ONNX product
    left. Fetching the loss alone, the logits stay bf16 into the loss and its gradient comes back
    in bf16 (`bf16_logits_into_loss`): the same values."""
    torch.manual_seed(0)
    model = _Products()
    reference = copy.deepcopy(model)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.05)
    trainer = _bf16_trainer(model, PRODUCTS_DESC, F.cross_entropy, graph_path=tmp_path / "training.onnx",
                            dtype=dtype)
    if loss_only:
        trainer.train_step_info.fetches = ["loss"]
    losses_close, equal = [], []
    for step, rows in enumerate([6, 6, 6, 6, 3]):
        x, target = _products_batch(step, rows)
        sgd.zero_grad()
        with _GraphRules():
            expected = reference(x)
        expected_loss = F.cross_entropy(expected, target)
        expected_loss.backward()
        sgd.step()
        loss, out = (trainer.train_step(x, target), expected) if loss_only else trainer.train_step(x, target)
        losses_close.append(torch.allclose(loss, expected_loss.detach(), rtol=1e-6, atol=0))
        equal.append(torch.equal(out, expected.detach()))
    equal += [torch.equal(p.detach(), q.detach()) for p, q in zip(trainer.model.parameters(), reference.parameters())]
    x, target = _products_batch(9)
    with _GraphRules(), torch.no_grad():
        expected = reference(x)
    if loss_only:
        losses_close.append(torch.allclose(trainer.eval_step(x, target), F.cross_entropy(expected, target),
                                           rtol=1e-6, atol=0))
    else:
        equal.append(torch.equal(trainer.eval_step(x, target)[1], expected))
    if dtype is None:
        assert not any(equal)
        return
    assert all(losses_close) and all(equal), (losses_close, equal)
    training = onnx.load(tmp_path / "training.onnx").graph.node
    ops = {node.op_type for node in training}
    assert "ATen" in ops and not ops & _PRODUCT_OPS, ops
    operators = {node.attribute[0].s.decode() for node in training if node.op_type == "ATen"}
    assert ({"ort_trainer::log_softmax_fp32", "ort_trainer::softmax_grad_to_bf16"} <= operators) == loss_only


class _Conversions(TorchDispatchMode):
    """Records each conversion between fp32 and bf16 the torch nodes make: (source fingerprint,
    target type). ONNX Runtime reuses memory within a run, so a source is known by its address,
    shape and values, not its address alone."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        source = args[0] if args else None
        if (func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and isinstance(source, torch.Tensor)
                and source.dtype != result.dtype and {source.dtype, result.dtype} == {torch.float32, torch.bfloat16}):
            with torch._C.DisableTorchFunction():
                key = (source.data_ptr(), tuple(source.shape), float(source.double().sum()))
            self.made.append((key, result.dtype))
        return result


def test_each_tensor_is_converted_once_a_step(bf16_cpu):
    """One training step of a model with every product form (convolutions, linears with biases,
    batched products): no tensor converted twice (each operand's bf16 copy made by the forward is
    the one its gradient reads; a product's output gradient is cast once for all its operands'
    gradients); the count is what the products need."""
    trainer = _bf16_trainer(_Products(), PRODUCTS_DESC, F.cross_entropy)
    trainer.train_step(*_products_batch(0))  # compiled
    with _Conversions() as conversions:
        trainer.train_step(*_products_batch(1))
    repeated = [made for made in set(conversions.made) if conversions.made.count(made) > 1]
    assert not repeated
    products = 7  # conv, conv transpose, linear, mix, scores, attention, head
    # forward: each product's two factors to bf16, its result to fp32; backward: each product's
    # output gradient to bf16 (the first conv's input needs no gradient), its operands' gradients to fp32
    assert len(conversions.made) <= products * 3 + products + products * 3


@pytest.mark.parametrize("case", ["seed", "sequential", "cnn", "gpt2", "bert"])
def test_bf16_losses_in_step_with_torch_autocast(bf16_cpu, case):
    make_model, loss_fn, desc, make_batch = mixed.CASES[case]
    model = make_model()
    model.train()
    batches = [make_batch(step) for step in range(STEPS)]
    expected, _ = mixed.autocast_losses(model, loss_fn, batches, optimizer="adam", dtype=torch.bfloat16)
    trainer = mixed._trainer(model, loss_fn, desc, optimizer="adam", enabled=True, dtype="bfloat16")
    losses = [trainer.train_step(*args, **kwargs)[0].item() for args, kwargs in batches]
    for step, (ours, theirs) in enumerate(zip(losses, expected)):
        assert abs(ours - theirs) <= LOSS_RTOL * abs(theirs), (case, step, ours, theirs)


@pytest.mark.parametrize("case", ["sequential", "seed", "cnn", "gpt2"])
def test_ortmodule_under_bf16_autocast_trains_in_step_with_torch(bf16_cpu, monkeypatch, case):
    """The user's autocast loop on ORTModule(model) and on the model: same losses, the outputs in
    bf16 as autocast gives them, no fallback."""
    from ort_trainer.ortmodule import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    make_model, loss_fn, _, make_batch = mixed.CASES[case]
    model = make_model()
    model.train()
    batches = [make_batch(step) for step in range(STEPS)]
    expected, expected_dtypes = mixed._autocast_loop(copy.deepcopy(model), loss_fn, batches, dtype=torch.bfloat16)
    losses, dtypes = mixed._autocast_loop(ORTModule(model), loss_fn, batches, dtype=torch.bfloat16)
    assert dtypes == expected_dtypes == {torch.bfloat16}
    for step, (ours, theirs) in enumerate(zip(losses, expected)):
        assert abs(ours - theirs) <= LOSS_RTOL * abs(theirs), (case, step, ours, theirs)


def test_the_zero_gradient_of_an_unused_output_is_made_once_and_stays_zero(bf16_cpu, monkeypatch):
    """GPT-2's logits, returned but not in the loss: under bf16 autocast ONNX Runtime needs their
    gradient in full shape; the zeros are made once per graph and read by every backward, which
    never writes them: the steps stay in step with eager autocast."""
    import transformers

    from ort_trainer.ortmodule import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).train()
    eager, wrapped = copy.deepcopy(model), ORTModule(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (wrapped, eager)]
    for step in range(4):
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        losses = []
        for module, optimizer in zip((wrapped, eager), optimizers):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = module(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=LOSS_RTOL), step
    graph, = (graph for graph in wrapped._graphs._graphs.values())
    zeros = list(graph._zero_gradients.values())
    assert [tuple(z.shape) for z in zeros] == [()] and all(bool((z == 0).all()) for z in zeros)


def test_bf16_on_a_cpu_without_bf16_instructions_is_refused_by_name(monkeypatch):
    from ort_trainer.ortmodule import ORTModule

    monkeypatch.setattr(autocast, "cpu_has_bf16_instructions", lambda: False)
    reason = ("this CPU has no bfloat16 instructions (AMX or AVX512-BF16): ONNX Runtime's CPU provider has no "
              "bfloat16 kernels and torch's bf16 matrix products run 15-190x slower than fp32 here")
    with pytest.raises(NotImplementedError,
                       match=re.escape(f"mixed_precision.dtype='bfloat16' on device 'cpu': {reason}")):
        _bf16_trainer(mixed._sequential(), mixed.SEQUENTIAL_DESC, F.cross_entropy)
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    wrapped = ORTModule(mixed._sequential())
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(NotImplementedError, match=re.escape(
            f"torch.autocast('cpu', bfloat16): {reason}")):
        wrapped(mixed._sequential_batch(0)[0])
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_DEVICE")
    wrapped = ORTModule(mixed._sequential())
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(UserWarning, match="runs in PyTorch"):
        assert wrapped(mixed._sequential_batch(0)[0]).dtype == torch.bfloat16


# ---------------------------------------------------------------- the rewrite

def _graph(nodes, inputs, outputs):
    value = onnx.helper.make_tensor_value_info
    return onnx.helper.make_model(onnx.helper.make_graph(
        nodes, "g", [value(name, onnx.TensorProto.FLOAT, shape) for name, shape in inputs],
        [value(name, onnx.TensorProto.FLOAT, None) for name in outputs]),
        opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_casts_between_fp32_and_bf16_run_in_torch_and_compute_the_same():
    """ONNX Runtime's CPU Cast to and from bf16 is a scalar loop: those Casts become torch nodes
    (`bf16_casts_in_torch`); other Casts stay ONNX Runtime's. The graph's result is the same."""
    from ort_trainer._configuration.runtime_settings import RuntimeSettings
    from ort_trainer._graph.bf16_products import bf16_casts_in_torch
    from ort_trainer._runtime.placement import Placement
    from ort_trainer._runtime.sessions import Sessions  # registers the torch node executor

    make = onnx.helper.make_node
    model = _graph([make("Cast", ["x"], ["low"], to=onnx.TensorProto.BFLOAT16),
                    make("Cast", ["low"], ["y"], to=onnx.TensorProto.FLOAT),
                    make("Cast", ["x"], ["n"], to=onnx.TensorProto.INT64),
                    make("Cast", ["n"], ["z"], to=onnx.TensorProto.FLOAT)], [("x", [300, 5000])], ["y", "z"])
    assert bf16_casts_in_torch(model) == 2
    assert [node.op_type for node in model.graph.node] == ["ATen", "ATen", "Cast", "Cast"]
    model.ir_version = 8  # ONNX Runtime 1.19 reads up to 10
    sessions = Sessions(Placement("cpu"), RuntimeSettings(device="cpu", threads=1))
    session = sessions.create(model.SerializeToString())
    x = torch.randn(300, 5000) * 100
    y, z = session.run(None, {"x": x.numpy()})
    assert torch.equal(torch.from_numpy(y), x.bfloat16().float())
    assert torch.equal(torch.from_numpy(z), x.long().float())


def test_the_rewrite_reads_transposed_weights_in_place_and_emulates_what_torch_cannot_state():
    """A weight's Transpose folds into the torch node (dropped when nothing else reads it, kept
    when something does); the operand that needs a gradient is listed first, the factors' bf16
    copies after the operands; a Conv with
    auto_pad (torch's convolution has no such padding) keeps the rounding emulation."""
    make = onnx.helper.make_node
    model = _graph([make("Transpose", ["w"], ["wt"], perm=[1, 0]), make("MatMul", ["x", "wt"], ["h"]),
                    make("Transpose", ["v"], ["vt"], perm=[1, 0]), make("MatMul", ["h", "vt"], ["y"]),
                    make("Conv", ["image", "kernel"], ["z"], auto_pad="SAME_UPPER")],
                   [("x", [4, 3]), ("w", [5, 3]), ("v", [2, 5]), ("image", [1, 1, 4, 4]), ("kernel", [1, 1, 3, 3])],
                   ["y", "z", "vt"])
    assert lower_precision(model, "bfloat16", device_type="cpu", differentiable=["w", "v"]) == 3
    nodes = {node.output[0]: node for node in model.graph.node}
    assert "wt" not in nodes and nodes["vt"].op_type == "Transpose"
    first, second = nodes["h"], nodes["y"]
    # the fp32 operands (gradients flow to them), then the factors' bf16 copies (op order), one node each
    assert first.op_type == second.op_type == "ATen" and list(first.input) == ["w", "x", "x__bf16", "w__bf16"]
    assert list(second.input) == ["h", "v", "h__bf16", "v__bf16"]
    assert sorted(node.output[0] for node in model.graph.node if b"to_bf16" in node.attribute[0].s) == [
        "h__bf16", "v__bf16", "w__bf16", "x__bf16"]
    params = onnx.helper.get_attribute_value(first.attribute[1]).decode()
    assert '"operands":[1,0]' in params and '"trans_b":true' in params
    assert [node.op_type for node in model.graph.node if node.output[0] in ("z__bfloat16", "z")] == ["Conv", "Cast"]


@pytest.mark.parametrize("variant", ["fetch_loss_only", "transformer_layer_recompute", "gradient_accumulation"])
def test_bf16_graph_variants_train_as_the_plain_bf16_graph(bf16_cpu, variant):
    """The torch nodes keep their types where the graph changes after the rewrite: an output not
    fetched (no longer a graph output), recompute copies; and accumulation runs the same graph."""
    from . import models

    options = {"mixed_precision": {"enabled": True, "dtype": "bfloat16"}}
    extra = {"transformer_layer_recompute": {"graph_transformer": {"transformer_layer_recompute": True}},
             "gradient_accumulation": {"batch": {"gradient_accumulation_steps": 2}}}.get(variant, {})
    trainers = [ORTTrainer(models.transformer(), models.TRANSFORMER_DESC, optim.AdamConfig(lr=1e-3),
                           loss_fn=models.transformer_loss, options=ORTTrainerOptions({**options, **more}))
                for more in ({}, extra)]
    if variant == "fetch_loss_only":
        trainers[1].train_step_info.fetches = ["loss"]
    if variant == "gradient_accumulation":  # the plain trainer updates once per two batches too
        trainers[0] = ORTTrainer(models.transformer(), models.TRANSFORMER_DESC, optim.AdamConfig(lr=1e-3),
                                 loss_fn=models.transformer_loss, options=ORTTrainerOptions({**options, **extra}))
    results = [[trainer.train_step(*models.transformer_batch(step)) for step in range(4)] for trainer in trainers]
    losses = [[(result[0] if isinstance(result, (list, tuple)) else result).item() for result in run]
              for run in results]
    assert losses[0] == losses[1]


def test_transformers_trainer_with_bf16_runs_its_steps_in_the_graph(bf16_cpu, monkeypatch, tmp_path):
    """`TrainingArguments(bf16=True)` on the CPU (Trainer's autocast) on ORTModule(GPT-2): no
    fallback, the logged losses those of the plain model's Trainer (logged to 4 decimals)."""
    pytest.importorskip("accelerate", reason="transformers.Trainer's PyTorch backend")
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from ort_trainer.ortmodule import ORTModule

    from .test_hf_trainer import tiny_gpt2

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # restored after: TrainingArguments(bf16=True) sets it
    generator = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (24, 16), generator=generator)]
    logs = []
    for model in (ORTModule(tiny_gpt2()), tiny_gpt2()):
        args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                                 bf16=True, per_device_train_batch_size=4, max_steps=4, learning_rate=3e-3,
                                 logging_steps=1, save_strategy="no")
        trainer = Trainer(model=model, args=args, train_dataset=data)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="ORTModule: ")
                trainer.train()
        finally:  # accelerate keeps its mixed precision in a process-wide state the next Trainer would inherit
            AcceleratorState._reset_state(reset_partial_state=True)
        logs.append([log["loss"] for log in trainer.state.log_history if "loss" in log])
    assert len(logs[0]) == len(logs[1]) == 4
    for ours, theirs in zip(*logs):
        assert ours == pytest.approx(theirs, rel=LOSS_RTOL, abs=1.01e-4), logs


def test_a_bias_add_folds_into_its_product_only_where_the_bias_is_computed_before_it():
    """The torch node takes the MatMul's place: a bias computed after the MatMul (here b * 2, traced
    after the product) stays a separate Add, so the graph stays in order; one ready before folds."""
    make = onnx.helper.make_node
    model = _graph([make("MatMul", ["x", "w"], ["h"]), make("Add", ["h", "b"], ["folded"]),
                    make("MatMul", ["folded", "v"], ["m"]), make("Add", ["b", "b"], ["late"]),
                    make("Add", ["m", "late"], ["y"])],
                   [("x", [4, 3]), ("w", [3, 5]), ("b", [5]), ("v", [5, 5])], ["y"])
    assert lower_precision(model, "bfloat16", device_type="cpu", differentiable=["w", "b", "v"]) == 2
    nodes = {node.output[0]: node for node in model.graph.node}
    assert nodes["folded"].op_type == "ATen" and "h" not in nodes and set(nodes["folded"].input) == {"x", "w", "b", "x__bf16", "w__bf16"}
    assert nodes["m"].op_type == "ATen" and nodes["y"].op_type == "Add" and list(nodes["y"].input) == ["m", "late"]
    produced = {value.name for value in model.graph.input}
    for node in model.graph.node:  # topologically sorted
        assert produced.issuperset(name for name in node.input if name), node
        produced.update(node.output)


@pytest.mark.parametrize("alpha, rewritten", [(1.0, 1), (0.5, 0)])
def test_logits_stay_bf16_into_the_loss_only_where_the_product_does_not_scale_them_in_fp32(alpha, rewritten):
    """A product scaling its bf16 result by alpha in fp32 (a MatMul's alpha: ONNX Runtime fuses a
    scale into it) keeps its fp32 output: bf16 out, the scale would be lost."""
    from ort_trainer._graph.torch_nodes import PRODUCT
    from ort_trainer._graph.bf16_products import bf16_logits_into_loss
    from ort_trainer._onnx import TORCH_NODE_DOMAIN, torch_node

    params = {"kind": "matmul", "alpha": alpha, "trans_a": False, "trans_b": False, "operands": [0, 1]}
    make = onnx.helper.make_node
    model = _graph([torch_node(PRODUCT, ["x", "w", "x_bf16", "w_bf16"], ["logits"], params=params),
                    make("LogSoftmax", ["logits"], ["log_prob"], axis=1)], [("x", [4, 3]), ("w", [3, 5])],
                   ["log_prob"])
    model.opset_import.append(onnx.helper.make_opsetid(TORCH_NODE_DOMAIN, 1))
    assert bf16_logits_into_loss(model) == rewritten


# ---------------------------------------------------------------- ORTModule's returned logits

class _ProductsWithLoss(_Products):
    """Hugging Face's way: the loss computed in forward (on the logits in fp32) and returned with the logits."""

    def forward(self, x, target):
        logits = super().forward(x)
        return F.cross_entropy(logits.float(), target), logits


@pytest.mark.parametrize("returns", ["loss_and_unused_logits", "loss_and_used_logits", "logits"])
def test_returned_logits_are_written_in_bf16_and_their_gradient_read_in_bf16(bf16_cpu, monkeypatch, returns):
    """ORTModule under bf16 autocast on a model returning (loss, logits), or the logits alone (the
    user's loss in torch): the logits come back in bf16 as autocast returns them, written by their
    product (`bf16_logits_into_loss`, `bf16_outputs_from_products`), and read by the loss in the
    graph; the user's gradient of the logits (bf16) is added to the loss's in bf16, as autocast's
    autograd sums them, or read by the product's gradient as it is. 4 SGD steps against torch with
    the graph's rules: logits and weights equal, losses within 1e-6 (ONNX Runtime's softmax
    cross-entropy), the outputs' dtypes eager autocast's. Logits the user's loss does not use get a
    scalar zero gradient, made once: no logits-sized zeros."""
    from ort_trainer.ortmodule import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    model = _ProductsWithLoss() if returns != "logits" else _Products()
    reference, wrapped = copy.deepcopy(model), ORTModule(model)
    arguments = (lambda x, target: (x, target)) if returns != "logits" else (lambda x, target: (x,))
    weight = torch.randn(6, 3, generator=torch.Generator().manual_seed(5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = copy.deepcopy(model)(*arguments(*_products_batch(0)))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (reference, wrapped)]
    losses_close, equal = [], []
    for step in range(4):
        x, target = _products_batch(step)
        for optimizer in optimizers:
            optimizer.zero_grad()
        with _GraphRules():
            expected_logits = _Products.forward(reference, x).bfloat16()  # autocast's linear returns bf16
        expected_loss = F.cross_entropy(expected_logits.float(), target)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs = wrapped(*arguments(x, target))
        if returns == "logits":
            assert outputs.dtype == eager.dtype == torch.bfloat16
            logits, loss = outputs, F.cross_entropy(outputs.float(), target)
        else:
            assert [t.dtype for t in outputs] == [t.dtype for t in eager] == [torch.float32, torch.bfloat16]
            loss, logits = outputs
        for total in ((expected_loss + (expected_logits.float() * weight).sum(), loss + (logits.float() * weight).sum())
                      if returns == "loss_and_used_logits" else (expected_loss, loss)):
            total.backward()
        for optimizer in optimizers:
            optimizer.step()
        losses_close.append(torch.allclose(loss, expected_loss.detach(), rtol=1e-6, atol=0))
        equal.append(torch.equal(logits, expected_logits.detach()))
    equal += [torch.equal(p.detach(), q.detach()) for p, q in zip(wrapped.parameters(), reference.parameters())]
    assert all(losses_close) and all(equal), (losses_close, equal)
    graph, = wrapped._graphs._graphs.values()
    assert [key[1] for key in graph._zero_gradients] == ([()] if returns == "loss_and_unused_logits" else [])


def test_the_loss_gradient_in_bf16_is_the_graph_nodes_and_adds_a_returned_gradient_as_autocast():
    """`SOFTMAX_GRAD_TO_BF16`: ONNX Runtime's Exp, ScatterElements and Mul of the loss gradient
    (`_graph.cpu_kernels`), rounded to bf16 as stored; its fifth input, a gradient of the result's
    size in another shape (the returned logits' [batch, sequence, classes] against the loss's rows)
    added in bf16 as autocast's autograd sums two bf16 gradients, a scalar (zero: nothing added), or
    refused by name."""
    import onnxruntime

    from ort_trainer._torch_node_catalogue import SOFTMAX_GRAD_TO_BF16
    from ort_trainer._runtime.torch_ops import IMPLEMENTATIONS

    generator = torch.Generator().manual_seed(3)
    rows, classes = 70, 6  # rows: more than one block of the kernel, the last one partial
    log_prob = torch.log_softmax(torch.randn(rows, classes, generator=generator), 1)
    index = torch.randint(0, classes, (rows, 1), generator=generator)
    at_label = log_prob.gather(1, index).exp() - 1
    row_scale = torch.rand(rows, 1, generator=generator)
    make, value = onnx.helper.make_node, onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(
        [make("Exp", ["log_prob"], ["prob"]), make("ScatterElements", ["prob", "index", "at_label"], ["unscaled"], axis=1),
         make("Mul", ["unscaled", "row_scale"], ["grad"])], "g",
        [value("log_prob", onnx.TensorProto.FLOAT, [rows, classes]), value("index", onnx.TensorProto.INT64, [rows, 1]),
         value("at_label", onnx.TensorProto.FLOAT, [rows, 1]), value("row_scale", onnx.TensorProto.FLOAT, [rows, 1])],
        [value("grad", onnx.TensorProto.FLOAT, None)])
    session = onnxruntime.InferenceSession(onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8).SerializeToString(),
        providers=["CPUExecutionProvider"])
    feeds = [log_prob, index, at_label, row_scale]
    ours = torch.from_numpy(session.run(None, dict(zip(["log_prob", "index", "at_label", "row_scale"],
                                                       (t.numpy() for t in feeds))))[0]).bfloat16()
    gradient = IMPLEMENTATIONS[SOFTMAX_GRAD_TO_BF16]
    added = torch.randn(7, 10, classes, generator=generator).bfloat16()
    assert torch.equal(gradient(feeds, {})[0], ours)
    assert torch.equal(gradient([*feeds, added], {})[0], ours + added.reshape(rows, classes))
    assert torch.equal(gradient([*feeds, torch.zeros((), dtype=torch.bfloat16)], {})[0], ours)
    assert torch.equal(gradient([*feeds, torch.tensor(0.5, dtype=torch.bfloat16)], {})[0], ours + 0.5)
    with pytest.raises(ValueError, match=re.escape(
            "softmax_grad_to_bf16: a gradient of shape [7, 6] added to a result of shape [70, 6]: it must have the "
            "result's size or be a scalar")):
        gradient([*feeds, added[:, 0]], {})
