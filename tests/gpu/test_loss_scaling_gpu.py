"""Loss-scaled updates decided on the device (ort_trainer._trainer.device_scaling, kernels/amp.cu)
against ORTTrainer's host-side rule run on the CPU optimizer: the same weights, optimizer state,
counters, loss scale and lr after every update of a sequence whose gradients overflow now and
then, for every optimizer; the host objects mirror the device lazily; an update makes no host
sync. Runs on a GPU and, without one, on the CPU emulation (tests/test_kernels_on_cpu.py).
"""
import contextlib
import math
import time

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from ort_trainer import optim  # noqa: E402
from ort_trainer._optimizers import cpu as host_kernels  # noqa: E402
from ort_trainer._optimizers import cuda_steps as K  # noqa: E402
from ort_trainer._optimizers.algorithms import make_optimizer, typed_hypers  # noqa: E402
from ort_trainer._optimizers.flat import FlatLayout  # noqa: E402
from ort_trainer._trainer.device_scaling import DeviceScaling, runs_on_device  # noqa: E402
from ort_trainer._trainer.train_step_info import TrainStepInfo  # noqa: E402
from ort_trainer.amp import DynamicLossScaler  # noqa: E402

pytestmark = pytest.mark.gpu

EMULATED = cupy.__name__ != "cupy"
HYPERS = {
    "SGDOptimizer": dict(momentum=0.9, nesterov=False, lambda_coef=0.01, dampening=0.0),
    "AdamOptimizer": dict(alpha=0.9, beta=0.999, lambda_coef=0.01, epsilon=1e-8, do_bias_correction=True,
                          weight_decay_mode=0),
    "LambOptimizer": dict(alpha=0.9, beta=0.999, lambda_coef=0.01, epsilon=1e-6, ratio_min=0.05, ratio_max=5.0,
                          do_bias_correction=True),
}
SIZES = [[3, 1029], [257, 16390]]
# (scale the gradients carry, a bad value to plant or None): overflows at updates 2, 3 and 7 (inf, NaN);
# up_scale_window 3 lets the scale grow twice in between.
BAD = {2: np.inf, 3: np.nan, 7: -np.inf}
UPDATES = 12


class Placement:
    """The trainer's placement, reduced to what DeviceScaling uses (device 0, the current stream)."""

    index = 0

    @staticmethod
    def step():
        return contextlib.nullcontext()


def stable_steps(loss_scaler):
    return loss_scaler.state_dict()["stable_steps"]


def scaler():
    return DynamicLossScaler(loss_scale=2.0**10, up_scale_window=3, min_loss_scale=1.0, max_loss_scale=2.0**11)


def scheduler():
    return optim.lr_scheduler.PolyWarmupLRScheduler(total_steps=10, warmup=0.3, power=2.0)


def gradients(size, scale):
    """The gradient sequence a graph would produce (scaled), with the BAD values planted."""
    rng = np.random.default_rng(7)
    for update in range(UPDATES):
        g = (rng.standard_normal(size) * scale).astype(np.float32)
        if update in BAD:
            g[update * 101 % size] = BAD[update]
        yield update, g


def host_rule(name, layout, w, *, max_norm, with_scheduler):
    """ORTTrainer._update's host path on the CPU optimizer: per update, (weights, state, counters, lr)."""
    config, loss_scaler, lr_scheduler = optim.AdamConfig(lr=0.01), scaler(), scheduler() if with_scheduler else None
    info, optimizer, w = TrainStepInfo(config), make_optimizer(name, layout, "cpu"), w.copy()
    for _, g in gradients(layout.size, 2.0**10):
        lr = lr_scheduler._step(info)[0] if lr_scheduler else config.lr
        divisor, norm = host_kernels.clip_divisor(g, max_norm, loss_scale=loss_scaler.loss_scale)
        info.all_finite = math.isfinite(norm)
        if info.all_finite:
            optimizer.step(w, g, lr, divisor)
            info.optimization_step += 1
        loss_scaler.update(info)
        yield (w.copy(), {k: v.copy() for k, v in optimizer.state.items()},
               (info.optimization_step, stable_steps(loss_scaler), info.all_finite, loss_scaler.loss_scale),
               lr_scheduler.get_last_lr()[0] if lr_scheduler else None)


