"""Ops whose ONNX Runtime 1.19 gradient is missing or wrong, and aten ops the exporter lacks.

InstanceNormalization (GroupNorm, InstanceNorm*d) and broadcast Where/Pow inputs are rewritten
before the gradient is built, so those models train like torch; other ops without a gradient raise
MissingGradientError naming the op and the module; torch.diff and integer torch.cumsum export
through our symbolics. Gradients ONNX Runtime lacks that we supply: CumSum (registered), the
activations without one (written with ops it differentiates), cross_entropy's label smoothing.
"""
import copy
import io
import re

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn as nn
from torch.onnx.errors import SymbolicValueError

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
from ort_trainer._export.symbolics import our_symbolics
from ort_trainer._export.trace import ExportError
from ort_trainer._graph.gradient_builder_preparation import expand_broadcast_inputs
from ort_trainer._graph.missing_gradient import MissingGradientError, torch_module
from ort_trainer._graph.normalization import decompose_instance_normalization
from ort_trainer._graph.trainer_graph_builder import build_graphs
from ort_trainer.ortmodule import ORTModule

from . import models

STEPS = 10
LR = 0.1


def mse(output, y):
    return ((output - y) ** 2).mean()


def trainer_for(model, desc, loss_fn=mse, *, opset=14):
    return ORTTrainer(model, desc, optim.SGDConfig(lr=LR), loss_fn=loss_fn, options=ORTTrainerOptions(
        {"utils": {"grad_norm_clip": False}, "_internal_use": {"onnx_opset_version": opset}}))


def assert_trains_like_torch(model, desc, batches, loss_fn=mse, *, opset=14):
    """STEPS of SGD through the trainer and in eager torch: same losses, same final parameters."""
    expected_losses, expected_params = models.torch_loop(model, loss_fn, batches, lambda p: torch.optim.SGD(p, lr=LR))
    trainer = trainer_for(model, desc, loss_fn, opset=opset)
    for step, batch in enumerate(batches):
        loss = trainer.train_step(*batch)[0].item()
        assert abs(loss - expected_losses[step]) <= 1e-4 * abs(expected_losses[step]), (step, loss)
    for name, parameter in trainer.model.named_parameters():
        expected = expected_params[name]
        error = ((parameter.detach() - expected).abs().max() / expected.abs().max()).item()
        assert error <= 1e-4, (name, error)


def batches(*shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(*shape, generator=generator) for shape in shapes) for _ in range(STEPS)]


