"""ORTTrainer's compiled graphs: the training and eval sessions of one input signature, bound to
the flat parameter and gradient buffers through IOBinding (no per-step copies)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import onnx
import onnxruntime
import torch
from onnxruntime.capi import _pybind_state as C

from .._export.guards import TracedState
from .._graph.cpu_kernels import target_out_of_range
from .._graph.gradient_builder_preparation import NO_GRADIENT_SUFFIX
from .._graph.loss_targets import UNCHECKED_DEVICES, check_targets, loss_targets
from .._onnx import inferred_tensors
from .._torch_node_catalogue import AUTOGRAD_FUNCTION
from .cpu_buffers import bound_outputs
from .memory import TORCH_TO_NUMPY
from .sessions import seed_random_ops
from .torch_ops import raising_torch_op_errors

if TYPE_CHECKING:
    from .._graph.batch_statistics import BatchStatistics
    from .placement import Placement
    from .sessions import Sessions

Array: TypeAlias = Any  # a NumPy array, or a CuPy one on CUDA (CuPy has no type information)

_ORT_TYPE_TO_TORCH = {
    "tensor(float)": torch.float32, "tensor(double)": torch.float64, "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16, "tensor(int64)": torch.int64, "tensor(int32)": torch.int32,
    "tensor(int8)": torch.int8, "tensor(uint8)": torch.uint8, "tensor(bool)": torch.bool,
}


def _concrete(shape):
    return shape is not None and all(isinstance(dim, int) for dim in shape)


def _output_shapes(shapes, graph):
    """The concrete shapes of the graph's outputs ({name: shape}; the graphs have the signature's
    input shapes): ONNX Runtime's, or where its inference left a dim symbolic (it does after some
    Where chains of a training graph), ONNX's inference of `graph` (serialized), run once."""
    if all(_concrete(shape) for shape in shapes.values()):
        return shapes
    inferred = inferred_tensors(onnx.load_from_string(graph))
    concrete = {}
    for name, shape in shapes.items():
        concrete[name] = shape if _concrete(shape) else inferred.get(name, (0, None))[1]
        if not _concrete(concrete[name]):
            raise RuntimeError(f"the shape of graph output {name!r} is not known at this input signature: ONNX "
                               f"Runtime inferred {shape}, ONNX {concrete[name]}")
    return concrete


class CompiledGraph:
    """The training and eval sessions for one input signature (sessions built on first use).

    Parameters, gradients, frozen weights and BatchNorm running statistics are bound once per
    session; each run binds only the caller's inputs (zero copy) and fresh output tensors.
    """

    def __init__(self, training_graph: bytes, eval_graph: bytes, sessions: Sessions, weights: WeightBindings,
                 input_names: Sequence[str], output_names: Sequence[str], *,
                 model_state: TracedState = TracedState((), ()), batch_statistics: BatchStatistics | None = None,
                 draws_random_numbers: bool = False, priority_order: bool = False) -> None:
        """training_graph, eval_graph: serialized models. sessions: the placement's `Sessions`.
        weights: the `WeightBindings` both graphs read (flat parameters, frozen weights, running
        statistics, constant feeds). model_state: the model's state when it was traced
        (`_export.guards.ModuleState`). batch_statistics: the
        `_graph.batch_statistics.BatchStatistics` the training graph returns after `output_names`; each
        training run updates the running statistics from them. draws_random_numbers: the training
        graph has dropout (ONNX Runtime's generator is seeded from torch's before each run).
        priority_order: the training graph runs in PRIORITY_BASED order (its recompute copies,
        `_graph.recompute`)."""
        self.model_state = model_state
        self.batch_statistics = batch_statistics
        statistics = list(batch_statistics.outputs) if batch_statistics is not None else []
        self._fetched = {True: list(output_names) + statistics, False: list(output_names)}
        self._graphs = {True: training_graph, False: eval_graph}
        # the inputs a loss reads targets from, checked before each run where the kernels would not
        self._targets = (loss_targets(onnx.load_from_string(eval_graph))
                         if sessions.placement.ort_device in UNCHECKED_DEVICES else {})
        self.runs_autograd_functions = AUTOGRAD_FUNCTION.encode() in training_graph  # custom Functions' nodes
        self._sessions = sessions
        self._weights = weights
        self._input_names = input_names
        self._output_names = output_names
        # per mode: the session, its binding, its input names, the (dtype, shape) of each fetched output
        self._bound: dict[bool, tuple[onnxruntime.InferenceSession, onnxruntime.IOBinding, set[str], list]] = {}
        self._first_runs = {True: sessions.first_run(), False: sessions.first_run()}
        self._grads_bound_to = None
        self._grad_tensors: dict[str, torch.Tensor] = {}  # the bound gradients as CPU tensors, by output name
        self._random, self._priority_order = draws_random_numbers, priority_order

    def _session(self, training):
        if training not in self._bound:
            graph = self._graphs.pop(training)
            session = self._sessions.create(graph, priority_order=training and self._priority_order)
            binding = session.io_binding()
            graph_inputs = {i.name for i in session.get_inputs()}
            self._weights.bind(binding, graph_inputs, self._sessions.placement)
            outputs = {o.name: o for o in session.get_outputs()}
            shapes = _output_shapes({name: outputs[name].shape for name in self._fetched[training]}, graph)
            specs = [(_ORT_TYPE_TO_TORCH[outputs[name].type], shapes[name]) for name in self._fetched[training]]
            self._bound[training] = (session, binding, graph_inputs, specs)
        return self._bound[training]

    def run(self, inputs: Mapping[str, torch.Tensor | None], *, training: bool, grads: Array | None = None,
            quiet: bool = False) -> list[torch.Tensor]:
        """Runs one step on the bound buffers; returns the user outputs as new torch tensors.

        `inputs`: {input name: tensor} (the graph's inputs; other entries are ignored).
        Training writes the gradients into `grads` (the flat gradient buffer or a scratch buffer
        of the same layout) and updates the BatchNorm running statistics; eval computes no
        gradient and changes nothing. `quiet`: ONNX Runtime logs no error of its own (a run whose
        failure the caller expects and handles, as the proof of a re-derived graph).
        """
        check_targets(inputs, self._targets)  # before anything runs
        placement, first_run = self._sessions.placement, self._first_runs[training]
        first_run.begin()
        session, binding, graph_inputs, specs = self._session(training)
        if training and self._grads_bound_to is not grads:
            self._weights.bind_gradients(binding, grads, placement)
            self._grads_bound_to = grads
            self._grad_tensors = self._weights.gradient_tensors(grads)
        for name in self._input_names:
            tensor = inputs[name]  # an input present when the graph was compiled: present in its signature
            if name in graph_inputs and tensor is not None:
                bind_tensor(binding, name, tensor, placement, output=False)
        outputs = []
        for name, (dtype, shape) in zip(self._fetched[training], specs):
            tensor = self._sessions.memory.output_tensor(shape, dtype)
            bind_tensor(binding, name, tensor, placement, output=True)
            outputs.append(tensor)
        if training and self._random:
            seed_random_ops()
        try:
            run_options = self._sessions.quiet_run_options if quiet else self._sessions.run_options
            written = {}  # the CPU tensors bound to outputs, which torch nodes write into
            if placement.torch_device.type == "cpu":
                written = dict(zip(self._fetched[training], outputs), **(self._grad_tensors if training else {}))
            with raising_torch_op_errors(), bound_outputs(written):
                session.run_with_iobinding(binding, run_options)
        except RuntimeError as error:
            explained = target_out_of_range(error)
            if explained is None:
                raise
            raise explained from error
        first_run.end()
        if training and self.batch_statistics is not None:
            self.batch_statistics.update(outputs)
        return outputs[:len(self._output_names)]


