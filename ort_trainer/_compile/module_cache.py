"""ORTModule's graphs in the exported-model cache on disk (ORTMODULE_CACHE_DIR, `_compile.disk_cache`).

A new process's first call of a signature looks its graph up before the probe: a hit skips the
probe, the export, ONNX Runtime's builder and the kernel substitutions (`GraphParts` hold what those
decided: the output structure, the attributes forward() writes, the built graph); only the session
is made. The key (`key`) is what the graph was made from: the model (`_export.fingerprint`), the
call's signature (shapes, dtypes, devices, requires_grad, constants, structures), grad mode and
autocast, the settings that change the graph, and the machine (its kernel choices were measured
there). Graphs with custom autograd.Functions (their torch nodes name a table of this process) are
not stored; nor are models the fingerprint cannot describe: said once in the log.

No proof against torch on a hit: the entry is the graph that the same export of the same code and
state gave, not one re-derived for a new shape (ORTModule re-derives none)."""
import logging

from .._export.fingerprint import NotPortable, model_fingerprint, portable_value
from .._onnx import torch_node_operator
from .._torch_node_catalogue import AUTOGRAD_FUNCTION
from .disk_cache import UNDECODABLE, DiskCache, machine
from .module_compiler import GraphParts, ModuleGraph

LOGGER = logging.getLogger("ort_trainer.cache")


class ModuleGraphCache:
    """One ORTModule's view of the cache in `directory` (None: no cache, every method a no-op)."""

    def __init__(self, directory):
        self._disk = None if directory is None else DiskCache(directory)

    def key(self, model, state, binding, values, settings, sessions, *, needs_grad, autocast):
        """The key of this call's graph, or None (no cache, or a model it cannot describe)."""
        if self._disk is None:
            return None
        try:
            return {"front": "ORTModule", "model": model_fingerprint(model, state.written),
                    "inputs": [[name, list(t.shape), str(t.dtype), str(t.device), t.requires_grad]
                               for name, t in values.items()],
                    "positional": list(binding.positional),
                    "constants": portable_value(dict(binding.constant_keywords), "a constant argument"),
                    "structures": [[name, str(s.spec), portable_value(s.leaves, name)]
                                   for name, s in binding.structures.items()],
                    "needs_grad": needs_grad, "autocast": str(autocast),
                    "settings": [settings.opset, settings.compute_optimizer, settings.label_sparsity,
                                 settings.embedding_sparsity, settings.custom_functions, settings.layer_recompute],
                    "machine": machine(sessions)}
        except NotPortable as error:
            self._not_cached(model, error)
            return None

    def load(self, key, model, state, sessions, settings):
        """The cached graph of `key` (the attributes forward() writes left out of `state`), or None."""
        if key is None:
            return None
        entry = self._disk.load(key)
        if entry is None:
            return None
        meta, blobs = entry
        try:
            parts = GraphParts.decoded(meta["parts"], blobs)
            written = meta["written"]
        except UNDECODABLE as error:  # not what `store` wrote: compiled again
            self._disk.discard(key, f"{type(error).__name__}: {error}")
            return None
        graph = ModuleGraph(model, parts, sessions, settings)
        state.forgets_written(written)
        LOGGER.info("ORTModule: the %s graph of %s read from %s", graph.kind, type(model).__name__,
                    self._disk.path(key))
        return graph

    def store(self, key, graph, model, state):
        """Writes the graph's parts under `key` (computed before the graph was compiled)."""
        if key is None:
            return
        functions = any(torch_node_operator(node) == AUTOGRAD_FUNCTION for node in graph.parts.model.graph.node)
        if functions:
            self._not_cached(model, "its graph runs custom autograd.Functions, which only this process can call")
            return
        try:
            meta, blobs = graph.parts.encoded()
        except NotPortable as error:
            self._not_cached(model, error)
            return
        self._disk.store(key, {"parts": meta, "written": state.written}, blobs)

    def _not_cached(self, model, why):
        self._disk.not_cached(f"ORTModule: the graphs of {type(model).__name__}", why)
