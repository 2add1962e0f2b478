"""The counters of loss-scaled updates kept on a CUDA device, and their host copy.

Under a DynamicLossScaler on CUDA the trainer decides each update on the device
(``_trainer.device_scaling``): the kernels count the update, skip it, move the scale, in one float64
device array (``Counters``' fields, kernels/common.cuh), and the graph reads the scale from an fp32
0-d array. The host objects whose values these are (``TrainStepInfo``, ``DynamicLossScaler``, the LR
scheduler) each hold this ``DeviceCounters`` as their device form (``KeptOnDevice``): they read it
back after an update (``version`` says when) and write their own values into it.
"""
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import numpy as np


class Counters(NamedTuple):
    """The device counters, in the order of the device array."""

    updates_applied: float
    stable_steps: float
    last_finite: float  # 1.0: the last update's gradients were finite
    loss_scale: float


class DeviceCounters:
    """``Counters`` in a float64 device array and the fp32 scale the graph reads, with their host copy.

    Args:
        array: the device array of ``Counters`` (``_optimizers.cuda_steps.device_counters``).
        graph_scale: the fp32 0-d device array the graph reads the loss scale from.
        stream_order: a context in which copies are ordered with the updates' kernels (the
            trainer's ``Placement.step``).
        start: the counters to begin with, written to the device (no copy back).
    """

    def __init__(self, array: Any, graph_scale: Any, stream_order: Callable[[], AbstractContextManager], *,
                 start: Counters):
        self.array, self.graph_scale, self._stream_order = array, graph_scale, stream_order
        self._host = self._after_update = start
        self._host_version = self.version = 0  # version: the updates queued on the device so far
        self.write(start)

    def updated(self) -> None:
        """An update's kernels were queued: the host copy is out of date until the next ``read``."""
        self.version += 1

    def read(self) -> Counters:
        """The counters now: as the last update queued left them (one copy to the host, a sync, per
        update), with the writes since."""
        if self._host_version != self.version:
            with self._stream_order():  # after the updates' kernels
                self._host = self._after_update = Counters(*(float(value) for value in self.array.get()))
            self._host_version = self.version
        return self._host

    def after_update(self) -> Counters:
        """The counters as the last update queued left them, without the writes since."""
        self.read()
        return self._after_update

    def updates_applied_at_most(self) -> int:
        """An upper bound on the updates applied, without a sync: each one queued since the last read counts."""
        return int(self._host.updates_applied) + self.version - self._host_version

    def write(self, counters: Counters) -> None:
        """Sets the counters (and the graph's scale) on the device, before the next update's kernels."""
        self.read()  # the copy is now the device's, so later reads see ``counters`` without a sync
        self._host = counters
        with self._stream_order():
            self.array.set(np.array(counters, dtype=np.float64))
            self.graph_scale[...] = np.float32(counters.loss_scale)


class KeptOnDevice:
    """Base of a host object whose values may live in ``DeviceCounters``, its device form: it reads
    them back itself after an update (``_sync_from_device``, lazily, from its public properties)
    and writes its own values there (``_write_to_device``); nothing else writes its state."""

    _device: DeviceCounters | None = None
    _device_version = 0  # the device's version at this object's last sync

    def _keep_on_device(self, device: DeviceCounters) -> None:
        """From now on this object's values live in ``device``, where the trainer's updates move them
        (``_trainer.device_scaling``): written there now and after each change, read back after an update."""
        self._device, self._device_version = device, device.version
        self._write_to_device()

    def _sync_from_device(self) -> None:
        """Before a read (or a change): this object's values as the last update left them, when one
        came since its last sync."""
        device = self._device
        if device is not None and device.version != self._device_version:
            self._device_version = device.version
            self._from_counters(device.after_update())

    def _write_to_device(self) -> None:
        """After a change (made after ``_sync_from_device``): this object's values into the device."""
        if self._device is not None:
            current = self._device.read()
            wanted = self._into_counters(current)
            if wanted != current:
                self._device.write(wanted)

    def _from_counters(self, counters: Counters) -> None:
        """Sets this object's values from ``counters``."""
        raise NotImplementedError

    def _into_counters(self, counters: Counters) -> Counters:
        """``counters`` with this object's values in (none by default)."""
        return counters
