"""Names and module paths of the original ORTTrainer API (onnxruntime.training, 1.5-1.8) that ported
code uses unchanged, and TrainStepInfo's checks (the original asserted its arguments)."""
import re

import numpy as np
import onnxruntime.training
import pytest

import ort_trainer
from ort_trainer import ORTTrainer, PropagateCastOpsStrategy, TrainStepInfo, amp, optim
from ort_trainer.optim import AdamConfig, SGDConfig

from . import models


def test_loss_scaler_module_of_the_original():
    """`from onnxruntime.training.amp.loss_scaler import DynamicLossScaler` ported as it is."""
    from ort_trainer.amp.loss_scaler import DynamicLossScaler, LossScaler

    assert (LossScaler, DynamicLossScaler) == (amp.LossScaler, amp.DynamicLossScaler)


def test_cast_strategy_enum_has_onnx_runtimes_members_and_values():
    """`from onnxruntime.training import PropagateCastOpsStrategy` ported as `from ort_trainer import ...`."""
    ours = {member.name: int(member) for member in PropagateCastOpsStrategy}
    theirs = {name: int(value) for name, value in onnxruntime.training.PropagateCastOpsStrategy.__members__.items()}
    assert ours == theirs == {"NONE": 0, "INSERT_AND_REDUCE": 1, "FLOOD_FILL": 2}


# ---------------------------------------------------------------- TrainStepInfo

def test_train_step_info_signature_of_the_original():
    config = SGDConfig()
    info = TrainStepInfo(config)
    assert (info.optimizer_config, info.all_finite, info.fetches, info.optimization_step, info.step) == (
        config, True, [], 0, 0)
    info = TrainStepInfo(config, False, ["loss"], 3, 5)
    assert (info.optimizer_config, info.all_finite, info.fetches, info.optimization_step, info.step) == (
        config, False, ["loss"], 3, 5)
    assert ort_trainer._trainer.train_step_info.TrainStepInfo is TrainStepInfo


def test_train_step_info_keeps_its_own_fetches_and_plain_ints():
    fetches = ("loss",)
    info = TrainStepInfo(AdamConfig(), fetches=fetches, optimization_step=np.int64(4), step=np.int32(9))
    assert info.fetches == ["loss"] and info.fetches is not fetches
    assert (type(info.optimization_step), type(info.step)) == (int, int)


CONFIG = SGDConfig()


@pytest.mark.parametrize("kwargs, error, message", [
    # the example: every argument is wrong, the first is reported
    (dict(optimizer_config=-1, step=-1, all_finite="Hello"), TypeError,
     "optimizer_config must be an optim.SGDConfig, optim.AdamConfig or optim.LambConfig, got -1 (int)"),
    (dict(optimizer_config=CONFIG, all_finite="Hello"), TypeError, "all_finite must be a bool, got 'Hello' (str)"),
    (dict(optimizer_config=CONFIG, all_finite=1), TypeError, "all_finite must be a bool, got 1 (int)"),
    (dict(optimizer_config=CONFIG, fetches="loss"), TypeError,
     "fetches must be a list of output names (str), got 'loss'"),
    (dict(optimizer_config=CONFIG, fetches=["loss", 3]), TypeError,
     "fetches must be a list of output names (str), got ['loss', 3]"),
    (dict(optimizer_config=CONFIG, fetches=["loss", "logits", "loss"]), ValueError,
     "fetches must name each output once, got ['loss', 'logits', 'loss'] (['loss'] repeated)"),
    (dict(optimizer_config=CONFIG, optimization_step=-1), ValueError, "optimization_step must be an int >= 0, got -1"),
    (dict(optimizer_config=CONFIG, optimization_step=1.0), TypeError,
     "optimization_step must be an int >= 0, got 1.0 (float)"),
    (dict(optimizer_config=CONFIG, step=-1), ValueError, "step must be an int >= 0, got -1"),
    (dict(optimizer_config=CONFIG, step=True), TypeError, "step must be an int >= 0, got True (bool)"),
], ids=["issue_example", "all_finite_str", "all_finite_int", "fetches_str", "fetches_item", "fetches_repeated",
        "optimization_step_negative", "optimization_step_float", "step_negative", "step_bool"])
def test_train_step_info_refuses_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=f"^{re.escape('TrainStepInfo: ' + message)}$"):
        TrainStepInfo(**kwargs)


def test_a_refused_assignment_leaves_the_value():
    info = TrainStepInfo(CONFIG, step=4)
    with pytest.raises(ValueError, match=r"^TrainStepInfo: step must be an int >= 0, got -1$"):
        info.step = -1
    with pytest.raises(TypeError, match=r"^TrainStepInfo: all_finite must be a bool, got None \(NoneType\)$"):
        info.all_finite = None
    assert (info.step, info.all_finite) == (4, True)
    info.step += 1
    info.fetches = None  # the original's default was an empty list
    assert (info.step, info.fetches) == (5, [])


def test_the_trainers_train_step_info_checks_assignments():
    trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(), loss_fn=models.mlp_loss)
    with pytest.raises(TypeError, match=r"^TrainStepInfo: fetches must be a list of output names \(str\), got 'loss'$"):
        trainer.train_step_info.fetches = "loss"
    trainer.train_step_info.fetches = ["loss"]
    assert isinstance(trainer.train_step_info, TrainStepInfo) and trainer.train_step_info.fetches == ["loss"]
