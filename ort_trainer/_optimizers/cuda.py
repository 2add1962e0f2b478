"""The CUDA implementation of the flat-buffer optimizers: CuPy launch wrappers for the kernels
in ``kernels/*.cu``, with the functional steps and the clip divisor that ``_optimizers`` calls
for device 'cuda' (the contract: DESIGN.md, "Optimizers").

Each ``kernels/<family>.cu`` is read once per process (``importlib.resources``), with
``common.cuh`` pasted in place of its ``#include`` so that CuPy's on-disk cache key (a hash of
the source text) follows header edits, compiled by NVRTC through ``cupy.RawModule(code=...,
options=NVRTC_OPTIONS)`` once per device, and launched by the thin wrappers below, which check
dtype, contiguity, sizes and device first. CuPy is imported on first use only: CPU-only installs
import this module fine, and the first GPU call raises an ImportError that says what to install.

All launches go to the current stream of the arrays' device; nothing here synchronizes with the
host: a gradient divisor may be a one-element device array (``clip_divisor``'s S), read on the
device.

Numerics: fp32 elementwise math with IEEE division and sqrt; CuPy appends ``-ftz=true`` to the
options, so fp32 denormals flush to zero. Step-dependent scalars (bias corrections, lr * ratio)
and every sum of squares are computed in double, in a fixed order (deterministic).
"""
from __future__ import annotations

import functools
import importlib.resources
import math
import threading

import numpy as np

from .cuda_tables import BLOCK, GROUP_FIELDS, MAX_PARTIALS, chunk_table, group_table

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
}


_INSTALL_HINT = "CuPy is required for the GPU optimizer: pip install 'ort-trainer[gpu]'"
_INCLUDE = '#include "common.cuh"'
_NULL = np.uint64(0)  # a null device pointer argument

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


def _function(family: str, name: str, device_id: int):
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


def _vector_blocks(n: int) -> int:
    """Blocks of BLOCK threads that cover n elements, 4 (one float4) per thread."""
    return -(-n // (4 * BLOCK))


def _grid_stride_blocks(n: int, device_id: int) -> int:
    """Blocks for a grid-stride kernel over n elements taken 4 at a time."""
    blocks = _vector_blocks(n)
    return max(1, min(blocks, _sm_count(device_id) * _BLOCKS_PER_SM))


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------


def _describe(array) -> str:
    kind = f"{type(array).__module__}.{type(array).__name__}"
    if hasattr(array, "dtype") and hasattr(array, "shape"):
        return f"{kind} {array.dtype} {tuple(array.shape)}"
    return kind


def _check_float32(cp, where: str, what: str, array, size: int | None, device_id: int | None):
    """A contiguous cupy float32 array (of ``size`` elements, on ``device_id``, when given)."""
    if not isinstance(array, cp.ndarray):
        raise TypeError(f"{where}: {what} must be a cupy.ndarray, got {_describe(array)}")
    if array.dtype != np.float32:
        raise TypeError(f"{where}: {what} must be float32, got {_describe(array)}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{where}: {what} must be C-contiguous, got a strided {_describe(array)}")
    if size is not None and array.size != size:
        raise ValueError(f"{where}: {what} must have {size} elements (the layout's size), "
                         f"got {_describe(array)}")
    if device_id is not None and array.device.id != device_id:
        raise ValueError(f"{where}: {what} must be on cuda:{device_id}, "
                         f"got one on cuda:{array.device.id}")


def _device_scalar(cp, where: str, what: str, value, device_id: int):
    """(pointer argument, value argument) for a kernel's ``const double* ptr, double value``.

    A one-element cupy array is read on the device (converted to float64 on the device if
    needed: no host sync); a Python number must be finite and > 0.
    """
    if isinstance(value, cp.ndarray):
        if value.size != 1:
            raise ValueError(f"{where}: {what} must be a number or a one-element cupy array, "
                             f"got {_describe(value)}")
        if value.device.id != device_id:
            raise ValueError(f"{where}: {what} must be on cuda:{device_id}, "
                             f"got one on cuda:{value.device.id}")
        if value.dtype.kind != "f":
            raise TypeError(f"{where}: {what} must be a floating-point array, got {_describe(value)}")
        if value.dtype != np.float64:
            with cp.cuda.Device(device_id):
                value = value.astype(np.float64)
        return value, np.float64(1.0)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: {what} must be a number or a one-element cupy array, "
                        f"got {_describe(value)}") from None
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{where}: {what} must be finite and > 0, got {value!r}")
    return _NULL, np.float64(number)


