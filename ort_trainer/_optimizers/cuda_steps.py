"""The CUDA implementation of the flat-buffer optimizers: CuPy launch wrappers for the kernels
in ``kernels/*.cu``, with the functional steps, the clip divisor and the loss scaler's update
that ``_optimizers`` calls for device 'cuda' (the contract: DESIGN.md, "Optimizers"). The
kernels are compiled once per process (``_optimizers.cuda_launch``); the thin wrappers below
check dtype, contiguity, sizes and device first.

All launches go to the current stream of the arrays' device; nothing here synchronizes with the
host: a gradient divisor may be a one-element device array (``clip_divisor``'s S), read on the
device, and under loss scaling the update counters and the lr schedule are device arrays too
(``device_counters``, kernels/common.cuh): S = NaN skips an update on the device.

Numerics: fp32 elementwise math with IEEE division and sqrt; CuPy appends ``-ftz=true`` to the
options, so fp32 denormals flush to zero. Step-dependent scalars (bias corrections, lr * ratio)
and every sum of squares are computed in double, in a fixed order (deterministic).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..amp._device_counters import Counters
from .cuda_launch import (KERNELS, NULL, check_float32, describe, device_scalar, grid_stride_blocks, kernel_function,
                          require_cupy, vector_blocks)
from .cuda_tables import BLOCK, GROUP_FIELDS, MAX_PARTIALS, chunk_table, group_table

#: The device counters of loss-scaled training (common.cuh's ORT_UPDATES_APPLIED ...): float64.
COUNTERS = Counters._fields

#: A CuPy array (CuPy is optional: no type to name).
DeviceArray = Any

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
        check_float32(cp, where, what, array, table.size, table.device_id)


def _checked_moment_step(cp, where, table, step, grad_divisor, **arrays):
    """The checks of an Adam or Lamb step ('adam_step', 'lamb_step'); (pointer, value) of its
    gradient divisor (`_device_scalar`)."""
    _check_step(cp, where, table, where.split("_")[0], **arrays)
    if step < 1:
        raise ValueError(f"{where}: step must be >= 1 (t is 1-based), got {step!r}")
    return device_scalar(cp, where, "grad_divisor", grad_divisor, table.device_id)


# ----------------------------------------------------------------------------------------------
# Optimizer steps
# ----------------------------------------------------------------------------------------------


def _float64_pointer(cp, where: str, what: str, array, device_id: int, size: int):
    """The device pointer of an optional float64 array of at least ``size`` elements (NULL for None)."""
    if array is None:
        return NULL
    if (not isinstance(array, cp.ndarray) or array.dtype != np.float64 or array.ndim != 1
            or array.size < size or not array.flags.c_contiguous or array.device.id != device_id):
        raise ValueError(f"{where}: {what} must be None or a contiguous 1-d float64 cupy array of at least {size} "
                         f"elements on cuda:{device_id}, got {describe(array)}")
    return array


def _scaling_pointers(cp, where, table, counters, lr_table):
    """(counters, lr_table) pointers of a step: ``device_counters`` and the lr schedule it indexes."""
    if lr_table is not None and counters is None:
        raise ValueError(f"{where}: lr_table is indexed by the device update count: pass counters too")
    return (_float64_pointer(cp, where, "counters", counters, table.device_id, len(COUNTERS)),
            _float64_pointer(cp, where, "lr_table", lr_table, table.device_id, 1))


def sgd_step(table: LayoutTable, params: DeviceArray, grads: DeviceArray, momentum: DeviceArray, *, lr: float,
             grad_divisor: float | DeviceArray = 1.0, first_step: bool, counters: DeviceArray | None = None,
             lr_table: DeviceArray | None = None) -> None:
    """One SGD step in place (torch.optim.SGD semantics, see kernels/sgd.cu).

    Args:
        table: ``layout_table(layout, 'sgd')``.
        params, grads, momentum: flat float32 buffers (momentum is neither read on the first step
            nor written by groups whose momentum is 0).
        lr: the learning rate.
        grad_divisor: S in g = grads / S, a number or a one-element device array (NaN: skip).
        first_step: True on the first update (the momentum buffer starts at g).
        counters, lr_table: ``device_counters`` and the lr of each update (lr_table[t - 1]):
            when given, they decide the first step and the lr on the device.
    """
    cp = require_cupy()
    where = "sgd_step"
    _check_step(cp, where, table, "sgd", params=params, grads=grads, momentum=momentum)
    divisor_ptr, divisor_value = device_scalar(cp, where, "grad_divisor", grad_divisor, table.device_id)
    counters_ptr, lr_table_ptr = _scaling_pointers(cp, where, table, counters, lr_table)
    kernel = kernel_function("sgd", "ort_trainer_sgd_step_f32", table.device_id)
    with cp.cuda.Device(table.device_id):
        kernel((grid_stride_blocks(table.size, table.device_id),), (BLOCK,),
               (params, grads, momentum, table.groups, np.int32(table.ngroups), np.int64(table.size),
                np.float64(lr), divisor_ptr, divisor_value, np.int32(bool(first_step)), counters_ptr,
                lr_table_ptr))


def adam_step(table: LayoutTable, params: DeviceArray, grads: DeviceArray, exp_avg: DeviceArray,
              exp_avg_sq: DeviceArray, *, step: int, lr: float, grad_divisor: float | DeviceArray = 1.0,
              counters: DeviceArray | None = None, lr_table: DeviceArray | None = None) -> None:
    """One Adam step in place (the original AdamOptimizer, see kernels/adam.cu).

    Args:
        table: ``layout_table(layout, 'adam')``.
        params, grads, exp_avg, exp_avg_sq: flat float32 buffers.
        step: t, the 1-based index of this update (bias corrections 1 - alpha^t, 1 - beta^t).
        lr: the learning rate.
        grad_divisor: S in g = grads / S, a number or a one-element device array (NaN: skip).
        counters, lr_table: ``device_counters`` and the lr of each update (lr_table[t - 1]):
            when given, t and the lr are read on the device (``step`` and ``lr`` are not used).
    """
    cp = require_cupy()
    where = "adam_step"
    divisor_ptr, divisor_value = _checked_moment_step(cp, where, table, step, grad_divisor, params=params,
                                                      grads=grads, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    counters_ptr, lr_table_ptr = _scaling_pointers(cp, where, table, counters, lr_table)
    kernel = kernel_function("adam", "ort_trainer_adam_step_f32", table.device_id)
    with cp.cuda.Device(table.device_id):
        kernel((grid_stride_blocks(table.size, table.device_id),), (BLOCK,),
               (params, grads, exp_avg, exp_avg_sq, table.groups, np.int32(table.ngroups),
                np.int64(table.size), np.float64(lr), np.int64(step), divisor_ptr, divisor_value,
                counters_ptr, lr_table_ptr))


def lamb_step(table: LayoutTable, params: DeviceArray, grads: DeviceArray, exp_avg: DeviceArray,
              exp_avg_sq: DeviceArray, *, step: int, lr: float, grad_divisor: float | DeviceArray = 1.0,
              segment_sums: None = None, counters: DeviceArray | None = None,
              lr_table: DeviceArray | None = None) -> None:
    """One Lamb step in place (the original LambOptimizer, see kernels/lamb.cu): three launches
    (direction + per-chunk sums of squares, per-tensor trust ratio, update).

    Args:
        table: ``layout_table(layout, 'lamb')``.
        params, grads, exp_avg, exp_avg_sq: flat float32 buffers.
        step: t, the 1-based index of this update.
        lr: the learning rate.
        grad_divisor: S in g = grads / S, a number or a one-element device array (NaN: skip).
        segment_sums: the CPU step's ZeRO hook (``cpu.lamb_step``): refused, the tensors are whole here.
        counters, lr_table: as in ``adam_step``.
    """
    cp = require_cupy()
    where = "lamb_step"
    if segment_sums is not None:
        raise ValueError(f"{where}: segment_sums (ZeRO's per-tensor sums over the shards) runs on the CPU only, "
                         f"got {segment_sums!r}")
    divisor_ptr, divisor_value = _checked_moment_step(cp, where, table, step, grad_divisor, params=params,
                                                      grads=grads, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    counters_ptr, lr_table_ptr = _scaling_pointers(cp, where, table, counters, lr_table)
    direction_kernel, ratio_kernel, update_kernel = (
        kernel_function("lamb", name, table.device_id) for name in KERNELS["lamb"])
    with cp.cuda.Device(table.device_id):
        if table.direction is None:
            table.direction = cp.empty(table.size, dtype=np.float32)
        nchunks = np.int32(table.nchunks)
        direction_kernel((table.nchunks,), (BLOCK,),
                         (params, grads, exp_avg, exp_avg_sq, table.direction, table.groups,
                          table.chunks, nchunks, np.int64(step), divisor_ptr, divisor_value,
                          counters_ptr, table.partials))
        ratio_kernel((table.nseg,), (BLOCK,),
                     (table.partials, table.chunks, table.seg_chunk, table.groups, np.int32(table.nseg),
                      np.float64(lr), np.int64(step), divisor_ptr, counters_ptr, lr_table_ptr, table.lr_ratio))
        update_kernel((table.nchunks,), (BLOCK,),
                      (params, table.direction, table.chunks, nchunks, divisor_ptr, table.lr_ratio))


# ----------------------------------------------------------------------------------------------
# Gradient preparation
# ----------------------------------------------------------------------------------------------


def _partial_count(n: int) -> int:
    """Blocks of the sum-of-squares pass over n values (each reduces 4 per thread per round)."""
    return 0 if n == 0 else min(MAX_PARTIALS, vector_blocks(n))


@dataclass(frozen=True)
class ClipBuffers:
    """The device scratch of ``clip_divisor`` (its ``out`` and ``partials``)."""

    out: DeviceArray
    partials: DeviceArray


def clip_buffers(n: int, device_id: int) -> ClipBuffers:
    """The device scratch of ``clip_divisor`` over n gradients, made once by a caller that clips
    every update (no allocation per update)."""
    cp = require_cupy()
    with cp.cuda.Device(device_id):
        return ClipBuffers(out=cp.empty(3, dtype=np.float64),
                           partials=cp.empty(max(_partial_count(n), 1), dtype=np.float64))


def _reduce_grads(where, grads, max_norm: float, loss_scale: float, out, partials=None, counters=None):
    """out = [sum of squares, N, S] (float64, on grads' device): two launches."""
    cp = require_cupy()
    check_float32(cp, where, "grads", grads, None, None)
    device_id = grads.device.id
    counters_ptr = _float64_pointer(cp, where, "counters", counters, device_id, len(COUNTERS))
    scale_ptr = NULL if counters is None else counters[COUNTERS.index("loss_scale"):]
    with cp.cuda.Device(device_id):
        if out is None:
            out = cp.empty(3, dtype=np.float64)
        elif (not isinstance(out, cp.ndarray) or out.dtype != np.float64 or out.shape != (3,)
              or not out.flags.c_contiguous or out.device.id != device_id):
            raise ValueError(f"{where}: out must be a contiguous float64 cupy array of shape (3,) "
                             f"on cuda:{device_id}, got {describe(out)}")
        n = int(grads.size)
        nparts = _partial_count(n)
        if partials is None:
            partials = cp.empty(max(nparts, 1), dtype=np.float64)
        elif (not isinstance(partials, cp.ndarray) or partials.dtype != np.float64 or partials.ndim != 1
              or partials.size < max(nparts, 1) or not partials.flags.c_contiguous
              or partials.device.id != device_id):
            raise ValueError(f"{where}: partials must be a contiguous 1-d float64 cupy array of at least "
                             f"{max(nparts, 1)} elements on cuda:{device_id}, got {describe(partials)}")
        if nparts:
            kernel_function("clip", "ort_trainer_clip_sumsq_f32", device_id)(
                (nparts,), (BLOCK,), (grads, np.int64(n), partials))
        kernel_function("clip", "ort_trainer_clip_divisor_f32", device_id)(
            (1,), (BLOCK,), (partials, np.int32(nparts), np.float64(max_norm), np.float64(loss_scale),
                             scale_ptr, np.int32(counters_ptr is not NULL), out))
    return out


def sum_of_squares(grads, out=None):
    """sum(grads**2) as a 0-d float64 device array (squares and sums in double, deterministic).

    Args:
        grads: a contiguous cupy float32 array.
        out: optional float64 cupy array of shape (3,) for the result ([sum, norm, 1.0]).
    """
    return _reduce_grads("sum_of_squares", grads, math.inf, 1.0, out)[0]


def clip_divisor(grads, max_norm: float, loss_scale: float = 1.0, out=None, partials=None, counters=None):
    """The clip divisor S on the device: ``_optimizers.reference.clip_divisor_from_norm`` on
    N = ||grads||_2, in two launches, no host sync.

    Args:
        grads: a contiguous cupy float32 array.
        max_norm: the clip norm, > 0 (inf: no clipping).
        loss_scale: the loss scale the gradients carry, > 0 (1.0 without mixed precision).
        out: optional float64 cupy array of shape (3,), filled with [N**2, N, S].
        partials: optional float64 cupy scratch (``clip_buffers`` makes both).
        counters: ``device_counters`` of loss scaling: the loss scale is read from them instead,
            and a non-finite N gives S = NaN, which makes the steps skip the update.

    Returns:
        (S, N): 0-d float64 views of ``out``; pass S as ``grad_divisor`` to a step.
    """
    where = "clip_divisor"
    if not max_norm > 0:
        raise ValueError(f"{where}: max_norm must be > 0, got {max_norm!r}")
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"{where}: loss_scale must be finite and > 0, got {loss_scale!r}")
    out = _reduce_grads(where, grads, float(max_norm), float(loss_scale), out, partials, counters)
    return out[2], out[1]


