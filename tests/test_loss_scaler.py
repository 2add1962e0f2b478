"""Loss scalers: the dynamic rule step by step, bounds, reset, state, and every message pinned."""
import re

import pytest

from ort_trainer import TrainStepInfo, _checkpoint_files
from ort_trainer._trainer import checkpoint as _checkpoint
from ort_trainer.amp import DynamicLossScaler, LossScaler
from ort_trainer.optim import SGDConfig

FINITE = TrainStepInfo(SGDConfig(), all_finite=True)
OVERFLOW = TrainStepInfo(SGDConfig(), all_finite=False)


def raises_exactly(message, error=ValueError):
    return pytest.raises(error, match=f"^{re.escape(message)}$")


def updates(scaler, flags):
    return [scaler.update(FINITE if finite else OVERFLOW) for finite in flags]


class FixedScaler(LossScaler):
    def update(self, train_step_info):
        return self.loss_scale


def test_defaults():
    scaler = DynamicLossScaler()
    assert scaler.state_dict() == {
        "type": "DynamicLossScaler", "automatic_update": True, "initial_loss_scale": 65536.0, "loss_scale": 65536.0,
        "up_scale_window": 2000, "min_loss_scale": 1.0, "max_loss_scale": 16777216.0, "stable_steps": 0}
    assert type(scaler.loss_scale) is float
    assert isinstance(scaler, LossScaler)


def test_up_scale_after_exactly_window_finite_updates():
    scaler = DynamicLossScaler(loss_scale=4, up_scale_window=3)
    assert updates(scaler, [True] * 7) == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0]
    assert DynamicLossScaler(loss_scale=4, up_scale_window=1, max_loss_scale=1e9).update(FINITE) == 8.0


def test_backoff_on_non_finite_restarts_the_window():
    scaler = DynamicLossScaler(loss_scale=64, up_scale_window=3)
    assert updates(scaler, [True, True, False, True, True, True]) == [64.0, 64.0, 32.0, 32.0, 32.0, 64.0]
    assert updates(scaler, [False, False]) == [32.0, 16.0]


def test_clamped_at_min_and_max():
    scaler = DynamicLossScaler(loss_scale=3, up_scale_window=1, min_loss_scale=1, max_loss_scale=10)
    assert updates(scaler, [True, True, True]) == [6.0, 10.0, 10.0]
    assert updates(scaler, [False] * 5) == [5.0, 2.5, 1.25, 1.0, 1.0]


def test_reset():
    scaler = DynamicLossScaler(loss_scale=8, up_scale_window=2)
    updates(scaler, [False, True])
    scaler.reset()
    assert scaler.state_dict()["loss_scale"] == 8.0 and scaler.state_dict()["stable_steps"] == 0
    assert updates(scaler, [True, True]) == [8.0, 16.0]  # the window starts over too


def test_manual_update_keeps_the_scale():
    scaler = DynamicLossScaler(automatic_update=False, loss_scale=8, up_scale_window=1)
    assert updates(scaler, [True, False, True]) == [8.0, 8.0, 8.0]
    scaler.loss_scale = 2
    assert (scaler.update(OVERFLOW), type(scaler.loss_scale)) == (2.0, float)


