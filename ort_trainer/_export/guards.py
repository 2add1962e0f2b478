"""What a trace depends on besides its inputs, so that a compiled graph is reused only while that
holds (as torch.compile's guards do).

A trace runs forward() once and keeps one path through its Python code. That path depends on:
- the model's state: the modules' train/eval flags, their plain Python attributes (flags, sizes,
  configs, functions, tensors that are not parameters or buffers) and their hooks. `ModuleState`
  reads it; a graph compiled for another state is compiled again.
- tensor values the code turned into Python values (`if x.sum() > 0`, `int(t)`, `t.item()`):
  the trace keeps the branch the sample took and would take it for every input, silently.
  `watch_data_dependence` records those during an export; `DataDependentTraceError` refuses the
  trace. Sizes are not values: a branch on `x.size(0)` is the input signature's business.
"""
import contextlib
import enum
import os
import traceback
from typing import NamedTuple

import torch

from .._configuration.refusals import TorchModelRefused

_MODULE_MACHINERY = frozenset(vars(torch.nn.Module()))  # tables, hook dicts, the train/eval flag
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOKS = tuple(getattr(torch.nn.modules.module, f"_global{name}") for name in _HOOKS)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)
_MAX_ITEMS = 64  # a longer list or dict is compared by identity


class TracedState(NamedTuple):
    """One `ModuleState.read()`: what a graph traced in this state may be reused for."""

    flags: tuple  # every module's train/eval flag, in `modules()` order
    attributes: tuple  # the global hooks, then per module its (hooks, plain attributes), frozen


class ModuleState:
    """The state of `model` a trace reads, comparable between calls.

    `read()` gives a TracedState (flags, attributes): every module's train/eval flag; every module's hooks and
    plain attributes, and the attributes of the objects they hold (a Hugging Face config), frozen
    into hashable values, tensors by identity and version (in-place changes count; the model's own
    parameters and buffers by identity alone: the graph reads them on every call). Attributes
    that forward() itself writes (`forgets`) are left out: they change on every call, and no trace
    could depend on them staying put. About 1 ms for a BERT-base (233 modules)."""

    def __init__(self, model):
        self._model = model
        self._written = set()

    def read(self) -> TracedState:
        # the model's parameters and buffers, wherever an attribute holds them too (nn.LSTM's
        # _flat_weights): graph inputs read on every call, so by identity (an optimizer step is
        # an in-place change)
        objects = {id(tensor): ("weight", id(tensor)) for tensor in (*self._model.parameters(), *self._model.buffers())}
        flags = []
        attributes = [tuple(tuple(hooks) for hooks in GLOBAL_HOOKS)]
        for index, module in enumerate(self._model.modules()):
            flags.append(module.training)
            hooks, plain = module_attributes(module, {name for i, name in self._written if i == index})
            attributes.append((tuple((name, tuple(table)) for name, table in hooks),
                               tuple((name, _frozen(value, objects)) for name, value in plain)))
        return TracedState(tuple(flags), tuple(attributes))

    @property
    def written(self):
        """The (module index, attribute name) pairs left out (`forgets`), sorted."""
        return sorted(self._written)

    def forgets_written(self, written):
        """Leaves out the attributes `written` names (pairs as `written` gives them), from now on."""
        self._written.update((int(index), str(name)) for index, name in written)

    def forgets(self, before: TracedState, after: TracedState) -> None:
        """Leaves out, from now on, the attributes that changed between two `read()`s, before and
        after one forward."""
        for index, ((_, old), (_, new)) in enumerate(zip(before.attributes[1:], after.attributes[1:])):
            if old != new:
                old, new = dict(old), dict(new)
                self._written.update((index, name) for name in old.keys() | new.keys()
                                     if old.get(name) != new.get(name))


def module_attributes(module, written=frozenset()):
    """(hooks, plain attributes) of one module, what a trace may read besides its weights:
    [(hook table name, its OrderedDict)] for the tables that hold hooks, [(name, value)] of its
    own attributes other than nn.Module's machinery and the names in `written`, sorted."""
    own = module.__dict__
    hooks = [(name, own[name]) for name in _HOOKS if own.get(name)]
    return hooks, [(name, own[name]) for name in sorted(own.keys() - _MODULE_MACHINERY) if name not in written]


