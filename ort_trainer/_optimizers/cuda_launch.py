"""Compiling and launching the CUDA optimizer kernels: each ``kernels/<family>.cu`` is read once
per process (``importlib.resources``), with ``common.cuh`` pasted in place of its ``#include`` so
that CuPy's on-disk cache key (a hash of the source text) follows header edits, compiled by NVRTC
through ``cupy.RawModule(code=..., options=NVRTC_OPTIONS)`` once per device; plus the argument
checks every launch wrapper of ``_optimizers.cuda_steps`` makes first. CuPy is imported on first use
only: CPU-only installs import this module fine, and the first GPU call raises an ImportError that
says what to install.
"""
from __future__ import annotations

import functools
import importlib.resources
import math
import threading

import numpy as np

from .._install import FROM_CHECKOUT, GPU_INSTALL
from .cuda_tables import BLOCK

#: Options for NVRTC (CuPy adds ``-arch`` for the device, and ``-ftz=true`` after these).
#: tests/test_kernels_compile.py compiles every kernel with nvcc using these same options.
NVRTC_OPTIONS = ("--std=c++17",)

_BLOCKS_PER_SM = 32  # grid cap of the grid-stride kernels, per multiprocessor

#: The ``extern "C"`` entry points of each kernel file.
KERNELS = {
    "sgd": ("ort_trainer_sgd_step_f32",),
    "adam": ("ort_trainer_adam_step_f32",),
    "lamb": ("ort_trainer_lamb_direction_f32", "ort_trainer_lamb_ratio_f32",
             "ort_trainer_lamb_update_f32"),
    "clip": ("ort_trainer_clip_sumsq_f32", "ort_trainer_clip_divisor_f32"),
    "amp": ("ort_trainer_amp_update",),
}


_INSTALL_HINT = f"CuPy is required for the GPU optimizer: {GPU_INSTALL} {FROM_CHECKOUT}"
_INCLUDE = '#include "common.cuh"'
NULL = np.uint64(0)  # a null device pointer argument

_cupy = None
_cupy_error: ImportError | None = None
_lock = threading.Lock()
_modules: dict = {}  # (family, device id) -> cupy.RawModule
_functions: dict = {}  # (kernel name, device id) -> cupy.RawKernel
_sm_counts: dict = {}  # device id -> multiprocessor count


# ----------------------------------------------------------------------------------------------
# CuPy, sources, modules
# ----------------------------------------------------------------------------------------------


def require_cupy():
    """The cupy module; the recorded ImportError, with what to install, if it is missing."""
    global _cupy, _cupy_error
    if _cupy is not None:
        return _cupy
    if _cupy_error is None:
        try:
            import cupy
        except ImportError as error:
            _cupy_error = error
        else:
            _cupy = cupy
            return cupy
    raise ImportError(f"{_INSTALL_HINT} (import cupy failed: {_cupy_error})") from _cupy_error


@functools.lru_cache(maxsize=None)
def kernel_source(family: str) -> str:
    """The text NVRTC compiles for ``kernels/<family>.cu``: common.cuh pasted in, #line kept."""
    if family not in KERNELS:
        raise ValueError(f"kernel family must be one of {sorted(KERNELS)}, got {family!r}")
    files = importlib.resources.files("ort_trainer.kernels")
    lines = files.joinpath(f"{family}.cu").read_text(encoding="utf-8").splitlines()
    common = files.joinpath("common.cuh").read_text(encoding="utf-8").rstrip("\n")
    at = [k for k, line in enumerate(lines) if line.strip() == _INCLUDE]
    if len(at) != 1:
        raise ValueError(f"kernels/{family}.cu must contain the line {_INCLUDE!r} exactly once, "
                         f"found it {len(at)} times")
    k = at[0]
    return "\n".join([f'#line 1 "{family}.cu"', *lines[:k], '#line 1 "common.cuh"', common,
                      f'#line {k + 2} "{family}.cu"', *lines[k + 1:]]) + "\n"


def kernel_function(family: str, name: str, device_id: int):
    """The kernel ``name`` of ``kernels/<family>.cu`` on a device, compiled once per process."""
    key = (name, device_id)
    function = _functions.get(key)
    if function is None:
        cp = require_cupy()
        with _lock:
            function = _functions.get(key)
            if function is None:
                with cp.cuda.Device(device_id):
                    module = _modules.get((family, device_id))
                    if module is None:
                        module = cp.RawModule(code=kernel_source(family), options=NVRTC_OPTIONS)
                        _modules[(family, device_id)] = module
                    function = module.get_function(name)
                _functions[key] = function
    return function


def _sm_count(device_id: int) -> int:
    count = _sm_counts.get(device_id)
    if count is None:
        cp = require_cupy()
        count = _sm_counts[device_id] = int(
            cp.cuda.Device(device_id).attributes["MultiProcessorCount"])
    return count


def vector_blocks(n: int) -> int:
    """Blocks of BLOCK threads that cover n elements, 4 (one float4) per thread."""
    return -(-n // (4 * BLOCK))


def grid_stride_blocks(n: int, device_id: int) -> int:
    """Blocks for a grid-stride kernel over n elements taken 4 at a time."""
    blocks = vector_blocks(n)
    return max(1, min(blocks, _sm_count(device_id) * _BLOCKS_PER_SM))


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------


def describe(array) -> str:
    kind = f"{type(array).__module__}.{type(array).__name__}"
    if hasattr(array, "dtype") and hasattr(array, "shape"):
        return f"{kind} {array.dtype} {tuple(array.shape)}"
    return kind


def check_float32(cp, where: str, what: str, array, size: int | None, device_id: int | None):
    """A contiguous cupy float32 array (of ``size`` elements, on ``device_id``, when given)."""
    if not isinstance(array, cp.ndarray):
        raise TypeError(f"{where}: {what} must be a cupy.ndarray, got {describe(array)}")
    if array.dtype != np.float32:
        raise TypeError(f"{where}: {what} must be float32, got {describe(array)}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{where}: {what} must be C-contiguous, got a strided {describe(array)}")
    if size is not None and array.size != size:
        raise ValueError(f"{where}: {what} must have {size} elements (the layout's size), "
                         f"got {describe(array)}")
    if device_id is not None and array.device.id != device_id:
        raise ValueError(f"{where}: {what} must be on cuda:{device_id}, "
                         f"got one on cuda:{array.device.id}")


def device_scalar(cp, where: str, what: str, value, device_id: int):
    """(pointer argument, value argument) for a kernel's ``const double* ptr, double value``.

    A one-element cupy array is read on the device (converted to float64 on the device if
    needed: no host sync); a Python number must be finite and > 0.
    """
    if isinstance(value, cp.ndarray):
        if value.size != 1:
            raise ValueError(f"{where}: {what} must be a number or a one-element cupy array, "
                             f"got {describe(value)}")
        if value.device.id != device_id:
            raise ValueError(f"{where}: {what} must be on cuda:{device_id}, "
                             f"got one on cuda:{value.device.id}")
        if value.dtype.kind != "f":
            raise TypeError(f"{where}: {what} must be a floating-point array, got {describe(value)}")
        if value.dtype != np.float64:
            with cp.cuda.Device(device_id):
                value = value.astype(np.float64)
        return value, np.float64(1.0)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: {what} must be a number or a one-element cupy array, "
                        f"got {describe(value)}") from None
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{where}: {what} must be finite and > 0, got {value!r}")
    return NULL, np.float64(number)
