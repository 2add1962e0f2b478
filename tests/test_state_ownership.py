"""Each object owns its state (issue #38, item 1).

No module writes the private state of the loss scaler, the LR scheduler, TrainStepInfo or the
flat Lamb from outside them (an AST scan of ort_trainer/); on CUDA their device form
(``amp._device_counters.DeviceCounters``) is read back lazily, once per update for all of them, and
their writes reach it. The device array here is a NumPy stand-in with CuPy's ``get``/``set``; the
kernels' side runs in tests/gpu/test_loss_scaling_gpu.py (GPU or the CPU emulation).
"""
import ast
import contextlib
from pathlib import Path

import numpy as np
import pytest

from ort_trainer import optim
from ort_trainer._trainer.train_step_info import TrainStepInfo
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.amp._device_counters import Counters, DeviceCounters

PACKAGE = Path(__file__).resolve().parents[1] / "ort_trainer"
OWNED = {"_loss_scale", "_stable_steps", "_optimization_step", "_all_finite", "_last_lr", "_mirror",
         "segment_sums", "_segment_sums", "_device", "_device_version", "_lr_of_update"}


def outside_writes(source):
    """(line, attribute) of each write to an OWNED attribute of an object other than `self`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in OWNED
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")):
            found.append((node.lineno, node.args[1].value))
        for target in targets:
            for element in ast.walk(target):
                if (isinstance(element, ast.Attribute) and isinstance(element.ctx, ast.Store) and element.attr in OWNED
                        and not (isinstance(element.value, ast.Name) and element.value.id == "self")):
                    found.append((element.lineno, element.attr))
    return sorted(found)


def test_the_scan_finds_outside_writes():
    source = ("scaler._loss_scale = 1.0\n"
              "info._optimization_step, x = 2, 3\n"
              "sched._last_lr += [1]\n"
              "lamb.segment_sums = hook\n"
              "setattr(info, '_all_finite', False)\n"
              "self._stable_steps = 0\n"
              "self.other._mirror = None\n")
    assert outside_writes(source) == [(1, "_loss_scale"), (2, "_optimization_step"), (3, "_last_lr"),
                                      (4, "segment_sums"), (5, "_all_finite"), (7, "_mirror")]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda path: str(path.relative_to(PACKAGE)))
def test_no_module_writes_another_objects_state(path):
    assert outside_writes(path.read_text()) == []


class HostArray(np.ndarray):
    """A NumPy array with CuPy's host copies (``get``, ``set``); counts the copies back."""

    gets = 0

    def get(self):
        HostArray.gets += 1
        return np.array(self)

    def set(self, host):
        self[...] = host


@pytest.fixture
def device():
    """A DeviceCounters over HostArrays, with the three host objects that keep it as their device form."""
    HostArray.gets = 0
    array = np.full(4, np.nan).view(HostArray)
    graph_scale = np.zeros((), np.float32).view(HostArray)
    counters = DeviceCounters(array, graph_scale, contextlib.nullcontext, start=Counters(0.0, 0.0, 1.0, 2.0**10))
    info = TrainStepInfo(optim.AdamConfig(lr=0.1), optimization_step=3)
    scaler = DynamicLossScaler(loss_scale=2.0**12, up_scale_window=4)
    scheduler = optim.LinearWarmupLRScheduler(total_steps=100)
    info._keep_on_device(counters)
    scaler._keep_on_device(counters)
    scheduler._decided_on_device(counters, lambda t: 0.001 * t)
    return counters, info, scaler, scheduler


def run_update(counters, values):
    """What the kernels of one update do: the counters moved on the device, the host not told."""
    counters.array[...] = values
    counters.graph_scale[...] = np.float32(values.loss_scale)
    counters.updated()


def test_host_values_are_written_to_the_device_form(device):
    counters, info, scaler, scheduler = device
    np.testing.assert_array_equal(counters.array, [3.0, 0.0, 1.0, 2.0**12])
    assert float(counters.graph_scale) == 2.0**12
    assert HostArray.gets == 0  # nor read back


def test_reads_copy_the_device_form_back_once_per_update(device):
    counters, info, scaler, scheduler = device
    gets = HostArray.gets
    run_update(counters, Counters(4.0, 1.0, 1.0, 2.0**12))
    run_update(counters, Counters(4.0, 0.0, 0.0, 2.0**11))  # skipped: not finite
    assert HostArray.gets == gets  # nothing read back yet
    assert (info.optimization_step, info.all_finite) == (4, False)
    assert (scaler.loss_scale, scaler.state_dict()["stable_steps"]) == (2.0**11, 0)
    assert scheduler.get_last_lr() == [0.001 * 5]  # the skipped update was the 5th: t = applied + 1
    assert HostArray.gets == gets + 1
    run_update(counters, Counters(5.0, 1.0, 1.0, 2.0**11))
    assert scheduler.state_dict()["last_lr"] == [0.001 * 5] and info.optimization_step == 5
    assert HostArray.gets == gets + 2


def test_each_write_reaches_the_device_form_and_keeps_the_others(device):
    counters, info, scaler, scheduler = device
    run_update(counters, Counters(7.0, 2.0, 1.0, 2.0**9))
    scaler.loss_scale = 8.0
    np.testing.assert_array_equal(counters.array, [7.0, 2.0, 1.0, 8.0])
    assert float(counters.graph_scale) == 8.0
    info.optimization_step = 9
    np.testing.assert_array_equal(counters.array, [9.0, 2.0, 1.0, 8.0])
    scaler.load_state_dict({**scaler.state_dict(), "stable_steps": 3, "loss_scale": 16.0})
    info.all_finite = False
    np.testing.assert_array_equal(counters.array, [9.0, 3.0, 0.0, 16.0])
    assert (info.optimization_step, scaler.loss_scale, scheduler.get_last_lr()) == (9, 16.0, [0.001 * 7])


def test_a_loaded_last_lr_wins_over_the_device_form(device):
    counters, info, scaler, scheduler = device
    run_update(counters, Counters(4.0, 1.0, 1.0, 2.0**12))
    scheduler.load_state_dict({**scheduler.state_dict(), "last_lr": [0.5]})
    assert scheduler.get_last_lr() == [0.5]
    run_update(counters, Counters(5.0, 2.0, 1.0, 2.0**12))
    assert scheduler.get_last_lr() == [0.001 * 5]


def test_the_bound_on_applied_updates_needs_no_copy(device):
    counters, *_ = device
    gets = HostArray.gets
    run_update(counters, Counters(4.0, 1.0, 1.0, 2.0**12))
    run_update(counters, Counters(4.0, 0.0, 0.0, 2.0**11))
    assert counters.updates_applied_at_most() == 5 and HostArray.gets == gets
    counters.read()
    assert counters.updates_applied_at_most() == 4