def _frozen(value, objects, depth=0):
    """A hashable stand-in for `value` that changes when it does (`objects`: memo by identity; the
    model's weights are in it)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return objects.get(id(value)) or ("tensor", id(value), value._version)
    if isinstance(value, (tuple, list, dict)) and len(value) <= _MAX_ITEMS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return (type(value), tuple((key, _frozen(item, objects, depth + 1)) for key, item in items))
    if isinstance(value, torch.nn.Module) or callable(value) or depth > 0 or not hasattr(value, "__dict__"):
        return ("object", id(value))
    if id(value) not in objects:  # a config object: its own attributes, one level down
        objects[id(value)] = ("object", id(value), tuple((name, _frozen(item, objects, depth + 1))
                                                         for name, item in vars(value).items()))
    return objects[id(value)]


class DataDependentTraceError(TorchModelRefused):
    """forward() branched on (or computed a Python value from) tensor values during the trace."""

    def __init__(self, places):
        self.places = places
        where = "; ".join(places)
        super().__init__(
            f"the model's forward turns tensor values into Python values ({where}): a traced graph keeps what the "
            "sample gave and would use it for every input, whatever their values. Write that part with tensor "
            "operations (torch.where instead of an if on a tensor), or compute the Python value outside the model "
            "and pass it as an argument")


_CONVERSIONS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy")
_SIZE_OPS = {"aten::size", "aten::numel", "aten::dim", "aten::len", "aten::sym_size", "prim::shape"}
_LIBRARY_DIRS = tuple(os.path.dirname(module.__file__) + os.sep for module in (torch,)) + (
    os.path.dirname(__file__) + os.sep,)


@contextlib.contextmanager
def watch_data_dependence():
    """Context of a trace; yields the list of places (`file:line: code`) where it turned a value
    computed from the inputs, parameters or buffers into a Python value.

    One such place is torch's own and harmless: nn.TransformerEncoder compares its mask with a
    causal one to pick a faster kernel for the same result. A mask computed from the inputs is
    then taken as it is (not causal, as torch does when told is_causal=False), so that the graph
    honours every mask it is given."""
    places, originals = [], {name: getattr(torch.Tensor, name) for name in _CONVERSIONS}
    transformer = torch.nn.modules.transformer
    detect_causal = transformer._detect_is_causal_mask

    def detect_causal_of_constant_masks(mask, is_causal=None, size=None):
        if mask is not None and torch._C._get_tracing_state() is not None and _computed_from_data(mask):
            return bool(is_causal)
        return detect_causal(mask, is_causal, size)

    def watched(name):
        original = originals[name]

        def conversion(tensor, *args, **kwargs):
            if torch._C._get_tracing_state() is not None and _computed_from_data(tensor):
                place = _caller()
                if place not in places:
                    places.append(place)
            return original(tensor, *args, **kwargs)
        return conversion

    try:
        for name in _CONVERSIONS:
            setattr(torch.Tensor, name, watched(name))
        transformer._detect_is_causal_mask = detect_causal_of_constant_masks
        yield places
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        transformer._detect_is_causal_mask = detect_causal


def _computed_from_data(tensor):
    """Whether the traced `tensor` depends on the trace's inputs other than through their sizes."""
    try:
        stack = [torch._C._get_value_trace(tensor)]
    except RuntimeError:  # not a traced value: a constant
        return False
    seen = set()
    while stack:
        node = stack.pop().node()
        if node.kind() == "prim::Param":
            return True
        if node.kind() in _SIZE_OPS:
            continue
        for value in node.inputs():
            if value.unique() not in seen:
                seen.add(value.unique())
                stack.append(value)
    return False


def _caller():
    """`file:line: code` of the innermost frame outside torch and this package."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(_LIBRARY_DIRS):
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "inside torch"
