"""The original ORTTrainer's state_dict layout and its HDF5 checkpoint files, read into ours so a
run started on the original resumes here.

The original's layout: `model.full_precision` {weight: array}; `optimizer` {weight: {Moment_1,
Moment_2, Update_Count (Adam)}} plus `shared_optimizer_state.Step` (Lamb); `trainer_options`
(its optimizer_name among them); `train_step_info`. ONNX Runtime starts Update_Count and Step at 1
before the first update, so the number of updates applied is one less. Moment_1/Moment_2 are
Adam's and Lamb's first and second moments (ours: exp_avg, exp_avg_sq); the original's SGD has no
state (ours: momentum, zero without momentum). The original saved no LR scheduler or loss scaler
state (both followed the step counters): this trainer's own are kept.
"""
import io
import os
import pickle
from collections.abc import Mapping

import numpy as np
import torch

_MOMENTS = {"Moment_1": "exp_avg", "Moment_2": "exp_avg_sq"}
_COUNTERS = ("Update_Count", "Step", "step")
_SHARED = "shared_optimizer_state"


def is_original_layout(state_dict):
    return isinstance(state_dict, Mapping) and isinstance(state_dict.get("model"), Mapping) \
        and "full_precision" in state_dict["model"]


def _tensor(value, where):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray) or np.isscalar(value):
        return torch.from_numpy(np.array(value))
    raise TypeError(f"load_state_dict: {where} must be an array or a tensor, got {type(value).__name__}")


def _text(value):
    return value.decode() if isinstance(value, bytes) else str(value)


def to_our_layout(state_dict, *, optimizer_name, state_names, current):
    """The original's state_dict as `ORTTrainer.state_dict()` lays it out. `current`: this
    trainer's train_step_info, lr_scheduler, loss_scaler and trainer_options sections (its
    scheduler and loss-scaler state are kept)."""
    if "partition_info" in state_dict:
        raise ValueError("load_state_dict: this state_dict of the original ORTTrainer holds one rank's shard "
                         "(partition_info: ZeRO or Megatron); aggregate the ranks' checkpoints with the original's "
                         "checkpoint.aggregate_checkpoints() first")
    model = {name: _tensor(value, f"state_dict['model']['full_precision'][{name!r}]")
             for name, value in state_dict["model"]["full_precision"].items()}
    options = state_dict.get("trainer_options", {})
    saved_name = _text(options.get("optimizer_name", optimizer_name))
    if saved_name != optimizer_name:
        raise ValueError(f"load_state_dict: the state_dict is of a {saved_name} run (trainer_options.optimizer_name), "
                         f"this trainer's optimizer is {optimizer_name}")
    per_weight = {name: value for name, value in state_dict.get("optimizer", {}).items() if name != _SHARED}
    counters = [int(np.asarray(values[key]).reshape(-1)[0]) for values in
                [*per_weight.values(), state_dict.get("optimizer", {}).get(_SHARED, {})]
                for key in _COUNTERS if key in values]
    if len(set(counters)) > 1:
        raise ValueError(f"load_state_dict: the original's update counts differ between weights ({sorted(set(counters))}); "
                         "this trainer keeps one count for all")
    state = {name: {} for name in state_names}
    for weight, values in per_weight.items():
        for original, ours in _MOMENTS.items():
            if original in values and ours in state:
                state[ours][weight] = _tensor(values[original], f"state_dict['optimizer'][{weight!r}][{original!r}]")
    if not per_weight and state_names == ("momentum",):  # the original's SGD keeps no state
        state["momentum"] = {name: torch.zeros_like(tensor) for name, tensor in model.items()
                             if tensor.is_floating_point()}
    info = state_dict.get("train_step_info", {})
    return {
        "model": model,
        "optimizer": {"name": optimizer_name, "step_count": max(counters[0] - 1, 0) if counters else 0,
                      "state": state},
        "train_step_info": {key: int(info.get(key, current["train_step_info"][key]))
                            for key in ("step", "optimization_step")},
        "lr_scheduler": current["lr_scheduler"],
        "loss_scaler": current["loss_scaler"],
        "trainer_options": current["trainer_options"],
    }


def read_hdf5(path):
    """The original's HDF5 checkpoint: nested groups become dicts, datasets NumPy values; its
    `user_dict` (a hex-encoded pickle) is read with no class allowed beyond Python's literals."""
    try:
        import h5py
    except ImportError as error:
        raise ImportError(f"checkpoint '{os.fspath(path)}' is an HDF5 file of the original ORTTrainer; reading it "
                          "needs h5py: pip install h5py") from error

    def read(group):
        return {key: read(item) if isinstance(item, h5py.Group) else item[()] for key, item in group.items()}

    try:
        with h5py.File(path, "r") as file:
            state = read(file)
    except OSError as error:  # h5py's error for a damaged file
        raise ValueError(f"checkpoint '{os.fspath(path)}' is a truncated or corrupt HDF5 file ({error})") from error
    if "user_dict" in state:
        state["user_dict"] = _LiteralUnpickler(io.BytesIO(bytes.fromhex(_text(state["user_dict"])))).load()
    return state


class _LiteralUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, tuples, str, bytes, numbers, bools and None; refuses every class
    (a checkpoint must not run code when it is read)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"the checkpoint's user_dict holds a {module}.{name}, which is not loaded "
                                     "(only Python literals are)")
