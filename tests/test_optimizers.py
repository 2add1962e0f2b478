"""Flat-buffer optimizers: fast CPU path vs references, references vs torch.optim and independent
float64 transcriptions, gradient clipping, state dicts and error messages."""
import dataclasses
import re
import types

import numpy as np
import pytest
import torch

from ort_trainer._optimizers import algorithms as opt
from ort_trainer._optimizers import cpu as _optim_cpu
from ort_trainer._optimizers import reference as _optim_reference
from ort_trainer._optimizers.flat import FlatLayout, GroupSlice
from ort_trainer._optimizers.hyper import AdamHyper, LambHyper, SGDHyper

SGD_HYPER = SGDHyper(momentum=0.9, nesterov=False, lambda_coef=0.0, dampening=0.0)
ADAM_HYPER = AdamHyper(alpha=0.9, beta=0.999, lambda_coef=0.0, epsilon=1e-8, do_bias_correction=True,
                       weight_decay_mode=0)
LAMB_HYPER = LambHyper(alpha=0.9, beta=0.999, lambda_coef=0.0, epsilon=1e-6, ratio_min=-np.inf,
                       ratio_max=np.inf, do_bias_correction=False)
replace = dataclasses.replace

# Per-group hyperparameters that reach every code path of each fast optimizer.
GROUP_HYPERS = {
    "SGDOptimizer": [
        replace(SGD_HYPER, nesterov=True, lambda_coef=0.01),
        replace(SGD_HYPER, momentum=0.0),
        replace(SGD_HYPER, momentum=0.5, dampening=0.1, lambda_coef=0.1),
    ],
    "AdamOptimizer": [
        ADAM_HYPER,  # fused Adam
        replace(ADAM_HYPER, alpha=0.8, beta=0.99, lambda_coef=0.01),  # fused AdamW
        replace(ADAM_HYPER, lambda_coef=0.01, epsilon=1e-6, weight_decay_mode=1),
        replace(ADAM_HYPER, alpha=0.85, lambda_coef=0.1, do_bias_correction=False),
        replace(ADAM_HYPER, beta=0.995, lambda_coef=0.05, do_bias_correction=False,
             weight_decay_mode=1),
    ],
    "LambOptimizer": [
        LAMB_HYPER,
        replace(LAMB_HYPER, alpha=0.8, beta=0.99, lambda_coef=0.01, ratio_min=0.5, ratio_max=2.0,
             do_bias_correction=True),
        replace(LAMB_HYPER, lambda_coef=0.1, epsilon=1e-5, ratio_min=0.0, ratio_max=10.0),
        replace(LAMB_HYPER, beta=0.98, lambda_coef=0.02, do_bias_correction=True),
        replace(LAMB_HYPER, ratio_min=0.9, ratio_max=0.95),
    ],
}
# Segment sizes per group: 1, odd, 1025, one tensor bigger than a CPU block, tensors straddling
# block boundaries, small ones after big ones. The fast path works in blocks of _optim_cpu._BLOCK
# elements (2**18); most tests shrink it to SMALL_BLOCK to cross block boundaries cheaply.
SMALL_BLOCK = 1024
GROUP_SIZES = [[1, 7, 1025, 31], [3001], [3, 1021, 5, 1027], [2, 1], [513, 64, 9]]
BIG_GROUP_SIZES = [[1, 7, 1025, 31], [300_001], [3, 262_143, 5, 262_145], [2, 1], [513, 64, 9]]
REFERENCES = {"SGDOptimizer": _optim_reference.sgd_reference,
              "AdamOptimizer": _optim_reference.adam_reference,
              "LambOptimizer": _optim_reference.lamb_reference}
LEARNING_RATES = {"SGDOptimizer": 1e-2, "AdamOptimizer": 1e-3, "LambOptimizer": 1e-3}


def rel_err(actual, expected):
    """max |actual - expected| / max |expected|."""
    expected = np.asarray(expected, dtype=np.float64)
    difference = np.abs(np.asarray(actual, np.float64) - expected)
    return float(np.max(difference) / np.max(np.abs(expected)))


def make_layout(name, sizes=GROUP_SIZES):
    hypers = GROUP_HYPERS[name]
    return FlatLayout.from_sizes(sizes, [hypers[i % len(hypers)] for i in range(len(sizes))])


def reference_step(name, layout, params, grads, state, step, lr, grad_divisor):
    """The reference of ``name`` applied group by group to flat arrays."""
    for group in layout.groups:
        part = slice(group.start, group.stop)
        arrays = (params[part], grads[part], *(array[part] for array in state))
        if name == "LambOptimizer":
            _optim_reference.lamb_reference(*arrays, step=step, lr=lr, hyper=group.hyper, grad_divisor=grad_divisor,
                                            seg_offsets=layout.local_offsets(group))
        else:
            REFERENCES[name](*arrays, step=step, lr=lr, hyper=group.hyper, grad_divisor=grad_divisor)


