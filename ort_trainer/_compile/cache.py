"""The compiled graphs a front end keeps: one per input signature, a bounded LRU cache."""
from collections import OrderedDict
from typing import NamedTuple

from .._export.guards import TracedState


class ModuleSignature(NamedTuple):
    """What one ORTModule graph serves (its key in the GraphCache): the call's inputs (name, shape,
    dtype, device, requires_grad), its positional names, constants and structures, the model's
    tensors (as the inputs), the model's state, the autocast state, whether it needs gradients."""

    inputs: tuple
    positional: tuple
    constants: tuple
    structures: tuple
    model: tuple
    state: TracedState
    autocast: tuple
    needs_grad: bool


class GraphCache:
    """A bounded least-recently-used cache of compiled graphs keyed by input signature."""

    def __init__(self, capacity):
        self._capacity = capacity
        self._graphs = OrderedDict()

    def get(self, signature):
        graph = self._graphs.get(signature)
        if graph is not None:
            self._graphs.move_to_end(signature)
        return graph

    def put(self, signature, graph):
        self._graphs[signature] = graph
        while len(self._graphs) > self._capacity:
            self._graphs.popitem(last=False)

    def __len__(self):
        return len(self._graphs)
