"""LR schedulers: every step against the formulas (written out here), step numbering, validation, state."""
import math
import re

import pytest

from ort_trainer import TrainStepInfo, _checkpoint_files
from ort_trainer._trainer import checkpoint as _checkpoint
from ort_trainer.optim import (AdamConfig, ConstantWarmupLRScheduler, CosineWarmupLRScheduler, LinearWarmupLRScheduler,
                               PolyWarmupLRScheduler, SGDConfig)


def raises_exactly(message, error=ValueError):
    return pytest.raises(error, match=f"^{re.escape(message)}$")


# ---------------------------------------------------------------- the formulas, independently

def warmup_or(t, total, warmup, after):
    w = warmup * total
    return t / max(1, w) if t < w else after()


def constant_lr(base, t, total, warmup):
    return base * warmup_or(t, total, warmup, lambda: 1.0)


def cosine_lr(base, t, total, warmup, cycles):
    w = warmup * total
    progress = (t - w) / max(1, total - w)
    return base * warmup_or(t, total, warmup,
                            lambda: max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress))))


def linear_lr(base, t, total, warmup):
    w = warmup * total
    return base * warmup_or(t, total, warmup, lambda: max(0.0, (total - t) / max(1, total - w)))


def poly_lr(base, t, total, warmup, lr_end, power):
    w = warmup * total
    if t < w:
        return base * t / max(1, w)
    if t > total:
        return lr_end
    return (base - lr_end) * (1 - (t - w) / (total - w)) ** power + lr_end


# (total_steps, warmup): W = 2.5 (fractional), 2.0 and 10.0 (integral), 0.5 (below 1), 0 (no warmup)
SHAPES = [(10, 0.25), (8, 0.25), (20, 0.5), (100, 0.005), (7, 0.0), (1, 0.0)]
CASES = [
    (ConstantWarmupLRScheduler, {}, constant_lr),
    (CosineWarmupLRScheduler, {}, lambda b, t, n, w: cosine_lr(b, t, n, w, 0.5)),
    (CosineWarmupLRScheduler, {"cycles": 1.5}, lambda b, t, n, w: cosine_lr(b, t, n, w, 1.5)),
    (CosineWarmupLRScheduler, {"cycles": 2}, lambda b, t, n, w: cosine_lr(b, t, n, w, 2.0)),
    (LinearWarmupLRScheduler, {}, linear_lr),
    (PolyWarmupLRScheduler, {}, lambda b, t, n, w: poly_lr(b, t, n, w, 1e-7, 1.0)),
    (PolyWarmupLRScheduler, {"lr_end": 0.001, "power": 2.0}, lambda b, t, n, w: poly_lr(b, t, n, w, 0.001, 2.0)),
    (PolyWarmupLRScheduler, {"lr_end": 0, "power": 0.5}, lambda b, t, n, w: poly_lr(b, t, n, w, 0.0, 0.5)),
    (PolyWarmupLRScheduler, {"power": 0}, lambda b, t, n, w: poly_lr(b, t, n, w, 1e-7, 0.0)),
]
CASE_IDS = ["constant", "cosine", "cosine-1.5", "cosine-2", "linear", "poly", "poly-2", "poly-0.5", "poly-0"]


@pytest.mark.parametrize("total, warmup", SHAPES)
@pytest.mark.parametrize("cls, kwargs, formula", CASES, ids=CASE_IDS)
def test_every_step_matches_the_formula(cls, kwargs, formula, total, warmup):
    base = 0.1
    scheduler = cls(total, warmup=warmup, **kwargs)
    for t in range(total + 6):  # lr_at: the formula at any t, t = 0 included
        assert scheduler.lr_at(base, t) == pytest.approx(formula(base, t, total, warmup), rel=1e-12, abs=1e-15), t
    info = TrainStepInfo(SGDConfig(lr=base))
    for applied in range(total + 5):  # the trainer: _step before counting the update
        info.optimization_step = applied
        expected = formula(base, applied + 1, total, warmup)
        assert scheduler._step(info) == [pytest.approx(expected, rel=1e-12, abs=1e-15)], applied
        assert scheduler.get_last_lr() == [pytest.approx(expected, rel=1e-12, abs=1e-15)]


@pytest.mark.parametrize("cls", [ConstantWarmupLRScheduler, CosineWarmupLRScheduler, LinearWarmupLRScheduler,
                                 PolyWarmupLRScheduler])
