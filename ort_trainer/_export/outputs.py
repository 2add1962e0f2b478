"""What ORTModule's wrapped forward() returns, as a structure without its tensors (`OutputSchema`):
the graph computes the tensors, the structure is rebuilt around them on every call."""
import torch
from torch.utils import _pytree as pytree

from .binding import BindingError, cache_attributes

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
            return ("pytree", node.unflatten_fn, context,
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
            return tree[1]([self._rebuild(item, tensors) for item in tree[3]], tree[2])
        items = [self._rebuild(item, tensors) for item in tree[2]]
        return tree[1](*items) if hasattr(tree[1], "_fields") else tree[1](items)


def output_names(schema):
    """The graph's names of forward()'s output tensors, in order."""
    return [f"output_{index}" for index in range(len(schema.shapes))]
