"""Refusals: the errors by which a stage says it cannot make a graph of what it was given (the
model is fine, this library or ONNX Runtime lacks something), each carrying its
ORTMODULE_FALLBACK_POLICY category as the class attribute `fallback`. They are raised where the
refusal is found; ORTModule's `ortmodule._fallback` decides in one place whether PyTorch runs the
call instead. Errors that are no refusal (a bug: KeyError, AttributeError, ...) propagate whatever
the policy. The refusals defined here only add a category to NotImplementedError and are named
by it in messages (`shown_name`); the stages' own refusal classes (BindingError, ExportError, ...)
derive from `Refusal` too.
"""
import re

from onnxruntime.capi import onnxruntime_pybind11_state as _ort

from .ortmodule_settings import FallbackPolicy

#: what ONNX Runtime raises on a graph it cannot build or run: its status errors, and RuntimeError
#: for its C++ exceptions (and ours, e.g. a torch kernel failing inside the graph)
ONNX_RUNTIME_ERRORS = (RuntimeError, _ort.Fail, _ort.InvalidArgument, _ort.InvalidGraph, _ort.InvalidProtobuf,
                       _ort.NotImplemented, _ort.RuntimeException, _ort.EPFail, _ort.EngineError)


# What a failing device says (ONNX Runtime's CUDA_CALL/CUBLAS_CALL/... and BFC arena, torch, CuPy):
# no property of the graph, so no reason to try another graph.
_DEVICE_FAILURE = re.compile(r"CUDA (error|failure)|CU(BLAS|DNN|RAND|FFT|SPARSE) failure|NCCL (error|failure)|"
                             r"cudaError|out of memory|Failed to allocate memory", re.IGNORECASE)


def device_failure(error: BaseException) -> bool:
    """Whether `error` is the device failing (out of memory, a CUDA error) rather than a graph
    ONNX Runtime cannot build or run: such an error propagates from a catch of
    `ONNX_RUNTIME_ERRORS` (re-tracing would hide it, or fail the same way)."""
    return isinstance(error, MemoryError) or bool(_DEVICE_FAILURE.search(str(error)))


class Refusal(Exception):
    """A failure to compile a graph that is no bug; `fallback`: its FallbackPolicy member."""

    fallback: FallbackPolicy | None = None


class TorchModelRefused(Refusal, NotImplementedError):
    """The model does what a graph cannot reproduce (changes buffers, LayerDrop, SyncBatchNorm, ...)."""

    fallback = FallbackPolicy.FALLBACK_UNSUPPORTED_TORCH_MODEL


class DeviceRefused(Refusal, NotImplementedError):
    """The call's device (or its compute type there) is one ONNX Runtime does not run here."""

    fallback = FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE


class OnnxModelRefused(Refusal, NotImplementedError):
    """The exported graph is one ONNX Runtime cannot build or differentiate."""

    fallback = FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL


def shown_name(error):
    """The class name messages give `error`: its own, or for a refusal of this module the error it
    refines (NotImplementedError), as such errors were named before they carried a category."""
    return next(klass.__name__ for klass in type(error).__mro__ if klass.__module__ != __name__)