class Device:
    """A DeviceScaling over a CUDA optimizer, with the host objects it mirrors."""

    def __init__(self, name, layout, w, *, with_scheduler, loss_scaler=None):
        self.config, self.scaler = optim.AdamConfig(lr=0.01), loss_scaler or scaler()
        self.scheduler = scheduler() if with_scheduler else None
        self.info = TrainStepInfo(self.config)
        self.optimizer = make_optimizer(name, layout, "cuda")
        self.flat = type("Flat", (), {})()
        self.flat.params, self.flat.grads = cupy.asarray(w), cupy.zeros(layout.size, dtype=np.float32)
        self.graph_scale = cupy.asarray(np.float32(self.scaler.loss_scale))
        self.scaling = DeviceScaling(scaler=self.scaler, graph_scale=self.graph_scale, info=self.info,
                                     scheduler=self.scheduler, optimizer=self.optimizer, optim_config=self.config,
                                     placement=Placement, size=layout.size)

    def update(self, g, max_norm):
        self.flat.grads[...] = cupy.asarray(g)
        self.scaling.update(self.flat, lr=self.config.lr, max_norm=max_norm)


def layout_for(name):
    return FlatLayout.from_sizes(SIZES, typed_hypers(name, [HYPERS[name]] * len(SIZES)))


@pytest.mark.parametrize("with_scheduler", [False, True])
@pytest.mark.parametrize("max_norm", [math.inf, 1.0])
@pytest.mark.parametrize("name", sorted(HYPERS))
def test_device_rule_matches_the_host_rule(name, max_norm, with_scheduler):
    layout = layout_for(name)
    w = np.random.default_rng(3).standard_normal(layout.size).astype(np.float32)
    device = Device(name, layout, w, with_scheduler=with_scheduler)
    for (update, g), (want_w, want_state, want_counters, want_lr) in zip(
            gradients(layout.size, 2.0**10), host_rule(name, layout, w, max_norm=max_norm,
                                                        with_scheduler=with_scheduler)):
        device.update(g, max_norm)
        got = (device.info.optimization_step, stable_steps(device.scaler), device.info.all_finite,
               device.scaler.loss_scale)
        assert got == want_counters, f"update {update}"
        assert float(device.graph_scale.get()) == want_counters[3]
        assert device.optimizer.step_count == want_counters[0]
        if with_scheduler:
            assert device.scheduler.get_last_lr() == [want_lr], f"update {update}"
        np.testing.assert_allclose(device.flat.params.get(), want_w, rtol=2e-5, atol=1e-6,
                                   err_msg=f"{name} weights after update {update}")
        for key, want in want_state.items():
            np.testing.assert_allclose(device.optimizer.state[key].get(), want, rtol=2e-5, atol=1e-6,
                                       err_msg=f"{name} {key} after update {update}")
    assert device.info.optimization_step == UPDATES - len(BAD)


def test_a_skipped_update_writes_nothing():
    layout = layout_for("LambOptimizer")
    w = np.random.default_rng(4).standard_normal(layout.size).astype(np.float32)
    device = Device("LambOptimizer", layout, w, with_scheduler=True)
    g = np.ones(layout.size, dtype=np.float32)
    device.update(g, 1.0)
    before = (device.flat.params.get(), {k: v.get() for k, v in device.optimizer.state.items()})
    g[5] = np.nan
    device.update(g, 1.0)
    np.testing.assert_array_equal(device.flat.params.get(), before[0])
    for key, array in device.optimizer.state.items():
        np.testing.assert_array_equal(array.get(), before[1][key])
    assert (device.info.optimization_step, device.info.all_finite, device.scaler.loss_scale) == (1, False, 2.0**9)


