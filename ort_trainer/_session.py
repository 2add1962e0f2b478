"""ONNX Runtime sessions bound to the flat buffers, one compiled graph per input signature."""
import contextlib
from collections import OrderedDict

import numpy as np
import onnxruntime
import torch
from onnxruntime.capi import _pybind_state as C

from ._cuda import require_cuda, require_cuda_provider
from ._graph import NO_GRADIENT_SUFFIX, builder_session_options, draws_random_numbers
from ._graph_cpu import substitute_cpu_kernels, target_out_of_range
from ._memory import TORCH_TO_NUMPY, memory_policy
from ._session_config import provider_options_from, session_options_from

_ORT_TYPE_TO_TORCH = {
    "tensor(float)": torch.float32, "tensor(double)": torch.float64, "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16, "tensor(int64)": torch.int64, "tensor(int32)": torch.int32,
    "tensor(int8)": torch.int8, "tensor(uint8)": torch.uint8, "tensor(bool)": torch.bool,
}


def _pointer(array):
    """Device address of a NumPy or CuPy array's first element."""
    if isinstance(array, np.ndarray):
        return array.ctypes.data
    return array.data.ptr


def torch_device(device_id):
    """The torch device of options.device.id, with its index: 'cuda' is torch's current CUDA
    device, as for tensors made with device='cuda' (tensors on the GPU always report an index,
    and torch.device('cuda') != torch.device('cuda', 0)); cuda:0 where torch has no CUDA."""
    device = torch.device(device_id)
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)


class Placement:
    """Where the graphs run: the ORT device name and index, providers and the torch device.

    On CUDA the trainer owns one stream: ORT runs every graph on it (`user_compute_stream`,
    without its end-of-run sync) and the CuPy clip and optimizer kernels queue behind on it;
    `step()` orders it after the caller's current stream and the caller's stream after it.
    """

    def __init__(self, options, threads):
        self._options = options
        self.device_id = options.device.id
        self.torch_device = torch_device(self.device_id)
        self.ort_device = self.torch_device.type
        self.index = self.torch_device.index or 0
        self.threads = threads
        self.deterministic = options.debug.deterministic_compute
        self.xp, self.stream = np, None
        self.substitute_kernels = substitute_cpu_kernels if self.ort_device == "cpu" else None
        self.providers = ["CPUExecutionProvider"]
        if self.ort_device == "cuda":
            self._use_cuda()
        self.providers = provider_options_from(options, self.providers)
        # ORT's end-of-run sync is dropped on CUDA: `step()` orders the streams instead
        config = {} if self.stream is None else {"disable_synchronize_execution_providers": "1"}
        self.run_options = _run_options(**config)
        self.quiet_run_options = _run_options(log_severity_level=4, **config)
        self.memory = memory_policy(self.torch_device, options.device.mem_limit, self.providers)

    def _use_cuda(self):
        self.xp = require_cuda(self.index)
        self.stream = torch.cuda.Stream(self.torch_device)
        self.providers = [("CUDAExecutionProvider", {
            "device_id": str(self.index), "has_user_compute_stream": "1",
            "user_compute_stream": str(self.stream.cuda_stream)}), "CPUExecutionProvider"]

    def allocating(self):
        """Context in which new CuPy buffers land on this device (flat buffers, optimizer state)."""
        return contextlib.nullcontext() if self.stream is None else self.xp.cuda.Device(self.index)

    @contextlib.contextmanager
    def step(self):
        """Context of one step's device work (graph, all-reduce, clip, update) on the trainer's
        stream, ordered after the caller's current stream (its inputs are ready) and before it
        (its next work, the outputs' `.item()`, sees the results). Nothing to do on the CPU."""
        if self.stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.torch_device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream), self.xp.cuda.Device(self.index), \
                self.xp.cuda.ExternalStream(self.stream.cuda_stream, self.index):
            yield
        caller.wait_stream(self.stream)

    def returned(self, outputs):
        """The step's outputs, handed to the caller's stream: allocated on the trainer's stream,
        their memory is not reused before the caller's work queued on them is done."""
        if self.stream is not None:
            caller = torch.cuda.current_stream(self.torch_device)
            for tensor in outputs:
                tensor.record_stream(caller)
        return outputs

    def check_providers(self, session):
        """A CUDA session ONNX Runtime silently built for the CPU (its CUDA provider library failed
        to load) would fail later, obscurely, on device pointers: refused here, by name."""
        if self.stream is not None:
            require_cuda_provider(session.get_providers())

    def session_options(self):
        options = builder_session_options()
        options.intra_op_num_threads = self.threads
        options.use_deterministic_compute = self.deterministic
        # Idle ORT workers block instead of spinning: each step runs torch's clip + optimizer on
        # the same cores right after the graph, and spinning workers starve them (benchmarks/).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.memory.configure(options)
        return session_options_from(self._options, options)

    def bind(self, binding, name, is_output, dtype, shape, pointer):
        bind = binding.bind_output if is_output else binding.bind_input
        bind(name, self.ort_device, self.index, dtype, list(shape), pointer)

    def bind_tensor(self, binding, name, is_output, tensor):
        """Binds a torch tensor in place: by pointer, or through DLPack for the dtypes NumPy lacks
        (bfloat16), which ONNX Runtime's pointer binding cannot name."""
        dtype = TORCH_TO_NUMPY.get(tensor.dtype)
        if dtype is not None:
            self.bind(binding, name, is_output, dtype, tensor.shape, tensor.data_ptr())
            return
        value = onnxruntime.OrtValue(C.OrtValue.from_dlpack(torch.utils.dlpack.to_dlpack(tensor), False))
        (binding.bind_ortvalue_output if is_output else binding.bind_ortvalue_input)(name, value)


