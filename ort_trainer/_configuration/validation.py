"""Schema loading and validation: the one place that reads ``schemas/*.yaml`` and talks to cerberus.

``validate(schema_name, document, prefix)`` returns the normalized document or raises one
``ValueError`` that lists every failing field as ``path: constraint, got value``, sorted.
"""
import copy
import functools
import importlib.resources
import numbers
import os
import re
import reprlib
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import cerberus
import torch
import yaml
from cerberus import TypeDefinition
from cerberus.errors import UNKNOWN_FIELD

TORCH_DTYPES = {
    name: getattr(torch, name)
    for name in ("bfloat16", "bool", "float16", "float32", "float64", "int8", "int32", "int64", "uint8")
}


@functools.cache
def _read_schema(name: str) -> dict:
    text = importlib.resources.files("ort_trainer.schemas").joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def load_schema(name: str) -> dict:
    """The schema ``schemas/<name>.yaml`` (read once; a copy, since cerberus expands schemas in place)."""
    return copy.deepcopy(_read_schema(name))


def directory_problem(path):
    """Why `path` cannot hold the cache (None when it can): an existing writable directory, or a
    path whose nearest existing parent is a writable directory (the cache creates it)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing!r} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing!r} is not writable"
    return None


@runtime_checkable
class _LRSchedulerLike(Protocol):
    def get_lr(self, train_step_info): ...


@runtime_checkable
class _LossScalerLike(Protocol):
    def update(self, train_step_info): ...

    def reset(self): ...


@runtime_checkable
class _SessionOptionsLike(Protocol):
    """Duck type of ``onnxruntime.SessionOptions``, so validation does not import onnxruntime."""

    def add_session_config_entry(self, key, value): ...


CPU_PROVIDER, CUDA_PROVIDER = "CPUExecutionProvider", "CUDAExecutionProvider"
# CUDA provider options the trainer sets itself: the device from device.id, the stream it owns.
TRAINER_CUDA_OPTIONS = ("device_id", "has_user_compute_stream", "user_compute_stream")

# How each type name reads in an error message ("must be <this>, got ...").
_TYPE_NAMES = {
    "boolean": "a bool",
    "integer": "an int",
    "number": "a number",
    "string": "a str",
    "list": "a list",
    "dict": "a dict",
    "callable": "callable",
    "lr_scheduler": "an LR scheduler (an object with get_lr())",
    "loss_scaler": "a loss scaler (an object with update() and reset())",
    "session_options": "an onnxruntime.SessionOptions",
    "cast_strategy": "a PropagateCastOpsStrategy or its name",
    "input_entry": "a (name, shape) or (name, shape, dtype) tuple",
    "output_entry": "a (name, shape) or (name, shape, is_loss) tuple",
}


class Validator(cerberus.Validator):
    """cerberus with strict numbers (bool is not a number), our object types, and our custom rules."""

    types_mapping = {
        **cerberus.Validator.types_mapping,
        "integer": TypeDefinition("integer", (numbers.Integral,), (bool,)),
        "number": TypeDefinition("number", (numbers.Real,), (bool,)),
        "callable": TypeDefinition("callable", (Callable,), ()),
        "lr_scheduler": TypeDefinition("lr_scheduler", (_LRSchedulerLike,), ()),
        "loss_scaler": TypeDefinition("loss_scaler", (_LossScalerLike,), ()),
        "session_options": TypeDefinition("session_options", (_SessionOptionsLike,), ()),
        "cast_strategy": TypeDefinition("cast_strategy", (str,), ()),  # after the cast_strategy coercion
        # model_desc entries, after the tuple -> dict coercion below
        "input_entry": TypeDefinition("input_entry", (Mapping,), ()),
        "output_entry": TypeDefinition("output_entry", (Mapping,), ()),
    }

    def _normalize_default(self, mapping, schema, field):
        """{'nullable': True}"""
        # Only a missing field gets its default. cerberus also fills an explicit None in a field that
        # is not nullable; kept, the nullable rule reports it by name (the caller asked for None).
        if field not in mapping:
            super()._normalize_default(mapping, schema, field)

    def _validate_nullable(self, nullable, field, value):
        """{'type': 'boolean'}"""
        super()._validate_nullable(nullable, field, value)
        if value is None:  # None is settled here; no other rule (check_with, interval) should see it
            self._drop_remaining_rules()

    def _validate_interval(self, interval, field, value):
        """Numeric range in math notation, for example '[0, 1)' or '(0, inf)'; NaN is never inside.

        The rule's arguments are validated against this schema:
        {'type': 'string'}
        """
        low, high = (float(bound) for bound in interval[1:-1].split(","))
        above_low = value >= low if interval[0] == "[" else value > low
        below_high = value <= high if interval[-1] == "]" else value < high
        if not (above_low and below_high):
            self._error(field, f"must be in {interval}, got {_show(value)}")

    # ---- coercers (normalization; they never raise, the validation rules report bad values)
    def _normalize_coerce_to_float(self, value):
        return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value

    def _normalize_coerce_torch_dtype(self, value):
        return TORCH_DTYPES.get(value, value) if isinstance(value, str) else value

    def _normalize_coerce_cast_strategy(self, value):
        """PropagateCastOpsStrategy (ours, or ONNX Runtime's pybind enum of the same name) -> its name."""
        return value.name if type(value).__name__ == "PropagateCastOpsStrategy" else value

    def _normalize_coerce_input_entry(self, value):
        return _entry_to_dict(value, ("name", "shape", "dtype"))

    def _normalize_coerce_output_entry(self, value):
        return _entry_to_dict(value, ("name", "shape", "is_loss"))

    # ---- check_with rules
    def _check_with_device_id(self, field, value):
        if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
            self._error(field, f"must be 'cpu', 'cuda' or 'cuda:N' (N a device index), got {_show(value)}")

    def _check_with_file_path(self, field, value):
        """A path a graph is written to: '' (not written) or a file, not a directory."""
        if value and (value.endswith(("/", os.sep)) or os.path.isdir(value)):
            self._error(field, f"must be a file path, got {_show(value)} (a directory)")

    def _check_with_cache_directory(self, field, value):
        """'' (no cache) or a directory the graph cache can write to (created if missing)."""
        problem = directory_problem(value) if value else None
        if problem is not None:
            self._error(field, f"must be a directory the graph cache can write to (created if missing), got "
                               f"{_show(value)}: {problem}")

    def _check_with_provider_options(self, field, value):
        """A provider of ``provider_options`` (``field``, its options ``value``) must be one the trainer
        runs on, and its options must be ones ONNX Runtime reads and the trainer does not set itself."""
        device = self.root_document.get("device")
        device_id = device.get("id") if isinstance(device, Mapping) else None
        on_cuda = isinstance(device_id, str) and device_id.startswith("cuda")
        runs_on = [CUDA_PROVIDER, CPU_PROVIDER] if on_cuda else [CPU_PROVIDER]
        if field not in runs_on:
            self._error(field, f"not a provider this trainer runs (device.id={device_id!r} runs on "
                               f"{', '.join(runs_on)})")
        elif field == CPU_PROVIDER and value:
            self._error(field, f"the CPU provider reads no options (ONNX Runtime would ignore them), got "
                               f"{_show(value)}; session_options holds the CPU settings")
        elif field == CUDA_PROVIDER:
            for key in (key for key in TRAINER_CUDA_OPTIONS if key in value):
                self._error(field, f"{key!r} is set by the trainer (from device.id, and the stream the trainer owns), "
                                   f"got {_show(value[key])}")
            mem_limit = device.get("mem_limit")
            if "gpu_mem_limit" in value and mem_limit:
                self._error(field, f"'gpu_mem_limit' and device.mem_limit={mem_limit} both limit the CUDA arena, "
                                   f"got {_show(value['gpu_mem_limit'])}; set one of them")

    def _check_with_recompute_layers(self, field, value):
        group = self.root_document.get("graph_transformer")
        if value and not (isinstance(group, Mapping) and group.get("transformer_layer_recompute") is True):
            self._error(field, "needs graph_transformer.transformer_layer_recompute=True (it counts the layers that "
                               f"one recomputes), got {value!r}")

    def _check_with_torch_dtype(self, field, value):
        if not any(value is dtype for dtype in TORCH_DTYPES.values()):
            allowed = ", ".join(map(repr, TORCH_DTYPES))
            self._error(field, f"must be a torch.dtype or one of {allowed}, got {_show(value)}")

    def _check_with_unique_names(self, field, value):
        names = [entry["name"] for entry in value if isinstance(entry, Mapping) and isinstance(entry.get("name"), str)]
        self._error_on_duplicates(field, names, "names")

    def _check_with_unique_items(self, field, value):
        self._error_on_duplicates(field, list(value), "entries")

    def _check_with_one_loss(self, field, value):
        if not all(isinstance(entry, Mapping) and isinstance(entry.get("is_loss"), bool) for entry in value):
            return  # the malformed entries have their own errors
        losses = [repr(entry["name"]) for entry in value if entry["is_loss"]]
        if len(losses) != 1:
            got = f"{len(losses)}: {', '.join(losses)}" if losses else "none"
            self._error(field, f"exactly one output must have is_loss=True, got {got}")

    def _check_with_param_group(self, field, value):
        if set(value) <= {"params"}:
            self._error(field, f"must set at least one hyperparameter besides 'params', got {_show(value)}")

    def _check_with_disjoint_groups(self, field, value):
        first_group = {}
        for index, group in enumerate(value):
            names = group.get("params") if isinstance(group, Mapping) else None
            if not isinstance(names, list | tuple):
                continue  # reported by the group's own rules
            for name in dict.fromkeys(name for name in names if isinstance(name, str)):  # repeats: unique_items
                if first_group.setdefault(name, index) != index:
                    self._error(field, f"{name!r} is in groups {first_group[name]} and {index}")

    def _check_with_global_only(self, field, value):
        self._error(field, f"cannot be set per parameter group ({field} is global), got {_show(value)}")

    def _error_on_duplicates(self, field, items, what):
        duplicates = sorted({repr(item) for item in items if items.count(item) > 1})
        if duplicates:
            self._error(field, f"{what} must be unique, got {', '.join(duplicates)} more than once")


def _entry_to_dict(value, keys):
    """``(name, shape[, third])`` -> dict, so each element gets its own rules and error path."""
    if isinstance(value, list | tuple) and 2 <= len(value) <= 3:
        return dict(zip(keys, value))
    return value


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80
_repr.maxlist = _repr.maxtuple = _repr.maxdict = 8


def _show(value) -> str:
    """Short repr of a received value."""
    return _repr.repr(value)


def _type_name(value) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _allowed_keys(schema: dict, path) -> str:
    """Keys the schema allows in the dict at ``path`` (per-group-forbidden keys left out)."""
    rules = {"schema": schema}
    for key in path:
        rules = rules["schema"] if isinstance(key, int) else rules["schema"][key]
    return ", ".join(sorted(key for key, rule in rules["schema"].items() if rule.get("check_with") != "global_only"))


def _type_message(type_names, value) -> str:
    expected = " or ".join(_TYPE_NAMES[name] for name in ([type_names] if isinstance(type_names, str) else type_names))
    return f"must be {expected}, got {_show(value)} ({_type_name(value)})"


# Message per cerberus rule (those our schemas use): (constraint, value) -> text.
_RULE_MESSAGES = {
    "required": lambda constraint, value: "required field",
    "nullable": lambda constraint, value: "must not be None",
    "empty": lambda constraint, value: "must not be empty",
    "min": lambda constraint, value: f"must be >= {constraint}, got {_show(value)}",
    "max": lambda constraint, value: f"must be <= {constraint}, got {_show(value)}",
    "minlength": lambda constraint, value: f"must have at least {constraint} item(s), got {len(value)}",
    "allowed": lambda constraint, value: f"must be one of {', '.join(map(repr, constraint))}, got {_show(value)}",
    "type": _type_message,
}


def _describe(error, schema: dict) -> str:
    """One error as 'must be ..., got ...'."""
    if error.code == UNKNOWN_FIELD.code:
        return f"unknown field (allowed: {_allowed_keys(schema, error.document_path[:-1])})"
    if error.rule is None:  # custom error from a check_with or the interval rule: the message is complete
        return error.info[0]
    return _RULE_MESSAGES[error.rule](error.constraint, error.value)


def _leaf_errors(errors):
    for error in errors:
        if error.is_group_error:
            yield from _leaf_errors(error.child_errors)
        else:
            yield error


def _path_sort_key(path) -> tuple:
    """Dict keys by name, list indices by number."""
    return tuple((0, key, "") if isinstance(key, int) else (1, 0, key) for key in path)


def _format_path(path) -> str:
    return "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in path).lstrip(".")


def _copy_containers(value):
    """Copy mappings (as dicts), lists and tuples, keeping user objects as they are.

    On the way in, cerberus can only copy plain containers (not e.g. a config's read-only groups); on
    the way out, it hands list/dict defaults out as objects shared between documents.
    """
    if isinstance(value, Mapping):
        return {key: _copy_containers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy_containers(item) for item in value]
    if isinstance(value, tuple):  # named tuples too (model_desc entries): the schema reads them by position
        return tuple(_copy_containers(item) for item in value)
    return value


def validate(schema_name: str, document, prefix: str) -> dict:
    """Normalize and validate ``document`` against ``schemas/<schema_name>.yaml``.

    Returns the normalized document (defaults filled, containers copied). Raises ``TypeError`` if
    ``document`` is not a dict, else ``ValueError(f"{prefix}: path: message; ...")`` naming every
    failing field, the value received and the constraint, sorted by path.
    """
    if not isinstance(document, Mapping):
        raise TypeError(f"{prefix}: expected a dict, got {_type_name(document)}")
    schema = load_schema(schema_name)
    validator = Validator(schema)
    if validator.validate(_copy_containers(document)):
        return _copy_containers(validator.document)
    problems = sorted(
        (_path_sort_key(error.document_path), _format_path(error.document_path), _describe(error, schema))
        for error in _leaf_errors(validator._errors)
    )
    raise ValueError(f"{prefix}: " + "; ".join(f"{path}: {message}" for _, path, message in problems))
