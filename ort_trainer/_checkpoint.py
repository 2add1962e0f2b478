"""Checkpoint files: atomic writes, ``weights_only`` reads, and key/shape comparison.

The trainer's state (per-parameter optimizer state, the checks before a load) is assembled and
checked here too. Files are plain
``torch.save`` archives of weights-only values, so ``torch.load(path, weights_only=True)['model']``
loads into a torch model without ort-trainer.
"""
import os
import pickle
import secrets
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from copy import deepcopy
from typing import BinaryIO

import torch

from ._legacy_checkpoint import read_hdf5

FORMAT = "ort-trainer-checkpoint"
FORMAT_VERSION = 1
_RESERVED = ("format", "format_version")
_LEAVES = (torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None))  # exact types: no numpy scalars
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _check_values(value, path: str) -> None:
    """Raise TypeError naming the first value that ``torch.load(weights_only=True)`` would refuse."""
    if type(value) in _LEAVES:
        return
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in (str, int):
                raise TypeError(f"cannot save checkpoint: {path} has a key {key!r} of type {type(key).__name__}; "
                                f"keys must be str or int")
            _check_values(item, f"{path}[{key!r}]")
    elif type(value) in (list, tuple):
        for index, item in enumerate(value):
            _check_values(item, f"{path}[{index}]")
    else:
        cls = type(value)
        raise TypeError(f"cannot save checkpoint: {path} is a {cls.__module__}.{cls.__qualname__}; values must be "
                        f"torch tensors, int, float, bool, str, None, or lists, tuples and dicts of those")


def atomic_write(path, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write(file)`` on a temporary file in ``path``'s directory, flush it to disk, then rename it
    over ``path``: a crash or an error leaves either the old file or the new one, never a partial file."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot write '{path}': directory '{directory}' does not exist")
    existing_mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else None
    # Created with mode 0o666 (not tempfile's 0o600) so the kernel applies the umask, and a directory's
    # default ACL, as for a plain open(): the umask is never read (reading it means setting it, a race
    # with other threads creating files). O_EXCL: a random name that already exists is never reused.
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        if existing_mode is not None:  # an overwritten file keeps its permissions
            os.chmod(temporary, existing_mode)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def save(path, state: Mapping) -> None:
    """Write ``state`` plus the format keys to ``path`` atomically (``atomic_write``), after checking
    that every value is one ``torch.load(weights_only=True)`` reads back."""
    if not isinstance(state, Mapping):
        raise TypeError(f"cannot save checkpoint: state must be a dict, got {type(state).__name__}")
    reserved = [key for key in _RESERVED if key in state]
    if reserved:
        raise ValueError(f"cannot save checkpoint: state must not contain the reserved keys {reserved}")
    _check_values(dict(state), "state")
    atomic_write(path, lambda file: torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, **state}, file))


def _first_sentence(error: BaseException) -> str:
    """'Type: first sentence' of an error (torch's messages go on for paragraphs)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0].split('. ')[0]}" if text else type(error).__name__


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
                         f"torch.load(weights_only=True) refuses ({_first_sentence(error.__context__ or error)})"
                         ) from error
    except OSError:
        raise
    except Exception as error:  # a damaged archive: zipfile.BadZipFile, torch's RuntimeError, ...
        raise ValueError(f"checkpoint '{path}' is truncated or corrupt ({_first_sentence(error)})") from error
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
    return {key: value for key, value in state.items() if key not in _RESERVED}


def _listed(items: list[str], more: str = "more", limit: int = 10) -> list[str]:
    return items[:limit] + ([f"... and {len(items) - limit} {more}"] if len(items) > limit else [])


def compare_keys(what: str, expected: Mapping, actual: Mapping) -> None:
    """Raise one ValueError listing every key missing from or unexpected in ``actual`` (the checkpoint)
    and every tensor whose shape or dtype differs from ``expected`` (the model); None if all match."""
    missing = sorted((key for key in expected if key not in actual), key=str)
    unexpected = sorted((key for key in actual if key not in expected), key=str)
    mismatches = []
    for key in sorted((key for key in expected if key in actual), key=str):
        want, got = expected[key], actual[key]
        if isinstance(want, torch.Tensor) != isinstance(got, torch.Tensor):
            mismatches.append(f"type mismatch for {key!r}: checkpoint {type(got).__name__} vs model "
                              f"{type(want).__name__}")
        elif isinstance(want, torch.Tensor):
            if want.shape != got.shape:
                mismatches.append(f"shape mismatch for {key!r}: checkpoint {tuple(got.shape)} vs model "
                                  f"{tuple(want.shape)}")
            if want.dtype != got.dtype:
                mismatches.append(f"dtype mismatch for {key!r}: checkpoint {got.dtype} vs model {want.dtype}")
    problems = [f"{name} keys [{', '.join(_listed([repr(key) for key in keys]))}]"
                for name, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
    problems += _listed(mismatches, "more mismatches")
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))


def check_component_state(owner, state) -> str:
    """The common checks of a scheduler's or scaler's load_state_dict: a dict with exactly the keys
    of ``owner.state_dict()`` and ``owner``'s type. Returns the error prefix for further checks."""
    name = type(owner).__name__
    prefix = f"Invalid {name} state_dict"
    if not isinstance(state, Mapping):
        raise TypeError(f"{prefix}: expected a dict, got {type(state).__name__}")
    compare_keys(prefix, owner.state_dict(), state)
    if state["type"] != name:
        raise ValueError(f"{prefix}: type: must be {name!r}, got {state['type']!r}")
    return prefix


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