def test_base_class():
    with pytest.raises(TypeError, match="abstract"):
        LossScaler(1.0)
    scaler = FixedScaler(16)
    scaler.loss_scale = 4
    assert scaler.update(FINITE) == 4.0
    scaler.reset()
    assert scaler.loss_scale == 16.0


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("make, message", [
    (lambda: DynamicLossScaler(automatic_update=1, loss_scale=0, up_scale_window=0, min_loss_scale=-1,
                               max_loss_scale=float("inf")),
     "Invalid DynamicLossScaler: automatic_update: must be a bool, got 1 (int); loss_scale: must be in (0, inf), "
     "got 0.0; max_loss_scale: must be in (0, inf), got inf; min_loss_scale: must be in (0, inf), got -1.0; "
     "up_scale_window: must be >= 1, got 0"),
    (lambda: DynamicLossScaler(up_scale_window=2.0),
     "Invalid DynamicLossScaler: up_scale_window: must be an int, got 2.0 (float)"),
    (lambda: DynamicLossScaler(loss_scale="1024"),
     "Invalid DynamicLossScaler: loss_scale: must be a number, got '1024' (str)"),
    (lambda: DynamicLossScaler(loss_scale=8, min_loss_scale=16, max_loss_scale=4),
     "Invalid DynamicLossScaler: max_loss_scale: must be >= min_loss_scale (16.0), got 4.0"),
    (lambda: DynamicLossScaler(loss_scale=0.5),
     "Invalid DynamicLossScaler: loss_scale: must be in [min_loss_scale, max_loss_scale] = [1.0, 16777216.0], "
     "got 0.5"),
    (lambda: DynamicLossScaler(max_loss_scale=1024),
     "Invalid DynamicLossScaler: loss_scale: must be in [min_loss_scale, max_loss_scale] = [1.0, 1024.0], "
     "got 65536.0"),
    (lambda: FixedScaler(-2), "Invalid FixedScaler: loss_scale: must be in (0, inf), got -2.0"),
    (lambda: FixedScaler(None), "Invalid FixedScaler: loss_scale: must not be None"),
])
def test_invalid_arguments(make, message):
    with raises_exactly(message):
        make()


def test_invalid_loss_scale_assignment():
    scaler = DynamicLossScaler()
    with raises_exactly("Invalid DynamicLossScaler: loss_scale: must be in (0, inf), got nan"):
        scaler.loss_scale = float("nan")
    assert scaler.loss_scale == 65536.0


# ---------------------------------------------------------------- state

def test_resume_equals_straight_run(tmp_path):
    flags = [True, True, False, True, True, True, True, False, False, True, True, True]
    straight = updates(DynamicLossScaler(loss_scale=32, up_scale_window=3, max_loss_scale=128), flags)
    first = DynamicLossScaler(loss_scale=32, up_scale_window=3, max_loss_scale=128)
    updates(first, flags[:5])
    _checkpoint_files.save(tmp_path / "ckpt.pt", {"loss_scaler": first.state_dict()})
    resumed = DynamicLossScaler()  # other settings: the checkpoint's win
    resumed.load_state_dict(_checkpoint.load(tmp_path / "ckpt.pt")["loss_scaler"])
    assert resumed.state_dict() == first.state_dict()
    assert updates(resumed, flags[5:]) == straight[5:]
    resumed.reset()
    assert resumed.loss_scale == 32.0


STATE = {"type": "DynamicLossScaler", "automatic_update": True, "initial_loss_scale": 8.0, "loss_scale": 4.0,
         "up_scale_window": 3, "min_loss_scale": 1.0, "max_loss_scale": 64.0, "stable_steps": 2}


@pytest.mark.parametrize("state, message, error", [
    (None, "Invalid DynamicLossScaler state_dict: expected a dict, got NoneType", TypeError),
    ({"loss_scale": 4.0, "growth_tracker": 0},
     "Invalid DynamicLossScaler state_dict: missing keys ['automatic_update', 'initial_loss_scale', "
     "'max_loss_scale', 'min_loss_scale', 'stable_steps', 'type', 'up_scale_window']; "
     "unexpected keys ['growth_tracker']", ValueError),
    ({**STATE, "type": "StaticLossScaler"},
     "Invalid DynamicLossScaler state_dict: type: must be 'DynamicLossScaler', got 'StaticLossScaler'", ValueError),
    ({**STATE, "stable_steps": 3, "loss_scale": 128.0, "initial_loss_scale": 0.5},
     "Invalid DynamicLossScaler state_dict: initial_loss_scale: must be in [min_loss_scale, max_loss_scale] = "
     "[1.0, 64.0], got 0.5; loss_scale: must be in [min_loss_scale, max_loss_scale] = [1.0, 64.0], got 128.0; "
     "stable_steps: must be < up_scale_window (3), got 3", ValueError),
    ({**STATE, "stable_steps": -1}, "Invalid DynamicLossScaler state_dict: stable_steps: must be >= 0, got -1",
     ValueError),
])
def test_invalid_state_dict(state, message, error):
    scaler = DynamicLossScaler(loss_scale=16)
    with raises_exactly(message, error):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == DynamicLossScaler(loss_scale=16).state_dict()  # untouched
