"""The executor of the graphs' torch nodes (`_graph.torch_nodes`): ONNX Runtime's `ATen` kernel
calls it, through two C callbacks registered once per process, with DLPack tensors in and out.

Pure Python (ctypes), no compiled extension. What it must get right, each pinned by a test:
- Inputs arrive as `DLManagedTensor*`: each is wrapped in a "dltensor" capsule that torch
  consumes (it calls the deleter once, when the tensor dies). They are never kept past the call:
  ONNX Runtime reuses their memory after the run (memory patterns).
- Outputs go back through `torch.utils.dlpack.to_dlpack`, the capsule renamed "used_dltensor" so
  that Python does not free what ONNX Runtime now owns. An output never aliases an input.
- A Python exception cannot cross into C, and a missing output is accepted silently: a failing
  implementation records its error and hands back an output of a type ONNX Runtime refuses, so the
  run fails at that node; the run's caller (`raising_torch_op_errors`) raises the recorded error.
- The callbacks take the GIL: a session with torch nodes must not run them on ONNX Runtime's
  inter-op threads while the calling thread holds the GIL (`Sessions.create` refuses
  ORT_PARALLEL for such graphs).
- The argument callback answers as ONNX Runtime 1.19.2 reads it (a later release inverted its
  meaning): other releases are refused by name before it is registered (`register_executor`).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import threading
from collections.abc import Iterator

import onnxruntime
import torch
from onnxruntime.capi import _pybind_state as C

from .._export.autograd_functions import function_call
from .._install import _INSTALL
from .._onnx import in_operand_order
from .._torch_node_catalogue import (ADAPTIVE_AVG_POOL, ADAPTIVE_AVG_POOL_GRAD, AUTOGRAD_FUNCTION,
                                     AUTOGRAD_FUNCTION_GRAD, CONV_TRANSPOSE_GRAD, DETACH, EINSUM, EINSUM_GRAD,
                                     FUNCTION, FUNCTION_GRAD, GELU_GRAD, LABELLED_PROJECTION, LABELLED_PROJECTION_GRAD,
                                     LAYER_NORM_GRAD, LOG_SOFTMAX_FP32, MATRIX_PRODUCT, PRODUCT, PRODUCT_GRAD,
                                     RESIZE_GRAD, ROWS_ADDED, SOFTMAX_GRAD, SOFTMAX_GRAD_TO_BF16, TO_BF16, TO_FP32)
from . import layer_kernels
from .cpu_buffers import converted, empty
from .labelled_projection import labelled_projection, labelled_projection_grad
from .product_kernels import (log_softmax_fp32, matrix_product, product, product_gradients,
                              rows_added, softmax_grad, softmax_grad_to_bf16)


class TorchOpError(RuntimeError):
    """A torch kernel inside an ONNX Runtime graph failed; the cause is chained."""


_IS_TENSOR_ARGUMENT = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                       ctypes.c_bool)
_EXECUTE = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p),
                            ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule_rename = ctypes.pythonapi.PyCapsule_SetName
_capsule_rename.restype, _capsule_rename.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]

_lock = threading.Lock()  # registration
# The ONNX Runtime release whose ATen kernel reads the argument callback as `_IS_TENSOR_ARGUMENT`
# says (every argument a tensor); a later release inverted its meaning.
ONNX_RUNTIME_RELEASE = "1.19.2"
# (operator, exception) recorded by failed calls, and the Function contexts kept, per thread: ONNX
# Runtime runs a sequential graph's nodes on the thread that called run, so each run finds its own.
_recorded = threading.local()


def _thread_list(name):
    """This thread's list `name` (the errors or the Function contexts its runs recorded)."""
    if not hasattr(_recorded, name):
        setattr(_recorded, name, [])
    return getattr(_recorded, name)
_registered: list = []  # the callbacks, kept alive for the life of the process