def export(model, inputs, input_names, dynamic_axes=None, opset=14):
    """model + mse loss as the trainer exports it (the model under attribute `model`, parameters
    named model.<name>); returns the ONNX model and the trainable parameter names."""

    class Traced(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            output = self.model(*tensors[:-1])
            return mse(output, tensors[-1]), output

    buffer = io.BytesIO()
    with our_symbolics():
        torch.onnx.export(Traced(), tuple(inputs), buffer, dynamo=False, input_names=input_names,
                          output_names=["loss", "output"], dynamic_axes=dynamic_axes, opset_version=opset,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    return onnx.load_from_string(buffer.getvalue()), [f"model.{name}" for name, _ in model.named_parameters()]


# ---------------------------------------------------------------- InstanceNormalization
class ConvNorm(nn.Module):
    def __init__(self, norm):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = norm
        self.head = nn.Linear(4 * 5 * 5, 2)

    def forward(self, x):
        return self.head(self.norm(self.conv(x)).flatten(1))


CONV_DESC = {"inputs": [("x", ["batch", 3, 5, 5]), ("y", ["batch", 2])],
             "outputs": [("loss", [], True), ("output", ["batch", 2])]}


@pytest.mark.parametrize("norm", [lambda: nn.GroupNorm(2, 4), lambda: nn.InstanceNorm2d(4, affine=True),
                                  lambda: nn.InstanceNorm2d(4)], ids=["group_norm", "instance_norm", "no_affine"])
def test_instance_normalization_trains_like_torch(norm):
    assert_trains_like_torch(ConvNorm(norm()), CONV_DESC, batches((3, 3, 5, 5), (3, 2)))


def _instance_norm_model(opset, epsilon):
    attributes = {} if epsilon is None else {"epsilon": epsilon}
    node = onnx.helper.make_node("InstanceNormalization", ["x", "scale", "bias"], ["y"], name="/model/norm/Norm",
                                 **attributes)
    graph = onnx.helper.make_graph(
        [node], "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4, 5]),
                      onnx.helper.make_tensor_value_info("scale", onnx.TensorProto.FLOAT, [3]),
                      onnx.helper.make_tensor_value_info("bias", onnx.TensorProto.FLOAT, [3])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize("opset, epsilon", [(14, None), (14, 0.5), (18, 1e-3)])
def test_instance_normalization_rewrite_computes_the_op(opset, epsilon):
    """Same output as ONNX Runtime's InstanceNormalization (epsilon default 1e-5; ReduceMean's axes
    an input from opset 18); every new node is named under the original node's name."""
    generator = np.random.default_rng(0)
    feeds = {"x": generator.standard_normal((2, 3, 4, 5), np.float32) * 3 + 1,
             "scale": generator.standard_normal(3, np.float32), "bias": generator.standard_normal(3, np.float32)}
    original = _instance_norm_model(opset, epsilon)
    rewritten = _instance_norm_model(opset, epsilon)
    assert decompose_instance_normalization(rewritten) == 1
    assert {node.op_type for node in rewritten.graph.node} & {"InstanceNormalization"} == set()
    assert all(node.name.startswith("/model/norm/Norm/") for node in rewritten.graph.node)
    expected, ours = (onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
                      .run(None, feeds)[0] for model in (original, rewritten))
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- broadcast Where / Pow inputs
class BroadcastWhere(nn.Module):
    """A [1, H, 1, K] parameter-dependent bias chosen by torch.where against [B, H, Q, K] scores."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bias = nn.Parameter(torch.randn(1, 2, 1, 4))
        self.scores = nn.Linear(4, 4)

    def forward(self, x):
        return torch.where(x > 0, self.bias * 2, self.scores(x)).sum(-1)


class BroadcastPow(nn.Module):
    """A [1, H, 1, K] parameter-dependent base raised to [B, H, Q, K] exponents."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Parameter(torch.rand(1, 2, 1, 4) + 0.5)

    def forward(self, x):
        return (self.base ** x).sum(-1)


BROADCAST_DESC = {"inputs": [("x", ["batch", 2, 3, 4]), ("y", ["batch", 2, 3])],
                  "outputs": [("loss", [], True), ("output", ["batch", 2, 3])]}


@pytest.mark.parametrize("model", [BroadcastWhere, BroadcastPow], ids=["where", "pow"])
def test_broadcast_input_trains_like_torch(model):
    assert_trains_like_torch(model(), BROADCAST_DESC, batches((3, 2, 3, 4), (3, 2, 3)))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static_shapes", "symbolic_shapes"])
@pytest.mark.parametrize("model, broadcast_input, other_inputs", [(BroadcastWhere, 1, 2), (BroadcastPow, 0, 1)],
                         ids=["where", "pow"])
def test_only_broadcast_parameter_inputs_are_expanded(model, broadcast_input, other_inputs, dynamic):
    """The broadcast input is expanded (to the output's known shape, else by the other inputs'
    shapes in turn); Where's full-shape scores are not: no copy. Gradients are torch's."""
    model, x, y = model(), torch.randn(3, 2, 3, 4), torch.randn(3, 2, 3)
    axes = {"x": {0: "batch"}, "y": {0: "batch"}} if dynamic else None
    exported, names = export(model, [x, y], ["x", "y"], axes)
    assert expand_broadcast_inputs(exported, names) == 1
    expands = [node for node in exported.graph.node if node.op_type == "Expand"]
    assert len(expands) == (other_inputs if dynamic else 1)
    assert all(f"/expanded_input{broadcast_input}/" in node.name for node in expands)

    exported, names = export(model, [x, y], ["x", "y"], axes)
    training, _ = build_graphs(exported, names, [], ["loss"], "loss")
    session = onnxruntime.InferenceSession(training, providers=["CPUExecutionProvider"])
    feeds = {"x": x.numpy(), "y": y.numpy(), **{f"model.{n}": p.detach().numpy() for n, p in model.named_parameters()}}
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    mse(model(x), y).backward()
    for name, parameter in model.named_parameters():
        np.testing.assert_allclose(outputs[f"model.{name}_grad"], parameter.grad.numpy(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- ops without a gradient
def grid_sampled(t):
    """t plus a bilinear resampling of it: ONNX's GridSample (opset 16), which ONNX Runtime 1.19
    cannot differentiate and no torch node stands in for (atan, pixel_shuffle, ReduceProd and
    reflect padding, the earlier examples, train through torch nodes now)."""
    grid = torch.full((t.shape[0], 2, 2, 2), 0.25)
    return t + nn.functional.grid_sample(t.reshape(-1, 1, 2, 2), grid, align_corners=False).reshape(-1, 4)


class Arctangent(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return grid_sampled(self.linear(x))


class Nested(nn.Module):
    def __init__(self, last):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), last)

    def forward(self, x):
        return self.body(x)


class ArctangentBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.atan = Arctangent()

    def forward(self, x):
        return self.atan(x)


VECTOR_DESC = {"inputs": [("x", ["batch", 4]), ("y", ["batch", 4])],
               "outputs": [("loss", [], True), ("output", ["batch", 4])]}


def test_op_without_gradient_names_op_and_module():
    trainer = trainer_for(Nested(ArctangentBlock()), VECTOR_DESC, opset=16)
    with pytest.raises(MissingGradientError, match=(
            r"^ONNX Runtime has no gradient for GridSample, used by module 'body\.1\.atan' \(ONNX node "
            r"/model/body/body\.1/atan/GridSample\) between the trainable parameters and the loss\. Compute that "
            r"part outside the trained graph \(e\.g\. in the data pipeline\), freeze the parameters that feed "
            r"it, or write it with ops that have gradients; if you need it as it is, report it to the "
            r"ort-trainer maintainers with this message\.$")) as raised:
        trainer.train_step(torch.randn(2, 4), torch.randn(2, 4))
    assert isinstance(raised.value, NotImplementedError)
    assert isinstance(raised.value.__cause__, RuntimeError)  # ORT's own message, chained
    assert (raised.value.op_type, raised.value.modules) == ("GridSample", ["body.1.atan"])


def test_op_without_gradient_off_the_parameters_path_trains():
    """A GridSample of the inputs alone needs no gradient."""

    class CumulativeFeatures(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(grid_sampled(x))

    torch.manual_seed(0)
    assert_trains_like_torch(CumulativeFeatures(), VECTOR_DESC, batches((2, 4), (2, 4)), opset=16)


@pytest.mark.parametrize("norm", [
    lambda h: h * torch.linalg.matrix_norm(h), lambda h: h * torch.sqrt((h * h).mean((0, 1))),
    lambda h: h * torch.linalg.vector_norm(h), lambda h: (h.T / torch.linalg.vector_norm(h, 2, 1)).T,
    lambda h: h - torch.logsumexp(h, 1, keepdim=False).unsqueeze(1),
], ids=["matrix_norm", "sqrt of a mean over dims", "vector_norm of all", "vector_norms of rows", "logsumexp"])
def test_norms_train_like_torch(norm):
    """ONNX Runtime's graphs of these failed to build or to load: ReduceL2 and ReduceLogSumExp
    without keepdims, a Sqrt of a 0-d value after a ReduceSum over explicit dims."""
    assert_trains_like_torch(LinearThen(norm, features=4), VECTOR_DESC, batches((3, 4), (3, 4)))


def onnx_model_with_loss(model, **export_options):
    """`model` (4 features in, 4 out) + mse loss exported by torch's exporter as a user would, the
    model under attribute `model` (as the trainer's own export names its modules)."""

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x, y):
            output = self.model(x)
            return mse(output, y), output

    buffer = io.BytesIO()
    torch.onnx.export(WithLoss(), (torch.randn(2, 4), torch.randn(2, 4)), buffer, input_names=["x", "y"],
                      output_names=["loss", "output"], opset_version=14, dynamo=False, **export_options)
    return onnx.load_from_string(buffer.getvalue())


@pytest.mark.parametrize("layer", ["lstm", "gru"])
def test_a_bidirectional_recurrence_in_an_onnx_model_is_refused_by_name(layer):
    """ONNX Runtime's LSTM and GRU training kernels run forwards only (its session failed to load).
    A torch model's bidirectional layer trains through a torch node (test_torch_ops); an ONNX
    model's is refused."""

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = (nn.LSTM if layer == "lstm" else nn.GRU)(4, 2, batch_first=True, bidirectional=True)

        def forward(self, x):
            return self.rnn(x.unsqueeze(1))[0][:, 0]

    trainer = ORTTrainer(onnx_model_with_loss(Recurrent(), training=torch.onnx.TrainingMode.TRAINING,
                                              do_constant_folding=False), VECTOR_DESC, optim.SGDConfig(lr=LR))
    op = layer.upper()
    with pytest.raises(MissingGradientError, match=(
            rf"^ONNX Runtime has no gradient for {op} \(direction 'bidirectional': its training kernels run the "
            rf"forward direction only\), used by module 'rnn' \(ONNX node /model/rnn/{op}\) between")):
        trainer.train_step(torch.randn(2, 4), torch.randn(2, 4))


@pytest.mark.parametrize("conv", [
    lambda: nn.Conv1d(2, 3, 4, padding="same"), lambda: nn.Conv1d(2, 3, 2, padding="same", dilation=3),
    lambda: nn.Conv2d(2, 3, (2, 3), padding="same"), lambda: nn.Conv1d(2, 3, 3, padding="same"),
], ids=["even kernel", "dilated", "2d", "odd kernel"])
def test_same_padding_trains_like_torch(conv):
    """padding='same' exports as auto_pad SAME_UPPER, whose gradients ONNX Runtime got wrong
    (silently, each of these cases): the explicit pads it stands for."""

    class Same(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = conv(), nn.Linear(3, 4)

        def forward(self, x):
            y = self.conv(x.reshape(x.shape[0], 2, *([2] if isinstance(self.conv, nn.Conv1d) else [1, 2])))
            return self.head(y.flatten(2).mean(-1))

    torch.manual_seed(0)
    assert_trains_like_torch(Same(), VECTOR_DESC, batches((3, 4), (3, 4)))


def test_unsupported_case_of_an_op_names_its_nodes_on_the_gradient_path():
    """ORT names no node when only a case lacks a gradient (Pad in reflect mode, in an ONNX model:
    a torch model's reflect padding trains through a torch node): every Pad between the
    parameters and the loss is named; the one on the inputs alone is not. The module's second
    call is scoped 'pad_1' by the exporter."""

    class Padded(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.pad = nn.ReflectionPad1d(1)

        def forward(self, x):
            return self.pad(self.linear(self.pad(x)[:, 1:-1].unsqueeze(1)))[:, 0, 1:-1]

    trainer = ORTTrainer(onnx_model_with_loss(Padded()), VECTOR_DESC, optim.SGDConfig(lr=LR))
    with pytest.raises(MissingGradientError, match=(
            r"^ONNX Runtime has no gradient for Pad \(Pad gradient currently supports constant mode only\), "
            r"used by module 'pad_1' or a repeated call of module 'pad' \(ONNX node /model/pad_1/Pad\) between"
    )) as raised:
        trainer.train_step(torch.randn(2, 4), torch.randn(2, 4))
    assert raised.value.nodes == ["/model/pad_1/Pad"]


@pytest.mark.parametrize("node, module", [
    ("/model/backbone/norm/InstanceNormalization", "backbone.norm"),
    ("/model/model/layers/layers.0/mlp/Gemm", "model.layers.0.mlp"),
    ("/model/blocks.1/Atan", "blocks.1"),
    ("/model/Atan", ""),
    ("/loss_fn/Atan", None),
    ("/Atan", None),
    ("", None),
])
def test_torch_module_of_an_exported_node(node, module):
    assert torch_module(node) == module


class CumulativeOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return grid_sampled(self.linear(x))


@pytest.mark.parametrize("model, loss_fn, where", [
    (CumulativeOutput, mse, r"the model's own forward\(\) \(ONNX node /model/GridSample\)"),
    (lambda: nn.Linear(4, 4), lambda output, y: mse(grid_sampled(output), y),
     r"loss_fn \(outside the model\) \(ONNX node /GridSample\)"),
], ids=["model_forward", "loss_fn"])
def test_op_without_gradient_outside_a_submodule(model, loss_fn, where):
    trainer = trainer_for(model(), VECTOR_DESC, loss_fn, opset=16)
    expected = f"^ONNX Runtime has no gradient for GridSample, used by {where} between"
    with pytest.raises(MissingGradientError, match=expected):
        trainer.train_step(torch.randn(2, 4), torch.randn(2, 4))


def test_missing_gradient_of_an_unnamed_node():
    with pytest.raises(MissingGradientError, match=r"^ONNX Runtime has no gradient for Atan, used by loss_fn "
                                                   r"\(outside the model\) \(ONNX node <unnamed>\) between"):
        raise MissingGradientError("Atan", [""])


def test_missing_gradient_without_a_node():
    with pytest.raises(MissingGradientError, match=r"^ONNX Runtime has no gradient for Pow \(exponent\), used by "
                                                   r"the model \(ONNX Runtime did not say where\) between"):
        raise MissingGradientError("Pow", [], "exponent.")


# ---------------------------------------------------------------- aten::diff, aten::cumsum
class Differences(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(5, 5)

    def forward(self, x):
        hidden = self.linear(x)
        return torch.diff(hidden, dim=1) + torch.diff(hidden, n=2, prepend=hidden[:, -1:] * 2)


def test_diff_trains_like_torch():
    desc = {"inputs": [("x", ["batch", 5]), ("y", ["batch", 4])],
            "outputs": [("loss", [], True), ("output", ["batch", 4])]}
    assert_trains_like_torch(Differences(), desc, batches((3, 5), (3, 4)))


def test_int64_diff_of_a_mask_exports_and_trains():
    """As transformers' packed-sequence check: an int64 diff, then a cumsum of the bool it gives."""

    class MaskStarts(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = nn.Linear(6, 6)

        def forward(self, x, mask):
            sequence = (torch.diff(mask, prepend=torch.zeros_like(mask[:, :1])) > 0).cumsum(-1)
            return self.linear(x) * sequence

    desc = {"inputs": [("x", ["batch", 6]), ("mask", ["batch", 6]), ("y", ["batch", 6])],
            "outputs": [("loss", [], True), ("output", ["batch", 6])]}
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [1, 1, 0, 0, 0, 1]])
    data = [(x, mask, y) for x, y in batches((2, 6), (2, 6))]
    assert_trains_like_torch(MaskStarts(), desc, data)


@pytest.mark.parametrize("opset", [9, 14, 20])
@pytest.mark.parametrize("x, kwargs", [
    (torch.arange(12.).view(3, 4) ** 2, dict(n=2, dim=0)),
    (torch.arange(12.).view(3, 4) ** 2, dict(n=0)),
    (torch.arange(12.).view(3, 4) ** 2, dict(n=5)),
    (torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]]), dict(dim=-1, append=torch.tensor([[0], [1]]))),
    (torch.tensor([1, 3, 4]), dict(prepend=torch.tensor([0.5]))),
    (torch.tensor([True, False, False, True]), {}),
], ids=["n2_dim0", "n0", "n_past_size", "int64_append", "promoted", "bool"])
def test_diff_export_computes_torch_diff(opset, x, kwargs):
    class Diff(nn.Module):
        def forward(self, x):
            return torch.diff(x, **kwargs)

    buffer = io.BytesIO()
    with our_symbolics():
        torch.onnx.export(Diff(), (x,), buffer, dynamo=False, input_names=["x"], opset_version=opset)
    session = onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    ours = session.run(None, {"x": x.numpy()})[0]
    expected = torch.diff(x, **kwargs).numpy()
    assert ours.dtype == expected.dtype and ours.shape == expected.shape
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("opset", [11, 14, 17])
@pytest.mark.parametrize("cumsum", [
    lambda x: (torch.diff(x, prepend=x[:, :1] - 1) != 1).cumsum(-1),
    lambda x: x.int().cumsum(0),
    lambda x: (x > 2).cumsum(1, dtype=torch.int32),
    lambda x: x.cumsum(1, dtype=torch.float32),
    lambda x: x.double().cumsum(1),
], ids=["bool", "int32", "bool_dtype_int32", "int64_dtype_float", "float64"])
def test_cumsum_export_has_torch_result_type(opset, cumsum):
    """Bool and integer inputs sum as int64 or as the dtype given (torch's exporter left bool
    inputs bool, invalid for ONNX CumSum)."""

    class CumSum(nn.Module):
        def forward(self, x):
            return cumsum(x)

    x = torch.tensor([[0, 1, 2, 0, 1, 5], [3, 4, 5, 6, 0, 1]])
    buffer = io.BytesIO()
    with our_symbolics():
        torch.onnx.export(CumSum(), (x,), buffer, dynamo=False, input_names=["x"], opset_version=opset)
    session = onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    ours, expected = session.run(None, {"x": x.numpy()})[0], cumsum(x).numpy()
    assert ours.dtype == expected.dtype
    np.testing.assert_array_equal(ours, expected)


def test_diff_with_a_computed_n_is_refused_at_export():
    class SizeDependent(nn.Module):
        def forward(self, x):
            return torch.diff(x, n=x.shape[0] - 1, dim=1)

    with our_symbolics(), pytest.raises(SymbolicValueError, match=r"^torch\.diff: argument n is computed in the "
                                                                r"graph \(from a dynamic size\?\), the ONNX export "
                                                                r"needs it constant: pass a Python int for n"):
        torch.onnx.export(SizeDependent(), (torch.randn(3, 4),), io.BytesIO(), dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "batch"}})


class PaddedLanguageModel(nn.Module):
    """An embedding with a padding row, optionally tied to the output layer (as GPT-2's)."""

    def __init__(self, tied):
        super().__init__()
        torch.manual_seed(12)
        self.embedding = nn.Embedding(9, 6, padding_idx=1)
        with torch.no_grad():
            self.embedding.weight[1] = torch.randn(6)  # a pretrained padding row need not be zero
        self.output = nn.Linear(6, 9, bias=False)
        if tied:
            self.output.weight = self.embedding.weight

    def forward(self, tokens):
        return self.output(torch.tanh(self.embedding(tokens)))


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_padding_row_gets_no_gradient_from_the_lookup_as_in_torch(tied):
    model = PaddedLanguageModel(tied)
    reference = copy.deepcopy(model)
    desc = {"inputs": [("tokens", ["batch", "seq"]), ("labels", ["batch", "seq"])], "outputs": [("loss", [], True)]}

    def loss_fn(logits, labels):
        return nn.functional.cross_entropy(logits.reshape(-1, 9), labels.reshape(-1))
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.5), loss_fn=loss_fn,
                         options=ORTTrainerOptions({"utils": {"grad_norm_clip": False}}))
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    padding_row = model.embedding.weight[1].clone()
    for step in range(10):
        generator = torch.Generator().manual_seed(800 + step)
        tokens = torch.randint(0, 9, (3, 5), generator=generator)
        tokens[:, -2:] = 1  # padding
        labels = torch.randint(0, 9, (3, 5), generator=generator)
        loss = trainer.train_step(tokens, labels)
        sgd.zero_grad()
        expected = loss_fn(reference(tokens), labels)
        expected.backward()
        sgd.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5), f"step {step}"
    torch.testing.assert_close(model.embedding.weight, reference.embedding.weight, rtol=1e-4, atol=1e-6)
    assert torch.equal(model.embedding.weight[1], padding_row) != tied  # tied: the output layer moves it