# ----------------------------------------------------------------------------------------------
# Layout tables
# ----------------------------------------------------------------------------------------------


class LayoutTable:
    """A FlatLayout on one device for one kernel family (what ``layout_table`` returns).

    Holds the group table, and for Lamb the chunk table and the scratch buffers of a step (the
    direction d, per-chunk partial sums, per-segment lr * ratio): one step at a time per table.
    """

    def __init__(self, layout, family: str):
        cp = require_cupy()
        if family not in GROUP_FIELDS:
            raise ValueError(f"layout_table: family must be one of {sorted(GROUP_FIELDS)}, "
                             f"got {family!r}")
        self.family = family
        self.device_id = cp.cuda.Device().id
        self.size = int(layout.seg_offsets[-1])
        self.nseg = int(len(layout.seg_offsets) - 1)
        self.ngroups = len(layout.groups)
        if self.nseg >= 2**31 or self.ngroups >= 2**31:
            raise ValueError(f"layout_table: {self.nseg} segments: too many for int32 indices")
        host_groups = group_table(layout, family)
        with cp.cuda.Device(self.device_id):
            self.groups = cp.asarray(host_groups.view(np.uint8))
            if family == "lamb":
                chunks, seg_chunk = chunk_table(layout)
                self.nchunks = int(chunks.size)
                self.chunks = cp.asarray(chunks.view(np.uint8))
                self.seg_chunk = cp.asarray(seg_chunk)
                self.partials = cp.empty(2 * self.nchunks, dtype=np.float64)
                self.lr_ratio = cp.empty(self.nseg, dtype=np.float64)
                self.direction = None  # N floats, allocated by the first step

    def __repr__(self):
        return (f"LayoutTable(family={self.family!r}, device=cuda:{self.device_id}, "
                f"size={self.size}, segments={self.nseg}, groups={self.ngroups})")


def layout_table(layout, family: str) -> LayoutTable:
    """The device tables of ``layout`` for ``family`` ('sgd', 'adam', 'lamb'), on the current
    device. Build once per optimizer and pass to every step."""
    return LayoutTable(layout, family)


def _check_step(cp, where, table, family, **arrays):
    if not isinstance(table, LayoutTable) or table.family != family:
        raise TypeError(f"{where}: table must be layout_table(layout, {family!r}), got {table!r}")
    for what, array in arrays.items():
        _check_float32(cp, where, what, array, table.size, table.device_id)


def _checked_moment_step(cp, where, table, step, grad_divisor, **arrays):
    """The checks of an Adam or Lamb step ('adam_step', 'lamb_step'); (pointer, value) of its
    gradient divisor (`_device_scalar`)."""
    _check_step(cp, where, table, where.split("_")[0], **arrays)
    if step < 1:
        raise ValueError(f"{where}: step must be >= 1 (t is 1-based), got {step!r}")
    return _device_scalar(cp, where, "grad_divisor", grad_divisor, table.device_id)


# ----------------------------------------------------------------------------------------------
# Optimizer steps
# ----------------------------------------------------------------------------------------------


