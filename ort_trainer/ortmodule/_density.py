"""ORTMODULE_PRINT_INPUT_DENSITY=1: per call input, the share of positions that hold data (a
label that is not the loss's ignore_index, a token that is not the embedding's padding_idx), logged
on a signature's first call and every INTERVAL calls after: how much of a padded batch the graph
computes for nothing (`_graph.input_density` finds those inputs), which losses compute on the labelled
rows (`_graph.label_sparsity`), and which embeddings' per-token layers skip the padding
(`_graph.embedding_sparsity`) or stay dense, and why."""
import logging
import weakref

from .._compile.module_compiler import LOGGER

INTERVAL = 100  # calls of one graph between two reports


class DensityReport:
    """Counts each graph's calls and logs its inputs' density when one is due."""

    def __init__(self):
        self._calls = weakref.WeakKeyDictionary()  # graph -> calls so far

    def __reduce__(self):
        """Pickled (an ORTModule saved) as a new report: the graphs it counted are not pickled."""
        return DensityReport, ()

    def record(self, graph, values):
        """Logs the density of `values` ({input name: tensor or None}) for this call of `graph`
        when due."""
        calls = self._calls.get(graph, 0)
        self._calls[graph] = calls + 1
        if calls % INTERVAL:
            return
        parts = []
        for name, (kind, marker) in graph.density_inputs.items():
            tensor = values.get(name)
            if tensor is not None:
                kept, total = int((tensor != marker).sum()), tensor.numel()
                parts.append(f"{name} {kept:,} of {total:,} positions hold data ({100 * kept / max(total, 1):.1f}%, "
                             f"{kind} {marker})")
        message = "; ".join(parts) or "no input is a loss's labels with an ignore_index or an embedding's indices " \
                                      "with a padding_idx"
        message += "".join(f"; {line}" for line in graph.sparse_losses)
        message += "".join(f"; {outcome.describe()}" for outcome in graph.sparse_embeddings)
        LOGGER.handle(LOGGER.makeRecord(LOGGER.name, logging.INFO, __file__, 0,
                                        f"ORTModule input density, call {calls + 1} of this signature: {message}",
                                        (), None))