def check_trainer_state(state_dict, *, model, optimizer_name, optimizer_state_names, trained, components,
                        strict, optimizer_built, accumulation_steps):
    """Every check `ORTTrainer.load_state_dict` makes before it changes anything.

    trained: {torch name: parameter} the optimizer updates; components: {'lr_scheduler': object or
    None, 'loss_scaler': ...}; optimizer_built: whether the flat optimizer exists (before it does,
    only the saved state of parameters this model trains is compared); accumulation_steps: the
    trainer's gradient_accumulation_steps (a checkpoint must resume at the start of a cycle)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
    compare_keys("load_state_dict: sections", dict.fromkeys(SECTIONS), state_dict)
    current, saved = model.state_dict(), state_dict["model"]
    if strict:
        compare_keys("load_state_dict: state_dict['model']", current, saved)
    else:
        compare_keys("load_state_dict: state_dict['model']", {k: v for k, v in current.items() if k in saved},
                     {k: v for k, v in saved.items() if k in current})
    optimizer = state_dict["optimizer"]
    if not isinstance(optimizer, dict):
        raise TypeError(f"load_state_dict: state_dict['optimizer'] must be a dict, got {type(optimizer).__name__}")
    compare_keys("load_state_dict: state_dict['optimizer']", dict.fromkeys(("name", "step_count", "state")), optimizer)
    step_count = optimizer["step_count"]
    if not isinstance(step_count, int) or isinstance(step_count, bool) or step_count < 0:
        raise ValueError(f"load_state_dict: state_dict['optimizer']['step_count'] must be an int >= 0, "
                         f"got {step_count!r}")
    if optimizer.get("name") != optimizer_name:
        raise ValueError(f"load_state_dict: the checkpoint's optimizer is {optimizer.get('name')!r}, "
                         f"this trainer's is {optimizer_name!r}")
    for state_name in optimizer_state_names:
        per_parameter = optimizer["state"].get(state_name, {}) if optimizer["state"] else None
        if per_parameter is None:
            continue  # saved before the first step: no optimizer state yet
        expected = trained
        if not optimizer_built:
            per_parameter = {k: v for k, v in per_parameter.items() if k in trained}
            expected = {k: v for k, v in trained.items() if k in optimizer["state"][state_name]}
        compare_keys(f"load_state_dict: state_dict['optimizer']['state'][{state_name!r}]", expected, per_parameter)
    info = state_dict["train_step_info"]
    for key in ("step", "optimization_step"):
        value = info.get(key) if isinstance(info, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"load_state_dict: train_step_info[{key!r}] must be an int >= 0, got {value!r}")
    if info["step"] % accumulation_steps:
        raise ValueError(f"load_state_dict: train_step_info['step']={info['step']} is micro-step "
                         f"{info['step'] % accumulation_steps} of a gradient-accumulation cycle for this trainer's "
                         f"batch.gradient_accumulation_steps={accumulation_steps}, and a checkpoint holds no "
                         "accumulated gradients: resume with a gradient_accumulation_steps that divides it")
    for name, component in components.items():
        if (component is None) != (state_dict[name] is None):
            raise ValueError(f"load_state_dict: the checkpoint {'has no' if component else 'has'} {name} state, "
                             f"and this trainer {'has' if component else 'has no'} {name}")
        if component is not None:
            deepcopy(component).load_state_dict(state_dict[name])  # validates, changes nothing


def plain(value):
    """Options as plain values for a checkpoint (a record of the run; not applied on load):
    objects (scheduler, scaler, callables) become their type names; their state is saved apart."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__
