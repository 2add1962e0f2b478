"""The trainer's checkpoints: reading a file (ours, or the original ORTTrainer's HDF5), the
per-parameter optimizer state, and every check `ORTTrainer.load_state_dict` makes before it
changes anything."""
import os
import pickle
import zipfile
from copy import deepcopy
from dataclasses import dataclass

import torch

from .._checkpoint_files import FORMAT, FORMAT_VERSION, RESERVED_KEYS, compare_keys, first_sentence
from .legacy_checkpoint import read_hdf5

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def load(path) -> dict:
    """Read a checkpoint written by ``save`` (returns the state without the format keys), or an
    HDF5 checkpoint of the original ORTTrainer (returns its state_dict, in its layout).

    Raises FileNotFoundError for a missing file, ValueError for a truncated or corrupt file, a file
    that is not an ort-trainer checkpoint, or one written by a newer ort-trainer.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    with open(path, "rb") as file:
        if file.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE:
            return read_hdf5(path)  # the original ORTTrainer's checkpoint
    try:
        with zipfile.ZipFile(path) as archive:  # torch.save's format; torch itself checks no CRC
            for name in archive.namelist():
                if name.endswith(".pkl"):
                    archive.read(name)  # CRC-checked: a damaged pickle would otherwise read as foreign objects
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # objects outside weights_only's allowlist: save() never writes them
        raise ValueError(f"checkpoint '{path}' is not an ort-trainer checkpoint: it holds objects that "
                         f"torch.load(weights_only=True) refuses ({first_sentence(error.__context__ or error)})"
                         ) from error
    except OSError:
        raise
    except Exception as error:  # a damaged archive: zipfile.BadZipFile, torch's RuntimeError, ...
        raise ValueError(f"checkpoint '{path}' is truncated or corrupt ({first_sentence(error)})") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        if isinstance(state, dict):
            keys = list(state)
            holds = f"a dict with keys {keys[:5]}" + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        else:
            holds = f"a {type(state).__name__}"
        raise ValueError(f"checkpoint '{path}' is not an ort-trainer checkpoint (no 'format': {FORMAT!r}); it holds "
                         f"{holds}. Plain model weights load with torch.load() and model.load_state_dict()")
    version = state.get("format_version")
    if type(version) is not int or version < 1:
        raise ValueError(f"checkpoint '{path}' has an invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(f"checkpoint '{path}' has format_version {version}, newer than this ort-trainer reads "
                         f"({FORMAT_VERSION}); upgrade ort-trainer")
    return {key: value for key, value in state.items() if key not in RESERVED_KEYS}


# ---------------------------------------------------------------- the trainer's state
SECTIONS = ("model", "optimizer", "train_step_info", "lr_scheduler", "loss_scaler", "trainer_options")


def optimizer_state(flat, optimizer):
    """{state name: {torch name: CPU tensor}}: per parameter, so independent of the flat layout."""
    return {state: {name: view.to("cpu", copy=True) for name, view in flat.per_parameter(array).items()}
            for state, array in optimizer.state.items()}


def load_optimizer_state(flat, optimizer, saved):
    """Writes a saved per-parameter optimizer state (`optimizer_state`'s layout, with
    'step_count') into `optimizer`'s flat buffers, all at once (nothing changes on an error)."""
    state = {}
    for state_name, array in optimizer.state.items():
        copy = array.copy()
        for name, view in flat.per_parameter(copy).items():
            view.copy_(saved["state"][state_name][name])
        state[state_name] = copy
    optimizer.load_state_dict({"step_count": saved["step_count"], "state": state})


@dataclass(frozen=True)
class TrainerState:
    """What a state_dict must match to load into a trainer: `ORTTrainer.load_state_dict` checks
    every section (`check`) before it changes anything.

    model: the torch model; optimizer_name and optimizer_state_names: the optimizer's; trained:
    {torch name: parameter} the optimizer updates; optimizer_built: whether the flat optimizer
    exists (before it does, only the saved state of parameters this model trains is compared);
    components: {'lr_scheduler': object or None, 'loss_scaler': ...}; accumulation_steps: the
    trainer's gradient_accumulation_steps (a checkpoint must resume at the start of a cycle)."""

    model: object
    optimizer_name: str
    optimizer_state_names: tuple
    trained: dict
    optimizer_built: bool
    components: dict
    accumulation_steps: int

    def check(self, state_dict, *, strict):
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
        compare_keys("load_state_dict: sections", dict.fromkeys(SECTIONS), state_dict)
        self._check_model(state_dict["model"], strict=strict)
        self._check_optimizer(state_dict["optimizer"])
        self._check_counters(state_dict["train_step_info"])
        self._check_components(state_dict)

    def _check_model(self, saved, *, strict):
        current = self.model.state_dict()
        if strict:
            compare_keys("load_state_dict: state_dict['model']", current, saved)
        else:
            compare_keys("load_state_dict: state_dict['model']", {k: v for k, v in current.items() if k in saved},
                         {k: v for k, v in saved.items() if k in current})

    def _check_optimizer(self, optimizer):
        if not isinstance(optimizer, dict):
            raise TypeError(f"load_state_dict: state_dict['optimizer'] must be a dict, got {type(optimizer).__name__}")
        compare_keys("load_state_dict: state_dict['optimizer']", dict.fromkeys(("name", "step_count", "state")),
                     optimizer)
        step_count = optimizer["step_count"]
        if not isinstance(step_count, int) or isinstance(step_count, bool) or step_count < 0:
            raise ValueError(f"load_state_dict: state_dict['optimizer']['step_count'] must be an int >= 0, "
                             f"got {step_count!r}")
        if optimizer.get("name") != self.optimizer_name:
            raise ValueError(f"load_state_dict: the checkpoint's optimizer is {optimizer.get('name')!r}, "
                             f"this trainer's is {self.optimizer_name!r}")
        for state_name in self.optimizer_state_names:
            per_parameter = optimizer["state"].get(state_name, {}) if optimizer["state"] else None
            if per_parameter is None:
                continue  # saved before the first step: no optimizer state yet
            expected = self.trained
            if not self.optimizer_built:
                per_parameter = {k: v for k, v in per_parameter.items() if k in self.trained}
                expected = {k: v for k, v in self.trained.items() if k in optimizer["state"][state_name]}
            compare_keys(f"load_state_dict: state_dict['optimizer']['state'][{state_name!r}]", expected,
                         per_parameter)

    def _check_counters(self, info):
        for key in ("step", "optimization_step"):
            value = info.get(key) if isinstance(info, dict) else None
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"load_state_dict: train_step_info[{key!r}] must be an int >= 0, got {value!r}")
        steps = self.accumulation_steps
        if info["step"] % steps:
            raise ValueError(f"load_state_dict: train_step_info['step']={info['step']} is micro-step "
                             f"{info['step'] % steps} of a gradient-accumulation cycle for this trainer's "
                             f"batch.gradient_accumulation_steps={steps}, and a checkpoint holds no "
                             "accumulated gradients: resume with a gradient_accumulation_steps that divides it")

    def _check_components(self, state_dict):
        for name, component in self.components.items():
            if (component is None) != (state_dict[name] is None):
                raise ValueError(f"load_state_dict: the checkpoint {'has no' if component else 'has'} {name} state, "
                                 f"and this trainer {'has' if component else 'has no'} {name}")
            if component is not None:
                deepcopy(component).load_state_dict(state_dict[name])  # validates, changes nothing


