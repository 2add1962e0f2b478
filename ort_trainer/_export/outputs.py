"""What ORTModule's wrapped forward() returns, as a structure without its tensors (`OutputSchema`):
the graph computes the tensors, the structure is rebuilt around them on every call."""
import torch

from .binding import BindingError

_CONSTANT_LEAVES = (type(None), bool, int, float, str)


class OutputSchema:
    """The structure of what forward() returned, without its tensors: rebuilt around the graph's
    outputs on every call (tuples, lists, named tuples, dicts and Hugging Face ModelOutputs, nested;
    None, numbers and strings kept as returned). Tensors are taken in the order `_export.binding` reads
    them (select_outputs): depth first, mappings by their values. `shapes`, `dtypes`: the tensors'."""

    def __init__(self, output, tensors):
        """`tensors`: a list that receives the tensors of `output`, in order."""
        self._tree = self._describe(output, tensors)
        self.shapes = [list(tensor.shape) for tensor in tensors]
        self.dtypes = [tensor.dtype for tensor in tensors]
        if not tensors:
            raise BindingError(f"forward() returned no tensor ({type(output).__name__})")

    def _describe(self, value, tensors):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return ("tensor",)
        if isinstance(value, dict):
            return ("mapping", type(value), [(key, self._describe(item, tensors)) for key, item in value.items()])
        if isinstance(value, (tuple, list)):
            return ("sequence", type(value), [self._describe(item, tensors) for item in value])
        if isinstance(value, _CONSTANT_LEAVES):
            return ("constant", value)
        raise BindingError(f"forward() returned a {type(value).__name__} among its outputs; an ONNX Runtime graph "
                           "returns tensors (and keeps None, numbers and strings as they were)")

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
        items = [self._rebuild(item, tensors) for item in tree[2]]
        return tree[1](*items) if hasattr(tree[1], "_fields") else tree[1](items)


def output_names(schema):
    """The graph's names of forward()'s output tensors, in order."""
    return [f"output_{index}" for index in range(len(schema.shapes))]