class CompiledGraph:
    """The training and eval sessions for one input signature (sessions built on first use).

    Parameters, gradients, frozen weights and BatchNorm running statistics are bound once per
    session; each run binds only the caller's inputs (zero copy) and fresh output tensors.
    """

    def __init__(self, training_graph, eval_graph, placement, flat, frozen, input_names, output_names,
                 feeds=None, model_state=((), ()), batch_statistics=None):
        """frozen: {graph input name: tensor} read as it is (frozen weights, running statistics).
        feeds: {graph input name: array} bound once and read on every run (e.g. the loss scale,
        updated in place). model_state: (train/eval flags, attributes) of the model when it was
        traced (`_guards.ModuleState`). batch_statistics: the `_batch_norm.BatchStatistics` the
        training graph returns after `output_names`; each training run updates the running
        statistics from them."""
        self.model_state = model_state
        self.batch_statistics = batch_statistics
        statistics = list(batch_statistics.outputs) if batch_statistics is not None else []
        self._fetched = {True: list(output_names) + statistics, False: list(output_names)}
        self._graphs = {True: training_graph, False: eval_graph}
        self._feeds = feeds or {}
        self._placement = placement
        self._flat = flat
        self._frozen = frozen
        self._input_names = input_names
        self._output_names = output_names
        self._sessions = {}
        self._grads_bound_to = None
        self._random = draws_random_numbers(training_graph)

    def _session(self, training):
        if training not in self._sessions:
            session = onnxruntime.InferenceSession(
                self._graphs.pop(training), self._placement.session_options(),
                providers=self._placement.providers)
            self._placement.check_providers(session)
            binding = session.io_binding()
            graph_inputs = {i.name for i in session.get_inputs()}
            for name in self._flat.names:  # and its alias read without a gradient (embedding padding rows)
                for graph_name in (name, name + NO_GRADIENT_SUFFIX):
                    if graph_name in graph_inputs:
                        self._placement.bind(binding, graph_name, False, np.float32, self._flat.shapes[name],
                                             _pointer(self._flat.view(self._flat.params, name)))
            for name, array in self._feeds.items():
                if name in graph_inputs:
                    self._placement.bind(binding, name, False, array.dtype, array.shape, _pointer(array))
            for name, tensor in self._frozen.items():
                if name in graph_inputs:
                    self._placement.bind_tensor(binding, name, False, tensor)
            outputs = {o.name: o for o in session.get_outputs()}
            specs = [(_ORT_TYPE_TO_TORCH[outputs[name].type], outputs[name].shape) for name in self._fetched[training]]
            self._sessions[training] = (session, binding, graph_inputs, specs)
        return self._sessions[training]

    def _bind_gradients(self, binding, grads):
        """Points the gradient outputs at `grads` (a buffer in the flat layout), if not already."""
        if self._grads_bound_to is not grads:
            for name in self._flat.names:
                self._placement.bind(binding, f"{name}_grad", True, np.float32, self._flat.shapes[name],
                                     _pointer(self._flat.view(grads, name)))
            self._grads_bound_to = grads

    def run(self, training, inputs, grads=None, quiet=False):
        """Runs one step on the bound buffers; returns the user outputs as new torch tensors.

        `inputs`: {input name: tensor} (the graph's inputs; other entries are ignored).
        Training writes the gradients into `grads` (the flat gradient buffer or a scratch buffer
        of the same layout) and updates the BatchNorm running statistics; eval computes no
        gradient and changes nothing. `quiet`: ONNX Runtime logs no error of its
        own (a run whose failure the caller expects and handles, as the proof of a re-derived graph).
        """
        first_run = training not in self._sessions
        if first_run:  # build and run on the memory in use, not on another session's free block
            self._placement.memory.release_cached_memory()
        session, binding, graph_inputs, specs = self._session(training)
        if training:
            self._bind_gradients(binding, grads)
        for name in self._input_names:
            tensor = inputs[name]
            if name in graph_inputs:
                self._placement.bind_tensor(binding, name, False, tensor)
        outputs = []
        for name, (dtype, shape) in zip(self._fetched[training], specs):
            tensor = self._placement.memory.output_tensor(shape, dtype)
            self._placement.bind_tensor(binding, name, True, tensor)
            outputs.append(tensor)
        run_options = self._placement.quiet_run_options if quiet else self._placement.run_options
        if training and self._random:
            seed_random_ops()
        try:
            session.run_with_iobinding(binding, run_options)
        except RuntimeError as error:
            explained = target_out_of_range(error)
            if explained is None:
                raise
            raise explained from error
        if first_run:  # ORT allocated this run tensor by tensor; later runs take one planned block
            self._placement.memory.release_cached_memory()
        if training and self.batch_statistics is not None:
            self.batch_statistics.update(outputs)
        return outputs[:len(self._output_names)]


def seed_random_ops():
    """Seeds ONNX Runtime's generator from torch's before a run that draws random numbers (dropout).

    Why: ORT's CPU Dropout seeds a minstd engine with its generator's next seed, one more per
    call, from the process seed, which torch.manual_seed(s) also sets: seeds 0 and 1 give that
    engine the same state, so the first two dropout calls after manual_seed(0) shared a mask.
    A fresh seed from torch's generator per run gives every run masks of its own, reproducible
    under torch.manual_seed, as torch's dropout is."""
    C.set_seed(int(torch.randint(1, _SEEDS, ())))


_SEEDS = 2**31 - 2**16  # minstd's modulus is 2**31 - 1; a run's nodes take the seeds after its own


def _run_options(log_severity_level=None, **config):
    options = onnxruntime.RunOptions()
    if log_severity_level is not None:
        options.log_severity_level = log_severity_level
    for key, value in config.items():
        options.add_run_config_entry(key, value)
    return options


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
