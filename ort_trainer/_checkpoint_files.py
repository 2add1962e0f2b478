"""Checkpoint files and state dicts, for everything that saves or loads state (the trainer, LR
schedulers, loss scalers, saved graphs): atomic writes, weights-only values, key and shape
comparison. Files are plain ``torch.save`` archives of weights-only values, so
``torch.load(path, weights_only=True)['model']`` loads into a torch model without ort-trainer.
"""
import os
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import BinaryIO

import torch

FORMAT = "ort-trainer-checkpoint"
FORMAT_VERSION = 1
RESERVED_KEYS = ("format", "format_version")
_LEAVES = (torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None))  # exact types: no numpy scalars


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
    reserved = [key for key in RESERVED_KEYS if key in state]
    if reserved:
        raise ValueError(f"cannot save checkpoint: state must not contain the reserved keys {reserved}")
    _check_values(dict(state), "state")
    atomic_write(path, lambda file: torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, **state}, file))


def first_sentence(error: BaseException) -> str:
    """'Type: first sentence' of an error (torch's messages go on for paragraphs)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0].split('. ')[0]}" if text else type(error).__name__


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
