"""How model_desc's inputs reach `model.forward` and `loss_fn`, and how what the model returns
becomes model_desc's outputs. The rule, in one place (README "Inputs and outputs"):

Inputs
1. By name. A model_desc input whose name is a parameter of `forward()` is passed by keyword,
   as the original ORTTrainer did. With a `loss_fn`, the inputs `forward()` does not name are
   the labels: `loss_fn(model_output, *labels)`, in model_desc order. Without one, every input
   must be a `forward()` parameter (or `forward()` takes `**kwargs`).
2. By position, only when no model_desc name is a `forward()` parameter (`nn.Sequential`'s
   `forward(input)`, a `forward(*args)`): the leading inputs go to `forward()` in order; without
   a `loss_fn` all of them; with one, as many as `forward()` requires (`forward(*args)`: all but
   the last), and the rest are the labels.
3. Anything else (a required `forward()` parameter no input feeds, inputs `forward()` cannot take
   without a `loss_fn`, ...) is an error showing `forward()`'s signature and the model_desc names.
- `None` for an input passed by keyword means "not passed": `forward()`'s default applies. Which
  inputs are None is part of the input signature (its own compiled graph).
- A `forward()` that takes `use_cache` (Hugging Face models) gets `use_cache=False` unless
  model_desc names it: a cache is not a tensor a graph can return, and training never reads it.

Outputs
- With a `loss_fn` the loss is `loss_fn`'s result; the other declared outputs come from what the
  model returns. Without one, every declared output (the loss too) comes from the model.
- A dict or `ModelOutput` is read by name when it has every declared name; when it has none of
  them, like a tuple, list or tensor: its tensors in order, those of transformers caches and
  pytree-registered containers included (other non-tensor entries skipped). A declared output the
  model does not produce is an error naming it.
- Outputs model_desc does not declare are neither computed nor returned (the graph never
  contains them).
"""
import contextlib
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

from .._configuration.ortmodule_settings import FallbackPolicy
from .._configuration.refusals import Refusal

_NO_CACHE = {"use_cache": False}
_INVALID = "Invalid model_desc: "


class BindingError(Refusal, ValueError):
    """model_desc and the model's forward()/outputs do not fit together."""

    fallback = FallbackPolicy.FALLBACK_UNSUPPORTED_DATA


@dataclass(frozen=True)
class InputBinding:
    """Where each model_desc input goes. `names`: model_desc's input names, in order."""

    names: tuple[str, ...]
    positional: tuple[str, ...]            # passed to forward() by position, in this order
    keyword: tuple[str, ...]               # passed to forward() by keyword
    labels: tuple[str, ...]                # passed to loss_fn after the model's output
    optional: frozenset[str]               # may be None: then not passed at all
    constant_keywords: Mapping[str, object] = field(default_factory=dict)
    signature: str = ""                    # forward()'s signature, for error messages
    structures: Mapping[str, "Structure"] = field(default_factory=dict)  # arguments holding tensors inside

    @property
    def model_inputs(self) -> tuple[str, ...]:
        """The inputs forward() reads, in model_desc order."""
        return tuple(name for name in self.names if name not in self.labels)

    def call_model(self, model, values):
        """`model(...)` on {name: tensor or None}; a None keyword input is left out."""
        keywords = {name: self._argument(name, values) for name in self.keyword
                    if name in self.structures or values.get(name) is not None}
        return model(*(self._argument(name, values) for name in self.positional), **keywords,
                     **self.constant_keywords)

    def _argument(self, name, values):
        structure = self.structures.get(name)
        return values[name] if structure is None else structure.rebuild(values)

    def check_value(self, method, name, value):
        """Raises for a None the binding cannot leave out."""
        if value is None and name not in self.optional:
            if name in self.labels:
                why = "it is a label for loss_fn"
            elif name in self.positional:
                why = "it is passed to forward() by position"
            else:
                why = f"forward{self.signature} has no default for {name!r}"
            raise BindingError(f"{method}(): input {name!r} is None, but {why}; pass a tensor")


