"""A run started on the original ORTTrainer resumes here: its state_dict layout and its HDF5
checkpoint files (written here with h5py as the original wrote them) load, and training goes on
exactly as this trainer's own checkpoint of the same run does."""
import pickle
import re

import numpy as np
import pytest
import torch

from ort_trainer import ORTTrainer, optim

from . import models

h5py = pytest.importorskip("h5py")

CONFIGS = {
    "adam": lambda: optim.AdamConfig(lr=1e-2),
    "lamb": lambda: optim.LambConfig(lr=1e-2),
    "sgd": lambda: optim.SGDConfig(lr=1e-2),
}


def _trainer(config):
    return ORTTrainer(models.mlp(), models.MLP_DESC, CONFIGS[config](), loss_fn=models.mlp_loss)


def _train(trainer, first, steps):
    return [trainer.train_step(*models.mlp_batch(step))[0].item() for step in range(first, first + steps)]


def original_layout(state, optimizer_name, as_numpy=True):
    """Our state_dict as the original ORTTrainer laid it out (ONNX Runtime counts updates from 1)."""
    convert = (lambda t: t.numpy()) if as_numpy else (lambda t: t)
    optimizer = state["optimizer"]
    counter = np.array([optimizer["step_count"] + 1], dtype=np.int64)
    per_weight = {}
    if optimizer_name != "SGDOptimizer":
        for name in optimizer["state"]["exp_avg"]:
            per_weight[name] = {"Moment_1": convert(optimizer["state"]["exp_avg"][name]),
                                "Moment_2": convert(optimizer["state"]["exp_avg_sq"][name])}
            if optimizer_name == "AdamOptimizer":
                per_weight[name]["Update_Count"] = counter
    if optimizer_name == "LambOptimizer":
        per_weight["shared_optimizer_state"] = {"Step": counter}
    return {
        "model": {"full_precision": {name: convert(t) for name, t in state["model"].items()}},
        "optimizer": per_weight,
        "trainer_options": {"mixed_precision": False, "zero_stage": 0, "world_rank": 0, "world_size": 1,
                            "optimizer_name": optimizer_name.encode(), "data_parallel_size": 1,
                            "horizontal_parallel_size": 1},
        "train_step_info": {"optimization_step": state["train_step_info"]["optimization_step"],
                            "step": state["train_step_info"]["step"]},
    }


def write_original_hdf5(path, state, user_dict):
    """What the original's save_checkpoint wrote: nested dicts as HDF5 groups, user_dict a hex pickle."""
    def write(group, values):
        for key, value in values.items():
            if isinstance(value, dict):
                write(group.create_group(key), value)
            else:
                group[key] = value

    with h5py.File(path, "w-") as file:
        write(file, {**state, "user_dict": pickle.dumps(user_dict).hex()})


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_an_original_state_dict_resumes_like_our_own(config):
    run = _trainer(config)
    _train(run, 0, 3)
    state = run.state_dict()
    expected = _train(run, 3, 3)
    resumed = _trainer(config)
    resumed.load_state_dict(original_layout(state, CONFIGS[config]().name))
    assert resumed.train_step_info.step == 3
    assert _train(resumed, 3, 3) == expected


def test_an_original_hdf5_checkpoint_resumes_and_returns_its_user_dict(tmp_path):
    run = _trainer("adam")
    _train(run, 0, 3)
    path = tmp_path / "ORT_checkpoint.ort.pt"
    write_original_hdf5(path, original_layout(run.state_dict(), "AdamOptimizer"), {"epoch": 2, "note": "original"})
    expected = _train(run, 3, 2)
    resumed = _trainer("adam")
    assert resumed.load_checkpoint(path) == {"epoch": 2, "note": "original"}
    assert _train(resumed, 3, 2) == expected


def test_a_user_dict_holding_objects_is_not_unpickled(tmp_path):
    run = _trainer("adam")
    _train(run, 0, 1)
    path = tmp_path / "ORT_checkpoint.ort.pt"
    write_original_hdf5(path, original_layout(run.state_dict(), "AdamOptimizer"), {"when": np.float64(1.0)})
    with pytest.raises(pickle.UnpicklingError, match=re.escape(
            "the checkpoint's user_dict holds a numpy")):
        _trainer("adam").load_checkpoint(path)


def test_another_optimizers_state_is_refused():
    run = _trainer("adam")
    _train(run, 0, 1)
    with pytest.raises(ValueError, match=re.escape(
            "load_state_dict: the state_dict is of a AdamOptimizer run (trainer_options.optimizer_name), this "
            "trainer's optimizer is LambOptimizer")):
        _trainer("lamb").load_state_dict(original_layout(run.state_dict(), "AdamOptimizer"))


def test_a_shard_of_a_zero_run_is_refused():
    run = _trainer("adam")
    _train(run, 0, 1)
    state = original_layout(run.state_dict(), "AdamOptimizer")
    state["partition_info"] = {"net.0.weight": {"original_dim": np.array([32, 12]), "megatron_row_partition": 0}}
    resumed = _trainer("adam")
    before = resumed.state_dict()
    with pytest.raises(ValueError, match=re.escape("holds one rank's shard (partition_info: ZeRO or Megatron)")):
        resumed.load_state_dict(state)
    for name, tensor in before["model"].items():
        assert torch.equal(resumed.state_dict()["model"][name], tensor)


def test_update_counts_that_differ_between_weights_are_refused():
    run = _trainer("adam")
    _train(run, 0, 2)
    state = original_layout(run.state_dict(), "AdamOptimizer")
    state["optimizer"]["net.0.bias"]["Update_Count"] = np.array([7])
    with pytest.raises(ValueError, match=re.escape(
            "load_state_dict: the original's update counts differ between weights ([3, 7])")):
        _trainer("adam").load_state_dict(state)


def test_missing_weights_are_named_as_for_our_own_layout():
    run = _trainer("adam")
    _train(run, 0, 1)
    state = original_layout(run.state_dict(), "AdamOptimizer", as_numpy=False)
    del state["model"]["full_precision"]["net.3.bias"]
    with pytest.raises(ValueError, match=re.escape("net.3.bias")):
        _trainer("adam").load_state_dict(state)


def test_pytorch_format_is_the_models_own_state_dict():
    run = _trainer("adam")
    _train(run, 0, 2)
    weights = run.state_dict(pytorch_format=True)
    plain = models.mlp()
    plain.load_state_dict(weights)
    assert weights.keys() == run.state_dict()["model"].keys()
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, run.model.state_dict()[name])
