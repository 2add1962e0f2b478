"""A digest of what a trace reads, the same in every process that would trace the same graph: the
key of the exported-model cache on disk (`_compile.disk_cache`).

`_export.guards.ModuleState` compares states within one process (objects by identity); a new
process has new objects, so the digest describes them by value instead:
- code: the source files of the model's classes (every module's, up their class hierarchy), of the
  loss function and of the functions, classes and hooks its modules hold, and of the functions and
  classes those name as globals, followed file by file; the code of torch, transformers, onnx,
  ONNX Runtime and ort_trainer counts by their versions (ort_trainer's also by its sources);
- state: every module's train/eval flag, hooks and plain attributes (those forward() does not
  write), tensors that are not weights by their values;
- weights: every parameter's and buffer's name, shape, dtype and requires_grad.
A value it cannot describe that way (an object inside an object, code without source) raises
`NotPortable`: such models are not cached.
"""
import enum
import functools
import hashlib
import importlib.metadata
import inspect
import json
import linecache
import os
import sys
import types
from pathlib import Path

import torch

from .guards import GLOBAL_HOOKS, module_attributes

_VERSIONED = ("torch", "transformers", "onnx", "onnxruntime", "numpy", "ort_trainer")
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
# Attributes that differ in every process and that no trace reads: transformers' GenerationConfig keeps
# a hash() of itself (salted per process for strings).
_PROCESS_LOCAL = frozenset({"_original_object_hash"})


class NotPortable(ValueError):
    """What the model holds that the digest cannot describe by value (the model is not cached)."""


def library_versions():
    """{library: version} of the libraries a graph depends on, imported or not (a process that has not
    imported transformers has the same key as one that has); ort_trainer's also names a digest of its
    own sources, so an edited checkout counts as new."""
    versions = {"python": "%d.%d" % sys.version_info[:2], "ort_trainer_sources": _own_sources()}
    for name in _VERSIONED:
        module = sys.modules.get(name)
        versions[name] = str(module.__version__) if module is not None else _installed_version(name)
    return versions