def poison_scratch(optimizer):
    """NaN into every scratch buffer, so that a step that relies on stale scratch fails."""
    for buffer in optimizer._table.block_buffers:
        buffer.fill_(float("nan"))
    if isinstance(optimizer, opt.Lamb):
        optimizer._table.direction.fill_(float("nan"))


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(_optim_cpu, "_BLOCK", SMALL_BLOCK)


# ----------------------------------------------------------------------------------------------
# (1) fast path == reference
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(GROUP_HYPERS))
def test_fast_path_matches_reference(name, small_blocks):
    check_fast_path_against_reference(name, GROUP_SIZES, steps=100)


@pytest.mark.parametrize("name", sorted(GROUP_HYPERS))
def test_fast_path_matches_reference_with_real_blocks(name):
    check_fast_path_against_reference(name, BIG_GROUP_SIZES, steps=3)


def check_fast_path_against_reference(name, sizes, steps):
    """fp32 fast path vs the float64 reference: relative 1e-6 after 1 step, 1e-5 at the end."""
    rng = np.random.default_rng(0)
    layout = make_layout(name, sizes)
    optimizer = opt.make_optimizer(name, layout)
    params = rng.standard_normal(layout.size).astype(np.float32)
    expected_params = params.astype(np.float64)
    expected_state = [np.zeros(layout.size) for _ in optimizer.state_names]
    lr = LEARNING_RATES[name]
    for step in range(1, steps + 1):
        grads = (rng.standard_normal(layout.size) * rng.uniform(0.1, 3.0)).astype(np.float32)
        grad_divisor = 1.0 if step % 3 else 2.5
        grads_before = grads.copy()
        poison_scratch(optimizer)
        optimizer.step(params, grads, lr, grad_divisor)
        reference_step(name, layout, expected_params, grads.astype(np.float64), expected_state,
                       step, lr, grad_divisor)
        np.testing.assert_array_equal(grads, grads_before)
        if step in (1, steps):
            tolerance = 1e-6 if step == 1 else 1e-5
            assert rel_err(params, expected_params) <= tolerance, step
            for state_name, expected in zip(optimizer.state_names, expected_state):
                assert rel_err(optimizer.state[state_name], expected) <= tolerance, (step,
                                                                                     state_name)
    assert optimizer.step_count == steps


def test_lamb_non_finite_follows_reference(small_blocks):
    """inf/nan gradients: d = 0 and the moments kept there; a weight whose update overflows keeps
    its value. Everything else as the reference (fp32 here: overflow depends on the dtype)."""
    rng = np.random.default_rng(1)
    layout = make_layout("LambOptimizer", [[5, 3001], [1025, 3]])
    optimizer = opt.make_optimizer("LambOptimizer", layout)
    params = rng.standard_normal(layout.size).astype(np.float32)
    expected_params = params.copy()
    expected_state = [np.zeros(layout.size, np.float32) for _ in range(2)]
    poisoned = [0, 7, 2900, layout.size - 2]
    for step, lr in enumerate([1e-3, 1e-3, 1e-3, 1e39, 1e-3], start=1):
        grads = rng.standard_normal(layout.size).astype(np.float32)
        if step in (2, 3):
            grads[poisoned] = [np.inf, np.nan, -np.inf, np.nan]
        params_before = params.copy()
        state_before = [array.copy() for array in optimizer.state.values()]
        poison_scratch(optimizer)
        optimizer.step(params, grads, lr, 1.5)
        reference_step("LambOptimizer", layout, expected_params, grads, expected_state, step, lr,
                       1.5)
        assert np.all(np.isfinite(params))
        assert rel_err(params, expected_params) <= 1e-6, step
        for actual, expected, before in zip(optimizer.state.values(), expected_state,
                                            state_before):
            assert rel_err(actual, expected) <= 1e-6, step
            if step in (2, 3):
                np.testing.assert_array_equal(actual[poisoned], before[poisoned])
        if step in (2, 3):
            np.testing.assert_array_equal(params[poisoned], params_before[poisoned])
        if step == 4:  # lr 1e39: every update overflows fp32
            np.testing.assert_array_equal(params, params_before)


# ----------------------------------------------------------------------------------------------
# (2) references vs torch.optim and independent float64 transcriptions
# ----------------------------------------------------------------------------------------------

def run_reference(name, hyper, sizes, grads_per_step, lr, params):
    """20 steps of a reference on fp32 arrays; returns the final params."""
    layout = FlatLayout.from_sizes([sizes], [hyper])
    params = params.copy()
    state = [np.zeros(layout.size, np.float32) for _ in opt.state_names(name)]
    for step, grads in enumerate(grads_per_step, start=1):
        reference_step(name, layout, params, grads, state, step, lr, 1.0)
    return params