# ---------------------------------------------------------------- cross_entropy with label_smoothing
def _label_batches(shape, classes, seed=0):
    """(logits input, class targets with some ignore_index) batches; `shape`: the input's."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        x = torch.randn(*shape, generator=generator)
        target_shape = (shape[0], *shape[2:]) if len(shape) > 2 else (shape[0],)
        target = torch.randint(0, classes, target_shape, generator=generator)
        target.view(-1)[::3] = -100  # ignore_index: not counted, in the loss or its mean
        out.append((x, target))
    return out


class Classes(nn.Module):
    """A linear classifier over dim 1 of a [batch, features, positions...] input."""

    def __init__(self, features=6, classes=5):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(features, classes)

    def forward(self, x):
        return self.linear(x.movedim(1, -1)).movedim(-1, 1)  # negative dims: our movedim symbolic


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("positions", [(), (4,)], ids=["2d", "3d"])
def test_cross_entropy_with_label_smoothing_trains_like_torch(reduction, weighted, positions):
    """torch's exporter refuses label_smoothing; ours exports torch's formula (class weights too)."""
    weight = torch.linspace(0.5, 1.5, 5) if weighted else None

    def loss_fn(logits, target):
        loss = nn.functional.cross_entropy(logits, target, weight=weight, label_smoothing=0.2, reduction=reduction)
        return loss if reduction != "none" else loss.sum() / 7

    dims = ["batch", *(f"p{i}" for i in range(len(positions)))]
    desc = {"inputs": [("x", [dims[0], 6, *dims[1:]]), ("target", dims)],
            "outputs": [("loss", [], True), ("logits", [dims[0], 5, *dims[1:]])]}
    assert_trains_like_torch(Classes(), desc, _label_batches((3, 6, *positions), 5), loss_fn=loss_fn)


@pytest.mark.parametrize("loss_fn, message", [
    (lambda logits, target: nn.functional.binary_cross_entropy(torch.sigmoid(logits), (logits > 0).float(),
                                                               weight=torch.ones(5)),
     "torch's binary_cross_entropy with a weight cannot be trained in ONNX Runtime: multiply its unreduced loss "
     "(reduction='none') by the weight instead"),
])
def test_loss_cases_it_cannot_export_are_named(loss_fn, message):
    desc = {"inputs": [("x", ["batch", 6]), ("target", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", 5])]}
    trainer = trainer_for(Classes(), desc, loss_fn)
    with pytest.raises(Exception, match=re.escape(message)):
        trainer.train_step(*_label_batches((3, 6), 5)[0])
    assert trainer.train_step_info.step == 0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing, weighted", [(0.0, False), (0.2, False), (0.2, True)],
                         ids=["plain", "smoothed", "smoothed+weighted"])
@pytest.mark.parametrize("positions", [(), (4,)], ids=["2d", "3d"])
def test_cross_entropy_of_class_probabilities_trains_like_torch(reduction, smoothing, weighted, positions):
    """Probability targets: torch's symbolic wrote a SoftmaxCrossEntropyLoss with float labels, an
    invalid graph."""
    weight = torch.linspace(0.5, 1.5, 5) if weighted else None

    def loss_fn(logits, target):
        probabilities = nn.functional.softmax(nn.functional.one_hot(target.clamp(min=0), 5).movedim(-1, 1) * 2.0, 1)
        loss = nn.functional.cross_entropy(logits, probabilities, weight=weight, label_smoothing=smoothing,
                                           reduction=reduction)
        return loss if reduction != "none" else loss.sum() / 7

    dims = ["batch", *(f"p{i}" for i in range(len(positions)))]
    desc = {"inputs": [("x", [dims[0], 6, *dims[1:]]), ("target", dims)],
            "outputs": [("loss", [], True), ("logits", [dims[0], 5, *dims[1:]])]}
    assert_trains_like_torch(Classes(), desc, _label_batches((3, 6, *positions), 5), loss_fn=loss_fn)


def _signs(target):
    return (target > 1).float() * 2 - 1


# The losses the exporter refuses (torch nodes now): loss(logits [3, 5], class targets [3]).
LOSSES = {
    "l1_loss": lambda o, t, r: nn.functional.l1_loss(o, nn.functional.one_hot(t, 5).float(), reduction=r),
    "smooth_l1_loss": lambda o, t, r: nn.functional.smooth_l1_loss(o, nn.functional.one_hot(t, 5).float(),
                                                                   reduction=r, beta=0.5),
    "huber_loss": lambda o, t, r: nn.functional.huber_loss(o, nn.functional.one_hot(t, 5).float(), reduction=r,
                                                           delta=0.3),
    "binary_cross_entropy": lambda o, t, r: nn.functional.binary_cross_entropy(
        torch.sigmoid(o), nn.functional.one_hot(t, 5).float(), reduction=r),
    "soft_margin_loss": lambda o, t, r: nn.functional.soft_margin_loss(o[:, 0], _signs(t), reduction=r),
    "hinge_embedding_loss": lambda o, t, r: nn.functional.hinge_embedding_loss(o[:, 0], _signs(t), reduction=r),
    "margin_ranking_loss": lambda o, t, r: nn.functional.margin_ranking_loss(o[:, 0], o[:, 1], _signs(t), margin=0.1,
                                                                             reduction=r),
    "cosine_embedding_loss": lambda o, t, r: nn.functional.cosine_embedding_loss(o, o.flip(0), _signs(t), margin=0.1,
                                                                                 reduction=r),
    "triplet_margin_loss": lambda o, t, r: nn.functional.triplet_margin_loss(o, o.flip(0), o.roll(1, 0), reduction=r),
    "multi_margin_loss": lambda o, t, r: nn.functional.multi_margin_loss(o, t, reduction=r),
    "multilabel_margin_loss": lambda o, t, r: nn.functional.multilabel_margin_loss(
        o, torch.stack([t, torch.full_like(t, -1), t, t, t], 1), reduction=r),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_losses_the_exporter_refuses_train_like_torch(name, reduction):
    def loss_fn(logits, target):
        loss = LOSSES[name](logits, target, reduction)
        return loss if reduction != "none" else loss.sum() / 7

    desc = {"inputs": [("x", ["batch", 6]), ("target", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", 5])]}
    batches = [(x, target.clamp(min=0)) for x, target in _label_batches((3, 6), 5)]
    assert_trains_like_torch(Classes(), desc, batches, loss_fn=loss_fn)


@pytest.mark.parametrize("source, destination", [(-1, 1), (1, -1), ((0, -1), (-1, 0)), ((-3, -2), (2, 0)),
                                                 (-2, -2), ((2, 0), (0, 1))])
def test_movedim_export_computes_torch_movedim(source, destination):
    """torch's symbolic put a negative source dim into the Transpose as it is (perm [0, -1])."""
    class MoveDim(nn.Module):
        def forward(self, x):
            return x.movedim(source, destination) * 1

    x = torch.randn(2, 3, 4)
    buffer = io.BytesIO()
    with our_symbolics():
        torch.onnx.export(MoveDim(), (x,), buffer, dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "batch"}})
    session = onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"x": x.numpy()})[0], x.movedim(source, destination).numpy())