# ----------------------------------------------------------------------------------------------
# Loss scaling on the device
# ----------------------------------------------------------------------------------------------


def device_counters(loss_scale: float, device_id: int):
    """The float64 device array of ``COUNTERS`` that loss-scaled updates keep on the device:
    no update applied, none stable, the last one finite, ``loss_scale``."""
    cp = require_cupy()
    with cp.cuda.Device(device_id):
        return cp.asarray(np.array(Counters(0.0, 0.0, 1.0, loss_scale), dtype=np.float64))


def loss_scaler_update(divisor, counters, graph_scale, *, up_scale_window: int, min_loss_scale: float,
                       max_loss_scale: float, automatic: bool) -> None:
    """After an update's steps (kernels/amp.cu): counts it unless ``divisor`` (``clip_divisor``'s S
    under ``counters``) marked it skipped, and moves the scale as ``DynamicLossScaler.update``
    does (``automatic``) in ``counters`` and in the fp32 0-d ``graph_scale`` the graph reads."""
    cp = require_cupy()
    where = "loss_scaler_update"
    if not isinstance(counters, cp.ndarray):  # required here: the update is counted in them
        raise TypeError(f"{where}: counters must be the float64 cupy array device_counters returned, "
                        f"got {describe(counters)}")
    device_id = counters.device.id
    _float64_pointer(cp, where, "counters", counters, device_id, len(COUNTERS))
    divisor_ptr, _ = device_scalar(cp, where, "divisor", divisor, device_id)
    check_float32(cp, where, "graph_scale", graph_scale, 1, device_id)
    if divisor_ptr is NULL:
        raise TypeError(f"{where}: divisor must be the one-element cupy array clip_divisor returned, got {divisor!r}")
    with cp.cuda.Device(device_id):
        kernel_function("amp", "ort_trainer_amp_update", device_id)(
            (1,), (32,), (divisor_ptr, counters, graph_scale, np.int64(up_scale_window), np.float64(min_loss_scale),
                          np.float64(max_loss_scale), np.int32(bool(automatic))))

