"""ORTTrainer's compile stage: a model (or an ONNX model) and one input signature become a
`CompiledGraph` (training and eval sessions on the flat buffers). The probe and the trace (or a
graph re-derived from an earlier trace), ORT's gradient builder and the graph fixes, the sessions,
and the proof of a re-derived graph against torch at its shape."""
from dataclasses import dataclass

import onnx

from .._export.batch_norm import sync_batch_norm_refused
from .._graph.batch_norm import BatchStatistics, running_statistics
from .._graph.recompute import has_copies
from .._graph.training_graphs import LOSS_SCALE_INPUT, build_graphs, draws_random_numbers
from .._runtime.compiled_graph import CompiledGraph, WeightBindings
from .._runtime.session_config import save_graphs
from .exports import eval_graph_differs

_SYNC_BATCH_NORM_REMEDY = ("convert them to BatchNorm: each rank then normalizes with the statistics of its own "
                           "batch, as DistributedDataParallel with nn.BatchNorm*d does; or put them in eval mode")


@dataclass(frozen=True)
class StepSettings:
    """What the trainer's options say about its graphs. recompute: a `_graph.recompute.Recompute`
    or None; graph_save_paths: `debug.graph_save_paths`; check_model_export: prove every graph
    against torch; loss_scaling: the training graph's loss is multiplied by a loss-scale input;
    compute_dtype: 'float16' or 'bfloat16' for mixed precision (`_graph.autocast`), None: fp32;
    label_sparsity: the loss's projection on the rows whose label counts (`_graph.label_sparsity`);
    embedding_sparsity: per-token layers on the non-padding rows (`_graph.embedding_sparsity`)."""

    recompute: object = None
    shape_inference: bool = False
    graph_save_paths: object = None
    check_model_export: bool = False
    loss_scaling: bool = False
    compute_dtype: str = None
    label_sparsity: bool = False
    embedding_sparsity: bool = False


@dataclass(frozen=True)
class Export:
    """One export: the ONNX model, whether it was re-derived from an earlier trace (to be proven
    before use), and the model state it was traced in (`_export.guards.ModuleState.read()`)."""

    model: onnx.ModelProto
    unproven: bool
    model_state: tuple

    @property
    def weight_names(self):
        """Names of the initializers and graph inputs: what the graph may read as a weight."""
        return {i.name for i in self.model.graph.initializer} | {i.name for i in self.model.graph.input}


class StepCompiler:
    """Compiles ORTTrainer's graphs. `exports`: the trace cache (`exports.TrainingExports`, or
    `_export.onnx_model.OnnxExports` for an ONNX model); `state`: the model's `ModuleState`;
    `sessions`: the placement's `Sessions`; `settings`: StepSettings."""

    def __init__(self, model, loss_fn, binding, desc, *, exports, state, sessions, settings):
        self._model, self._loss_fn, self._binding, self._desc = model, loss_fn, binding, desc
        self._exports, self._state, self._sessions, self._settings = exports, state, sessions, settings

    def export(self, values):
        """The probe, then the trace of these inputs (or a graph re-derived from an earlier trace).
        Attributes the probe saw forward() write are left out of the model state from then on."""
        refused = sync_batch_norm_refused(self._model, _SYNC_BATCH_NORM_REMEDY)
        if refused is not None:
            raise refused
        before = self._state.read()
        self._exports.check(values, self._desc)
        self._state.forgets(before, self._state.read())
        model_state = self._state.read()
        model, unproven = self._exports.get(values, model_state)
        return Export(model, unproven, model_state)

    def build(self, export, values, outputs, *, flat, frozen, loss_scale=None):
        """The CompiledGraph of an export (consumed) on the flat buffers `flat`, reading `frozen`
        ({graph name: tensor}) as it is and `loss_scale` (an array) as the loss-scale input.

        A re-derived graph is first proven against torch at this shape; one that fails to build
        or to match is traced again. With debug.check_model_export every graph is proven."""
        weights = (flat, frozen, loss_scale)
        graph = self._proven_or_none(export, values, outputs, weights) if export.unproven else \
            self._build(export.model, values, outputs, export.model_state, weights)
        if graph is None:
            self._exports.reject(values, export.model_state)
            traced = self._exports.get(values, export.model_state)[0]
            graph = self._build(traced, values, outputs, export.model_state, weights)
        if self._settings.check_model_export:
            difference = self.differs_from_torch(graph, values, outputs)
            if difference is not None:
                raise RuntimeError(f"debug.check_model_export: {difference}")
        return graph

    def with_weights(self, values):
        """The forward + loss model with the current weights (the original's `save_as_onnx`)."""
        return self._exports.with_weights(values)

    def differs_from_torch(self, graph, values, outputs):
        """None when the eval graph computes what torch's eval-mode forward does on `values`."""
        return eval_graph_differs(graph, self._model, self._loss_fn, self._binding, values, self._desc.output_names,
                                  outputs, device_type=self._sessions.placement.ort_device,
                                  compute_dtype=self._settings.compute_dtype)

    def _proven_or_none(self, export, values, outputs, weights):
        """The graph re-derived for a new shape, if it builds and its eval graph matches torch's
        forward there; None otherwise (e.g. a size the first trace saw as 1 was specialized)."""
        try:
            graph = self._build(export.model, values, outputs, export.model_state, weights)
        except Exception:  # ORT rejects the graph at this shape: tracing it again decides
            return None
        return graph if self.differs_from_torch(graph, values, outputs) is None else None

    def _build(self, exported, values, outputs, model_state, weights):
        """Training and eval graphs from an export (consumed), on the flat buffers."""
        flat, frozen, loss_scale = weights
        settings, paths = self._settings, self._settings.graph_save_paths
        save_graphs(paths, exported=exported)
        running, statistics = running_statistics(exported, self._model), BatchStatistics(self._model)
        training, evaluation = build_graphs(
            exported, flat.names, [*frozen, *running], outputs, self._desc.output_names[self._desc.loss_index],
            device_type=self._sessions.placement.ort_device, loss_scaling=settings.loss_scaling,
            compute_dtype=settings.compute_dtype,
            recompute=settings.recompute, shape_inference=settings.shape_inference, batch_statistics=statistics,
            faster_in_torch=self._sessions.faster_in_torch, label_sparsity=settings.label_sparsity,
            embedding_sparsity=settings.embedding_sparsity)
        save_graphs(paths, training=training, evaluation=evaluation, session_options=self._sessions.session_options(),
                    providers=self._sessions.providers)
        present = [name for name, value in values.items() if value is not None]
        feeds = {LOSS_SCALE_INPUT: loss_scale} if settings.loss_scaling else None
        training_model = onnx.load_from_string(training)
        return CompiledGraph(training, evaluation, self._sessions, WeightBindings(flat, {**frozen, **running}, feeds),
                             present, outputs, model_state=model_state, batch_statistics=statistics,
                             draws_random_numbers=draws_random_numbers(training_model),
                             priority_order=has_copies(training_model))