def _function(inputs, params):
    """torch.<function>(*inputs, *args, **kwargs) ('linalg.det': torch.linalg.det); each [start, end)
    of params' `tensor_lists` is passed as one list (an LSTM's (h0, c0), a recurrent layer's weights)."""
    function = functools.reduce(getattr, params["function"].split("."), torch)
    operands = in_operand_order(inputs, params)
    for start, end in reversed(params.get("tensor_lists", [])):
        operands = [*operands[:start], operands[start:end], *operands[end:]]
    # params' output_type informs the graph only
    if not params.get("draws"):
        result = function(*operands, *params["args"], **params["kwargs"])
        return list(result) if isinstance(result, tuple) else [result]  # (values, indices) as torch returns them
    # random draws (a recurrent layer's dropout): cuDNN's RNN draws from a state of its own, which cannot be
    # set back; torch's own kernels draw from the generator, whose state before the call is the last output
    state = _generator_state(inputs[0].device)
    with torch.backends.cudnn.flags(enabled=False):
        result = function(*operands, *params["args"], **params["kwargs"])
    return [*result, state.to(inputs[0].device)]


def _generator_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _drawing_again(forward):
    """`forward` recomputed for a gradient: one that drew random numbers (params' `draws`) gets, as
    its last operand, the generator's state its forward node started from (that node's last output),
    draws the same numbers again from it, and leaves torch's generator as it found it."""
    def recomputed(operands, params):
        if not params.get("draws"):
            return forward(operands, params)
        *operands, state = operands
        device = operands[0].device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if device.type == "cuda":
                torch.cuda.set_rng_state(state.cpu(), device)
            else:
                torch.set_rng_state(state)
            return forward(operands, params)
    return recomputed


def _input_gradients(forward):
    """The one-pass gradient node of `forward` (inputs: the gradients of the forward's first
    `differentiable_outputs` outputs, then the forward's inputs): the gradients of the inputs
    params['wanted'] lists, in that order, by one autograd pass of the forward recomputed at these
    inputs. Where the forward is not differentiable in one of them (a loss's target, which ONNX
    Runtime may ask a gradient for), each input's gradient is computed alone."""
    one_input = _input_gradient(forward)

    def gradients(inputs, params):
        count, wanted = params.get("differentiable_outputs", 1), params["wanted"]
        grads, operands = inputs[:count], list(inputs[count:])
        floating = [k for k in wanted if operands[k].is_floating_point()]  # an integer input: zeros
        for k in floating:
            operands[k] = operands[k].detach().requires_grad_(True)
        with torch.enable_grad():
            try:
                outputs = forward(operands, params)[:count]
            except RuntimeError as error:
                if "is not differentiable with respect to argument" not in str(error):
                    raise
                return [one_input(inputs, {**params, "input": k})[0] for k in wanted]
        pairs = [(output, grad) for output, grad in zip(outputs, grads) if output.requires_grad]
        found = torch.autograd.grad([output for output, _ in pairs], [operands[k] for k in floating],
                                    [grad for _, grad in pairs], allow_unused=True) if pairs and floating else []
        by_input = dict(zip(floating, found))
        return [torch.zeros_like(operands[k]) if by_input.get(k) is None else by_input[k] for k in wanted]
    return gradients


def _input_gradient(forward):
    """The gradient node of `forward` for input params['input'] (inputs: the gradients of the
    forward's first `differentiable_outputs` outputs (1 by default: the values of (values, indices)),
    then the forward's inputs), by torch's autograd of the forward at these inputs."""
    def gradient(inputs, params):
        count, k = params.get("differentiable_outputs", 1), params["input"]
        grads, operands = inputs[:count], list(inputs[count:])
        if not operands[k].is_floating_point():  # an integer input (ldexp's exponent): no gradient flows on
            return [torch.zeros_like(operands[k])]
        operands[k] = operands[k].detach().requires_grad_(True)
        with torch.enable_grad():
            try:
                outputs = forward(operands, params)[:count]
            except RuntimeError as error:  # a loss's target: ONNX Runtime asks for every input's gradient
                if "is not differentiable with respect to argument" not in str(error):
                    raise
                return [torch.zeros_like(operands[k])]
        pairs = [(output, grad) for output, grad in zip(outputs, grads) if output.requires_grad]
        if not pairs:  # the outputs do not depend on this input (hinge_embedding_loss's target)
            return [torch.zeros_like(operands[k])]
        result = torch.autograd.grad([output for output, _ in pairs], operands[k], [grad for _, grad in pairs],
                                     allow_unused=True)[0]
        return [torch.zeros_like(operands[k]) if result is None else result]
    return gradient


