"""fp16 and bf16 models on the CPU (`_graph.cpu_low_precision`): ONNX Runtime's CPU provider has
almost no fp16/bf16 kernels, so ORTModule's graph computes in fp32 and rounds each op's result to
the model's type, as torch's CPU kernels do. Parity: elementwise forwards bit-identical to eager;
whole models as close to a float64 reference as eager fp16/bf16 is."""
import copy

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn as nn
import transformers
from onnxruntime.capi import _pybind_state as C

from ort_trainer._graph.autocast import element_types
from ort_trainer._graph.cpu_low_precision import low_precision_in_fp32
from ort_trainer.ortmodule import ORTModule

from . import models

LOW = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _no_fallback(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # PyTorch would hide a failure


def _relative(value, exact):
    return ((value.double() - exact).abs().max() / exact.abs().max()).item()


def _step(model, x):
    """Output, input gradient and parameter gradients of one backward of a fixed weighting."""
    x = x.clone().requires_grad_()
    y = model(x)
    (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8), nn.Softmax(-1))


@pytest.mark.parametrize("dtype", LOW)
def test_a_low_precision_model_trains_on_the_cpu_as_accurately_as_eager(dtype):
    base, x = _mlp(), torch.randn(16, 32)
    exact = _step(copy.deepcopy(base).double(), x.double())
    eager = _step(copy.deepcopy(base).to(dtype), x.to(dtype))
    ours = _step(ORTModule(copy.deepcopy(base).to(dtype)), x.to(dtype))
    ulp = torch.finfo(dtype).eps
    for mine, theirs, reference in zip(ours, eager, exact):
        assert mine.dtype == dtype
        assert _relative(mine, reference) <= 2 * max(_relative(theirs, reference), ulp)


class Elementwise(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scale, self.shift = nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(7))

    def forward(self, x):
        return torch.tanh((x * self.scale + self.shift).relu() - x * x) * torch.sigmoid(x)


@pytest.mark.parametrize("dtype", LOW)
def test_each_op_rounds_its_result_as_torch_does(dtype):
    """Bit-identical forward: fp32 throughout and one rounding at the end would differ."""
    x = torch.randn(50, 7, dtype=dtype)
    model = Elementwise().to(dtype)
    ours, eager = _step(ORTModule(copy.deepcopy(model)), x), _step(model, x)
    assert torch.equal(ours[0], eager[0])
    for mine, theirs in zip(ours[1:], eager[1:]):  # the backward's formulas round elsewhere: close
        torch.testing.assert_close(mine, theirs, rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("keepdim", [True, False])
def test_max_and_min_of_a_low_precision_tensor(dtype, keepdim):
    """The original ORTModule's test_gradient_correctness_minmax cases: values, indices and
    gradients exactly torch's."""
    class Extrema(nn.Module):
        def forward(self, x):
            values, indices = torch.max(x, 0, keepdim=keepdim)
            return values, indices, torch.min(x, dim=-1, keepdim=keepdim)[0], torch.amax(x, 1)

    x = torch.rand(4, 6, 5).to(dtype)
    x[1, 0] = x[0, 0]  # ties
    ours, expected = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = ORTModule(Extrema())(ours), Extrema()(expected)
    sum(value.sum() for value in got if value.is_floating_point()).backward()
    sum(value.sum() for value in want if value.is_floating_point()).backward()
    for value, reference in zip(got, want):
        assert torch.equal(value, reference)
    assert torch.equal(ours.grad, expected.grad)


def test_an_output_the_model_also_reads_gets_both_gradients():
    """GPT-2's logits: an output and the loss's input. The gradient from outside and the graph's
    own add up in fp32 (ONNX Runtime has no bf16 Add on the CPU)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base, ids = transformers.GPT2LMHeadModel(config), torch.randint(0, 50, (2, 8))

    def grads(model):
        output = model(input_ids=ids, labels=ids)
        (output.loss + output.logits.float().square().mean()).backward()
        return [output.loss, output.logits] + [p.grad for p in model.parameters()]

    exact = grads(copy.deepcopy(base).double())
    eager = grads(copy.deepcopy(base).bfloat16())
    ours = grads(ORTModule(copy.deepcopy(base).bfloat16()))
    assert ours[1].dtype == torch.bfloat16
    for mine, theirs, reference in zip(ours, eager, exact):
        assert _relative(mine, reference) <= 2 * max(_relative(theirs, reference), torch.finfo(torch.bfloat16).eps)


@pytest.mark.parametrize("dtype", LOW)
def test_a_low_precision_model_evaluates_without_gradients(dtype):
    model = models.conv_batch_norm().to(dtype).eval()
    x = models.conv_batch_norm_batch(0)[0].to(dtype)
    with torch.no_grad():
        ours, eager = ORTModule(copy.deepcopy(model))(x), model(x)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, eager, rtol=8 * torch.finfo(dtype).eps, atol=8 * torch.finfo(dtype).eps)


def _graph(element_type):
    """y = (x @ w) * Cast<element_type>(c) + k: x, w inputs, c an fp32 Constant, k a Constant of
    element_type."""
    make = onnx.helper
    nodes = [make.make_node("MatMul", ["x", "w"], ["xw"]),
             make.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(np.array(1 / 3, np.float32))),
             make.make_node("Cast", ["c"], ["c_low"], to=element_type),
             make.make_node("Mul", ["xw", "c_low"], ["scaled"]),
             make.make_node("Constant", [], ["k"], value=make.make_tensor("k", element_type, [2], [0.5, -1.25])),
             make.make_node("Add", ["scaled", "k"], ["y"])]
    graph = make.make_graph(nodes, "g", [make.make_tensor_value_info("x", element_type, [3, 4]),
                                         make.make_tensor_value_info("w", element_type, [4, 2])],
                            [make.make_tensor_value_info("y", element_type, [3, 2])])
    return make.make_model(graph, opset_imports=[make.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("dtype", LOW)
def test_the_rewritten_graph_computes_in_fp32_and_returns_the_models_type(dtype):
    element_type = {torch.float16: onnx.TensorProto.FLOAT16, torch.bfloat16: onnx.TensorProto.BFLOAT16}[dtype]
    model = _graph(element_type)
    assert low_precision_in_fp32(model)
    types = element_types(model)
    for node in model.graph.node:
        if node.op_type != "Cast":
            assert all(types[name] == onnx.TensorProto.FLOAT for name in node.input), node
    assert [o.type.tensor_type.elem_type for o in model.graph.output] == [element_type]
    x, w = torch.randn(3, 4).to(dtype), torch.randn(4, 2).to(dtype)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    binding, y = session.io_binding(), torch.empty(3, 2, dtype=dtype)
    for name, value in (("x", x), ("w", w), ("y", y)):  # numpy has no bf16: the tensors bound by DLPack
        bind = binding.bind_ortvalue_output if name == "y" else binding.bind_ortvalue_input
        bind(name, onnxruntime.OrtValue(C.OrtValue.from_dlpack(torch.utils.dlpack.to_dlpack(value), False)))
    session.run_with_iobinding(binding)
    expected = (x @ w) * torch.tensor(1 / 3).to(dtype) + torch.tensor([0.5, -1.25]).to(dtype)
    assert torch.equal(y, expected)


def test_a_graph_without_low_precision_tensors_is_left_as_it_is():
    model = _graph(onnx.TensorProto.FLOAT)
    before = model.SerializeToString()
    assert not low_precision_in_fp32(model)
    assert model.SerializeToString() == before
