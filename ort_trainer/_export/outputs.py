"""What ORTModule's wrapped forward() returns, as a structure without its tensors (`OutputSchema`):
the graph computes the tensors, the structure is rebuilt around them on every call."""
import importlib

import torch
from torch.utils import _pytree as pytree

from .binding import BindingError, cache_attributes
from .fingerprint import NotPortable

_CONSTANT_LEAVES = (type(None), bool, int, float, str, torch.device, torch.dtype, type)


class OutputSchema:
    """The structure of what forward() returned, without its tensors: rebuilt around the graph's
    outputs on every call (tuples, lists, named tuples, dicts and Hugging Face ModelOutputs, nested;
    transformers caches, a new object of the cache's class with the same attributes; other containers
    torch's pytree flattens; None, numbers, strings, devices, dtypes and classes kept as returned).
    Tensors are taken in the order `_export.binding` reads them (select_outputs): depth first,
    mappings by their values, caches by their attributes. `shapes`, `dtypes`: the tensors'."""

    def __init__(self, output, tensors):
        """`tensors`: a list that receives the tensors of `output`, in order."""
        self._tree = self._describe(output, tensors, "output", None)
        self.shapes = [list(tensor.shape) for tensor in tensors]
        self.dtypes = [tensor.dtype for tensor in tensors]
        if not tensors:
            raise BindingError(f"forward() returned no tensor ({type(output).__name__})")

    def _describe(self, value, tensors, path, cache):
        """`path`: where `value` is in the output; `cache`: the path of the cache object holding it, or None."""
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return ("tensor",)
        if isinstance(value, dict):
            return ("mapping", type(value), [(key, self._describe(item, tensors, f"{path}[{key!r}]", cache))
                                             for key, item in value.items()])
        if isinstance(value, (tuple, list)):
            return ("sequence", type(value), [self._describe(item, tensors, f"{path}[{index}]", cache)
                                              for index, item in enumerate(value)])
        if isinstance(value, _CONSTANT_LEAVES):
            return ("constant", value)
        attributes = cache_attributes(value)
        if attributes is not None:
            cache = cache or path
            return ("object", type(value), [(name, self._describe(item, tensors, f"{path}.{name}", cache))
                                            for name, item in attributes.items()])
        node = pytree.SUPPORTED_NODES.get(type(value))
        if node is not None:
            children, context = node.flatten_fn(value)
            return ("pytree", type(value), context,
                    [self._describe(item, tensors, f"{path}[{index}]", cache) for index, item in enumerate(children)])
        if cache is not None:
            raise BindingError(f"forward() returned a {type(value).__name__} at {path}, inside the cache {cache}: "
                               "ORTModule rebuilds a cache around its tensors only when the rest of it is plain values "
                               "(None, numbers, strings, devices, dtypes, classes). Call the model with "
                               "use_cache=False (training does not read the cache)")
        raise BindingError(f"forward() returned a {type(value).__name__} at {path}; an ONNX Runtime graph returns "
                           "tensors (kept in tuples, lists, dicts, transformers caches and containers torch's pytree "
                           "flattens, with None, numbers and strings as they were): register the type with "
                           "torch.utils._pytree.register_pytree_node, or leave it out of the outputs")

    def encoded(self):
        """The schema as JSON-able data (classes by their import path), for the graph cache on disk;
        NotPortable where it holds a value that JSON and import paths cannot say."""
        return {"tree": _encoded(self._tree), "shapes": self.shapes, "dtypes": [str(d) for d in self.dtypes]}

    @classmethod
    def decoded(cls, data):
        """The schema `encoded` gave. ValueError where a class it names cannot be imported."""
        schema = cls.__new__(cls)
        schema._tree = _decoded(data["tree"])
        schema.shapes = data["shapes"]
        schema.dtypes = [getattr(torch, name.removeprefix("torch.")) for name in data["dtypes"]]
        return schema

    def rebuild(self, tensors):
        return self._rebuild(self._tree, iter(tensors))

    def _rebuild(self, tree, tensors):
        kind = tree[0]
        if kind == "tensor":
            return next(tensors)
        if kind == "constant":
            return tree[1]
        if kind == "mapping":
            return tree[1]((key, self._rebuild(item, tensors)) for key, item in tree[2])
        if kind == "object":
            rebuilt = tree[1].__new__(tree[1])
            vars(rebuilt).update((name, self._rebuild(item, tensors)) for name, item in tree[2])
            return rebuilt
        if kind == "pytree":
            return pytree.SUPPORTED_NODES[tree[1]].unflatten_fn([self._rebuild(item, tensors) for item in tree[3]],
                                                                tree[2])
        items = [self._rebuild(item, tensors) for item in tree[2]]
        return tree[1](*items) if hasattr(tree[1], "_fields") else tree[1](items)


def output_names(schema):
    """The graph's names of forward()'s output tensors, in order."""
    return [f"output_{index}" for index in range(len(schema.shapes))]


def _encoded(tree):
    kind = tree[0]
    if kind == "tensor":
        return ["tensor"]
    if kind == "constant":
        return ["constant", _constant(tree[1])]
    if kind in ("mapping", "object"):
        return [kind, _class_path(tree[1]), [[_constant(key), _encoded(item)] for key, item in tree[2]]]
    if kind == "pytree":
        return [kind, _class_path(tree[1]), _constant(tree[2]), [_encoded(item) for item in tree[3]]]
    return [kind, _class_path(tree[1]), [_encoded(item) for item in tree[2]]]


def _decoded(data):
    kind = data[0]
    if kind == "tensor":
        return ("tensor",)
    if kind == "constant":
        return ("constant", _value(data[1]))
    if kind in ("mapping", "object"):
        return (kind, _imported(data[1]), [(_value(key), _decoded(item)) for key, item in data[2]])
    if kind == "pytree":
        return (kind, _imported(data[1]), _value(data[2]), [_decoded(item) for item in data[3]])
    return (kind, _imported(data[1]), [_decoded(item) for item in data[2]])


def _constant(value):
    """A constant of a schema (a leaf, a mapping's key, a pytree context) as JSON-able data."""
    if value is None or isinstance(value, (bool, int, str)):
        return ["plain", value]
    if isinstance(value, float):
        return ["float", repr(value)]
    if isinstance(value, (torch.device, torch.dtype)):
        return [type(value).__name__, str(value)]
    if isinstance(value, type):
        return ["type", _class_path(value)]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_constant(item) for item in value]]
    raise NotPortable(f"forward() returns a structure holding a {type(value).__name__} ({value!r})")


def _value(data):
    kind, value = data
    if kind == "plain":
        return value
    if kind == "float":
        return float(value)
    if kind == "device":
        return torch.device(value)
    if kind == "dtype":
        return getattr(torch, value.removeprefix("torch."))
    if kind == "type":
        return _imported(value)
    return {"list": list, "tuple": tuple}[kind](_value(item) for item in value)


def _class_path(klass):
    path = f"{klass.__module__}:{klass.__qualname__}"
    if "<locals>" in path:
        raise NotPortable(f"forward() returns a {klass.__qualname__}, a class defined inside a function")
    return path


def _imported(path):
    module, qualname = path.split(":")
    value = importlib.import_module(module)
    for name in qualname.split("."):
        value = getattr(value, name)
    if not isinstance(value, type):
        raise ValueError(f"{path} is not a class")
    return value