def test_warmup_boundary(cls):
    integral = cls(8, warmup=0.25)  # W = 2.0
    assert integral.warmup_steps == 2.0
    assert integral.lr_at(1.0, 1) == 0.5
    assert integral.lr_at(1.0, 1.999) == pytest.approx(0.9995)
    assert integral.lr_at(1.0, 2) == pytest.approx(1.0)  # t == W: the decay, at its start
    fractional = cls(10, warmup=0.25)  # W = 2.5
    assert fractional.lr_at(1.0, 2) == 0.8
    assert fractional.lr_at(1.0, 2.5) == pytest.approx(1.0)  # t == W
    below_one = cls(100, warmup=0.005)  # W = 0.5: max(1, W) keeps t = 0 at 0
    assert below_one.lr_at(1.0, 0) == 0.0
    assert below_one.lr_at(1.0, 0.25) == 0.25
    assert below_one.lr_at(1.0, 0.5) == pytest.approx(1.0)  # t == W


def test_step_numbering():
    """The k-th update uses t = k: the first is not wasted on lr 0 (the original's t = optimization_step was)."""
    scheduler = LinearWarmupLRScheduler(10, warmup=0.4)  # W = 4
    info = TrainStepInfo(AdamConfig(lr=0.2), optimization_step=0)
    assert scheduler.lr_at(0.2, 0) == 0.0  # what the original applied first
    assert scheduler.get_lr(info) == [0.05]  # 0.2 * 1/4
    info.optimization_step = 9  # the 10th and last update of the schedule reaches the end of the decay
    assert scheduler.get_lr(info) == [0.0]
    info.step = 123  # train_step calls (gradient accumulation) do not move the schedule
    assert scheduler.get_lr(info) == [0.0]


def test_defaults_and_state_dict():
    assert CosineWarmupLRScheduler(1000).state_dict() == {
        "type": "CosineWarmupLRScheduler", "total_steps": 1000, "cycles": 0.5, "warmup": 0.002, "last_lr": None}
    poly = PolyWarmupLRScheduler(5, lr_end=0, power=2)
    assert poly.state_dict() == {"type": "PolyWarmupLRScheduler", "total_steps": 5, "lr_end": 0.0, "power": 2.0,
                                 "warmup": 0.002, "last_lr": None}
    assert (type(poly.lr_end), type(poly.power), poly.warmup_steps) == (float, float, 0.01)
    assert ConstantWarmupLRScheduler(3).state_dict()["type"] == "ConstantWarmupLRScheduler"
    assert LinearWarmupLRScheduler(3).state_dict()["type"] == "LinearWarmupLRScheduler"


def test_poly_past_total_steps_is_lr_end():
    scheduler = PolyWarmupLRScheduler(10, lr_end=0.01, power=3.0, warmup=0.1)
    assert scheduler.lr_at(0.5, 10) == pytest.approx(0.01)
    assert [scheduler.lr_at(0.5, t) for t in (11, 12, 1000)] == [pytest.approx(0.01)] * 3


def test_cosine_cycles():
    scheduler = CosineWarmupLRScheduler(10, cycles=1.0, warmup=0.0)  # one full period: down to 0, back up
    assert [scheduler.lr_at(1.0, t) for t in (0, 5, 10)] == [1.0, pytest.approx(0.0, abs=1e-15), 1.0]


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("make, message", [
    (lambda: CosineWarmupLRScheduler(0, cycles=0, warmup=1),
     "Invalid CosineWarmupLRScheduler: cycles: must be in (0, inf), got 0.0; total_steps: must be >= 1, got 0; "
     "warmup: must be in [0, 1), got 1.0"),
    (lambda: ConstantWarmupLRScheduler(10.0),
     "Invalid ConstantWarmupLRScheduler: total_steps: must be an int, got 10.0 (float)"),
    (lambda: LinearWarmupLRScheduler(True, warmup="0.1"),
     "Invalid LinearWarmupLRScheduler: total_steps: must be an int, got True (bool); "
     "warmup: must be a number, got '0.1' (str)"),
    (lambda: LinearWarmupLRScheduler(10, warmup=-0.1),
     "Invalid LinearWarmupLRScheduler: warmup: must be in [0, 1), got -0.1"),
    (lambda: CosineWarmupLRScheduler(10, cycles=math.nan),
     "Invalid CosineWarmupLRScheduler: cycles: must be in (0, inf), got nan"),
    (lambda: PolyWarmupLRScheduler(10, lr_end=-1e-7, power=-1),
     "Invalid PolyWarmupLRScheduler: lr_end: must be in [0, inf), got -1e-07; power: must be in [0, inf), got -1.0"),
    (lambda: PolyWarmupLRScheduler(None),
     "Invalid PolyWarmupLRScheduler: total_steps: must not be None"),
])
def test_invalid_arguments(make, message):
    with raises_exactly(message):
        make()