def sgd_step(table: LayoutTable, params, grads, momentum, *, lr: float, grad_divisor=1.0,
             first_step: bool) -> None:
    """One SGD step in place (torch.optim.SGD semantics, see kernels/sgd.cu).

    Args:
        table: ``layout_table(layout, 'sgd')``.
        params, grads, momentum: flat float32 buffers (momentum is neither read on the first step
            nor written by groups whose momentum is 0).
        lr: the learning rate.
        grad_divisor: S in g = grads / S, a number or a one-element device array.
        first_step: True on the first update (the momentum buffer starts at g).
    """
    cp = require_cupy()
    where = "sgd_step"
    _check_step(cp, where, table, "sgd", params=params, grads=grads, momentum=momentum)
    divisor_ptr, divisor_value = _device_scalar(cp, where, "grad_divisor", grad_divisor,
                                                table.device_id)
    kernel = _function("sgd", "ort_trainer_sgd_step_f32", table.device_id)
    with cp.cuda.Device(table.device_id):
        kernel((_grid_stride_blocks(table.size, table.device_id),), (BLOCK,),
               (params, grads, momentum, table.groups, np.int32(table.ngroups),
                np.int64(table.size), np.float64(lr), divisor_ptr, divisor_value,
                np.int32(bool(first_step))))