class WeightBindings:
    """What every session of a trainer reads besides the call's inputs, bound once per session:
    the flat parameters (and the no-gradient alias of an embedding's padding rows), `read_only`
    tensors bound as they are ({graph name: tensor}: frozen weights, BatchNorm running
    statistics), and `feeds` ({graph name: array} updated in place, e.g. the loss scale)."""

    def __init__(self, flat, read_only: dict[str, torch.Tensor], feeds: dict[str, Array] | None = None) -> None:
        self.flat, self.read_only, self.feeds = flat, read_only, feeds or {}

    def bind(self, binding: onnxruntime.IOBinding, graph_inputs: set[str], placement: Placement) -> None:
        flat = self.flat
        for name in flat.names:
            for graph_name in (name, name + NO_GRADIENT_SUFFIX):
                if graph_name in graph_inputs:
                    bind_array(binding, graph_name, flat.view(flat.params, name), placement, output=False)
        for name, array in self.feeds.items():
            if name in graph_inputs:
                bind_array(binding, name, array, placement, output=False)
        for name, tensor in self.read_only.items():
            if name in graph_inputs:
                bind_tensor(binding, name, tensor, placement, output=False)

    def bind_gradients(self, binding: onnxruntime.IOBinding, grads: Array, placement: Placement) -> None:
        """Points the gradient outputs at `grads` (a buffer in the flat layout)."""
        for name in self.flat.names:
            bind_array(binding, f"{name}_grad", self.flat.view(grads, name), placement, output=True)

    def gradient_tensors(self, grads: Array) -> dict[str, torch.Tensor]:
        """{gradient output name: its view of `grads` as a torch tensor}, for a CPU buffer (the torch
        nodes that write gradients write there: `cpu_buffers.bound_outputs`); {} for a device one."""
        if not isinstance(grads, np.ndarray):
            return {}
        return {f"{name}_grad": torch.from_numpy(self.flat.view(grads, name)) for name in self.flat.names}


def bind_array(binding: onnxruntime.IOBinding, name: str, array: Array, placement: Placement, *, output: bool) -> None:
    """Binds a NumPy or CuPy array (its memory, in place) as input or output `name`."""
    pointer = array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr
    bind = binding.bind_output if output else binding.bind_input
    bind(name, placement.ort_device, placement.index, array.dtype, list(array.shape), pointer)


def bind_tensor(binding: onnxruntime.IOBinding, name: str, tensor: torch.Tensor, placement: Placement, *,
                output: bool) -> None:
    """Binds a torch tensor in place: by pointer, or through DLPack for the dtypes NumPy lacks
    (bfloat16), which ONNX Runtime's pointer binding cannot name."""
    dtype = TORCH_TO_NUMPY.get(tensor.dtype)
    if dtype is not None:
        bind = binding.bind_output if output else binding.bind_input
        bind(name, placement.ort_device, placement.index, dtype, list(tensor.shape), tensor.data_ptr())
        return
    value = onnxruntime.OrtValue(C.OrtValue.from_dlpack(torch.utils.dlpack.to_dlpack(tensor), False))  # False: not bool
    (binding.bind_ortvalue_output if output else binding.bind_ortvalue_input)(name, value)