def run_torch(optimizer_class, sizes, grads_per_step, params, **kwargs):
    """The same steps with a torch.optim optimizer over one tensor per segment."""
    tensors = [torch.nn.Parameter(t.clone()) for t in torch.from_numpy(params).split(sizes)]
    optimizer = optimizer_class(tensors, **kwargs)
    for grads in grads_per_step:
        for tensor, grad in zip(tensors, torch.from_numpy(grads).split(sizes)):
            tensor.grad = grad.clone()
        optimizer.step()
    return torch.cat([t.detach() for t in tensors]).numpy()


def random_problem(sizes, steps=20, seed=2):
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    params = rng.standard_normal(n).astype(np.float32)
    return params, [rng.standard_normal(n).astype(np.float32) for _ in range(steps)]


SIZES = [1, 7, 1025, 4000]


@pytest.mark.parametrize("hyper", [
    replace(SGD_HYPER, momentum=0.0),
    replace(SGD_HYPER, lambda_coef=0.01),
    replace(SGD_HYPER, nesterov=True, lambda_coef=0.1),
    replace(SGD_HYPER, momentum=0.5, dampening=0.3),
])
def test_sgd_reference_matches_torch(hyper):
    params, grads = random_problem(SIZES)
    expected = run_torch(torch.optim.SGD, SIZES, grads, params, lr=0.05,
                         momentum=hyper.momentum, dampening=hyper.dampening,
                         nesterov=hyper.nesterov, weight_decay=hyper.lambda_coef)
    actual = run_reference("SGDOptimizer", hyper, SIZES, grads, 0.05, params)
    assert rel_err(actual, expected) <= 1e-5


@pytest.mark.parametrize("alpha,beta,eps", [(0.9, 0.999, 1e-8), (0.8, 0.99, 1e-3)])
def test_adam_reference_without_decay_matches_torch_adam(alpha, beta, eps):
    params, grads = random_problem(SIZES)
    expected = run_torch(torch.optim.Adam, SIZES, grads, params, lr=1e-2, betas=(alpha, beta),
                         eps=eps)
    hyper = replace(ADAM_HYPER, alpha=alpha, beta=beta, epsilon=eps)
    assert rel_err(run_reference("AdamOptimizer", hyper, SIZES, grads, 1e-2, params),
                   expected) <= 1e-5


@pytest.mark.parametrize("decay", [0.01, 0.5])
def test_adam_reference_mode_0_matches_torch_adamw(decay):
    params, grads = random_problem(SIZES)
    expected = run_torch(torch.optim.AdamW, SIZES, grads, params, lr=1e-2, betas=(0.9, 0.999),
                         eps=1e-8, weight_decay=decay)
    hyper = replace(ADAM_HYPER, lambda_coef=decay)
    assert rel_err(run_reference("AdamOptimizer", hyper, SIZES, grads, 1e-2, params),
                   expected) <= 1e-5


def adam_float64(params, grads_per_step, lr, hyper):
    """The original Adam, transcribed element by element from the legacy spec, in float64."""
    w = params.astype(np.float64)
    m, v = np.zeros_like(w), np.zeros_like(w)
    a, b, lam, eps = hyper.alpha, hyper.beta, hyper.lambda_coef, hyper.epsilon
    for t, grads in enumerate(grads_per_step, start=1):
        g = grads.astype(np.float64)
        m = a * m + (1 - a) * g
        v = b * v + (1 - b) * g**2
        c1, c2 = (1 - a**t, 1 - b**t) if hyper.do_bias_correction else (1, 1)
        if hyper.weight_decay_mode == 0:
            w = w - lr * ((m / c1) / (np.sqrt(v / c2) + eps) + lam * w)
        else:
            s = lr * np.sqrt(c2) / c1
            w_prime = w - s * m / (np.sqrt(v) + eps)
            w = w_prime - lr * lam * w_prime
    return w


@pytest.mark.parametrize("hyper", [
    replace(ADAM_HYPER, lambda_coef=0.1, weight_decay_mode=1),
    replace(ADAM_HYPER, lambda_coef=0.1, weight_decay_mode=1, do_bias_correction=False),
    replace(ADAM_HYPER, lambda_coef=0.1, epsilon=1e-3, do_bias_correction=False),
])
def test_adam_reference_matches_float64_transcription(hyper):
    params, grads = random_problem(SIZES)
    expected = adam_float64(params, grads, 1e-2, hyper)
    assert rel_err(run_reference("AdamOptimizer", hyper, SIZES, grads, 1e-2, params),
                   expected) <= 1e-5


