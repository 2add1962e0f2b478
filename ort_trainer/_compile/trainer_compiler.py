"""ORTTrainer's compile stage: a model (or an ONNX model) and one input signature become a
`CompiledGraph` (training and eval sessions on the flat buffers). The probe and the trace (or a
graph re-derived from an earlier trace), ORT's gradient builder and the graph fixes, the sessions,
and the proof of a re-derived graph against torch at its shape."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import onnx
import torch

from .._configuration.refusals import ONNX_RUNTIME_ERRORS, device_failure
from .._export.running_statistics import sync_batch_norm_refused
from .._export.fingerprint import NotPortable, model_fingerprint
from .._export.trace import graph_name
from .._graph.batch_statistics import BatchStatistics, running_statistics
from .._graph.recompute import has_copies
from .._graph.trainer_graph_builder import LOSS_SCALE_INPUT, build_graphs, draws_random_numbers
from .._runtime.trainer_sessions import Array, CompiledGraph, WeightBindings
from .._runtime.session_config import save_graphs
from .disk_cache import UNDECODABLE, DiskCache, machine
from .exports import GraphDiffers, check_eval_graph

if TYPE_CHECKING:
    from .._configuration.model_desc import ModelDescription
    from .._export.binding import InputBinding
    from .._export.guards import ModuleState, TracedState
    from .._export.onnx_model import OnnxExports
    from .._graph.recompute import Recompute
    from .._optimizers.flat import FlatParameters
    from .._runtime.sessions import Sessions
    from .exports import TrainingExports

Values = dict[str, torch.Tensor | None]  # {input name: tensor}; None: an optional input left out
# what `build` binds: the flat buffers, the frozen weights ({graph name: tensor}), the loss scale
_Weights: TypeAlias = "tuple[FlatParameters, dict[str, torch.Tensor], Array | None]"
_SYNC_BATCH_NORM_REMEDY = ("convert them to BatchNorm: each rank then normalizes with the statistics of its own "
                           "batch, as DistributedDataParallel with nn.BatchNorm*d does; or put them in eval mode")


@dataclass(frozen=True)
class StepSettings:
    """What the trainer's options say about its graphs. recompute: a `_graph.recompute.Recompute`
    or None; graph_save_paths: `debug.graph_save_paths`; check_model_export: prove every graph
    against torch; loss_scaling: the training graph's loss is multiplied by a loss-scale input;
    compute_dtype: 'float16' or 'bfloat16' for mixed precision (`_graph.autocast`), None: fp32;
    label_sparsity: the loss's projection on the rows whose label counts (`_graph.label_sparsity`);
    embedding_sparsity: per-token layers on the non-padding rows (`_graph.embedding_sparsity`);
    opset, frozen_weights: the export's opset and `utils.frozen_weights`; cache_directory:
    `utils.graph_cache_dir` (None: no cache on disk)."""

    recompute: Recompute | None = None
    shape_inference: bool = False
    graph_save_paths: object = None
    check_model_export: bool = False
    loss_scaling: bool = False
    compute_dtype: str | None = None
    label_sparsity: bool = False
    embedding_sparsity: bool = False
    opset: int = 14
    frozen_weights: tuple[str, ...] = ()
    cache_directory: str | None = None

    def changing_the_graph(self) -> list:
        """The settings a graph is built from (part of its key in the cache on disk)."""
        recompute = None if self.recompute is None else sorted((k, repr(v)) for k, v in vars(self.recompute).items())
        return [recompute, self.shape_inference, self.loss_scaling, self.compute_dtype, self.label_sparsity,
                self.embedding_sparsity, self.opset, list(self.frozen_weights)]


@dataclass(frozen=True)
class Export:
    """One export: the ONNX model, whether it was re-derived from an earlier trace (to be proven
    before use), the model state it was traced in (`_export.guards.ModuleState.read()`), the names
    the graph may read as a weight (its initializers and inputs). From the cache on disk: no model,
    the built graphs (`cached`). `disk_key`: the graph's key there (None: not cached)."""

    model: onnx.ModelProto | None
    unproven: bool
    model_state: TracedState
    weight_names: frozenset[str]
    cached: StepParts | None = None
    disk_key: dict | None = None


@dataclass(frozen=True)
class StepParts:
    """What building an export made that running it needs (and the cache on disk keeps): the
    serialized training and eval graphs, the running statistics they read (graph names), the
    BatchStatistics' (modules, outputs), whether the training graph runs in priority order."""

    training: bytes
    evaluation: bytes
    running: tuple[str, ...]
    statistics: tuple[tuple[str, ...], ...]  # (modules, outputs)
    priority_order: bool

    def encoded(self) -> tuple[dict, dict[str, bytes]]:
        return ({"running": list(self.running), "statistics": [list(s) for s in self.statistics],
                 "priority_order": self.priority_order}, {"training": self.training, "evaluation": self.evaluation})

    @classmethod
    def decoded(cls, meta: dict, blobs: dict[str, bytes]) -> StepParts:
        return cls(training=blobs["training"], evaluation=blobs["evaluation"], running=tuple(meta["running"]),
                   statistics=tuple(tuple(s) for s in meta["statistics"]), priority_order=bool(meta["priority_order"]))