# The contexts of custom autograd.Functions that ran in a forward node, by number, until their
# gradient node runs their backward or the run that made them is dropped (`FunctionContexts`).
_contexts = {}
_context_numbers = itertools.count(1)


class _Arguments(torch.autograd.Function):
    """The tensor arguments of a custom autograd.Function that need gradients, as the outputs of
    one node rather than as leaves: the Function may then modify them in place (ctx.mark_dirty),
    as it may in eager, where they are no leaves either. Its backward keeps the gradients that
    reach them in `gradients` (None where none does)."""

    @staticmethod
    def forward(ctx, anchor, tensors, gradients):
        ctx.set_materialize_grads(False)
        ctx.gradients = gradients
        return tuple(tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.gradients[:] = grads
        return None, None, None


def _autograd_function(inputs, params):
    """A custom autograd.Function's own forward (`_export.autograd_functions`), on copies of the
    inputs (its ctx may keep them, and ONNX Runtime reuses their memory), recording its backward
    when an input needs a gradient (`needs_grad`: those copies come out of `_Arguments`); outputs:
    its tensors, then the number of its kept context. An output its ctx also keeps goes to ONNX
    Runtime as a copy (ONNX Runtime may write over memory it owns)."""
    call = function_call(params["call"])
    needs = set(params.get("needs_grad", ()))
    booleans = {params.get("operands", range(len(inputs))).index(k) for k in params["bool_inputs"]}
    operands = [t.view(torch.bool).clone() if k in booleans else t.detach().clone() for k, t in enumerate(inputs)]
    differentiable = [k for k in sorted(needs) if operands[k].is_floating_point() or operands[k].is_complex()]
    gradients = [None] * len(differentiable)
    kept = set()

    def pack(tensor):
        kept.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.set_grad_enabled(bool(needs)), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if differentiable:
            anchor = torch.zeros((), requires_grad=True)
            arguments = _Arguments.apply(anchor, [operands[k] for k in differentiable], gradients)
            for k, argument in zip(differentiable, arguments):
                operands[k] = argument
        result = call.function.apply(*call.arguments(in_operand_order(operands, params)))
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    if len(outputs) != len(params["output_types"]) or not all(isinstance(t, torch.Tensor) for t in outputs):
        raise TypeError(f"custom autograd.Function {call.name} returned {_kinds(outputs)} here, traced as "
                        f"{len(params['output_types'])} tensors")
    context = next((t.grad_fn for t in outputs if t.grad_fn is not None), None)
    if context is not None:  # tensors set as ctx attributes
        kept.update(t.untyped_storage().data_ptr() for t in vars(context).values() if isinstance(t, torch.Tensor))
    number = 0
    if needs:
        number = next(_context_numbers)
        _contexts[number] = (outputs, operands, differentiable, gradients)  # gradients: filled by the backward
        _thread_list("contexts").append(number)
    handed = [t.detach().clone() if t.untyped_storage().data_ptr() in kept else t.detach() for t in outputs]
    return [*handed, torch.tensor(number, dtype=torch.int64)]


def _kinds(values):
    return "(" + ", ".join(type(value).__name__ for value in values) + ")"


def _autograd_function_grad(inputs, params):
    """The Function's own backward, on the ctx its forward node kept (inputs: the gradients of its
    `differentiable` outputs, then the context's number): the gradients of the inputs `wanted`
    lists, zeros where the backward gives None. Gradients nothing computed (`absent`) are not
    passed: the backward gets what eager's would (zeros, or None after set_materialize_grads(False))."""
    grads, number = inputs[:-1], int(inputs[-1])
    if number not in _contexts:
        raise RuntimeError(f"custom autograd.Function {params['function']}: no kept context numbered {number} (its "
                           "forward ran without recording a backward, or the backward already ran)")
    outputs, operands, differentiable, gradients = _contexts.pop(number)
    absent = set(params.get("absent", ()))
    pairs = [(outputs[k], grad) for j, (k, grad) in enumerate(zip(params["differentiable"], grads))
             if j not in absent and outputs[k].requires_grad]
    if pairs:  # backward(), not grad(): reentrant torch.utils.checkpoint accepts no other
        torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])
    found = {k: grad for k, grad in zip(differentiable, gradients) if grad is not None}
    return [found[k] if k in found else torch.zeros_like(operands[k]) for k in params["wanted"]]