def test_the_scale_stays_within_its_bounds():
    layout = layout_for("SGDOptimizer")
    bounded = dict(loss_scale=2.0, up_scale_window=1, min_loss_scale=1.0, max_loss_scale=4.0)
    device = Device("SGDOptimizer", layout, np.ones(layout.size, dtype=np.float32), with_scheduler=False,
                    loss_scaler=DynamicLossScaler(**bounded))
    host, info = DynamicLossScaler(**bounded), TrainStepInfo(device.config)
    for finite in (False, False, True, True, True, False):
        g = np.full(layout.size, 1.0 if finite else np.inf, dtype=np.float32)
        device.update(g, math.inf)
        info.all_finite = finite
        assert device.scaler.loss_scale == host.update(info) and float(device.graph_scale.get()) == host.loss_scale
    assert host.loss_scale == 2.0


def test_host_writes_reach_the_device():
    layout = layout_for("AdamOptimizer")
    device = Device("AdamOptimizer", layout, np.ones(layout.size, dtype=np.float32), with_scheduler=False)
    device.update(np.ones(layout.size, dtype=np.float32), math.inf)
    device.scaler.loss_scale = 8.0
    assert float(device.graph_scale.get()) == 8.0 and device.scaling.counters.array.get()[3] == 8.0
    device.info.optimization_step = 5
    assert device.optimizer.step_count == 5 and device.scaler.loss_scale == 8.0
    device.scaler.load_state_dict({**device.scaler.state_dict(), "loss_scale": 16.0, "stable_steps": 2})
    np.testing.assert_array_equal(device.scaling.counters.array.get(), [5.0, 2.0, 1.0, 16.0])
    device.update(np.ones(layout.size, dtype=np.float32), math.inf)  # the third stable update doubles it
    assert (device.info.optimization_step, device.scaler.loss_scale, stable_steps(device.scaler)) == (6, 32.0, 0)


def test_only_dynamic_loss_scalers_on_cuda_run_on_the_device():
    class Halving(DynamicLossScaler):
        def update(self, train_step_info):
            return super().update(train_step_info)

    assert runs_on_device("cuda", DynamicLossScaler(automatic_update=False))
    assert not runs_on_device("cpu", DynamicLossScaler())
    assert not runs_on_device("cuda", None)
    assert not runs_on_device("cuda", Halving())


@pytest.mark.skipif(not EMULATED, reason="the emulation's arrays can be patched; a GPU runs the timed test below")
def test_an_update_reads_nothing_back(monkeypatch):
    layout = layout_for("AdamOptimizer")
    device = Device("AdamOptimizer", layout, np.ones(layout.size, dtype=np.float32), with_scheduler=True)

    def refuse(*_):
        raise AssertionError("an update copied a device array to the host")
    monkeypatch.setattr(type(device.flat.params), "get", refuse)
    for _, g in gradients(layout.size, 1.0):
        device.update(g, 1.0)
    monkeypatch.undo()
    assert device.info.optimization_step == UPDATES - len(BAD)


@pytest.mark.skipif(not EMULATED, reason="the emulation's arrays can be patched")
def test_one_copy_back_serves_every_host_object(monkeypatch):
    """The host objects read their device form lazily: nothing when it is made nor during the
    updates, one copy of the counters for all of them after, and the values of the host rule."""
    layout = layout_for("LambOptimizer")
    w = np.random.default_rng(5).standard_normal(layout.size).astype(np.float32)
    copies, get = [], cupy.ndarray.get
    monkeypatch.setattr(cupy.ndarray, "get", lambda array: copies.append(array.shape) or get(array))
    device = Device("LambOptimizer", layout, w, with_scheduler=True)
    for _, g in gradients(layout.size, 2.0**10):
        device.update(g, 1.0)
    assert copies == []
    *_, (_, _, want_counters, want_lr) = host_rule("LambOptimizer", layout, w, max_norm=1.0, with_scheduler=True)
    got = (device.info.optimization_step, stable_steps(device.scaler), device.info.all_finite,
           device.scaler.loss_scale)
    assert (got, device.scheduler.get_last_lr()) == (want_counters, [want_lr])
    assert copies == [(4,)]


