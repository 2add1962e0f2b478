"""Sums and means of a whole tensor on the CPU: torch's pairwise sums, exact to float rounding.

ORT's CPU ReduceMean adds one element after another in float32: a mean-squared loss over 1M
elements was 1.7e-5 relative from float64 (eager PyTorch: 3e-8).
"""
import onnx
import pytest
import torch

from ort_trainer import ORTModule, ORTTrainer, ORTTrainerOptions, optim
from ort_trainer._graph.cpu_kernels import whole_tensor_sums_in_torch
from ort_trainer._onnx import torch_node_operator

_EXACT = 1e-6  # relative, against float64; ORT's running sum: 1.7e-5 on these sizes


class _SquaredReduced(torch.nn.Module):
    def __init__(self, reduction):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 512))
        self.reduction = reduction

    def forward(self, x):
        return getattr((x * self.weight).pow(2), self.reduction)()


def _big_input():
    return torch.randn(4, 512, 512, generator=torch.Generator().manual_seed(0)) + 1.0


def _relative(value, reference):
    return abs(float(value) - float(reference)) / abs(float(reference))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ortmodule_reduction_of_a_large_tensor_is_exact(reduction):
    x = _big_input()
    exact = _SquaredReduced(reduction).double()
    reference = exact(x.double())
    reference.backward()
    wrapped = ORTModule(_SquaredReduced(reduction))
    loss = wrapped(x)
    loss.backward()
    assert _relative(loss.item(), reference.item()) < _EXACT
    torch.testing.assert_close(dict(wrapped.named_parameters())["weight"].grad.double(), exact.weight.grad,
                               rtol=1e-5, atol=0)  # a sum over 2,048 rows per weight (ORT's ReduceSum)


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 512))

    def forward(self, x):
        return x * self.weight


def test_ortrainer_mse_loss_over_a_large_output_is_exact():
    x = _big_input()
    target = torch.randn(4, 512, 512, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = torch.nn.functional.mse_loss(_Scaled().double()(x.double()), target.double())
    desc = {"inputs": [("x", ["b", 512, 512]), ("target", ["b", 512, 512])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(_Scaled(), desc, optim.SGDConfig(lr=1e-3), loss_fn=torch.nn.functional.mse_loss,
                         options=ORTTrainerOptions({"utils": {"grad_norm_clip": False}}))
    assert _relative(trainer.eval_step(x, target), reference) < _EXACT
    assert _relative(trainer.train_step(x, target), reference) < _EXACT


def _reduction_model(op_type, dims, opset=17, **attributes):
    node = onnx.helper.make_node(op_type, ["x"], ["y"], **attributes)
    graph = onnx.helper.make_graph([node], "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, dims)],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])


@pytest.mark.parametrize("op_type, dims, attributes, replaced", [
    ("ReduceMean", [512, 512], {"keepdims": 0}, 1),
    ("ReduceSum", ["rows", 8], {"keepdims": 0}, 1),  # size unknown: torch's sum
    ("ReduceMean", [16, 16], {"keepdims": 0}, 0),  # small: ORT's kernel is exact enough and cheaper
    ("ReduceMean", [512, 512], {}, 0),  # keepdims (ONNX's default): not torch's sum()
    ("ReduceMean", [512, 512], {"keepdims": 0, "axes": [1]}, 0),  # some axes only
    ("ReduceSumSquare", [512, 512], {"keepdims": 0}, 0),
])
def test_which_reductions_run_in_torch(op_type, dims, attributes, replaced):
    model = _reduction_model(op_type, dims, **attributes)
    assert whole_tensor_sums_in_torch(model) == replaced
    assert [torch_node_operator(node) != "" for node in model.graph.node] == [bool(replaced)]