@functools.cache
def _installed_version(name):
    """The installed version of a library not imported (None: not installed), without importing it."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _own_sources():
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted([*package.rglob("*.py"), *package.parent.joinpath("schemas").glob("*.yaml")]):
        digest.update(str(path.relative_to(package.parent)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def model_fingerprint(model, written=(), loss_fn=None):
    """A JSON-able description of `model` (and `loss_fn`) as the module docstring says; `written`:
    the (module index, attribute) pairs forward() writes (`ModuleState.written`), left out."""
    weights = {id(t): ("weight", name) for name, t in (*model.named_parameters(), *model.named_buffers())}
    code = _Code()
    state = []
    for index, module in enumerate(model.modules()):
        code.add(type(module))
        hooks, plain = module_attributes(module, written={name for i, name in written if i == index})
        state.append([module.training,
                      [[name, _portable(list(table.values()), weights, code, name)] for name, table in hooks],
                      [[name, _portable(value, weights, code, f"module {index}.{name}")] for name, value in plain]])
    global_hooks = _portable([list(table.values()) for table in GLOBAL_HOOKS], weights, code, "global hooks")
    loss = None if loss_fn is None else _portable(loss_fn, weights, code, "loss_fn")
    tensors = [[name, list(t.shape), str(t.dtype), t.requires_grad]
               for name, t in (*model.named_parameters(), *model.named_buffers())]
    return {"state": state, "global_hooks": global_hooks, "loss_fn": loss, "tensors": tensors,
            "code": code.digests(), "versions": library_versions()}


def portable_value(value, path):
    """A JSON-able description of one value (a call's constant argument) and of the code it holds;
    `path` names it in NotPortable's message."""
    code = _Code()
    return [_portable(value, {}, code, path), code.digests()]


def _portable(value, weights, code, path, depth=0):
    """A JSON-able stand-in for `value` that is equal across processes when `value` is."""
    if isinstance(value, bool) or type(value) in _PLAIN:
        return [type(value).__name__, repr(value)]
    if isinstance(value, enum.Enum):
        return ["enum", _name(type(value)), value.name]
    if isinstance(value, torch.Tensor):
        if id(value) in weights:
            return list(weights[id(value)])
        data = value.detach().cpu().contiguous()
        return ["tensor", str(data.dtype), list(data.shape),
                hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [_portable(item, weights, code, f"{path}[{i}]", depth + 1)
                                       for i, item in enumerate(value)]]
    if isinstance(value, (set, frozenset)):
        return ["set", sorted((_portable(item, weights, code, path, depth + 1) for item in value), key=json.dumps)]
    if isinstance(value, dict):
        return ["dict", [[_portable(key, weights, code, path, depth + 1),
                          _portable(item, weights, code, f"{path}[{key!r}]", depth + 1)] for key, item in value.items()]]
    if isinstance(value, functools.partial):
        return ["partial", _portable(value.func, weights, code, path, depth + 1),
                _portable(value.args, weights, code, path, depth + 1),
                _portable(value.keywords, weights, code, path, depth + 1)]
    if isinstance(value, types.MethodType):
        return ["method", _portable(value.__func__, weights, code, path, depth + 1), _name(type(value.__self__))]
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        code.add(value)
        return ["code", _name(value)]
    if isinstance(value, torch.nn.Module):  # held, not a submodule: its class
        code.add(type(value))
        return ["module", _name(type(value))]
    if depth == 0 and hasattr(value, "__dict__") and not callable(value):  # a config object: its attributes
        code.add(type(value))
        return ["object", _name(type(value)), [[name, _portable(item, weights, code, f"{path}.{name}", depth + 1)]
                                               for name, item in sorted(vars(value).items())
                                               if name not in _PROCESS_LOCAL]]
    raise NotPortable(f"{path} holds a {type(value).__module__}.{type(value).__qualname__}, which cannot be "
                      "compared with another process's")


def _name(obj):
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


class _Code:
    """The source files of classes and functions and of what they name as globals, followed file by
    file; the versioned libraries' by their versions."""

    def __init__(self):
        self._files, self._seen = {}, set()

    def digests(self):
        return sorted(self._files.items())

    def add(self, obj):
        stack = [obj]
        while stack:
            obj = stack.pop()
            if id(obj) in self._seen or _versioned(obj):
                continue
            self._seen.add(id(obj))
            if isinstance(obj, type):
                for klass in obj.__mro__[1:]:
                    stack.append(klass)
                functions = [getattr(item, "__func__", item) for item in vars(obj).values()]
                functions = [f for f in functions if isinstance(f, types.FunctionType)]
                stack.extend(functions)
                self._file(obj, _class_file(obj, functions))
            elif isinstance(obj, types.FunctionType):
                self._file(obj, obj.__code__.co_filename)
                stack.extend(_globals_named(obj))

    def _file(self, obj, filename):
        if filename is None:
            raise NotPortable(f"{_name(obj)} has no source file")
        if filename in self._files:
            return
        if os.path.isfile(filename):
            source = Path(filename).read_bytes()
        else:
            source = "".join(linecache.getlines(filename)).encode()  # an interactive session's cell
            if not source:
                raise NotPortable(f"{_name(obj)}'s source ({filename}) cannot be read")
        self._files[filename] = hashlib.sha256(source).hexdigest()


def _class_file(klass, functions):
    """The file that defines `klass`, or None (a class of C code)."""
    try:
        return inspect.getsourcefile(klass)
    except TypeError:  # a class of an interactive session (no module file): its methods' code names it
        return next((f.__code__.co_filename for f in functions), None)


def _versioned(obj):
    module = getattr(obj, "__module__", None) or ""
    return module.split(".")[0] in (*_VERSIONED, "builtins", "typing", "abc", "collections", "enum", "functools")


def _globals_named(function):
    """The functions and classes `function`'s code (and the code nested in it) names as globals."""
    names, stack = set(), [function.__code__]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    found = (function.__globals__.get(name) for name in names)
    return [obj for obj in found if isinstance(obj, (type, types.FunctionType))]