_SPIN = r'''
extern "C" __global__ void ort_test_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) { }
}
'''


def test_scaled_update_needs_no_host_sync():
    """Queued behind a ~0.5 s spin kernel, an update with an overflow returns while the stream is
    still busy (a host sync would have waited); the skip is seen after the sync."""
    layout = layout_for("AdamOptimizer")
    device = Device("AdamOptimizer", layout, np.ones(layout.size, dtype=np.float32), with_scheduler=True)
    g = np.ones(layout.size, dtype=np.float32)
    device.update(g, 1.0)  # compiles every kernel
    g[0] = np.inf
    spin = cupy.RawKernel(_SPIN, "ort_test_spin")
    clock_khz = cupy.cuda.Device().attributes.get("ClockRate", 2_000_000)
    spin((1,), (1,), (np.int64(1000),))
    cupy.cuda.Device().synchronize()
    bad = cupy.asarray(g)
    spin((1,), (1,), (np.int64(clock_khz * 1000 // 2),))
    start = time.perf_counter()
    device.flat.grads[...] = bad
    device.scaling.update(device.flat, lr=0.01, max_norm=1.0)
    host_seconds = time.perf_counter() - start
    still_busy = not cupy.cuda.get_current_stream().done
    cupy.cuda.Device().synchronize()
    assert still_busy, f"the update returned after the stream drained ({host_seconds:.3f} s)"
    assert (device.info.optimization_step, device.info.all_finite) == (1, False)


def test_argument_checks():
    layout = layout_for("AdamOptimizer")
    table = K.layout_table(layout, "adam")
    buffers = [cupy.zeros(layout.size, dtype=np.float32) for _ in range(4)]
    with pytest.raises(ValueError, match="adam_step: lr_table is indexed by the device update count: pass counters"):
        K.adam_step(table, *buffers, step=1, lr=0.1, lr_table=cupy.ones(4))
    with pytest.raises(ValueError, match=r"adam_step: counters must be None or a contiguous 1-d float64 cupy array "
                                         r"of at least 4 elements on cuda:0, got .*float32 \(4,\)"):
        K.adam_step(table, *buffers, step=1, lr=0.1, counters=cupy.zeros(4, dtype=np.float32))
    with pytest.raises(ValueError, match=r"clip_divisor: counters must be None or a contiguous 1-d float64 cupy "
                                         r"array of at least 4 elements on cuda:0, got .*float64 \(3,\)"):
        K.clip_divisor(buffers[1], 1.0, counters=cupy.zeros(3))
    counters = K.device_counters(4.0, 0)
    with pytest.raises(TypeError, match="loss_scaler_update: divisor must be the one-element cupy array clip_divisor "
                                        "returned, got 2.0"):
        K.loss_scaler_update(2.0, counters, cupy.zeros((), dtype=np.float32), up_scale_window=1, min_loss_scale=1.0,
                             max_loss_scale=8.0, automatic=True)
    with pytest.raises(TypeError, match="loss_scaler_update: counters must be the float64 cupy array device_counters "
                                        "returned, got builtins.NoneType"):
        K.loss_scaler_update(cupy.ones(1), None, cupy.zeros((), dtype=np.float32), up_scale_window=1,
                             min_loss_scale=1.0, max_loss_scale=8.0, automatic=True)
    np.testing.assert_array_equal(counters.get(), [0.0, 0.0, 1.0, 4.0])