def lamb_float64(params, grads_per_step, lr, hyper, sizes):
    """The original Lamb, tensor by tensor (finite inputs), in float64."""
    a, b, lam, eps = hyper.alpha, hyper.beta, hyper.lambda_coef, hyper.epsilon
    tensors = [[w.astype(np.float64), 0.0, 0.0] for w in np.split(params, np.cumsum(sizes)[:-1])]
    for t, grads in enumerate(grads_per_step, start=1):
        for entry, g in zip(tensors, np.split(grads.astype(np.float64), np.cumsum(sizes)[:-1])):
            w, m, v = entry
            m = a * m + (1 - a) * g
            v = b * v + (1 - b) * g * g
            c1, c2 = (1 - a**t, 1 - b**t) if hyper.do_bias_correction else (1, 1)
            d = lam * w + (m / c1) / (np.sqrt(v / c2) + eps)
            w_norm, d_norm = np.linalg.norm(w), np.linalg.norm(d)
            ratio = 1.0
            if w_norm != 0 and d_norm != 0:
                ratio = max(hyper.ratio_min, min(hyper.ratio_max, w_norm / d_norm))
            entry[:] = w - lr * ratio * d, m, v
    return np.concatenate([entry[0] for entry in tensors])


@pytest.mark.parametrize("hyper", [
    LAMB_HYPER,
    replace(LAMB_HYPER, lambda_coef=0.01, do_bias_correction=True),
    replace(LAMB_HYPER, lambda_coef=0.1, ratio_min=0.5, ratio_max=0.8),
])
def test_lamb_reference_matches_float64_transcription(hyper):
    params, grads = random_problem(SIZES)
    expected = lamb_float64(params, grads, 1e-2, hyper, SIZES)
    assert rel_err(run_reference("LambOptimizer", hyper, SIZES, grads, 1e-2, params),
                   expected) <= 1e-5


def test_lamb_reference_uses_ratio_1_for_a_zero_norm():
    params = np.array([0.0, 0.0, 1.0, -2.0], np.float32)  # tensor 0 has ||w|| = 0
    grads = np.array([1.0, -1.0, 3.0, 4.0], np.float32)
    hyper = replace(LAMB_HYPER, ratio_min=5.0, ratio_max=6.0)  # would clamp any real ratio
    expected = lamb_float64(params, [grads], 0.1, hyper, [2, 2])
    actual = run_reference("LambOptimizer", hyper, [2, 2], [grads], 0.1, params)
    assert rel_err(actual, expected) <= 1e-6
    direction = 0.1 * grads[:2] / (np.sqrt(0.001) * np.abs(grads[:2]) + 1e-6)  # after 1 step
    np.testing.assert_allclose(actual[:2], -0.1 * direction, rtol=1e-5)  # ratio 1


# ----------------------------------------------------------------------------------------------
# (3) gradient norm and clipping
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("values", ["random", "constant"])
def test_global_grad_norm_is_accurate(values):
    rng = np.random.default_rng(3)
    n = 3_000_001
    grads = (rng.standard_normal(n) if values == "random" else np.full(n, 0.1)).astype(np.float32)
    exact = np.sqrt(np.sum(grads.astype(np.float64) ** 2))
    assert abs(_optim_cpu.global_grad_norm(grads) - exact) / exact <= 1e-6


@pytest.mark.parametrize("max_norm,loss_scale,grad_scale", [
    (1.0, 1.0, 1.0),  # clipped
    (1e4, 1.0, 1.0),  # not clipped: S = 1
    (2.0, 8.0, 8.0),  # loss-scaled grads, clipped after unscaling
    (1e4, 8.0, 8.0),  # loss-scaled grads, only unscaled
])
def test_clip_divisor_matches_torch_clip_grad_norm(max_norm, loss_scale, grad_scale):
    """torch scales by max_norm / (N + 1e-6): equal to ours within 1e-6 / N relative."""
    rng = np.random.default_rng(4)
    sizes = [1, 7, 1025, 30_000]
    flat = (rng.standard_normal(sum(sizes)) * grad_scale).astype(np.float32)
    divisor, norm = opt.clip_divisor(flat, max_norm, loss_scale)
    assert isinstance(divisor, float) and isinstance(norm, float)

    tensors = [torch.nn.Parameter(torch.zeros(size)) for size in sizes]
    for tensor, grad in zip(tensors, torch.from_numpy(flat / np.float32(loss_scale)).split(sizes)):
        tensor.grad = grad.clone()
    torch_norm = float(torch.nn.utils.clip_grad_norm_(tensors, max_norm))
    clipped = torch.cat([t.grad for t in tensors]).numpy()

    assert norm / loss_scale == pytest.approx(torch_norm, rel=1e-5)
    assert rel_err(flat / np.float32(divisor), clipped) <= 1e-5
    clips = norm > loss_scale * max_norm
    assert divisor == (norm / max_norm if clips else loss_scale)


def test_clip_divisor_rejects_non_positive_max_norm():
    with pytest.raises(ValueError, match=re.escape("clip_divisor: max_norm must be > 0, got 0.0")):
        opt.clip_divisor(np.ones(3, np.float32), 0.0)


