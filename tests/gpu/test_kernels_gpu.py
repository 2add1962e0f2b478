"""The CUDA kernels (ort_trainer._optimizers.cuda_steps) against the NumPy references of
ort_trainer._optimizers.reference.

The references run in float64 on copies of the same fp32 data; the kernels' fp32 results must
agree to a relative 1e-6 after one step and 1e-5 after 100 steps, elementwise. "Relative" is to
max(|want|, |old|, rms(want) / 10): an element that cancels to nearly 0 (g + lambda * w, an
average of random gradients) carries the rounding error of its operands, which is judged
against the array's typical magnitude instead. State is random (never zeros); buffers a kernel
must write are poisoned with NaN first.
"""
import math
import time
import zlib

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from ort_trainer._optimizers import cuda_steps as K  # noqa: E402
from ort_trainer._optimizers.algorithms import clip_divisor, make_optimizer, typed_hypers  # noqa: E402
from ort_trainer._optimizers.flat import FlatLayout  # noqa: E402
from ort_trainer._optimizers.reference import adam_reference, lamb_reference, sgd_reference  # noqa: E402

pytestmark = pytest.mark.gpu

RTOL_ONE_STEP = 1e-6
RTOL_MANY_STEPS = 1e-5

# Segment (tensor) sizes per group: single elements, odd sizes, sizes around the block (256
# threads, 1024 elements per float4 pass), around Lamb's chunk (16384), and millions.
LAYOUTS = {
    "one": [[1]],
    "small": [[1, 1, 2, 3], [255, 256, 257], [1023, 1024, 1025, 7], [5, 1]],
    "chunks": [[16383, 1, 16385], [16384, 32769, 2]],
    "many": "random",  # 150 tensors of random sizes in 4 groups (GPT-2-like counts)
    "large": [[2_000_003, 5], [1_048_579, 1, 64]],
}
STEADY_LAYOUTS = ["one", "small", "chunks", "many"]  # for the 100-step runs

HYPERS = {
    "sgd": [
        dict(momentum=0.9, nesterov=False, lambda_coef=0.0, dampening=0.0),
        dict(momentum=0.0, nesterov=False, lambda_coef=0.01, dampening=0.0),
        dict(momentum=0.8, nesterov=True, lambda_coef=0.05, dampening=0.0),
        dict(momentum=0.7, nesterov=False, lambda_coef=0.0, dampening=0.25),
    ],
    "adam": [
        dict(alpha=0.9, beta=0.999, lambda_coef=0.0, epsilon=1e-8, do_bias_correction=True,
             weight_decay_mode=0),
        dict(alpha=0.8, beta=0.99, lambda_coef=0.01, epsilon=1e-6, do_bias_correction=True,
             weight_decay_mode=1),
        dict(alpha=0.85, beta=0.995, lambda_coef=0.1, epsilon=1e-7, do_bias_correction=False,
             weight_decay_mode=0),
        dict(alpha=0.95, beta=0.9999, lambda_coef=0.02, epsilon=1e-8, do_bias_correction=False,
             weight_decay_mode=1),
    ],
    "lamb": [
        dict(alpha=0.9, beta=0.999, lambda_coef=0.0, epsilon=1e-6, ratio_min=-math.inf,
             ratio_max=math.inf, do_bias_correction=False),
        dict(alpha=0.8, beta=0.99, lambda_coef=0.01, epsilon=1e-6, ratio_min=0.05,
             ratio_max=0.5, do_bias_correction=True),
        dict(alpha=0.85, beta=0.995, lambda_coef=0.1, epsilon=1e-7, ratio_min=1.5,
             ratio_max=10.0, do_bias_correction=False),
        dict(alpha=0.9, beta=0.999, lambda_coef=0.02, epsilon=1e-6, ratio_min=2.0,
             ratio_max=1.0, do_bias_correction=True),  # crossed bounds: ratio_min wins
    ],
}
STATE_NAMES = {"sgd": ("momentum",), "adam": ("exp_avg", "exp_avg_sq"),
               "lamb": ("exp_avg", "exp_avg_sq")}
CONFIG_NAMES = {"sgd": "SGDOptimizer", "adam": "AdamOptimizer", "lamb": "LambOptimizer"}
FAMILIES = ["sgd", "adam", "lamb"]


