"""ORTTrainer's loss-scaled updates on CUDA without a host sync.

On the host, an update under loss scaling needs to know whether the gradients were finite (skip
or apply, halve or grow the scale), which makes the host wait for the GPU every step. Here that
decision never leaves the device: the clip kernel writes S = NaN for non-finite gradients, the
optimizer kernels return on it, and one more kernel counts the update and moves the scale
(kernels/amp.cu), all in the stream order of the step. The counters (updates applied, stable
steps, last finite, scale) live in one float64 device array that the kernels read; the lr of
each possible update is evaluated ahead on the host into a device table indexed by t.

The host objects users read (``TrainStepInfo.optimization_step`` / ``all_finite``, the
``DynamicLossScaler``'s scale, the scheduler's last lr) each keep the counters
(``amp._device_counters.DeviceCounters``) as their device form: the first read after an update
copies them back (one sync), a write is copied to the device.
"""
import numpy as np

from .._optimizers import cuda_steps as _kernels
from ..amp import DynamicLossScaler
from ..amp._device_counters import Counters, DeviceCounters
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
        self.host: list[float] = []
        self.device = None

    def lr_of_update(self, t: int) -> float:
        """The lr of update t, evaluated already (``covering(t)`` was called)."""
        return self.host[t - 1]

    def covering(self, t: int):
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
    """The device state of loss-scaled updates (see the module docstring). `update` runs inside the
    trainer's `placement.step()`.

    The trainer's TrainStepInfo, loss scaler and LR scheduler are handed the counters as their
    device form (`amp._device_counters.KeptOnDevice`): they read them back after an update and
    write their values there.
    """

    def __init__(self, *, scaler, graph_scale, info, scheduler, optimizer, optim_config, placement, size):
        self._scaler = scaler
        start = Counters(updates_applied=0.0, stable_steps=0.0, last_finite=1.0, loss_scale=scaler.loss_scale)
        self.counters = DeviceCounters(_kernels.device_counters(scaler.loss_scale, placement.index), graph_scale,
                                       placement.step, start=start)
        self._buffers = _kernels.clip_buffers(size, placement.index)
        self._optimizer = optimizer
        optimizer.count_on_device(self.counters.array)
        info._keep_on_device(self.counters)  # its update count wins over the optimizer's
        scaler._keep_on_device(self.counters)
        self._lr_table = None
        if scheduler is not None:
            self._lr_table = LrTable(scheduler, optim_config, placement.index)
            scheduler._decided_on_device(self.counters, self._lr_table.lr_of_update)

    def update(self, flat, *, lr, max_norm):
        """One update of `flat` from its gradients: clip, skip or apply, count, move the scale."""
        counters = self.counters.array
        divisor, _ = _kernels.clip_divisor(flat.grads, max_norm, counters=counters, out=self._buffers.out,
                                           partials=self._buffers.partials)
        lr_table = (None if self._lr_table is None
                    else self._lr_table.covering(self.counters.updates_applied_at_most() + 1))
        self._optimizer.step(flat.params, flat.grads, lr, divisor, lr_table=lr_table)
        scaler = self._scaler
        _kernels.loss_scaler_update(divisor, counters, self.counters.graph_scale,
                                    up_scale_window=scaler.up_scale_window, min_loss_scale=scaler.min_loss_scale,
                                    max_loss_scale=scaler.max_loss_scale, automatic=scaler.automatic_update)
        self.counters.updated()