@pytest.mark.parametrize("norm,max_norm,loss_scale,expected", [
    (3.0, 1.0, 1.0, 3.0),  # clipped: N / max_norm
    (0.5, 1.0, 1.0, 1.0),  # not clipped
    (12.0, 2.0, 4.0, 6.0),  # N > loss_scale * max_norm: clipped after unscaling
    (6.0, 2.0, 4.0, 4.0),  # only unscaled
    (float("nan"), 1.0, 8.0, 8.0),  # a NaN norm does not clip
    (1e30, float("inf"), 8.0, 8.0),  # max_norm inf: loss scaling only
])
def test_clip_divisor_from_norm(norm, max_norm, loss_scale, expected):
    assert _optim_reference.clip_divisor_from_norm(norm, max_norm, loss_scale) == expected


def test_zero_hook_completes_lamb_sums(small_blocks):
    """Lamb's segment_sums hook gets this layout's per-tensor sums of squares (w, then d) and
    what it leaves in them sets the trust ratios: doubling ||w||^2 scales each ratio by sqrt(2)."""
    rng = np.random.default_rng(8)
    layout = make_layout("LambOptimizer", [[5, 3001], [1025, 3]])
    params = rng.standard_normal(layout.size).astype(np.float32)
    grads = rng.standard_normal(layout.size).astype(np.float32)
    seen = []

    def double_params_sums(params_sumsq, direction_sumsq):
        seen.append(params_sumsq.copy())
        params_sumsq *= 2

    hooked, plain = opt.Lamb(layout, segment_sums=double_params_sums), opt.make_optimizer("LambOptimizer", layout)
    hooked_params, plain_params = params.copy(), params.copy()
    hooked.step(hooked_params, grads, 1e-3)
    plain.step(plain_params, grads, 1e-3)
    expected = np.add.reduceat(params.astype(np.float64) ** 2, layout.seg_offsets[:-1])
    np.testing.assert_allclose(seen[0], expected, rtol=1e-6)
    for group in layout.groups:  # the clamps of these groups do not bind at this ratio
        if group.hyper.ratio_max < np.inf:
            continue
        part = slice(group.start, group.stop)
        np.testing.assert_allclose(params[part] - hooked_params[part],
                                   np.sqrt(2) * (params[part] - plain_params[part]),
                                   rtol=1e-3, atol=1e-7)


def test_zero_hook_is_refused_on_cuda():
    """The CUDA Lamb step takes whole tensors: the hook is refused, by the optimizer and by the step."""
    layout = make_layout("LambOptimizer", [[4]])
    with pytest.raises(ValueError, match=re.escape(
            "Lamb: segment_sums (ZeRO's per-tensor sums over the shards) runs on the CPU only, got device='cuda'")):
        opt.Lamb(layout, "cuda", segment_sums=lambda params_sumsq, direction_sumsq: None)


@pytest.mark.parametrize("family", ["sgd", "adam", "lamb"])
def test_cpu_steps_refuse_device_counters(family):
    """The steps of both devices take counters and lr_table (one contract); the CPU ones count on the host."""
    layout = make_layout({"sgd": "SGDOptimizer", "adam": "AdamOptimizer", "lamb": "LambOptimizer"}[family], [[4]])
    table = _optim_cpu.layout_table(layout, family)
    params, *rest = (np.ones(4, np.float32) for _ in range(4 if family != "sgd" else 3))
    scalars = dict(first_step=True) if family == "sgd" else dict(step=1)
    step = getattr(_optim_cpu, f"{family}_step")
    with pytest.raises(ValueError, match=re.escape(
            f"{family}_step: counters and lr_table are the device arrays of loss scaling on CUDA; the CPU steps count "
            "updates on the host and take None, got counters=numpy.ndarray, lr_table=numpy.ndarray")):
        step(table, params, *rest, lr=0.1, **scalars, counters=np.zeros(4), lr_table=np.ones(1))
    with pytest.raises(ValueError, match=re.escape("got lr_table=numpy.ndarray")):
        step(table, params, *rest, lr=0.1, **scalars, lr_table=np.ones(1))
    assert np.all(params == 1)


def test_state_names():
    assert opt.state_names("SGDOptimizer") == ("momentum",)
    assert opt.state_names("AdamOptimizer") == opt.state_names("LambOptimizer") == (
        "exp_avg", "exp_avg_sq")
    with pytest.raises(ValueError, match=re.escape(
            "state_names: config_name must be one of ['AdamOptimizer', 'LambOptimizer', "
            "'SGDOptimizer'], got 'Adam'")):
        opt.state_names("Adam")