# ---------------------------------------------------------------- activations without an ORT gradient
ACTIVATIONS = {
    "elu": lambda h: nn.functional.elu(h, alpha=0.7), "celu": lambda h: nn.functional.celu(h, alpha=1.5),
    "selu": nn.functional.selu, "softplus": nn.functional.softplus,
    "softplus_beta": lambda h: nn.functional.softplus(h, beta=2.0, threshold=5.0), "mish": nn.functional.mish,
    "hardsigmoid": nn.functional.hardsigmoid, "hardswish": nn.functional.hardswish,
    "prelu": nn.PReLU(6, init=0.3),  # a trained slope per channel
    "relu6": nn.ReLU6(), "hardtanh": nn.Hardtanh(-1.0, 2.0),
    # exactly at the bounds (x - x.detach() is 0 with a gradient of 1): torch's hardtanh passes no
    # gradient there, ONNX Runtime's Clip gradient passed it
    "relu6 at its bounds": lambda h: nn.functional.relu6(h - h.detach()) + nn.functional.relu6(h - h.detach() + 6) + h,
}


class LinearThen(nn.Module):
    """activation(scale * linear(x)) / scale; the activation may be a module with parameters."""

    def __init__(self, activation, *, features=6, scale=1.0):
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.activation, self.scale = nn.Linear(features, features), copy.deepcopy(activation), scale

    def forward(self, x):
        return self.activation(self.linear(x) * self.scale) / self.scale


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_without_an_ort_gradient_trains_like_torch(name):
    """ONNX Runtime 1.19 has no gradient for PRelu, Elu, Celu, Selu, Softplus (Mish), HardSigmoid
    and HardSwish, and its Clip gradient is torch.clamp's, not hardtanh's (ReLU6's): a training
    export writes them with ops it differentiates as torch does."""
    desc = {"inputs": [("x", ["batch", 6]), ("y", ["batch", 6])],
            "outputs": [("loss", [], True), ("output", ["batch", 6])]}
    # far into both tails (exp(100) overflows fp32): the left-out branch of a Where gives no NaN gradient
    assert_trains_like_torch(LinearThen(ACTIVATIONS[name], scale=100.0), desc, batches((4, 6), (4, 6)))