@dataclass(frozen=True)
class Structure:
    """An argument holding tensors inside lists, tuples, dicts or named tuples (any container
    torch's pytree flattens): its tensors are inputs of their own, named after their place
    (`batch.input_ids`, `pair.0`), everything else is kept as passed. `key` tells calls apart."""

    spec: pytree.TreeSpec
    leaves: tuple  # per leaf: (True, input name) for a tensor, (False, value) for anything else

    @classmethod
    def flatten(cls, name, value):
        """(Structure, {input name: tensor}) of argument `name`."""
        try:
            paths, spec = pytree.tree_flatten_with_path(value)
        except ValueError:  # a container type registered without key paths (ModelOutput): places by index
            leaves, spec = pytree.tree_flatten(value)
            paths = [((pytree.SequenceKey(index),), leaf) for index, leaf in enumerate(leaves)]
        tensors, leaves = {}, []
        for path, leaf in paths:
            if isinstance(leaf, torch.Tensor):
                input_name = ".".join([name, *(_key_name(key) for key in path)])
                tensors[input_name] = leaf
                leaves.append((True, input_name))
            else:
                leaves.append((False, leaf))
        return cls(spec, tuple(leaves)), tensors

    def rebuild(self, values):
        return pytree.tree_unflatten([values[leaf] if is_input else leaf for is_input, leaf in self.leaves], self.spec)

    @property
    def key(self):
        return self.spec, tuple((is_input, leaf if is_input else (type(leaf), leaf)) for is_input, leaf in self.leaves)


