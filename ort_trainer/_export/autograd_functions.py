"""Custom torch.autograd.Functions in training exports: each `Function.apply` is one torch node
(`AUTOGRAD_FUNCTION`) that runs the Function's own forward, and its gradient node runs the
Function's own backward on the same `ctx` (saved tensors, attributes, needs_input_grad,
mark_non_differentiable, set_materialize_grads), as the original ORTModule's PythonOp did. The
exporter would otherwise inline the forward, and the graph would differentiate that instead of
running the backward the Function defines.

A training export keeps the tracer's `prim::PythonOp` nodes (`autograd_inlining=False`, `_export.trace`);
`python_op` turns each into a torch node. The Function, its calling convention and its constant
arguments (anything but a tensor: numbers, None, modules, callables) stay in this process
(`FUNCTION_CALLS`), named in the node by a number: a graph with such nodes runs only in the process
that exported it. An inference export (`export_onnx`) inlines the Functions as torch does.
"""
import itertools
import threading
from dataclasses import dataclass

import torch
from torch.onnx._internal.torchscript_exporter import _type_utils
from torch.utils._pytree import tree_leaves

from .._configuration.refusals import OnnxModelRefused
from .._onnx import TORCH_NODE_DOMAIN, torch_node_params
from .._torch_node_catalogue import AUTOGRAD_FUNCTION


class AutogradFunctionRefused(OnnxModelRefused):
    """A custom autograd.Function called in a way a graph cannot reproduce; the message says what
    to change."""


@dataclass(frozen=True)
class FunctionCall:
    """One `Function.apply(...)` of a trace: the Function, which arguments are tensors (`cconv`:
    'd' a tensor, 'c' a constant, in call order) and the constants, in order."""

    function: type
    cconv: str
    constants: tuple

    @property
    def name(self):
        return f"{self.function.__module__}.{self.function.__qualname__}"

    def arguments(self, tensors):
        """apply's arguments: `tensors` and the constants interleaved as traced."""
        tensors, constants = iter(tensors), iter(self.constants)
        return [next(tensors) if kind == "d" else next(constants) for kind in self.cconv]


_lock = threading.Lock()
_numbers = itertools.count()
#: the number a torch node names its call by -> FunctionCall (for the life of the process)
FUNCTION_CALLS = {}


def function_call(number):
    """The FunctionCall a torch node names by `number`."""
    call = FUNCTION_CALLS.get(number)
    if call is None:
        raise KeyError(f"no custom autograd.Function call numbered {number} in this process: a graph with "
                       "autograd.Function nodes runs only in the process that exported it")
    return call


def _input_dim(size, input_shapes, position):
    """[input, dim] of the traced input dim of `size` (the same position first), else `size`."""
    candidates = [(k, j) for k, shape in enumerate(input_shapes) for j, dim in enumerate(shape or ()) if dim == size]
    return list(min(candidates, key=lambda kj: kj[1] != position)) if candidates else size


def python_op(g, *args, **attributes):
    """The symbolic of `prim::PythonOp` (a custom autograd.Function's apply) in a training export:
    one AUTOGRAD_FUNCTION torch node, inputs the tensor arguments, outputs the Function's tensor
    outputs (typed and shaped as traced) and last its context's number (int64, read by the gradient
    node). Refused: a tensor inside a list, tuple or dict argument (the trace would keep its values
    as a constant) and a non-tensor output (the trace would keep the value of this call)."""
    node = g.original_node
    function = node.pyobj().__self__
    call = FunctionCall(function, node.cconv(), tuple(node.scalar_args()))
    if any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(call.constants)):
        raise AutogradFunctionRefused(
            f"custom autograd.Function {call.name} gets a tensor inside a list, tuple or dict argument: a graph "
            "would keep that tensor's values of this call as a constant. Pass each tensor as an argument of "
            f"{function.__name__}.apply itself")
    outputs = list(node.outputs())
    tensors = [value for value in args if isinstance(value, torch._C.Value)]
    shapes, types = [], []
    for k, output in enumerate(outputs):
        scalar_type = output.type().scalarType() if isinstance(output.type(), torch._C.TensorType) else None
        sizes = output.type().varyingSizes() if scalar_type is not None else None
        if scalar_type is None or sizes is None:
            raise AutogradFunctionRefused(
                f"custom autograd.Function {call.name} returns a non-tensor value at output {k}: a graph would keep "
                "the value of the traced call for every call. Return tensors only (a number as a 0-d tensor), "
                "or compute that value outside the Function")
        shapes.append(list(sizes))
        types.append(int(_type_utils.JitScalarType._from_name(scalar_type).onnx_type()))
    with _lock:
        number = next(_numbers)
        FUNCTION_CALLS[number] = call
    # the traced sizes (the exporter's values may have symbolic dims already)
    input_shapes = [value.type().varyingSizes() if isinstance(value.type(), torch._C.TensorType) else None
                    for value in node.inputs()]
    floating = [k for k, output in enumerate(outputs)
                if output.type().scalarType() in ("Float", "Double", "Half", "BFloat16")]
    params = {"call": number, "function": call.name, "output_types": types, "output_shapes": shapes,
              "input_shapes": [None if shape is None else list(shape) for shape in input_shapes],
              # at other input shapes: each output dim as the input dim of its traced size (else that size)
              "output_dims": [[_input_dim(size, input_shapes, position) for position, size in enumerate(shape)]
                              for shape in shapes],
              "differentiable": [k for k in floating if outputs[k].requiresGrad() is not False],
              # ONNX Runtime hands bool tensors over as uint8
              "bool_inputs": [k for k, value in enumerate(node.inputs())
                              if isinstance(value.type(), torch._C.TensorType) and value.type().scalarType() == "Bool"]}
    results = g.op(f"{TORCH_NODE_DOMAIN}::ATen", *tensors, operator_s=AUTOGRAD_FUNCTION,
                   overload_name_s=torch_node_params(params), outputs=len(outputs) + 1)
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    for result, output in zip(results, outputs):
        result.setType(output.type())
    results[-1].setType(torch._C.TensorType.create_from_tensor(torch.zeros((), dtype=torch.int64)))
    return tuple(results[:-1]) if len(outputs) > 1 else results[0]  # the context: read by the gradient alone