@pytest.mark.parametrize("activation", [nn.ReLU6(), nn.Hardtanh(-1.0, 6.0), nn.Hardsigmoid(), nn.Hardswish()],
                         ids=["relu6", "hardtanh", "hardsigmoid", "hardswish"])
def test_an_ortmodule_piecewise_activation_has_torchs_gradient_at_its_kinks(monkeypatch, activation):
    """torch's rules at the kinks: none of the pieces' gradients at hardtanh's (ReLU6's) and
    hardsigmoid's bounds, hardswish's outer pieces' at -3 and 3. A ReLU6 after zeros (an
    eval-mode BatchNorm with zero bias, zero padding) sits at its bound: MobileNetV2's BatchNorm
    biases got gradients 27-52% off with ONNX Runtime's Clip gradient."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    ours, expected = (torch.tensor([-4.0, -3.0, -1.0, 0.0, 2.0, 3.0, 6.0, 7.0], requires_grad=True)
                      for _ in range(2))
    ORTModule(activation)(ours).sum().backward()
    activation(expected).sum().backward()
    torch.testing.assert_close(ours.grad, expected.grad, rtol=1e-6, atol=1e-7)  # hardswish's x / 3 + 1/2: rounding


@pytest.mark.parametrize("name, op", [("elu", "Elu"), ("selu", "Selu"), ("softplus", "Softplus"),
                                      ("hardswish", "HardSwish"), ("prelu", "PRelu"), ("relu6", "Clip"),
                                      ("hardtanh", "Clip")])
def test_an_inference_export_keeps_the_activation_op(name, op):
    buffer = io.BytesIO()
    with our_symbolics():
        torch.onnx.export(LinearThen(ACTIVATIONS[name]), (torch.randn(2, 6),), buffer, dynamo=False,
                          input_names=["x"], opset_version=14, training=torch.onnx.TrainingMode.EVAL)
    assert op in {node.op_type for node in onnx.load_from_string(buffer.getvalue()).graph.node}


def _rrelu_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 40), nn.RReLU(0.1, 0.3), nn.Linear(40, 3))


def test_rrelu_trains_with_torchs_own_slopes_in_orttrainer():
    """Training-mode RReLU: each negative element's slope drawn by torch's kernel from torch's
    generator (the same draws as eager under the same seed), its gradient those slopes; eval_step
    uses the fixed slope (lower + upper) / 2, as torch's eval."""
    model, batch = _rrelu_model(), (torch.randn(8, 6), torch.randn(8, 3))
    reference = copy.deepcopy(model)
    trainer = trainer_for(model, {"inputs": [("x", ["batch", 6]), ("y", ["batch", 3])],
                                  "outputs": [("loss", [], True), ("output", ["batch", 3])]})
    sgd = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(4):
        torch.manual_seed(step)
        loss = trainer.train_step(*batch)[0]
        torch.manual_seed(step)
        sgd.zero_grad()
        expected = mse(reference(batch[0]), batch[1])
        expected.backward()
        sgd.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6), step
    for ours, theirs in zip(trainer.model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.detach(), theirs, rtol=1e-5, atol=1e-6)
    reference.eval()
    assert trainer.eval_step(*batch)[0].item() == pytest.approx(mse(reference(batch[0]), batch[1]).item(), rel=1e-6)