def adam_step(table: LayoutTable, params, grads, exp_avg, exp_avg_sq, *, step: int, lr: float,
              grad_divisor=1.0) -> None:
    """One Adam step in place (the original AdamOptimizer, see kernels/adam.cu).

    Args:
        table: ``layout_table(layout, 'adam')``.
        params, grads, exp_avg, exp_avg_sq: flat float32 buffers.
        step: t, the 1-based index of this update (bias corrections 1 - alpha^t, 1 - beta^t).
        lr: the learning rate.
        grad_divisor: S in g = grads / S, a number or a one-element device array.
    """
    cp = require_cupy()
    divisor_ptr, divisor_value = _checked_moment_step(cp, "adam_step", table, step, grad_divisor, params=params,
                                                      grads=grads, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    kernel = _function("adam", "ort_trainer_adam_step_f32", table.device_id)
    with cp.cuda.Device(table.device_id):
        kernel((_grid_stride_blocks(table.size, table.device_id),), (BLOCK,),
               (params, grads, exp_avg, exp_avg_sq, table.groups, np.int32(table.ngroups),
                np.int64(table.size), np.float64(lr), np.int64(step), divisor_ptr,
                divisor_value))


def lamb_step(table: LayoutTable, params, grads, exp_avg, exp_avg_sq, *, step: int, lr: float,
              grad_divisor=1.0) -> None:
    """One Lamb step in place (the original LambOptimizer, see kernels/lamb.cu): three launches
    (direction + per-chunk sums of squares, per-tensor trust ratio, update).

    Args:
        table: ``layout_table(layout, 'lamb')``.
        params, grads, exp_avg, exp_avg_sq: flat float32 buffers.
        step: t, the 1-based index of this update.
        lr: the learning rate.
        grad_divisor: S in g = grads / S, a number or a one-element device array.
    """
    cp = require_cupy()
    divisor_ptr, divisor_value = _checked_moment_step(cp, "lamb_step", table, step, grad_divisor, params=params,
                                                      grads=grads, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    direction_kernel, ratio_kernel, update_kernel = (
        _function("lamb", name, table.device_id) for name in KERNELS["lamb"])
    with cp.cuda.Device(table.device_id):
        if table.direction is None:
            table.direction = cp.empty(table.size, dtype=np.float32)
        nchunks = np.int32(table.nchunks)
        direction_kernel((table.nchunks,), (BLOCK,),
                         (params, grads, exp_avg, exp_avg_sq, table.direction, table.groups,
                          table.chunks, nchunks, np.int64(step), divisor_ptr, divisor_value,
                          table.partials))
        ratio_kernel((table.nseg,), (BLOCK,),
                     (table.partials, table.chunks, table.seg_chunk, table.groups,
                      np.int32(table.nseg), np.float64(lr), table.lr_ratio))
        update_kernel((table.nchunks,), (BLOCK,),
                      (params, table.direction, table.chunks, nchunks, table.lr_ratio))


# ----------------------------------------------------------------------------------------------
# Gradient preparation
# ----------------------------------------------------------------------------------------------


def _partial_count(n: int) -> int:
    """Blocks of the sum-of-squares pass over n values (each reduces 4 per thread per round)."""
    return 0 if n == 0 else min(MAX_PARTIALS, _vector_blocks(n))


def clip_buffers(n: int, device_id: int) -> dict:
    """{'out', 'partials'}: the device scratch of ``clip_divisor`` over n gradients, made once by a
    caller that clips every update (no allocation per update)."""
    cp = require_cupy()
    with cp.cuda.Device(device_id):
        return {"out": cp.empty(3, dtype=np.float64),
                "partials": cp.empty(max(_partial_count(n), 1), dtype=np.float64)}


def _reduce_grads(where, grads, max_norm: float, loss_scale: float, out, partials=None):
    """out = [sum of squares, N, S] (float64, on grads' device): two launches."""
    cp = require_cupy()
    _check_float32(cp, where, "grads", grads, None, None)
    device_id = grads.device.id
    with cp.cuda.Device(device_id):
        if out is None:
            out = cp.empty(3, dtype=np.float64)
        elif (not isinstance(out, cp.ndarray) or out.dtype != np.float64 or out.shape != (3,)
              or not out.flags.c_contiguous or out.device.id != device_id):
            raise ValueError(f"{where}: out must be a contiguous float64 cupy array of shape (3,) "
                             f"on cuda:{device_id}, got {_describe(out)}")
        n = int(grads.size)
        nparts = _partial_count(n)
        if partials is None:
            partials = cp.empty(max(nparts, 1), dtype=np.float64)
        elif (not isinstance(partials, cp.ndarray) or partials.dtype != np.float64 or partials.ndim != 1
              or partials.size < max(nparts, 1) or not partials.flags.c_contiguous
              or partials.device.id != device_id):
            raise ValueError(f"{where}: partials must be a contiguous 1-d float64 cupy array of at least "
                             f"{max(nparts, 1)} elements on cuda:{device_id}, got {_describe(partials)}")
        if nparts:
            _function("clip", "ort_trainer_clip_sumsq_f32", device_id)(
                (nparts,), (BLOCK,), (grads, np.int64(n), partials))
        _function("clip", "ort_trainer_clip_divisor_f32", device_id)(
            (1,), (BLOCK,), (partials, np.int32(nparts), np.float64(max_norm),
                             np.float64(loss_scale), out))
    return out


def sum_of_squares(grads, out=None):
    """sum(grads**2) as a 0-d float64 device array (squares and sums in double, deterministic).

    Args:
        grads: a contiguous cupy float32 array.
        out: optional float64 cupy array of shape (3,) for the result ([sum, norm, 1.0]).
    """
    return _reduce_grads("sum_of_squares", grads, math.inf, 1.0, out)[0]


def clip_divisor(grads, max_norm: float, loss_scale: float = 1.0, out=None, partials=None):
    """The clip divisor S on the device: ``_optimizers.reference.clip_divisor_from_norm`` on
    N = ||grads||_2, in two launches, no host sync.

    Args:
        grads: a contiguous cupy float32 array.
        max_norm: the clip norm, > 0.
        loss_scale: the loss scale the gradients carry, > 0 (1.0 without mixed precision).
        out: optional float64 cupy array of shape (3,), filled with [N**2, N, S].
        partials: optional float64 cupy scratch (``clip_buffers`` makes both).

    Returns:
        (S, N): 0-d float64 views of ``out``; pass S as ``grad_divisor`` to a step.
    """
    where = "clip_divisor"
    if not max_norm > 0:
        raise ValueError(f"{where}: max_norm must be > 0, got {max_norm!r}")
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"{where}: loss_scale must be finite and > 0, got {loss_scale!r}")
    out = _reduce_grads(where, grads, float(max_norm), float(loss_scale), out, partials)
    return out[2], out[1]