# ----------------------------------------------------------------------------------------------
# (4) grads unchanged, (5) state dicts
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(GROUP_HYPERS))
@pytest.mark.parametrize("grad_divisor", [1.0, 3.0])
def test_step_does_not_modify_grads(name, grad_divisor, small_blocks):
    rng = np.random.default_rng(5)
    layout = make_layout(name, [[1, 1025], [3001], [7], [9], [11]])
    optimizer = opt.make_optimizer(name, layout)
    params = rng.standard_normal(layout.size).astype(np.float32)
    for _ in range(3):
        grads = rng.standard_normal(layout.size).astype(np.float32)
        grads_before = grads.copy()
        optimizer.step(params, grads, 1e-2, grad_divisor)
        np.testing.assert_array_equal(grads, grads_before)


@pytest.mark.parametrize("name", sorted(GROUP_HYPERS))
def test_state_dict_round_trip(name):
    rng = np.random.default_rng(6)
    layout = make_layout(name, [[3, 1025], [4000]])
    trained = opt.make_optimizer(name, layout)
    params = rng.standard_normal(layout.size).astype(np.float32)
    for _ in range(3):
        trained.step(params, rng.standard_normal(layout.size).astype(np.float32), 1e-2)

    saved = trained.state_dict()
    assert saved["step_count"] == 3 and set(saved["state"]) == set(trained.state_names)
    for array in saved["state"].values():  # a snapshot, not the live buffers
        array.fill(np.nan)
    saved = trained.state_dict()
    restored = opt.make_optimizer(name, layout)
    for array in restored.state.values():
        array.fill(np.nan)
    restored.load_state_dict(saved)
    assert restored.step_count == 3

    params_copy = params.copy()
    grads = rng.standard_normal(layout.size).astype(np.float32)
    trained.step(params, grads, 1e-2)
    restored.step(params_copy, grads, 1e-2)
    np.testing.assert_array_equal(params_copy, params)
    for state_name in trained.state_names:
        np.testing.assert_array_equal(restored.state[state_name], trained.state[state_name])


def adam_state_dict(n, **changes):
    state = {"exp_avg": np.ones(n, np.float32), "exp_avg_sq": np.ones(n, np.float32)}
    state.update(changes)
    return {"step_count": 2, "state": state}


@pytest.mark.parametrize("make_bad,message", [
    (lambda n: {"state": adam_state_dict(n)["state"]},
     "AdamOptimizer.load_state_dict: expected keys ['state', 'step_count'], got ['state']"),
    (lambda n: [1, 2], "AdamOptimizer.load_state_dict: expected keys ['state', 'step_count'], "
                       "got <class 'list'>"),
    (lambda n: dict(adam_state_dict(n), step_count=-1),
     "AdamOptimizer.load_state_dict: 'step_count' must be an int >= 0, got -1"),
    (lambda n: dict(adam_state_dict(n), step_count=True),
     "AdamOptimizer.load_state_dict: 'step_count' must be an int >= 0, got True"),
    (lambda n: dict(adam_state_dict(n), step_count=2.0),
     "AdamOptimizer.load_state_dict: 'step_count' must be an int >= 0, got 2.0"),
    (lambda n: {"step_count": 2, "state": {"exp_avg": np.ones(n, np.float32)}},
     "AdamOptimizer.load_state_dict: 'state' must have exactly the keys "
     "['exp_avg', 'exp_avg_sq'], got ['exp_avg']"),
    (lambda n: adam_state_dict(n, momentum=np.ones(n, np.float32)),
     "AdamOptimizer.load_state_dict: 'state' must have exactly the keys "
     "['exp_avg', 'exp_avg_sq'], got ['exp_avg', 'exp_avg_sq', 'momentum']"),
    (lambda n: adam_state_dict(n, exp_avg_sq=np.ones(n + 1, np.float32)),
     "AdamOptimizer.load_state_dict: state['exp_avg_sq'] must be a float32 array of shape "
     "(1032,), got float32 array of shape (1033,)"),
    (lambda n: adam_state_dict(n, exp_avg=np.ones(n, np.float64)),
     "AdamOptimizer.load_state_dict: state['exp_avg'] must be a float32 array of shape "
     "(1032,), got float64 array of shape (1032,)"),
    (lambda n: adam_state_dict(n, exp_avg=[1.0] * n),
     "AdamOptimizer.load_state_dict: state['exp_avg'] must be a float32 array of shape "
     "(1032,), got <class 'list'>"),
])
def test_load_state_dict_errors_change_nothing(make_bad, message):
    layout = FlatLayout.from_sizes([[7, 1025]], [ADAM_HYPER])
    optimizer = opt.make_optimizer("AdamOptimizer", layout)
    optimizer.step(np.ones(layout.size, np.float32), np.full(layout.size, 0.5, np.float32), 0.1)
    before = optimizer.state_dict()
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        optimizer.load_state_dict(make_bad(layout.size))
    assert optimizer.step_count == before["step_count"]
    for name, array in before["state"].items():
        np.testing.assert_array_equal(optimizer.state[name], array)