def test_rrelu_in_an_ortmodule_draws_what_eager_draws(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model, x = _rrelu_model(), torch.randn(8, 6)
    reference, wrapped = copy.deepcopy(model), ORTModule(model)
    for seed in (3, 4):
        torch.manual_seed(seed)
        ours = wrapped(x)
        torch.manual_seed(seed)
        expected = reference(x)
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)  # other draws: slopes 0.1 to 0.3
        ours.square().sum().backward()
        expected.square().sum().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)
    wrapped.eval(), reference.eval()
    torch.testing.assert_close(wrapped(x), reference(x), rtol=1e-6, atol=1e-6)


def test_rrelu_inside_a_checkpointed_segment_keeps_its_slopes(monkeypatch):
    """A checkpointed segment's nodes are copied into the backward; the torch node drawing the
    slopes is left to the forward (its copy drew other slopes: gradients 5% off, silently)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _rrelu_model()

        def forward(self, x):
            first, rrelu, last = self.inner
            return last(torch.utils.checkpoint.checkpoint(lambda h: rrelu(first(h)).tanh(), x, use_reentrant=False))

    model, x = Checkpointed(), torch.randn(8, 6)
    reference, wrapped = copy.deepcopy(model), ORTModule(model)
    for module in (wrapped, reference):
        torch.manual_seed(3)
        module(x).square().sum().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)


def test_a_random_op_with_its_own_generator_is_refused_by_name(monkeypatch):
    """torch's exporter itself fails on a Generator constant; the error says what to change."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")

    class OwnGenerator(nn.Module):
        def forward(self, x):
            return torch.rrelu(x, 0.1, 0.3, True, torch.Generator().manual_seed(0))

    with pytest.raises(ExportError, match=r"a torch\.Generator passed to a random op, e\.g\. torch\.rrelu\(\.\.\., "
                                        r"generator=g\), cannot be traced: draw from the default generator"):
        ORTModule(OwnGenerator())(torch.randn(3, 4, requires_grad=True))