def seeded(*key):
    """A generator seeded from the test's parameters (stable across processes)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def make_layout(name, family, seed=0):
    sizes = LAYOUTS[name]
    if sizes == "random":
        rng = np.random.default_rng(seed)
        flat = rng.integers(1, 5000, size=150).tolist()
        sizes = [flat[:40], flat[40:41], flat[41:149], flat[149:]]
    hypers = [HYPERS[family][k % len(HYPERS[family])] for k in range(len(sizes))]
    return FlatLayout.from_sizes(sizes, typed_hypers(CONFIG_NAMES[family], hypers))


def random_problem(layout, family, rng):
    """Host fp32 params, grads and state: random, no zeros; second moments positive."""
    n = layout.size
    w = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    state = {name: rng.standard_normal(n).astype(np.float32) for name in STATE_NAMES[family]}
    if "exp_avg_sq" in state:
        state["exp_avg_sq"] = (rng.random(n) * 2 + 0.01).astype(np.float32)
    return w, g, state


def reference_step(family, layout, w, g, state, step, lr, divisor):
    """In place, float64, group by group: the oracle."""
    for group in layout.groups:
        s = slice(group.start, group.stop)
        if family == "sgd":
            sgd_reference(w[s], g[s], state["momentum"][s], step=step, lr=lr, hyper=group.hyper,
                          grad_divisor=divisor)
        elif family == "adam":
            adam_reference(w[s], g[s], state["exp_avg"][s], state["exp_avg_sq"][s], step=step, lr=lr,
                           hyper=group.hyper, grad_divisor=divisor)
        else:
            lamb_reference(w[s], g[s], state["exp_avg"][s], state["exp_avg_sq"][s], step=step, lr=lr,
                           hyper=group.hyper, grad_divisor=divisor, seg_offsets=layout.local_offsets(group))


def device_step(family, table, w, g, state, step, lr, divisor):
    if family == "sgd":
        K.sgd_step(table, w, g, state["momentum"], lr=lr, grad_divisor=divisor,
                   first_step=step == 1)
    elif family == "adam":
        K.adam_step(table, w, g, state["exp_avg"], state["exp_avg_sq"], step=step, lr=lr,
                    grad_divisor=divisor)
    else:
        K.lamb_step(table, w, g, state["exp_avg"], state["exp_avg_sq"], step=step, lr=lr,
                    grad_divisor=divisor)


def poison_scratch(table):
    """NaN in every buffer a Lamb step must write before it reads it."""
    if table.family == "lamb":
        table.direction = cupy.full(table.size, np.nan, dtype=np.float32)
        table.partials.fill(np.nan)
        table.lr_ratio.fill(np.nan)


def assert_close(what, got, want, old, rtol):
    got = cupy.asnumpy(got).astype(np.float64)
    want = np.asarray(want, dtype=np.float64)
    old = np.asarray(old, dtype=np.float64)
    old = np.where(np.isfinite(old), old, 0.0)  # poisoned or non-finite before: no scale
    assert got.shape == want.shape
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    finite = want[np.isfinite(want)]
    floor = 0.1 * float(np.sqrt(np.mean(finite ** 2))) if finite.size else 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        scale = np.maximum(np.maximum(np.abs(want), np.abs(old)), max(floor, 1e-30))
        err = np.where(same, 0.0, np.abs(got - want) / scale)
    err = np.where(np.isnan(err), np.inf, err)
    worst = int(np.argmax(err))
    assert err[worst] <= rtol, (
        f"{what}: relative error {err[worst]:.3g} > {rtol:g} at element {worst} of {got.size}: "
        f"got {got[worst]!r}, want {want[worst]!r}, before the step {old[worst]!r} (as scale); "
        f"{int(np.sum(err > rtol))} elements off")


def to_device(host):
    return cupy.asarray(host)


# ----------------------------------------------------------------------------------------------
# One step, every family, every layout, every kind of divisor
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("divisor_kind", ["one", "number", "device", "device_f32"])
def test_one_step_matches_reference(family, layout_name, divisor_kind):
    rng = seeded(family, layout_name, divisor_kind)
    layout = make_layout(layout_name, family)
    w, g, state = random_problem(layout, family, rng)
    if family == "sgd":  # the first step (buffer = g) and a later one (buffer updated)
        step, lr = (1 if divisor_kind in ("one", "device") else 2), 0.05
        if step == 1:  # the momentum buffer must not be read
            state["momentum"][:] = np.nan
    else:
        step, lr = 5, 0.01
    W, G = to_device(w), to_device(g)
    S = {name: to_device(a) for name, a in state.items()}
    table = K.layout_table(layout, family)
    poison_scratch(table)
    if divisor_kind == "one":
        divisor, host_divisor = 1.0, 1.0
    elif divisor_kind == "number":
        divisor, host_divisor = 3.0, 3.0
    elif divisor_kind == "device":
        divisor, _ = K.clip_divisor(G, max_norm=0.5 * float(np.linalg.norm(g)) + 1e-3)
        host_divisor = float(divisor)
        assert host_divisor > 1.0
    else:
        divisor, host_divisor = cupy.asarray(np.float32(2.5)), 2.5

    device_step(family, table, W, G, S, step, lr, divisor)

    w64, g64 = w.astype(np.float64), g.astype(np.float64)
    s64 = {name: a.astype(np.float64) for name, a in state.items()}
    reference_step(family, layout, w64, g64, s64, step, lr, host_divisor)
    assert_close(f"{family}/{layout_name} params", W, w64, w, RTOL_ONE_STEP)
    for name in STATE_NAMES[family]:
        assert_close(f"{family}/{layout_name} {name}", S[name], s64[name], state[name],
                     RTOL_ONE_STEP)
    np.testing.assert_array_equal(cupy.asnumpy(G), g, err_msg="grads must not be modified")


@pytest.mark.parametrize("layout_name", STEADY_LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_hundred_steps_match_reference(family, layout_name):
    rng = seeded(family, layout_name, 100)
    layout = make_layout(layout_name, family, seed=1)
    w, g, state = random_problem(layout, family, rng)
    w64 = w.astype(np.float64)
    s64 = {name: a.astype(np.float64) for name, a in state.items()}
    W = to_device(w)
    S = {name: to_device(a) for name, a in state.items()}
    table = K.layout_table(layout, family)
    poison_scratch(table)
    lr = {"sgd": 0.01, "adam": 1e-3, "lamb": 1e-3}[family]
    G = cupy.empty(layout.size, dtype=np.float32)
    for step in range(1, 101):
        g = rng.standard_normal(layout.size).astype(np.float32)
        G.set(g)
        divisor = 1.0 + (step % 3)  # vary the divisor too
        device_step(family, table, W, G, S, step, lr, divisor)
        reference_step(family, layout, w64, g.astype(np.float64), s64, step, lr, divisor)
    assert_close(f"{family}/{layout_name} params after 100 steps", W, w64, w, RTOL_MANY_STEPS)
    for name in STATE_NAMES[family]:
        assert_close(f"{family}/{layout_name} {name} after 100 steps", S[name], s64[name],
                     state[name], RTOL_MANY_STEPS)


@pytest.mark.parametrize("family", FAMILIES)
def test_misaligned_buffers_take_the_scalar_path(family):
    """Views that start 4 bytes into an allocation cannot use float4: same results."""
    rng = np.random.default_rng(7)
    layout = make_layout("small", family)
    w, g, state = random_problem(layout, family, rng)
    n = layout.size

    def misaligned(host):
        base = cupy.full(n + 1, np.nan, dtype=np.float32)
        base[1:] = cupy.asarray(host)
        return base[1:]

    W, G = misaligned(w), misaligned(g)
    S = {name: misaligned(a) for name, a in state.items()}
    table = K.layout_table(layout, family)
    poison_scratch(table)
    device_step(family, table, W, G, S, 3, 0.01, 2.0)
    w64 = w.astype(np.float64)
    s64 = {name: a.astype(np.float64) for name, a in state.items()}
    reference_step(family, layout, w64, g.astype(np.float64), s64, 3, 0.01, 2.0)
    assert_close(f"{family} misaligned params", W, w64, w, RTOL_ONE_STEP)
    for name in STATE_NAMES[family]:
        assert_close(f"{family} misaligned {name}", S[name], s64[name], state[name],
                     RTOL_ONE_STEP)


@pytest.mark.parametrize("family", FAMILIES)
def test_flat_optimizer_on_cupy_matches_numpy(family):
    """The steps as FlatOptimizer.step calls them (device='cuda') against the CPU ones."""
    rng = np.random.default_rng(11)
    layout = make_layout("small", family)
    w, _, _ = random_problem(layout, family, rng)
    cpu = make_optimizer(CONFIG_NAMES[family], layout, device="cpu")
    gpu = make_optimizer(CONFIG_NAMES[family], layout, device="cuda")
    w_cpu, w_gpu = w.copy(), to_device(w)
    for step in range(3):
        g = rng.standard_normal(layout.size).astype(np.float32)
        cpu.step(w_cpu, g, 0.01, 2.0)
        gpu.step(w_gpu, to_device(g), 0.01, 2.0)
    assert gpu.step_count == 3
    np.testing.assert_allclose(cupy.asnumpy(w_gpu), w_cpu, rtol=1e-5, atol=1e-6)
    for name in STATE_NAMES[family]:
        np.testing.assert_allclose(cupy.asnumpy(gpu.state[name]), cpu.state[name], rtol=1e-5,
                                   atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Lamb's special rules
# ----------------------------------------------------------------------------------------------


def test_lamb_nonfinite_direction_and_zero_norms():
    """Non-finite d: d = 0 and the moments keep their values; a tensor of zero weights or zero
    direction gets ratio 1; non-finite new weights are not stored."""
    layout = FlatLayout.from_sizes([[5, 300, 17], [1030, 3]],
                                   typed_hypers("LambOptimizer", [HYPERS["lamb"][0], HYPERS["lamb"][1]]))
    rng = np.random.default_rng(3)
    w, g, state = random_problem(layout, "lamb", rng)
    g[2] = np.inf  # tensor 0
    g[7] = np.nan  # tensor 1
    g[400:410] = -np.inf  # tensor 3 (group 1)
    w[5 + 300: 5 + 300 + 17] = 0.0  # tensor 2: ||w|| = 0 -> ratio 1
    W, G = to_device(w), to_device(g)
    S = {name: to_device(a) for name, a in state.items()}
    table = K.layout_table(layout, "lamb")
    poison_scratch(table)
    K.lamb_step(table, W, G, S["exp_avg"], S["exp_avg_sq"], step=2, lr=0.01)
    w64 = w.astype(np.float64)
    s64 = {name: a.astype(np.float64) for name, a in state.items()}
    reference_step("lamb", layout, w64, g.astype(np.float64), s64, 2, 0.01, 1.0)
    assert_close("lamb params", W, w64, w, RTOL_ONE_STEP)
    for name in STATE_NAMES["lamb"]:
        assert_close(f"lamb {name}", S[name], s64[name], state[name], RTOL_ONE_STEP)
    assert cupy.asnumpy(S["exp_avg"])[2] == state["exp_avg"][2]  # kept
    assert np.all(np.isfinite(cupy.asnumpy(W)))


def test_lamb_is_deterministic():
    layout = make_layout("chunks", "lamb")
    rng = np.random.default_rng(5)
    w, g, state = random_problem(layout, "lamb", rng)
    results = []
    for _ in range(2):
        W, G = to_device(w), to_device(g)
        S = {name: to_device(a) for name, a in state.items()}
        table = K.layout_table(layout, "lamb")
        K.lamb_step(table, W, G, S["exp_avg"], S["exp_avg_sq"], step=1, lr=0.01)
        results.append(cupy.asnumpy(W))
    np.testing.assert_array_equal(results[0], results[1])


# ----------------------------------------------------------------------------------------------
# Clip divisor, sum of squares
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 3, 255, 1024, 1025, 16385, 3_000_017])
@pytest.mark.parametrize("max_norm_factor,loss_scale", [(0.25, 1.0), (4.0, 1.0), (0.5, 8.0),
                                                        (1e-3, 1024.0)])
def test_clip_divisor_matches_reference(n, max_norm_factor, loss_scale):
    rng = np.random.default_rng(n)
    g = (rng.standard_normal(n) * 3).astype(np.float32)
    exact_norm = float(np.sqrt(np.sum(g.astype(np.float64) ** 2)))
    max_norm = max_norm_factor * exact_norm + 0.1
    out = cupy.full(3, np.nan, dtype=np.float64)
    S, N = K.clip_divisor(to_device(g), max_norm, loss_scale, out=out)
    want_S, want_N = clip_divisor(g.astype(np.float64), max_norm, loss_scale)
    assert S.shape == () and N.shape == () and S.dtype == np.float64
    assert float(N) == pytest.approx(want_N, rel=1e-12, abs=0.0)
    assert float(S) == pytest.approx(want_S, rel=1e-12, abs=0.0)
    assert float(out[0]) == pytest.approx(exact_norm ** 2, rel=1e-12, abs=0.0)
    sumsq = K.sum_of_squares(to_device(g))
    assert sumsq.shape == () and float(sumsq) == pytest.approx(exact_norm ** 2, rel=1e-12)


def test_clip_divisor_picks_the_implementation_by_device():
    g = np.random.default_rng(2).standard_normal(10_001).astype(np.float32)
    S, N = clip_divisor(to_device(g), 1.0, 2.0, device="cuda")
    assert isinstance(S, cupy.ndarray) and S.shape == () and N.shape == ()
    want_S, want_N = clip_divisor(g, 1.0, 2.0, device="cpu")
    assert float(S) == pytest.approx(want_S, rel=1e-6) and float(N) == pytest.approx(want_N, rel=1e-6)


def test_clip_divisor_is_deterministic_and_flags_nonfinite():
    rng = np.random.default_rng(1)
    g = rng.standard_normal(1_000_003).astype(np.float32)
    G = to_device(g)
    first = float(K.clip_divisor(G, 1.0)[1])
    assert all(float(K.clip_divisor(G, 1.0)[1]) == first for _ in range(3))
    for bad, want_S, want_N in ((np.inf, np.inf, np.inf), (np.nan, 1.0, np.nan)):
        h = g.copy()
        h[123_457] = bad
        S, N = K.clip_divisor(to_device(h), 1.0)
        ref_S, ref_N = clip_divisor(h.astype(np.float64), 1.0)
        np.testing.assert_equal([float(S), float(N)], [ref_S, ref_N])
        np.testing.assert_equal([float(S), float(N)], [want_S, want_N])
    # A finite fp32 gradient whose square overflows fp32 is still finite: sums are in double.
    h = g.copy()
    h[5] = 3e38
    assert math.isfinite(float(K.clip_divisor(to_device(h), 1.0)[1]))


# ----------------------------------------------------------------------------------------------
# No host sync, argument checks
# ----------------------------------------------------------------------------------------------

_SPIN = r'''
extern "C" __global__ void ort_test_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) { }
}
'''


@pytest.mark.parametrize("family", FAMILIES)
def test_step_needs_no_host_sync(family):
    """Queued behind a ~0.5 s spin kernel on a side stream, clip + step return while the stream
    is still busy (a host sync would have waited), and the results are right after the sync."""
    layout = make_layout("chunks", family)
    rng = np.random.default_rng(13)
    w, g, state = random_problem(layout, family, rng)
    W, G = to_device(w), to_device(g)
    S = {name: to_device(a) for name, a in state.items()}
    table = K.layout_table(layout, family)
    out = cupy.empty(3, dtype=np.float64)
    spin = cupy.RawKernel(_SPIN, "ort_test_spin")
    clock_khz = cupy.cuda.Device().attributes.get("ClockRate", 2_000_000)  # kHz
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # warm-up on copies: compiles, fills this stream's memory pool arena
        scratch_W = W.copy()
        scratch_S = {name: a.copy() for name, a in S.items()}
        divisor, _ = K.clip_divisor(G, 1.0, out=out)
        device_step(family, table, scratch_W, G, scratch_S, 2, 0.01, divisor)
        spin((1,), (1,), (np.int64(1000),))
    stream.synchronize()

    with stream:
        spin((1,), (1,), (np.int64(clock_khz * 1000 // 2),))
        start = time.perf_counter()
        divisor, _ = K.clip_divisor(G, 1.0, out=out)
        device_step(family, table, W, G, S, 2, 0.01, divisor)
        host_seconds = time.perf_counter() - start
        still_busy = not stream.done
    stream.synchronize()
    assert still_busy, f"the calls returned after the stream drained ({host_seconds:.3f} s)"

    host_divisor = float(divisor)
    w64 = w.astype(np.float64)
    s64 = {name: a.astype(np.float64) for name, a in state.items()}
    reference_step(family, layout, w64, g.astype(np.float64), s64, 2, 0.01, host_divisor)
    assert_close(f"{family} params (stream)", W, w64, w, RTOL_ONE_STEP)


def test_argument_checks():
    layout = make_layout("small", "adam")
    table = K.layout_table(layout, "adam")
    n = layout.size
    good = [cupy.ones(n, dtype=np.float32) for _ in range(4)]

    def call(*arrays, **kwargs):
        K.adam_step(table, *arrays, **{"step": 1, "lr": 0.1, **kwargs})

    with pytest.raises(TypeError, match="float32"):
        call(good[0].astype(np.float64), *good[1:])
    with pytest.raises(ValueError, match=f"must have {n} elements"):
        call(cupy.ones(n + 1, dtype=np.float32), *good[1:])
    with pytest.raises(ValueError, match="C-contiguous"):
        call(cupy.ones(2 * n, dtype=np.float32)[::2], *good[1:])
    with pytest.raises(TypeError, match="cupy.ndarray"):
        call(np.ones(n, dtype=np.float32), *good[1:])
    with pytest.raises(ValueError, match="step must be >= 1"):
        call(*good, step=0)
    with pytest.raises(ValueError, match="grad_divisor must be finite and > 0"):
        call(*good, grad_divisor=0.0)
    with pytest.raises(TypeError, match="layout_table"):
        K.sgd_step(table, good[0], good[1], good[2], lr=0.1, first_step=True)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        K.clip_divisor(good[0], 0.0)
