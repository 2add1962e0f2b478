"""ORTMODULE_FALLBACK_POLICY, decided in one place (as the original ORTModule's `_FallbackManager`).

Where a call's graph cannot be made, PyTorch runs the model instead, with a warning naming the
cause, if the policy lets the failure's category fall back; otherwise the error propagates. A
refusal carries its category (`_configuration.refusals`: BindingError, the data; ExportError, the
ONNX model; ...); ONNX Runtime's own errors and the graph passes' NotImplementedErrors, untyped,
are the ONNX model's. Anything else is no refusal but a bug, and propagates with its traceback.
"""
import os
import sys
import warnings

import torch

from .._configuration.ortmodule_settings import FallbackPolicy
from .._configuration.refusals import ONNX_RUNTIME_ERRORS, Refusal, shown_name

#: what making a graph raises where it cannot (catch these, then call `handle`)
REFUSED = (Refusal, NotImplementedError, *ONNX_RUNTIME_ERRORS)
_INSIDE = (os.path.dirname(os.path.dirname(__file__)) + os.sep, torch.nn.modules.module.__file__)  # ours, Module call


def category(error):
    """The FallbackPolicy member of a failure in `REFUSED`: a refusal's own, else the ONNX model's."""
    return error.fallback if isinstance(error, Refusal) else FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL


def handle(error, settings, model):
    """Warns that PyTorch runs `model` for this input signature where `settings`' policy lets
    `error`'s category fall back; re-raises `error` otherwise. Call it where `error` is caught."""
    kind = category(error)
    if not settings.falls_back(kind):
        raise error
    warnings.warn(f"ORTModule: {type(model).__name__} runs in PyTorch for this input signature ({kind.name}): "
                  f"{shown_name(error)}: {error}. Set ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE to raise instead",
                  UserWarning, stacklevel=_callers_level())


def _callers_level():
    """The stacklevel of the caller of model(...) for a warning of `handle`: the first frame
    outside this package and torch's Module call machinery."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level
