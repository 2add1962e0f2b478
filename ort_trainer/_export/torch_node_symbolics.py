"""Training-export symbolics that write torch nodes (`_onnx.torch_node`, run by
`_runtime.torch_ops`) where ONNX Runtime 1.19 cannot export an op or has no gradient for it:
einsum, adaptive average pooling to sizes that do not divide, and elementwise and cumulative
functions (`FUNCTIONS`). An inference export (export_onnx) keeps torch's own symbolic, or its
refusal: a plain ONNX Runtime could not run the node.

`Tensor.detach` becomes a torch node whose input the gradient builder does not differentiate
(the exporter drops it, which would carry gradients through); values computed inside
`torch.no_grad()` are detached while tracing (`NoGradValuesDetached`). A torch node is written
only where needed: a function ONNX exports and ONNX Runtime runs stays
its ONNX op unless an input needs a gradient. The gradient builder fails when a torch node's input
0 needs no gradient and another input needs one: einsum puts an operand that needs one first.
"""
import torch
from torch.onnx import symbolic_helper
from torch.onnx._internal.torchscript_exporter import (symbolic_opset9, symbolic_opset10, symbolic_opset11,
                                                       symbolic_opset12)
from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
from torch.onnx.errors import SymbolicValueError, UnsupportedOperatorError
from torch.utils._pytree import tree_flatten, tree_map

from .._onnx import TORCH_NODE_DOMAIN, torch_node_params

TORCH_OP_PREFIX = "ort_trainer::"
EINSUM = TORCH_OP_PREFIX + "einsum"
ADAPTIVE_AVG_POOL = TORCH_OP_PREFIX + "adaptive_avg_pool"
FUNCTION = TORCH_OP_PREFIX + "function"
DETACH = TORCH_OP_PREFIX + "detach"

# aten op -> (torch's symbolic or None, the opset to register at: torch's, so that ours wins,
# the number of leading tensor inputs). The torch function of the same name runs it.
FUNCTIONS = {
    **{name: (getattr(symbolic_opset9, name), 9, 1)
       for name in ("atan", "asin", "acos", "tan", "floor", "ceil", "sign")},
    **{name: (None, 9, 1) for name in ("sinh", "cosh", "asinh", "acosh", "atanh", "erfinv", "trunc", "frac",
                                       "expm1")},
    "round": (symbolic_opset11.round, 11, 1),
    "linalg_det": (symbolic_opset11.linalg_det, 11, 1),
    "fmod": (symbolic_opset10.fmod, 10, 2),
    "remainder": (symbolic_opset11.remainder, 11, 2),
    "cumprod": (None, 9, 1),
    "logcumsumexp": (None, 9, 1),
}


def register_torch_node_symbolics():
    torch.onnx.register_custom_op_symbolic("aten::einsum", _einsum, 12)
    for dims in (1, 2, 3):
        torch.onnx.register_custom_op_symbolic(f"aten::adaptive_avg_pool{dims}d", _adaptive_avg_pool(dims), 9)
    torch.onnx.register_custom_op_symbolic("aten::detach", _detach, 9)
    for name, (default, opset, tensors) in FUNCTIONS.items():
        torch.onnx.register_custom_op_symbolic(f"aten::{name}", _function(name, default, tensors), opset)


def _torch_node(g, operator, inputs, *, rank, **params):
    """A torch node (`_onnx.torch_node`): its output has input 0's element type and `rank` dims."""
    output = g.op(f"{TORCH_NODE_DOMAIN}::ATen", *inputs, operator_s=operator, overload_name_s=torch_node_params(params))
    if rank is not None:
        output.setType(inputs[0].type().with_sizes([None] * rank))
    return output


def _einsum(g, equation, tensor_list, path=None):
    """torch.einsum; in a training export with an operand that needs a gradient, a torch node
    (ONNX Runtime has no Einsum gradient), its operands reordered so that such an operand is first
    (the gradient builder's rule, `_graph.torch_nodes`)."""
    operands = symbolic_helper._unpack_list(tensor_list)
    needs_grad = [operand.requiresGrad() for operand in operands]
    if not GLOBALS.export_training or not any(needs_grad):
        return symbolic_opset12.einsum(g, equation, tensor_list, path)
    equation = _explicit_einsum(symbolic_helper._parse_arg(equation, "s"))
    terms, result = equation.split("->")
    order = sorted(range(len(operands)), key=lambda k: not needs_grad[k])  # stable: the first that needs one
    terms = terms.split(",")
    equation = ",".join(terms[k] for k in order) + "->" + result
    ranks = [symbolic_helper._get_tensor_rank(operand) for operand in operands]
    ellipsis = {rank - len(term.replace("...", "")) for term, rank in zip(terms, ranks) if "..." in term
                and rank is not None}
    rank = len(result.replace("...", "")) + (max(ellipsis, default=0) if "..." in result else 0)
    rank = None if "..." in result and None in ranks else rank
    return _torch_node(g, EINSUM, [operands[k] for k in order], rank=rank, equation=equation)


