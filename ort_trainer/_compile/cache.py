"""The compiled graphs a front end keeps: one per input signature, a bounded LRU cache."""
from collections import OrderedDict


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