class StepCompiler:
    """Compiles ORTTrainer's graphs. `exports`: the trace cache (`exports.TrainingExports`, or
    `_export.onnx_model.OnnxExports` for an ONNX model); `state`: the model's `ModuleState`;
    `sessions`: the placement's `Sessions`; `settings`: StepSettings."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable | None, binding: InputBinding, desc: ModelDescription,
                 *, exports: TrainingExports | OnnxExports, state: ModuleState, sessions: Sessions,
                 settings: StepSettings) -> None:
        self._model, self._loss_fn, self._binding, self._desc = model, loss_fn, binding, desc
        self._exports, self._state, self._sessions, self._settings = exports, state, sessions, settings
        self._disk = None if settings.cache_directory is None else DiskCache(settings.cache_directory)

    def export(self, values: Values, outputs: Sequence[str]) -> Export:
        """The probe, then the trace of these inputs (or a graph re-derived from an earlier trace),
        unless the cache on disk holds the graphs of this export (`_compile.disk_cache`; no probe).
        Attributes the probe saw forward() write are left out of the model state from then on."""
        refused = sync_batch_norm_refused(self._model, _SYNC_BATCH_NORM_REMEDY)
        if refused is not None:
            raise refused
        key = self._disk_key(values, outputs)
        entry = self._disk.load(key) if key is not None else None
        if entry is not None:
            try:
                meta, blobs = entry
                parts, names = StepParts.decoded(meta["parts"], blobs), frozenset(meta["weight_names"])
                self._state.forgets_written(meta["written"])
            except UNDECODABLE as error:  # not what `build` wrote: compiled again
                self._disk.discard(key, f"{type(error).__name__}: {error}")
            else:
                return Export(None, False, self._state.read(), names, cached=parts, disk_key=key)
        before = self._state.read()
        self._exports.check(values, self._desc)
        self._state.forgets(before, self._state.read())
        model_state = self._state.read()
        model, unproven = self._exports.get(values, model_state)
        names = frozenset(i.name for i in (*model.graph.initializer, *model.graph.input))
        return Export(model, unproven, model_state, names, disk_key=key)

    def build(self, export: Export, values: Values, outputs: Sequence[str], *, flat: FlatParameters,
              frozen: dict[str, torch.Tensor], loss_scale: Array | None = None) -> CompiledGraph:
        """The CompiledGraph of an export (consumed) on the flat buffers `flat`, reading `frozen`
        ({graph name: tensor}) as it is and `loss_scale` (an array) as the loss-scale input.

        A re-derived graph is first proven against torch at this shape; one that fails to build
        or to match is traced again. With debug.check_model_export every graph is proven (one
        from the cache on disk too; otherwise it needs no proof: it is what the same trace gave)."""
        weights = (flat, frozen, loss_scale)
        built: tuple[StepParts, CompiledGraph] | None
        if export.cached is not None:
            built = export.cached, self._graph_of(export.cached, values, outputs, export.model_state, weights)
        elif export.unproven:
            built = self._proven_or_none(export, values, outputs, weights)
        else:
            assert export.model is not None  # an export without graphs on disk has its model
            built = self._build(export.model, values, outputs, export.model_state, weights)
        if built is None:
            self._exports.reject(values, export.model_state)
            traced = self._exports.get(values, export.model_state).model
            built = self._build(traced, values, outputs, export.model_state, weights)
        parts, graph = built
        if self._settings.check_model_export:
            try:
                self.check_against_torch(graph, values, outputs)
            except GraphDiffers as difference:
                raise RuntimeError(f"debug.check_model_export: {difference}") from difference
        if export.cached is None and export.disk_key is not None:
            self._store(export, parts, graph)
        return graph

    def with_weights(self, values: Values) -> onnx.ModelProto:
        """The forward + loss model with the current weights (the original's `save_as_onnx`)."""
        return self._exports.with_weights(values)

    def check_against_torch(self, graph: CompiledGraph, values: Values, outputs: Sequence[str]) -> None:
        """Raises GraphDiffers unless the eval graph computes what torch's eval-mode forward does on `values`."""
        check_eval_graph(graph, self._model, self._loss_fn, self._binding, values, self._desc.output_names, outputs,
                         device_type=self._sessions.placement.ort_device, compute_dtype=self._settings.compute_dtype)

    def _proven_or_none(self, export: Export, values: Values, outputs: Sequence[str],
                        weights: _Weights) -> tuple[StepParts, CompiledGraph] | None:
        """(parts, graph) re-derived for a new shape, if it builds and its eval graph matches torch's
        forward there; None where it differs or ONNX Runtime (or a graph pass) refuses it at this shape
        (e.g. a size the first trace saw as 1 was specialized): tracing it again decides. Other errors
        (bugs, the device failing: out of memory, a CUDA error) propagate."""
        assert export.model is not None  # an export without graphs on disk has its model
        try:
            parts, graph = self._build(export.model, values, outputs, export.model_state, weights)
            self.check_against_torch(graph, values, outputs)
        except (GraphDiffers, NotImplementedError, *ONNX_RUNTIME_ERRORS) as error:
            if device_failure(error):
                raise
            return None
        return parts, graph

    def _build(self, exported: onnx.ModelProto, values: Values, outputs: Sequence[str], model_state: TracedState,
               weights: _Weights) -> tuple[StepParts, CompiledGraph]:
        """(StepParts, CompiledGraph): training and eval graphs from an export (consumed), on the flat buffers."""
        flat, frozen, _ = weights
        settings, paths = self._settings, self._settings.graph_save_paths
        save_graphs(paths, exported=exported)
        running, statistics = running_statistics(exported, self._model), BatchStatistics(self._model)
        # With recomputation every kernel stays ONNX Runtime's, as ORTModule's checkpointed graphs:
        # torch nodes' outputs sit in torch's heap beside the arena (the memory recomputation saves),
        # and a torch node's output feeding a recompute copy's wait (a PassThrough) failed at run time
        # ("PassThrough input and output are not sharing the same buffer"), 2 runs of 4 of the gelu model.
        faster_in_torch = None if settings.recompute is not None else self._sessions.faster_in_torch
        training, evaluation = build_graphs(
            exported, flat.names, [*frozen, *running], outputs, self._desc.output_names[self._desc.loss_index],
            device_type=self._sessions.placement.ort_device, loss_scaling=settings.loss_scaling,
            compute_dtype=settings.compute_dtype,
            recompute=settings.recompute, shape_inference=settings.shape_inference, batch_statistics=statistics,
            faster_in_torch=faster_in_torch, label_sparsity=settings.label_sparsity,
            embedding_sparsity=settings.embedding_sparsity)
        save_graphs(paths, training=training, evaluation=evaluation, session_options=self._sessions.session_options(),
                    providers=self._sessions.providers)
        parts = StepParts(training, evaluation, tuple(running), (tuple(statistics.modules), tuple(statistics.outputs)),
                          has_copies(onnx.load_from_string(training)))
        return parts, self._graph_of(parts, values, outputs, model_state, weights)

    def _graph_of(self, parts: StepParts, values: Values, outputs: Sequence[str], model_state: TracedState,
                  weights: _Weights) -> CompiledGraph:
        """The CompiledGraph of built graphs, on the flat buffers."""
        flat, frozen, loss_scale = weights
        buffers = {graph_name(name): buffer for name, buffer in self._model.named_buffers()}
        running = {name: buffers[name] for name in parts.running}
        statistics = BatchStatistics.restored(self._model, *parts.statistics)
        present = [name for name, value in values.items() if value is not None]
        feeds = {LOSS_SCALE_INPUT: loss_scale} if self._settings.loss_scaling else None
        return CompiledGraph(parts.training, parts.evaluation, self._sessions,
                             WeightBindings(flat, {**frozen, **running}, feeds), present, outputs,
                             model_state=model_state, batch_statistics=statistics,
                             draws_random_numbers=draws_random_numbers(onnx.load_from_string(parts.training)),
                             priority_order=parts.priority_order)

    def _disk_key(self, values, outputs):
        """The key of this export's graphs in the cache on disk, or None (no cache, an ONNX model,
        a model the fingerprint cannot describe: said once)."""
        if self._disk is None:
            return None
        try:
            model = model_fingerprint(self._model, self._state.written, self._loss_fn)
        except NotPortable as error:
            self._not_cached(error)
            return None
        inputs = [[name, None] if value is None else [name, list(value.shape), str(value.dtype), str(value.device)]
                  for name, value in values.items()]
        return {"front": "ORTTrainer", "model": model, "inputs": inputs, "outputs": list(outputs),
                "model_desc": repr(self._desc), "settings": self._settings.changing_the_graph(),
                "machine": machine(self._sessions)}

    def _store(self, export, parts, graph):
        if graph.runs_autograd_functions:
            self._not_cached("its graph runs custom autograd.Functions, which only this process can call")
            return
        meta, blobs = parts.encoded()
        self._disk.store(export.disk_key, {"parts": meta, "weight_names": sorted(export.weight_names),
                                           "written": self._state.written}, blobs)

    def _not_cached(self, why):
        self._disk.not_cached(f"ORTTrainer: the graphs of {type(self._model).__name__}", why)