# ---------------------------------------------------------------- CumSum's gradient (registered)
def test_cumsum_trains_like_torch():
    desc = {"inputs": [("x", ["batch", 5]), ("y", ["batch", 5])],
            "outputs": [("loss", [], True), ("output", ["batch", 5])]}
    def cumulative(hidden):
        return torch.cumsum(hidden, dim=1) + torch.cumsum(hidden.flip(0), dim=0)

    assert_trains_like_torch(LinearThen(cumulative, features=5), desc, batches((3, 5), (3, 5)))


@pytest.mark.parametrize("exclusive, reverse", [(1, 0), (0, 1), (1, 1)])
def test_cumsum_with_exclusive_or_reverse_computes_and_differentiates_as_its_definition(exclusive, reverse):
    """ONNX models may set exclusive/reverse, which the registered gradient (of the inclusive forward
    CumSum) does not read: such nodes are rewritten first. Values and gradients against torch."""
    from onnx import TensorProto, helper

    from ort_trainer._graph.trainer_graph_builder import build_graphs

    nodes = [helper.make_node("Constant", [], ["axis"], value=onnx.numpy_helper.from_array(np.array(1, np.int64))),
             helper.make_node("Mul", ["x", "w"], ["h"]),
             helper.make_node("CumSum", ["h", "axis"], ["c"], exclusive=exclusive, reverse=reverse),
             helper.make_node("Mul", ["c", "c"], ["sq"]), helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)
    training, _ = build_graphs(model, ["w"], [], ["loss"], "loss", device_type="cpu")
    session = onnxruntime.InferenceSession(training, providers=["CPUExecutionProvider"])
    x, w = torch.randn(2, 4), torch.randn(4, requires_grad=True)
    loss, grad = session.run(["loss", "w_grad"], {"x": x.numpy(), "w": w.detach().numpy()})
    h = x * w
    c = h.flip(1).cumsum(1).flip(1) if reverse else h.cumsum(1)
    expected = ((c - h if exclusive else c) ** 2).sum()
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    np.testing.assert_allclose(grad, w.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_ortmodule_runs_these_in_its_graph(monkeypatch):
    """CumSum, an activation ONNX Runtime cannot differentiate and a label-smoothed loss in one
    ORTModule, no fallback: the gradients torch gives."""

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = nn.Linear(6, 5)

        def forward(self, x, target):
            hidden = self.linear(x)
            logits = nn.functional.elu(torch.cumsum(hidden, 1)) + nn.functional.hardswish(hidden)
            return nn.functional.cross_entropy(logits, target, label_smoothing=0.1)

    model = Mixed()
    reference = copy.deepcopy(model)
    x, target = torch.randn(4, 6), torch.randint(0, 5, (4,))
    ours, expected = ORTModule(model)(x, target), reference(x, target)
    ours.backward()
    expected.backward()
    assert ours.item() == pytest.approx(expected.item(), rel=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- ReduceMax / ReduceMin (no ORT gradient)
EXTREMA = {
    "max_dim": lambda h: torch.max(h.view(-1, 2, 3), 1)[0].repeat(1, 2),
    "min_dim_keepdim": lambda h: (h.view(-1, 2, 3) - torch.min(h.view(-1, 2, 3), 2, keepdim=True)[0]).flatten(1),
    "amax_masked": lambda h: torch.softmax(h.masked_fill(torch.arange(6) > 3, float("-inf")) -
                                           h.masked_fill(torch.arange(6) > 3, float("-inf")).amax(1, keepdim=True), 1),
    "max_all": lambda h: h * torch.max(h),
    "ties": lambda h: h * torch.amax(torch.cat([h, h], 1), 1, keepdim=True),  # each maximum twice: the value
    # max/min with a dim: the whole gradient to the index torch returns (the first of ties), none to the others
    "max_dim_ties": lambda h: torch.max(torch.stack([h, h.detach()], 2), 2)[0],
    "min_dim_ties": lambda h: h * torch.min(torch.stack([h.detach(), h], 2), 2, keepdim=True)[0].flatten(1),
    "max_dim_indices": lambda h: h * torch.max(h.view(-1, 3, 2), 2)[1].repeat(1, 2),
    # torch.flip: a reversing Slice, whose ORT gradient fails to run, written as a Gather
    "flip": lambda h: torch.flip(h, [1]) * h,
    "flip_two_axes": lambda h: torch.flip(h.view(-1, 2, 3), [1, 2]).flatten(1),
}


@pytest.mark.parametrize("name", sorted(EXTREMA))
def test_max_and_min_train_like_torch(name):
    """amax/amin and max/min without a dim: the mean of the elements equal to the extremum, torch's
    gradient (ties share it evenly), -inf elements (masked attention scores) kept out; max/min with a
    dim: the element at the ArgMax/ArgMin. torch.flip too."""
    desc = {"inputs": [("x", ["batch", 6]), ("y", ["batch", 6])],
            "outputs": [("loss", [], True), ("output", ["batch", 6])]}
    assert_trains_like_torch(LinearThen(EXTREMA[name]), desc, batches((4, 6), (4, 6)))


@pytest.mark.parametrize("keepdim", [True, False])
def test_an_ortmodule_max_with_a_dim_returns_torchs_indices_and_gradient_among_ties(monkeypatch, keepdim):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")

    class Extrema(nn.Module):
        def forward(self, x):
            values, indices = torch.max(x, 1, keepdim=keepdim)
            smallest, at = x.min(dim=0)
            return values, indices, smallest, at

    x = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0], [1.0, 5.0, 0.0]])
    ours, expected = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = ORTModule(Extrema())(ours), Extrema()(expected)
    (got[0].sum() + got[2].sum()).backward()
    (want[0].sum() + want[2].sum()).backward()
    for value, reference in zip(got, want):
        torch.testing.assert_close(value, reference, rtol=0, atol=0)
    torch.testing.assert_close(ours.grad, expected.grad, rtol=0, atol=0)