def test_poly_lr_must_exceed_lr_end():
    scheduler = PolyWarmupLRScheduler(10, lr_end=0.001)
    message = "Invalid PolyWarmupLRScheduler: lr_end: must be < the optimizer's lr (0.001), got 0.001"
    with raises_exactly(message):
        scheduler.get_lr(TrainStepInfo(SGDConfig(lr=0.001)))  # also during warmup
    with raises_exactly("Invalid PolyWarmupLRScheduler: lr_end: must be < the optimizer's lr (0.0005), got 0.001"):
        scheduler.lr_at(0.0005, 100)


def test_get_last_lr_before_the_first_update():
    with raises_exactly("LinearWarmupLRScheduler.get_last_lr(): no update yet; the first train_step sets it",
                        RuntimeError):
        LinearWarmupLRScheduler(10).get_last_lr()


# ---------------------------------------------------------------- state

@pytest.mark.parametrize("cls, kwargs", [(ConstantWarmupLRScheduler, {}), (CosineWarmupLRScheduler, {"cycles": 1.5}),
                                         (LinearWarmupLRScheduler, {}), (PolyWarmupLRScheduler, {"power": 2.0})])
def test_resume_equals_straight_run(cls, kwargs, tmp_path):
    total, stop = 12, 5
    info = TrainStepInfo(SGDConfig(lr=0.3))

    def run(scheduler, steps):
        lrs = []
        for applied in steps:
            info.optimization_step = applied
            lrs.append(scheduler._step(info))
        return lrs

    straight = run(cls(total, warmup=0.3, **kwargs), range(total + 3))
    first = cls(total, warmup=0.3, **kwargs)
    run(first, range(stop))
    _checkpoint_files.save(tmp_path / "ckpt.pt", {"lr_scheduler": first.state_dict()})
    resumed = cls(99)  # other hyperparameters: the checkpoint's win
    resumed.load_state_dict(_checkpoint.load(tmp_path / "ckpt.pt")["lr_scheduler"])
    assert resumed.state_dict() == first.state_dict()
    assert resumed.get_last_lr() == straight[stop - 1]
    assert run(resumed, range(stop, total + 3)) == straight[stop:]


@pytest.mark.parametrize("state, message, error", [
    ([("total_steps", 10)], "Invalid LinearWarmupLRScheduler state_dict: expected a dict, got list", TypeError),
    ({"type": "LinearWarmupLRScheduler", "total_steps": 10, "warmup_steps": 1.0},
     "Invalid LinearWarmupLRScheduler state_dict: missing keys ['last_lr', 'warmup']; unexpected keys ['warmup_steps']",
     ValueError),
    ({"type": "ConstantWarmupLRScheduler", "total_steps": 10, "warmup": 0.1, "last_lr": None},
     "Invalid LinearWarmupLRScheduler state_dict: type: must be 'LinearWarmupLRScheduler', "
     "got 'ConstantWarmupLRScheduler'", ValueError),
    ({"type": "LinearWarmupLRScheduler", "total_steps": -1, "warmup": 0.1, "last_lr": [-0.5]},
     "Invalid LinearWarmupLRScheduler state_dict: last_lr[0]: must be in [0, inf), got -0.5; "
     "total_steps: must be >= 1, got -1", ValueError),
    ({"type": "LinearWarmupLRScheduler", "total_steps": 10, "warmup": 0.1, "last_lr": 0.5},
     "Invalid LinearWarmupLRScheduler state_dict: last_lr: must be a list, got 0.5 (float)", ValueError),
])
def test_invalid_state_dict(state, message, error):
    scheduler = LinearWarmupLRScheduler(10, warmup=0.5)
    with raises_exactly(message, error):
        scheduler.load_state_dict(state)
    assert scheduler.state_dict()["warmup"] == 0.5  # untouched