# ----------------------------------------------------------------------------------------------
# Layout and construction errors
# ----------------------------------------------------------------------------------------------

def test_from_sizes_builds_contiguous_groups():
    other = replace(SGD_HYPER, momentum=0.5)
    layout = FlatLayout.from_sizes([[2, 3], [4]], [SGD_HYPER, other])
    np.testing.assert_array_equal(layout.seg_offsets, [0, 2, 5, 9])
    assert layout.size == 9
    assert layout.groups == (GroupSlice(0, 5, 0, 2, SGD_HYPER), GroupSlice(5, 9, 2, 3, other))
    np.testing.assert_array_equal(layout.local_offsets(layout.groups[1]), [0, 4])
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.groups[0].hyper.momentum = 0.3  # read-only
    with pytest.raises(ValueError):
        layout.seg_offsets[0] = 1  # read-only


@pytest.mark.parametrize("sizes,hypers,message", [
    ([[2]], [SGD_HYPER] * 2, "FlatLayout.from_sizes needs the hyperparameters of each group: got 1 "
                             "groups and 2 hyperparameters"),
    ([[2], []], [SGD_HYPER] * 2, "sizes_per_group[1] must list at least one tensor, got none"),
    ([[2, 0]], [SGD_HYPER], "sizes_per_group[0][1] must be an int >= 1, got 0"),
    ([[2.0]], [SGD_HYPER], "sizes_per_group[0][0] must be an int >= 1, got 2.0"),
    ([[True]], [SGD_HYPER], "sizes_per_group[0][0] must be an int >= 1, got True"),
])
def test_from_sizes_errors(sizes, hypers, message):
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        FlatLayout.from_sizes(sizes, hypers)


@pytest.mark.parametrize("offsets,groups,message", [
    ([0, 2, 2], [GroupSlice(0, 2, 0, 2, SGD_HYPER)],
     "FlatLayout.seg_offsets must be strictly increasing (no empty tensor), got 2 then 2 at "
     "index 1"),
    ([1, 2], [GroupSlice(1, 2, 0, 1, SGD_HYPER)],
     "FlatLayout.seg_offsets must be 1-D, start at 0 and hold at least one segment, "
     "got array([1, 2])"),
    ([0, 2, 5], [], "FlatLayout.groups must hold at least one group, got none"),
    ([0, 2, 5], [GroupSlice(0, 2, 0, 1, SGD_HYPER), GroupSlice(2, 5, 2, 2, SGD_HYPER)],
     "FlatLayout.groups[1] must cover segments [1, k) with k > 1, got [2, 2)"),
    ([0, 2, 5], [GroupSlice(0, 5, 0, 3, SGD_HYPER)],
     "FlatLayout.groups[0].seg_stop must be <= 2 (the number of segments), got 3"),
    ([0, 2, 5], [GroupSlice(0, 4, 0, 2, SGD_HYPER)],
     "FlatLayout.groups[0] must span elements [0, 5) (its segments), got [0, 4)"),
    ([0, 2, 5], [GroupSlice(0, 2, 0, 1, SGD_HYPER)],
     "FlatLayout.groups must cover all 2 segments, they stop at segment 1"),
])
def test_layout_errors(offsets, groups, message):
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        FlatLayout(np.array(offsets), tuple(groups))


def test_typed_hypers_build_each_algorithms_dataclass_from_its_dicts():
    for name, hyper in [("SGDOptimizer", SGD_HYPER), ("AdamOptimizer", ADAM_HYPER), ("LambOptimizer", LAMB_HYPER)]:
        other = replace(hyper, lambda_coef=0.5)
        assert opt.typed_hypers(name, [dataclasses.asdict(hyper), dataclasses.asdict(other)]) == (hyper, other)


def test_optimizer_construction_errors():
    with pytest.raises(ValueError, match=re.escape(
            "AdamOptimizer: param group 0 must have exactly the hyperparameters ['alpha', "
            "'beta', 'do_bias_correction', 'epsilon', 'lambda_coef', 'weight_decay_mode']; "
            "missing ['beta'], unexpected ['lambda']")):
        hyper = {k: v for k, v in dataclasses.asdict(ADAM_HYPER).items() if k != "beta"} | {"lambda": 0.0}
        opt.typed_hypers("AdamOptimizer", [hyper])
    with pytest.raises(TypeError, match=re.escape(
            "AdamOptimizer: param group 0 has hyperparameters of type LambHyper, expected AdamHyper "
            "(typed_hypers)")):
        opt.make_optimizer("AdamOptimizer", FlatLayout.from_sizes([[3]], [LAMB_HYPER]))
    with pytest.raises(ValueError, match=re.escape(
            "AdamOptimizer: param group 1: weight_decay_mode must be 0 or 1, got 2")):
        opt.make_optimizer("AdamOptimizer", FlatLayout.from_sizes(
            [[3], [4]], [ADAM_HYPER, replace(ADAM_HYPER, weight_decay_mode=2)]))
    with pytest.raises(ValueError, match=re.escape(
            "make_optimizer: config_name must be one of ['AdamOptimizer', 'LambOptimizer', "
            "'SGDOptimizer'], got 'Adam'")):
        opt.make_optimizer("Adam", FlatLayout.from_sizes([[3]], [ADAM_HYPER]))
    with pytest.raises(ValueError, match=re.escape("SGD: device must be 'cpu' or 'cuda', got 'mps'")):
        opt.SGD(FlatLayout.from_sizes([[3]], [SGD_HYPER]), device="mps")