class FunctionContexts:
    """The custom autograd.Function contexts one run kept: those its backward did not take are
    freed with this object (a forward whose backward never runs, an inference run)."""

    def __init__(self):
        self.numbers = []

    def __del__(self):
        for number in self.numbers:
            _contexts.pop(number, None)


#: operator (`_torch_node_catalogue`) -> implementation(list of input tensors, params) -> list of output tensors
IMPLEMENTATIONS = {
    RESIZE_GRAD: layer_kernels.interpolate_grad, CONV_TRANSPOSE_GRAD: layer_kernels.conv_transpose_grad,
    EINSUM: layer_kernels.einsum, EINSUM_GRAD: _input_gradients(layer_kernels.einsum),
    ADAPTIVE_AVG_POOL: layer_kernels.adaptive_avg_pool,
    ADAPTIVE_AVG_POOL_GRAD: _input_gradients(layer_kernels.adaptive_avg_pool),
    FUNCTION: _function, FUNCTION_GRAD: _input_gradients(_drawing_again(_function)),
    DETACH: lambda inputs, params: [inputs[0].detach()],  # copied: an output never aliases an input
    PRODUCT: product, PRODUCT_GRAD: product_gradients, MATRIX_PRODUCT: matrix_product,
    TO_BF16: lambda inputs, params: [converted(inputs[0], torch.bfloat16)],
    TO_FP32: lambda inputs, params: [converted(inputs[0], torch.float32)],
    LOG_SOFTMAX_FP32: log_softmax_fp32,
    GELU_GRAD: lambda inputs, params: [torch.ops.aten.gelu_backward.grad_input(  # dy, x (+ the bias, if any)
        inputs[0], inputs[1] + inputs[2] if len(inputs) > 2 else inputs[1], approximate="tanh",
        grad_input=empty(inputs[0].shape, torch.float32))],
    SOFTMAX_GRAD_TO_BF16: softmax_grad_to_bf16, SOFTMAX_GRAD: softmax_grad, ROWS_ADDED: rows_added,
    LAYER_NORM_GRAD: layer_kernels.layer_norm_grad,
    LABELLED_PROJECTION: labelled_projection, LABELLED_PROJECTION_GRAD: labelled_projection_grad,
    AUTOGRAD_FUNCTION: _autograd_function, AUTOGRAD_FUNCTION_GRAD: _autograd_function_grad,
}


#: ATen operators ONNX Runtime itself calls through the executor (their overload is an ATen name, not our JSON)
ONNX_RUNTIME_CALLS = {"sum": layer_kernels.onnx_runtime_reduce_sum, "aten::sum": layer_kernels.onnx_runtime_reduce_sum}


def _hand_over(tensor, outputs, k):
    """Writes `tensor` into output slot k as a DLManagedTensor that ONNX Runtime now owns."""
    capsule = torch.utils.dlpack.to_dlpack(tensor)
    outputs[k] = _capsule_pointer(capsule, b"dltensor")
    _capsule_rename(capsule, b"used_dltensor")


_POISON = torch.zeros(1, dtype=torch.complex64)  # a DLPack type ONNX Runtime refuses: fails the node


