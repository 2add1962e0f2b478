"""ORTTrainer's loss-scaled updates on CUDA without a host sync.

On the host, an update under loss scaling needs to know whether the gradients were finite (skip
or apply, halve or grow the scale), which makes the host wait for the GPU every step. Here that
decision never leaves the device: the clip kernel writes S = NaN for non-finite gradients, the
optimizer kernels return on it, and one more kernel counts the update and moves the scale
(kernels/amp.cu), all in the stream order of the step. The counters (updates applied, stable
steps, last finite, scale) live in one float64 device array that the kernels read; the lr of
each possible update is evaluated ahead on the host into a device table indexed by t.

The host objects users read (``TrainStepInfo.optimization_step`` / ``all_finite``, the
``DynamicLossScaler``'s scale, the scheduler's last lr) are mirrored lazily: the first read
after an update copies the counters back (one sync), a write is copied to the device.
"""
import numpy as np

from .._optimizers import cuda_steps as _kernels
from ..amp import DynamicLossScaler
from .train_step_info import TrainStepInfo

_LR_TABLE_BLOCK = 1024  # updates evaluated ahead at a time


def runs_on_device(device, scaler):
    """True when `scaler`'s updates can be decided on the device: CUDA (where ZeRO is refused, so
    every rank holds one flat optimizer) and DynamicLossScaler's own rule (a subclass that
    overrides `update` runs it on the host)."""
    return device == "cuda" and scaler is not None and type(scaler).update is DynamicLossScaler.update


class LrTable:
    """The lr of updates t = 1, 2, ... at [t - 1] in a float64 device array: the scheduler's
    `get_lr` evaluated with `optimization_step = t - 1`, in blocks, ahead of the updates."""

    def __init__(self, scheduler, optim_config, device_id):
        self._scheduler, self._optim_config, self._device_id = scheduler, optim_config, device_id
        self.host = []
        self.device = None

    def covering(self, t):
        """The device table, holding at least the lr of update t."""
        if len(self.host) < t:
            stop = -(-t // _LR_TABLE_BLOCK) * _LR_TABLE_BLOCK
            self.host += [float(self._scheduler.get_lr(TrainStepInfo(self._optim_config, optimization_step=k))[0])
                          for k in range(len(self.host), stop)]
            cp = _kernels.require_cupy()
            with cp.cuda.Device(self._device_id):
                self.device = cp.asarray(np.array(self.host, dtype=np.float64))
        return self.device


class DeviceScaling:
    """The device state of loss-scaled updates and the host mirror of it (see the module docstring).
    `update` runs inside the trainer's `placement.step()`; `pull` and `push` enter it themselves.

    Attached to the trainer's TrainStepInfo, loss scaler and LR scheduler (their `_mirror`), which
    call `pull` before a read of a mirrored value and `push` after a write.
    """

    def __init__(self, *, scaler, graph_scale, info, scheduler, optimizer, optim_config, placement, size):
        self._scaler, self._graph_scale, self._info, self._scheduler = scaler, graph_scale, info, scheduler
        self._placement = placement
        self.counters = _kernels.device_counters(scaler.loss_scale, placement.index)
        self._buffers = _kernels.clip_buffers(size, placement.index)
        self._lr_table = None if scheduler is None else LrTable(scheduler, optim_config, placement.index)
        self._stale = False
        self._optimizer = optimizer
        optimizer.count_on_device(self.counters)
        self.push()  # nothing is stale yet; sets _applied_at_most
        for mirrored in (info, scaler, scheduler):
            if mirrored is not None:
                mirrored._mirror = self

    def update(self, flat, *, lr, max_norm):
        """One update of `flat` from its gradients: clip, skip or apply, count, move the scale."""
        divisor, _ = _kernels.clip_divisor(flat.grads, max_norm, counters=self.counters, **self._buffers)
        lr_table = None if self._lr_table is None else self._lr_table.covering(self._applied_at_most + 1)
        self._optimizer.step(flat.params, flat.grads, lr, divisor, lr_table=lr_table)
        scaler = self._scaler
        _kernels.loss_scaler_update(divisor, self.counters, self._graph_scale,
                                    up_scale_window=scaler.up_scale_window, min_loss_scale=scaler.min_loss_scale,
                                    max_loss_scale=scaler.max_loss_scale, automatic=scaler.automatic_update)
        self._applied_at_most += 1
        self._stale = True

    def pull(self):
        """The host objects from the device counters: one copy, only after an update."""
        if not self._stale:
            return
        self._stale = False
        with self._placement.step():  # after the step's kernels
            counters = self.counters.get()
        applied, stable, finite, scale = (float(value) for value in counters)
        self._applied_at_most = int(applied)
        self._info._optimization_step, self._info._all_finite = int(applied), finite == 1.0
        self._scaler._loss_scale, self._scaler._stable_steps = scale, int(stable)
        if self._scheduler is not None:  # the lr the last update was given, applied or skipped
            last_t = int(applied) if finite == 1.0 else int(applied) + 1
            self._scheduler._last_lr = [self._lr_table.host[last_t - 1]]

    def push(self):
        """The device counters from the host objects (after a write to one of them, which pulled first)."""
        info, scaler = self._info, self._scaler
        host = np.array([info._optimization_step, scaler._stable_steps, float(info._all_finite), scaler._loss_scale],
                        dtype=np.float64)
        with self._placement.step():  # before the next step's kernels
            self.counters[...] = _kernels.require_cupy().asarray(host)
            self._graph_scale[...] = np.float32(host[3])
        self._applied_at_most = int(host[0])