@pytest.mark.parametrize("make_buffer,got", [
    (lambda: np.zeros(5, np.float32), "numpy.ndarray float32 (5,)"),
    (lambda: np.zeros(4, np.float64), "numpy.ndarray float64 (4,)"),
    (lambda: np.zeros(8, np.float32)[::2], "numpy.ndarray float32 (4,)"),
    (lambda: torch.zeros(4), "torch.Tensor torch.float32 torch.Size([4])"),
])
def test_step_rejects_bad_buffers(make_buffer, got):
    optimizer = opt.make_optimizer("SGDOptimizer", FlatLayout.from_sizes([[4]], [SGD_HYPER]))
    message = f"SGD.step: grads must be a contiguous numpy.float32 array of shape (4,), got {got}"
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        optimizer.step(np.ones(4, np.float32), make_buffer(), 0.1)
    assert optimizer.step_count == 0


# ----------------------------------------------------------------------------------------------
# device='cuda': the calls into _kernels (a recording stand-in; no GPU needed)
# ----------------------------------------------------------------------------------------------

def test_cupy_backend_calls_kernels(monkeypatch):
    fake_cupy = types.ModuleType("cupy")
    for name in ("ndarray", "zeros", "float32", "copyto", "asarray"):
        setattr(fake_cupy, name, getattr(np, name))
    calls = []
    fake_kernels = types.ModuleType("ort_trainer._optimizers.cuda_steps")
    fake_kernels.require_cupy = lambda: fake_cupy
    fake_kernels.layout_table = lambda layout, family: ("table", family)
    for family in ("sgd", "adam", "lamb"):
        setattr(fake_kernels, f"{family}_step",
                lambda table, *arrays, _family=family, **scalars: calls.append(
                    (_family, table, len(arrays), scalars)))
    monkeypatch.setattr(opt, "cuda_steps", fake_kernels)

    params, grads = np.ones(4, np.float32), np.ones(4, np.float32)
    for name, hyper in [("SGDOptimizer", SGD_HYPER), ("AdamOptimizer", ADAM_HYPER),
                        ("LambOptimizer", LAMB_HYPER)]:
        optimizer = opt.make_optimizer(name, FlatLayout.from_sizes([[4]], [hyper]), device="cuda")
        optimizer.step(params, grads, 0.5, grad_divisor=2.0)
        optimizer.step(params, grads, 0.5)
    host = dict(counters=None, lr_table=None)  # not counting on the device
    assert calls == [
        ("sgd", ("table", "sgd"), 3, dict(lr=0.5, grad_divisor=2.0, first_step=True, **host)),
        ("sgd", ("table", "sgd"), 3, dict(lr=0.5, grad_divisor=1.0, first_step=False, **host)),
        ("adam", ("table", "adam"), 4, dict(step=1, lr=0.5, grad_divisor=2.0, **host)),
        ("adam", ("table", "adam"), 4, dict(step=2, lr=0.5, grad_divisor=1.0, **host)),
        ("lamb", ("table", "lamb"), 4, dict(step=1, lr=0.5, grad_divisor=2.0, segment_sums=None, **host)),
        ("lamb", ("table", "lamb"), 4, dict(step=2, lr=0.5, grad_divisor=1.0, segment_sums=None, **host)),
    ]


def test_device_counting_is_refused_on_the_cpu():
    optimizer = opt.make_optimizer("AdamOptimizer", FlatLayout.from_sizes([[4]], [ADAM_HYPER]))
    with pytest.raises(ValueError, match=re.escape(
            "Adam.count_on_device: the counters are device arrays; this optimizer runs on 'cpu'")):
        optimizer.count_on_device(np.zeros(4))
    params = np.ones(4, np.float32)
    with pytest.raises(ValueError, match=re.escape(
            "Adam.step: lr_table is indexed by the device update count: call count_on_device first")):
        optimizer.step(params, np.ones(4, np.float32), 0.1, lr_table=np.ones(1))
    assert optimizer.step_count == 0 and np.all(params == 1)