def _key_name(key):
    for attribute in ("idx", "key", "name"):  # SequenceKey, MappingKey, GetAttrKey
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def bind_inputs(model, input_names, has_loss_fn):
    """The InputBinding of model_desc's inputs to `model.forward` (rule in the module docstring)."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        raise BindingError(_INVALID + f"cannot read the signature of {type(model).__name__}.forward()") from None
    signature = str(inspect.signature(model.forward))
    names = tuple(input_names)
    kinds = inspect.Parameter
    by_name = {p.name: p for p in parameters if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    takes_kwargs = any(p.kind is kinds.VAR_KEYWORD for p in parameters)
    described = f"forward{signature} and model_desc inputs {list(names)}"
    constant = {key: value for key, value in _NO_CACHE.items() if key in by_name and key not in names}

    matched = [name for name in names if name in by_name]
    if matched:
        unnamed = [name for name in names if name not in by_name]
        if has_loss_fn:
            keyword, labels = tuple(matched), tuple(unnamed)
            if not labels:
                raise BindingError(_INVALID + "with a loss_fn at least one input must be a label (an input forward() "
                                   f"does not take), but forward() takes every one: {described}")
        elif takes_kwargs or not unnamed:
            keyword, labels = names, ()
        else:
            raise BindingError(_INVALID + f"inputs {unnamed} are not parameters of forward() and there is no loss_fn "
                               f"to take them as labels: {described}. Rename them after forward()'s parameters, or "
                               "pass a loss_fn")
        missing = [p.name for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD,
                                                            kinds.KEYWORD_ONLY)
                   and p.default is kinds.empty and p.name not in keyword]
        if missing:
            raise BindingError(_INVALID + f"forward() parameters {missing} have no default and no model_desc input of "
                               f"that name: {described}. Name the inputs after forward()'s parameters")
        optional = frozenset(name for name in keyword if name in by_name and by_name[name].default is not kinds.empty)
        return InputBinding(names, (), keyword, labels, optional, constant, signature)

    positional = [p for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is kinds.empty]
    takes_args = any(p.kind is kinds.VAR_POSITIONAL for p in parameters)
    if not has_loss_fn:
        count = len(names)
        if count < len(required) or (count > len(positional) and not takes_args):
            raise BindingError(_INVALID + f"forward() takes {len(required)} to {len(positional)} positional inputs, "
                               f"but model_desc has {count} and no loss_fn to take the rest as labels: {described}")
    elif takes_args and not positional:
        count = len(names) - 1
    elif len(required) == len(positional) and not takes_args:
        count = len(required)
    else:
        raise BindingError(_INVALID + f"cannot tell which inputs go to forward() and which are labels for loss_fn: no "
                           f"model_desc input is named after a forward() parameter, and forward() has optional "
                           f"positional parameters: {described}. Name the inputs after forward()'s parameters")
    if has_loss_fn and not 0 < count < len(names):
        raise BindingError(_INVALID + f"forward() takes {count} positional inputs, so model_desc's {len(names)} inputs "
                           "leave "
                           f"{'no label for loss_fn' if count >= len(names) else 'nothing for forward()'}: "
                           f"{described}")
    return InputBinding(names, names[:count], (), names[count:], frozenset(), constant, signature)


def bind_call(model, args, kwargs):
    """How one call `model(*args, **kwargs)` reaches `forward()`, for a wrapper that sees calls
    instead of a model_desc (ORTModule): (InputBinding, {input name: tensor}).

    The tensor arguments are the inputs, named after forward()'s parameters (`<name>_<i>` for the
    items of a `*args`, their keywords for a `**kwargs`), in the call's order; tensors inside
    lists, tuples and dicts are inputs too (`Structure`), the argument rebuilt around them. Every
    other argument (None, flags, sizes) is a constant of the call, passed as given
    (`constant_keywords`). Arguments go by keyword, except positional-only ones and those before
    a non-empty `*args`, which go by position and so must hold tensors. A `use_cache` parameter
    the call leaves out is False, as with bind_inputs. A call that does not fit forward()'s
    signature raises TypeError, as forward() would; a positional argument without a tensor raises
    BindingError.
    """
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        raise BindingError(f"cannot read the signature of {type(model).__name__}.forward()") from None
    arguments = signature.bind(*args, **kwargs).arguments
    kinds = inspect.Parameter
    parameters = signature.parameters
    before_args = set()
    for name, value in arguments.items():
        if parameters[name].kind is kinds.VAR_POSITIONAL and value:
            before_args = {other for other in arguments if parameters[other].kind is kinds.POSITIONAL_OR_KEYWORD}
    values, positional, keyword, constants, structures = {}, [], [], {}, {}
    for name, value in arguments.items():
        kind = parameters[name].kind
        if kind is kinds.VAR_POSITIONAL:
            items, by_position = [(f"{name}_{index}", item) for index, item in enumerate(value)], True
        elif kind is kinds.VAR_KEYWORD:
            items, by_position = list(value.items()), False
        else:
            items, by_position = [(name, value)], kind is kinds.POSITIONAL_ONLY or name in before_args
        for item_name, item in items:
            if isinstance(item, torch.Tensor):
                values[item_name] = item
            elif _tensors(item):
                structures[item_name], tensors = Structure.flatten(item_name, item)
                values.update(tensors)
            elif by_position:
                raise BindingError(f"argument {item_name!r} of forward{signature} is a {type(item).__name__} passed "
                                   "by position; only tensors can be passed by position here (pass it by keyword)")
            else:
                constants[item_name] = item
                continue
            (positional if by_position else keyword).append(item_name)
    for key, value in _NO_CACHE.items():
        if key in parameters and key not in arguments:
            constants[key] = value
    return InputBinding(tuple(values), tuple(positional), tuple(keyword), (), frozenset(), constants,
                        str(signature), structures), values


def select_outputs(output, names):
    """The declared outputs `names`, as a tuple of tensors, from what the model returned."""
    if not names:
        return ()
    if isinstance(output, Mapping):
        present = [name for name in names if name in output]
        if len(present) == len(names):
            for name in names:
                if not isinstance(output[name], torch.Tensor):
                    raise BindingError(f"model output {name!r} is a {type(output[name]).__name__}, not a tensor")
            return tuple(output[name] for name in names)
        if present:
            missing = [name for name in names if name not in output]
            raise BindingError(f"model_desc outputs {missing} are not among the model's outputs "
                               f"{list(output.keys())} ({type(output).__name__})")
    tensors = _tensors(output)
    if len(tensors) < len(names):
        raise BindingError(f"model_desc outputs {list(names[len(tensors):])} are not produced: the model returned "
                           f"{len(tensors)} tensor(s) ({type(output).__name__}) for model_desc outputs {list(names)}")
    return tuple(tensors[:len(names)])


def _tensors(output):
    """The tensors in `output` in order (tuples, lists, dicts, ModelOutputs, transformers caches, other
    containers torch's pytree flattens; other values skipped)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [tensor for item in output for tensor in _tensors(item)]
    attributes = cache_attributes(output)
    if attributes is not None:
        return _tensors(list(attributes.values()))
    node = pytree.SUPPORTED_NODES.get(type(output))
    if node is not None:
        return _tensors(list(node.flatten_fn(output)[0]))
    return []


def cache_attributes(value):
    """The attributes of a transformers cache object (a `Cache`, or one of its layers), in order; None
    for any other value. A cache (DynamicCache and friends, not a pytree node) is plain attributes
    around its layers' key and value tensors: those tensors are outputs, the rest is kept."""
    cache_utils = sys.modules.get("transformers.cache_utils")  # a cache exists only if transformers is loaded
    if cache_utils is None or not isinstance(value, (cache_utils.Cache, cache_utils.CacheLayerMixin)):
        return None
    return vars(value)


@contextlib.contextmanager
def training_flags_kept(model):
    """Restores every module's train/eval flag on exit: they are the user's (a frozen backbone in
    eval mode must stay so), while checks and exports may switch them for a while."""
    flags = [(module, module.training) for module in model.modules()]
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


def present_inputs(values):
    """(names, tensors) of the inputs given, None ones left out, in model_desc order."""
    names = [name for name, value in values.items() if value is not None]
    return names, [values[name] for name in names]