def _execute(operator, overload, count_in, inputs, count_out, outputs):
    name = operator.decode()
    tensors = [torch.utils.dlpack.from_dlpack(_capsule_new(inputs[k], b"dltensor", None)) if inputs[k] else None
               for k in range(count_in)]  # None: an optional argument left out
    try:
        implementation = IMPLEMENTATIONS.get(name) or ONNX_RUNTIME_CALLS.get(name)
        if implementation is None:
            raise KeyError(f"no torch implementation named {name!r} (known: {sorted(IMPLEMENTATIONS)})")
        params = {} if name in ONNX_RUNTIME_CALLS else json.loads(overload.decode() or "{}")
        results = implementation(tensors, params)
        if len(results) != count_out:
            raise ValueError(f"{len(results)} outputs for the node's {count_out}")
        # An output on an input's memory is a copy, unless the node writes into its input 0: memory a
        # torch node wrote that nothing else reads (`in_place`, `_graph.tied_embedding_gradient`).
        storages = {t.untyped_storage().data_ptr()
                    for t in tensors[1 if params.get("in_place") else 0:] if t is not None}
        results = [r.clone() if r.untyped_storage().data_ptr() in storages else r.contiguous() for r in results]
    except Exception as error:  # noqa: BLE001 - nothing may cross into C; the run raises it
        _thread_list("errors").append((name, error))
        results = [_POISON.clone() for _ in range(count_out)]
    del tensors  # the inputs' deleters run now: nothing of ONNX Runtime's memory is kept
    for k, result in enumerate(results):
        _hand_over(result, outputs, k)


def register_executor() -> None:
    """Registers the executor with ONNX Runtime, once per process (idempotent, thread-safe).

    Raises:
        ImportError: the installed ONNX Runtime is not release `ONNX_RUNTIME_RELEASE` (a build
            tag such as +cu118 aside), whose argument callback this executor answers; not a
            RuntimeError, which the graph checks read as a graph ONNX Runtime cannot run.
    """
    installed = onnxruntime.__version__
    if installed.split("+")[0] != ONNX_RUNTIME_RELEASE:
        raise ImportError(f"this graph runs torch kernels inside ONNX Runtime, whose ATen argument callback "
                          f"ort-trainer answers as onnxruntime {ONNX_RUNTIME_RELEASE} reads it (a later release "
                          f"inverted its meaning), but onnxruntime {installed} is installed: install "
                          f"onnxruntime {ONNX_RUNTIME_RELEASE} ({_INSTALL})")
    with _lock:
        if _registered:
            return
        is_tensor_argument = _IS_TENSOR_ARGUMENT(lambda operator, overload, index, is_input: True)
        execute = _EXECUTE(_execute)
        C.register_aten_op_executor(str(ctypes.cast(is_tensor_argument, ctypes.c_void_p).value),
                                    str(ctypes.cast(execute, ctypes.c_void_p).value))
        _registered.extend([is_tensor_argument, execute])


def take_errors() -> list[tuple[str, Exception]]:
    """The errors this thread's runs recorded since the last call, oldest first."""
    errors = _thread_list("errors")
    taken = list(errors)
    errors.clear()
    return taken


@contextlib.contextmanager
def raising_torch_op_errors() -> Iterator[FunctionContexts]:
    """Around a run: a run that a failed torch node made fail raises TorchOpError naming the node's
    torch implementation, chained to its exception (ONNX Runtime's own error is in the message).
    Yields the run's `FunctionContexts` (filled when the run ends): keep it while a later run
    (ORTModule's backward) may read them."""
    take_errors()
    contexts, created = FunctionContexts(), _thread_list("contexts")
    start = len(created)
    try:
        yield contexts
    except Exception:  # ONNX Runtime's exception types vary with the failure
        errors = take_errors()
        if not errors:
            raise
        operator, cause = errors[0]
        raise TorchOpError(f"the torch kernel {operator!r} inside the ONNX Runtime graph failed: "
                           f"{type(cause).__name__}: {cause}") from cause
    finally:
        contexts.numbers = created[start:]
        del created[start:]
