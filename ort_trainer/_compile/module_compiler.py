"""ORTModule's compile stage: one input signature of the wrapped model, compiled. The model exported
(every module in its own train/eval state), training-mode BatchNorms rewritten, label sparsity
(ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER: where forward() returns a loss; its logits too in fp32), embedding sparsity
(ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER), the graph fixes,
ONNX Runtime's ORTModule graph builder, the device's kernel substitutions, then a runner (a
`TrainingAgent`, or an inference session for calls without gradients).

Parameters and buffers are graph inputs read from the model's own tensors on every call (DLPack,
no copy); gradients come back as new tensors, for autograd to accumulate into `.grad`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx
import torch

from .._configuration.ortmodule_settings import LogLevel
from .._export.outputs import OutputSchema, output_names
from .._export.trace import export_training_model, graph_name
from .._graph.autocast import cast_outputs, lower_precision
from .._graph.backward_weights import weights_read_in_backward
from .._graph.input_density import density_inputs
from .._graph.batch_statistics import BatchStatistics
from .._graph.cpu_kernels import kernel_substitutions
from .._graph.cpu_low_precision import low_precision_in_fp32
from .._graph.embedding_sparsity import Outcome, drop_padding_rows
from .._graph.gradient_builder_preparation import (NO_GRADIENT_SUFFIX, padding_rows_without_gradient, prepare_for_gradient,
                                                   weights_as_inputs)
from .._graph.label_sparsity import described_losses, gather_labelled_rows, returned_scores_gradient_scalar
from .._graph.module_graph_builder import (build_module_graph, describe_outputs, forward_outputs_as_graph_outputs,
                                    gradients_in_full_shape, outputs_reaching, outputs_read_by_backward)
from .._graph.recompute import module_groups, recompute_in_backward
from .._graph.torch_node_shapes import declare_torch_node_outputs
from .._graph.trainer_graph_builder import draws_random_numbers
from .._onnx import largest_tensors
from .._runtime.memory_stats import peak_above_start
from .._runtime.module_runner import ForwardState, ModuleRunner
from .._runtime.session_config import write_graphs

if TYPE_CHECKING:
    from .._configuration.ortmodule_settings import Settings
    from .._export.binding import InputBinding
    from .._runtime.sessions import Sessions

LOGGER = logging.getLogger("ort_trainer.ortmodule")
_LARGEST = 5  # tensors named by the memory stats


class Source(enum.Enum):
    """Where a graph input comes from on each call."""

    CALL = "an input of the call"
    WEIGHT = "a parameter or buffer of the model"
    WEIGHT_WITHOUT_GRADIENT = "a weight read where it gets no gradient (an embedding's padding rows)"


@dataclass
class GraphParts:
    """What one compile made that running its graph needs, and nothing of the process that made it:
    the built graph (`model`, consumed by `ModuleGraph`) and ModuleGraph's tables (see there), so
    that the exported-model cache on disk (`_compile.disk_cache`) can keep them (`encoded`)."""

    model: onnx.ModelProto
    trains: bool
    schema: OutputSchema
    density_inputs: dict[str, tuple]
    statistics: tuple  # `BatchStatistics` (modules, outputs)
    non_differentiable: list[str]
    full_shape_grads: set[int]
    reaching: list[set[int]] | None  # a training graph's: per gradient, the outputs (indices) it is computed from
    read_by_backward: list[int] | None
    recomputed: int
    sources: list[tuple[Source, str]]  # (Source, key) per graph input
    gradient_slots: list[int | None]
    fetched: list[str]  # what the runner fetches: the gradients, or the forward's outputs
    sparse_embeddings: list[Outcome]  # per embedding with a padding_idx
    sparse_losses: list[str]  # per cross-entropy with an ignore_index, under label sparsity: what it computes
    forward_outputs: int  # the forward's outputs (then the weights it passes through the YieldOp)
    read_again: list[int]  # the feeds the backward takes again (indices)
    read_in_place: list[int]  # the feeds whose memory must not move before the backward (indices)

    def encoded(self) -> tuple[dict, dict[str, bytes]]:
        """(JSON-able meta, {name: bytes}); `_export.fingerprint.NotPortable` where the schema holds
        values JSON cannot say."""
        meta = {"trains": self.trains, "schema": self.schema.encoded(), "density_inputs": self.density_inputs,
                "statistics": list(self.statistics), "non_differentiable": self.non_differentiable,
                "full_shape_grads": sorted(self.full_shape_grads),
                "reaching": [sorted(r) for r in self.reaching] if self.reaching is not None else None,
                "read_by_backward": self.read_by_backward, "recomputed": self.recomputed,
                "sources": [[source.name, key] for source, key in self.sources], "gradient_slots": self.gradient_slots,
                "fetched": self.fetched, "sparse_embeddings": [dataclasses.asdict(o) for o in self.sparse_embeddings],
                "sparse_losses": self.sparse_losses,
                "forward_outputs": self.forward_outputs, "read_again": self.read_again,
                "read_in_place": self.read_in_place}
        return meta, {"graph": self.model.SerializeToString()}

    @classmethod
    def decoded(cls, meta: dict, blobs: dict[str, bytes]) -> GraphParts:
        """The parts `encoded` gave (ValueError, KeyError, TypeError where they are not)."""
        reaching = meta["reaching"]
        return cls(model=onnx.load_from_string(blobs["graph"]), trains=bool(meta["trains"]),
                   schema=OutputSchema.decoded(meta["schema"]),
                   density_inputs={name: tuple(rule) for name, rule in meta["density_inputs"].items()},
                   statistics=tuple(meta["statistics"]), non_differentiable=list(meta["non_differentiable"]),
                   full_shape_grads=set(meta["full_shape_grads"]),
                   reaching=None if reaching is None else [set(r) for r in reaching],
                   read_by_backward=meta["read_by_backward"], recomputed=int(meta["recomputed"]),
                   sources=[(Source[source], key) for source, key in meta["sources"]],
                   gradient_slots=list(meta["gradient_slots"]), fetched=list(meta["fetched"]),
                   sparse_embeddings=[Outcome(**{**o, "dense": tuple(o["dense"])}) for o in meta["sparse_embeddings"]],
                   sparse_losses=list(meta["sparse_losses"]),
                   forward_outputs=int(meta["forward_outputs"]), read_again=list(meta["read_again"]),
                   read_in_place=list(meta["read_in_place"]))


def compile_parts(model: torch.nn.Module, binding: InputBinding, values: dict[str, torch.Tensor], schema: OutputSchema,
                  sessions: Sessions, settings: Settings, needs_grad: bool, *,
                  compute_dtype: str | None = None) -> GraphParts:
    """The GraphParts of one signature: export, rewrites, ORT's builder, kernel substitutions.
    `schema`: the OutputSchema of forward()'s result; `needs_grad`: a graph with a backward;
    `sessions`: the placement's `Sessions`; `compute_dtype`: 'float16' or 'bfloat16' for a call under
    torch.autocast (`_graph.autocast`: the products in that type, the outputs in the types the model
    returns under autocast)."""
    outputs = output_names(schema)
    device_type = sessions.placement.ort_device
    with torch.autocast(device_type, enabled=False):  # the graph's own casts follow (`_graph.autocast`)
        exported = export_training_model(model, None, binding, outputs, values, settings.opset)
    _save(settings, exported, "torch_exported", training=needs_grad)
    density = density_inputs(exported)  # before the fixes drop the padding marker
    statistics = BatchStatistics(model)  # training-mode BatchNorms: batch statistics as outputs
    statistics.rewrite(exported)
    by_graph_name = {graph_name(name): name for name, _ in (*model.named_parameters(), *model.named_buffers())}
    weights = [i.name for i in exported.graph.initializer if i.name in by_graph_name]
    parameters = dict(model.named_parameters())
    trainable = [name for name in weights if needs_grad and by_graph_name[name] in parameters
                 and parameters[by_graph_name[name]].requires_grad]
    weights_as_inputs(exported, weights)
    declare_torch_node_outputs(exported)
    inputs_requiring_grad = [i.name for i in exported.graph.input
                             if needs_grad and i.name in values and values[i.name].requires_grad]
    if settings.label_sparsity:  # fp32 graphs also where forward() returns the logits
        gather_labelled_rows(exported, outputs, returned_scores=compute_dtype is None,
                             differentiable=trainable + inputs_requiring_grad)
    sparse_losses = described_losses(exported) if settings.label_sparsity else []  # for the density report
    # per embedding with a padding_idx: made sparse, or why not (the density report says)
    sparse_embeddings = [dataclasses.replace(outcome, weight=by_graph_name[outcome.weight])
                         for outcome in drop_padding_rows(exported, weights)] if settings.embedding_sparsity else []
    widened = device_type == "cpu" and low_precision_in_fp32(exported)
    if compute_dtype is not None:
        lower_precision(exported, compute_dtype, device_type=device_type,
                        differentiable=trainable + inputs_requiring_grad)
        lowered = {name: str(dtype).removeprefix("torch.") for name, dtype in zip(outputs, schema.dtypes)
                   if dtype in (torch.float16, torch.bfloat16)}
        cast_outputs(exported, lowered)
    aliases = (prepare_for_gradient(exported, trainable, inputs_requiring_grad) if needs_grad
               else padding_rows_without_gradient(exported, ()))
    known = set(weights) | set(aliases)
    user = [i.name for i in exported.graph.input if i.name not in known]  # unused inputs are not graph inputs
    requiring_grad = [name for name in user if needs_grad and values[name].requires_grad]
    built = build_module_graph(
        exported, weights + aliases, trainable, requiring_grad, outputs, schema.shapes, trains=needs_grad,
        severity=settings.ort_severity, compute_optimizer=settings.compute_optimizer,
        propagate_casts=compute_dtype is None and not widened,
        pre_grad_path=_path(settings, "optimized_pre_grad", training=True),
        log=lambda message: _info(settings, message))
    model_proto = built.model
    if needs_grad:  # unused logits of a LABELLED_PROJECTION: a scalar zero, its backward on the kept rows
        returned_scores_gradient_scalar(model_proto)
    recomputed = needs_grad and recompute_in_backward(model_proto, built.forward,
                                                      module_groups(model, settings.layer_recompute))
    if recomputed:
        _info(settings, "%d nodes recomputed in the backward (checkpointed segments%s)", recomputed,
              ", layers" if settings.layer_recompute else "")
    describe_outputs(model_proto, outputs, schema.dtypes, schema.shapes)
    statistics.describe(model_proto)
    substitute = kernel_substitutions(sessions.placement.ort_device)
    if substitute is not None:
        # each rewrite finds its nodes in either kind. Products torch runs faster stay in ONNX Runtime
        # where segments are recomputed: their outputs in torch's heap beside the arena doubled a
        # checkpointed step's peak (BENCHMARKS.md, gradient checkpointing); checkpointing asks for memory
        substitute(model_proto, model_proto, faster_in_torch=None if recomputed else sessions.faster_in_torch)
    full_shape_grads = gradients_in_full_shape(model_proto)  # after the substitutions, which free some
    graph_outputs = [o.name for o in model_proto.graph.output]  # the gradients, or the forward's outputs
    reaching = read_by_backward = None
    read_again: list[str] = []  # weights given to the backward again
    in_place = weights + aliases  # weights read in place
    if needs_grad:
        reaching = outputs_reaching(model_proto, graph_outputs, outputs)
        read_by_backward = outputs_read_by_backward(model_proto, outputs)
        read_again, in_place = weights_read_in_backward(model_proto, weights + aliases)
        forward_outputs_as_graph_outputs(model_proto, outputs + statistics.outputs)
    _save(settings, model_proto, "optimized", training=needs_grad)
    sources = {**{name: (Source.CALL, name) for name in user},
               **{name: (Source.WEIGHT, by_graph_name[name]) for name in weights},
               **{name: (Source.WEIGHT_WITHOUT_GRADIENT, by_graph_name[name[:-len(NO_GRADIENT_SUFFIX)]])
                  for name in aliases}}
    inputs = [i.name for i in model_proto.graph.input]
    slots = {name: index for index, name in enumerate(built.differentiated)}
    movable = set(weights + aliases) - set(in_place)  # weights whose memory may move before the backward
    return GraphParts(model=model_proto, trains=needs_grad, schema=schema, density_inputs=density,
                      statistics=(statistics.modules, statistics.outputs),
                      non_differentiable=built.non_differentiable, full_shape_grads=full_shape_grads,
                      reaching=reaching, read_by_backward=read_by_backward, recomputed=int(recomputed),
                      sources=[sources[name] for name in inputs], gradient_slots=[slots.get(name) for name in inputs],
                      fetched=graph_outputs, sparse_embeddings=sparse_embeddings, sparse_losses=sparse_losses,
                      forward_outputs=len(outputs) + len(statistics.outputs),
                      read_again=[inputs.index(name) for name in read_again],
                      read_in_place=[index for index, name in enumerate(inputs) if name not in movable])


class ModuleGraph:
    """The compiled graph of one input signature (see the module docstring) and how to feed it:
    the `GraphParts` of a compile (`compile_parts`) or of the cache on disk, and its runner.
    `sessions`: the placement's `Sessions`; `settings`: the ORTModule's settings."""

    def __init__(self, model: torch.nn.Module, parts: GraphParts, sessions: Sessions, settings: Settings) -> None:
        self.parts = parts if settings.cache_directory is not None else None  # to be stored on disk
        self.schema, self.trains = parts.schema, parts.trains
        self.density_inputs, self.sparse_embeddings = parts.density_inputs, parts.sparse_embeddings
        self.sparse_losses = parts.sparse_losses
        self.batch_statistics = BatchStatistics.restored(model, *parts.statistics)
        self.non_differentiable, self.full_shape_grads = parts.non_differentiable, parts.full_shape_grads
        self._reaching = parts.reaching or []  # a training graph's (the one with a backward)
        self.read_by_backward = parts.read_by_backward
        model_proto = parts.model
        # ORTMODULE_PRINT_MEMORY_STATS=1: the largest tensors, the first forward's and backward's peaks
        self._memory_stats = largest_tensors(model_proto, _LARGEST) if settings.memory_stats else None
        self._measured: set[str] = set()
        self._model_name = type(model).__name__
        self._zero_gradients: dict[tuple, torch.Tensor] = {}  # (output, shape, dtype, device) -> zeros
        inputs = [i.name for i in model_proto.graph.input]
        self._runner = ModuleRunner(
            sessions, model_proto.SerializeToString(), inputs, parts.fetched,
            parts.forward_outputs + len(parts.read_again), trains=parts.trains,
            draws_random_numbers=draws_random_numbers(model_proto),
            optimized_model_path=_path(settings, "execution_model", training=parts.trains),
            priority_order=bool(parts.recomputed))
        self._sources = parts.sources
        self.feed_names = [key for _, key in self._sources]  # the call's input or the model's tensor, per feed
        self.gradient_slots = parts.gradient_slots  # each feed's backward output
        self._forward_outputs, self.read_again = parts.forward_outputs, parts.read_again
        self.read_in_place = frozenset(parts.read_in_place)  # looked up per feed in every backward

    @classmethod
    def compiled(cls, model: torch.nn.Module, binding: InputBinding, values: dict[str, torch.Tensor],
                 schema: OutputSchema, sessions: Sessions, settings: Settings, needs_grad: bool, *,
                 compute_dtype: str | None = None) -> ModuleGraph:
        """The graph of one signature, compiled (`compile_parts`)."""
        started = time.perf_counter()
        graph = cls(model, compile_parts(model, binding, values, schema, sessions, settings, needs_grad,
                                         compute_dtype=compute_dtype), sessions, settings)
        user = [key for source, key in graph._sources if source is Source.CALL]
        _info(settings, "compiled the %s graph of %s for inputs %s in %.2f s", graph.kind, type(model).__name__,
              {name: list(values[name].shape) for name in user}, time.perf_counter() - started)
        for name, value in binding.constant_keywords.items():  # the original's line for each
            if isinstance(value, str):
                _info(settings, "Received input of type %s is treated as a constant by ORT by default. (argument "
                      "%r: the graph has its value %r; another value compiles another graph)", type(value), name, value)
        return graph

    @property
    def kind(self) -> str:
        return "training" if self.trains else "inference"

    def feeds(self, values: dict[str, torch.Tensor], named: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The graph's inputs for one call, in order: `values` {input name: tensor} of the call,
        `named` {torch name: tensor} of the model's parameters and buffers."""
        return [values[key] if source is Source.CALL else named[key] if source is Source.WEIGHT
                else named[key].detach() for source, key in self._sources]

    def infer(self, feeds: list[torch.Tensor]) -> list[torch.Tensor]:
        """The forward alone (no gradient): the outputs as tensors."""
        with self._memory_measured("forward"):
            return self._runner.infer(feeds)

    def zero_gradient(self, index: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The gradient of output `index` when the loss did not use it: zeros of its shape where
        ONNX Runtime needs the full shape, else a scalar zero; made once and read by every backward
        (ONNX Runtime does not write its inputs): a language model's unused logits no longer cost a
        logits-sized allocation and fill every step."""
        key = (index, tuple(shape) if index in self.full_shape_grads else (), dtype, device)
        if key not in self._zero_gradients:
            self._zero_gradients[key] = torch.zeros(key[1], dtype=dtype, device=device)
        return self._zero_gradients[key]

    def run_forward(self, feeds: list[torch.Tensor]) -> tuple[list[torch.Tensor], ForwardState]:
        """(outputs, state): the forward of a training call; `state` keeps what its backward reads."""
        with self._memory_measured("forward"):
            outputs, state = self._runner.run_forward(feeds)
        return outputs[:self._forward_outputs], state  # not the weights passed through the YieldOp

    @contextlib.contextmanager
    def _memory_measured(self, phase: str) -> Iterator[None]:
        """ORTMODULE_PRINT_MEMORY_STATS=1: the first run of `phase` ('forward', 'backward') of this
        graph measured (the process's peak resident memory above its start) and logged, the
        forward's line with the graph's largest tensors."""
        if self._memory_stats is None or phase in self._measured:
            yield
            return
        self._measured.add(phase)
        with peak_above_start() as peak:
            yield
        measured = "not measured here (no /proc)" if peak["mib"] is None else f"{peak['mib']:+.1f} MiB"
        message = f"ORTModule memory, the {self.kind} graph of {self._model_name}: its first {phase}'s peak {measured}"
        if phase == "forward":
            message += "; its largest tensors: " + ", ".join(
                f"{name} {dims} {kind} {size / 2 ** 20:.1f} MiB" for size, name, dims, kind in self._memory_stats)
        LOGGER.handle(LOGGER.makeRecord(LOGGER.name, logging.INFO, __file__, 0, message, (), None))

    def run_backward(self, state: ForwardState, output_grads: Sequence[torch.Tensor], used: set[int],
                     feeds: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """The gradients of the forward's inputs that require one, in feed order, from the gradients
        of its outputs (`output_grads`: tensors, in output order; `used`: the indices of the outputs
        that received a gradient, the others' are zeros) and the forward's `feeds` as they are now
        (those in `read_again` are read again). None for the others, and for those no output in
        `used` depends on: torch leaves them without a gradient, ONNX Runtime gives zeros."""
        with self._memory_measured("backward"):
            grads = self._runner.run_backward(state, [*output_grads, *(feeds[index] for index in self.read_again)])
        return [None if slot is None or not self._reaching[slot] & used else grads[slot]
                for slot in self.gradient_slots]


def _info(settings, message, *args):
    """A line for the `ort_trainer.ortmodule` logger's handlers, at LogLevel INFO and below: the
    ORTModule's DebugOptions decide, not the logger's level (WARNING unless configured), as the
    original's log_level set its logger's."""
    if settings.log_level <= LogLevel.INFO:
        LOGGER.handle(LOGGER.makeRecord(LOGGER.name, logging.INFO, __file__, 0, "ORTModule: " + message, args, None))


def _path(settings, stage, *, training):
    """Where DebugOptions(save_onnx=True) writes a stage's model; None when it saves nothing."""
    if settings.save_directory is None:
        return None
    return os.path.join(settings.save_directory,
                        f"{settings.onnx_prefix}_{stage}_{'training' if training else 'inference'}.onnx")


def _save(settings, model_proto, stage, *, training):
    """Writes a stage's model where DebugOptions(save_onnx=True) asks for it (`write_graphs`)."""
    write_graphs([("ORTMODULE_SAVE_ONNX_PATH", _path(settings, stage, training=training), model_proto)])