def _explicit_einsum(equation):
    """`equation` with its output spelled out: implicit, it is the labels used once, in
    alphabetical order, after the ellipsis' dims when there is one (torch's rule)."""
    equation = equation.replace(" ", "")
    if "->" in equation:
        return equation
    labels = equation.replace(",", "").replace("...", "")
    once = "".join(sorted(label for label in set(labels) if labels.count(label) == 1))
    return equation + "->" + ("..." if "..." in equation else "") + once


def _adaptive_avg_pool(dims):
    """torch's adaptive_avg_pool{dims}d symbolic; where it refuses an output size that does not
    divide the input size, a training export writes a torch node (an inference export keeps the
    refusal: a plain ONNX Runtime could not run the node)."""
    default = getattr(symbolic_opset9, f"adaptive_avg_pool{dims}d")

    def symbolic(g, x, output_size):
        try:
            return default(g, x, output_size)
        except SymbolicValueError:
            if not GLOBALS.export_training:
                raise
        sizes = symbolic_helper._maybe_get_const(output_size, "is")
        if not isinstance(sizes, list):
            raise SymbolicValueError(f"adaptive_avg_pool{dims}d: the output size must be a constant", x)
        return _torch_node(g, ADAPTIVE_AVG_POOL, [x], rank=symbolic_helper._get_tensor_rank(x), output_size=sizes)
    return symbolic


_FLOATS = frozenset({"Float", "Double", "Half", "BFloat16", None})  # None: not known, treated as floating


def _scalar_type_name(value):
    return value.type().scalarType() if isinstance(value.type(), torch._C.TensorType) else "not a tensor"


def _needs_grad(value):
    return isinstance(value.type(), torch._C.TensorType) and value.requiresGrad()


def _function(name, default, tensors):
    """The symbolic of aten::`name`: a torch node (FUNCTION) in a training export where an input
    needs a gradient or ONNX has no such op, else torch's symbolic (or its refusal)."""
    def symbolic(g, *args):
        inputs, constants = list(args[:tensors]), args[tensors:]
        if not GLOBALS.export_training or (default is not None and not any(map(_needs_grad, inputs))):
            if default is None:
                raise UnsupportedOperatorError(f"aten::{name}", GLOBALS.export_onnx_opset_version, None)
            return default(g, *args)
        params = {"function": name.replace("linalg_", "linalg."), "args": [], "kwargs": {}}
        if name in ("cumprod", "logcumsumexp"):
            params["args"] = [symbolic_helper._get_const(constants[0], "i", "dim")]
            if name == "cumprod" and not symbolic_helper._is_none(constants[1]):
                raise SymbolicValueError("torch.cumprod with a dtype cannot be trained in ONNX Runtime: cast the "
                                         "input instead", inputs[0])
        elif name == "round" and constants and not symbolic_helper._is_none(constants[0]):
            params["kwargs"] = {"decimals": symbolic_helper._get_const(constants[0], "i", "decimals")}
        ranks = [symbolic_helper._get_tensor_rank(value) for value in inputs]  # None: unknown, or a scalar
        rank = None if ranks[0] is None else max(r for r in ranks if r is not None) - (2 if name == "linalg_det" else 0)
        return _torch_node(g, FUNCTION, inputs, rank=rank, **params)
    return symbolic


def _detach(g, x):
    """Tensor.detach: the exporter writes nothing for it, so the gradient builder would carry
    gradients through where torch stops them (silently wrong gradients). In a training export, for
    a floating-point x: a torch node whose input is a stop-gradient edge (`_graph.torch_nodes`).
    Not only where the trace says x needs a gradient: it says False for some values that do (the
    outputs of convolutions)."""
    if not GLOBALS.export_training or _scalar_type_name(x) not in _FLOATS:
        return x
    output = g.op(f"{TORCH_NODE_DOMAIN}::ATen", x, operator_s=DETACH, overload_name_s=torch_node_params({}))
    output.setType(x.type())  # x's own type and sizes: later symbolics may need them (BatchNorm's channels)
    return output


class NoGradValuesDetached(torch.overrides.TorchFunctionMode):
    """Active during a trace: a value a torch function computes under `torch.no_grad()` from a
    tensor that requires grad comes back `.detach()`ed, so that the trace records the stop (ONNX
    has no no-grad region; the gradient builder would differentiate through it). Only inside a
    trace that itself runs with gradients (a call under `torch.no_grad()` exports no gradient).
    In-place functions (their result is the tensor they changed) are left as they are."""

    def __enter__(self):
        self._tracing_with_grad = torch.is_grad_enabled()
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self._tracing_with_grad or torch.is_grad_enabled() or getattr(func, "__name__", "").endswith("_"):
            return result
        values = tree_flatten((args, kwargs))[0]
        if not any(isinstance(value, torch.Tensor) and value.requires_grad for value in values):
            return result
        return tree_map(lambda value: value.detach() if isinstance(value, torch.Tensor) and value.is_floating_point()
                        else value, result)
