"""Memory policy of the graphs' device, one small interface (`memory_policy(device)`):

- `config_entries()`: the session config entries of how sessions allocate their intermediates;
- `output_tensor(shape, dtype)`: a new tensor for a graph output, which the caller then owns;
- `release_cached_memory()`: called around each session's first run.

CPU (BENCHMARKS.md has the measurements): one ORT arena shared by all our sessions, compacted
with the heap around first runs; large outputs reuse the memory of outputs the caller dropped.
CUDA: one ORT arena per device shared by all our sessions, outputs from torch's caching allocator.
"""
import ctypes
import functools
import math
import weakref
from collections import OrderedDict

import numpy as np
import onnx
import onnxruntime
import torch

from .._configuration.validation import CUDA_PROVIDER
from .._onnx import quiet_session_options
from .session_config import USE_ENV_ALLOCATORS, register_shared_cpu_arena, register_shared_cuda_arena

TORCH_TO_NUMPY = {
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
    torch.int64: np.int64, torch.int32: np.int32, torch.int8: np.int8, torch.uint8: np.uint8,
    torch.bool: np.bool_,
}
POOLED_OUTPUT_BYTES = 1 << 20
# One free block per size, for the two sizes dropped last (training and eval outputs, or the
# short last batch): a loop that holds the last step's outputs while the next step runs needs
# one; more sizes (variable-length batches) would hold memory no step asks for.
_MAX_FREE_OUTPUT_SIZES = 2


def memory_policy(torch_device, mem_limit, providers):
    """`providers`: the sessions' provider list (the CUDA provider's options size its arena)."""
    if torch_device.type == "cpu":
        return CpuMemory(mem_limit)
    cuda_options = next(dict(entry[1]) for entry in providers if entry[0] == CUDA_PROVIDER)
    return CudaMemory(torch_device, cuda_options)


class CpuMemory:
    def __init__(self, mem_limit):
        register_shared_cpu_arena(mem_limit)
        self.free_outputs = OrderedDict()  # nbytes -> memory of an output the caller dropped

    def config_entries(self):
        """Sessions allocate from one shared arena instead of one each: each arena keeps its own
        peak for the life of its session."""
        return {USE_ENV_ALLOCATORS: "1"}

    def output_tensor(self, shape, dtype):
        """A large output reuses the memory of an earlier one once the caller has dropped every
        tensor that views it (a finalizer on the NumPy array under the tensor puts it back): a
        fresh 77 MiB tensor costs ~20k page faults, ~20 ms per step on the seed model."""
        numpy_dtype = TORCH_TO_NUMPY.get(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if numpy_dtype is None or nbytes < POOLED_OUTPUT_BYTES:
            return torch.empty(shape, dtype=dtype)
        block = self.free_outputs.pop(nbytes, None)
        if block is None:
            block = np.empty(nbytes, np.uint8)
        array = block.view(numpy_dtype).reshape(shape)
        weakref.finalize(array, _recycle, self.free_outputs, block).atexit = False
        return torch.from_numpy(array)

    def release_cached_memory(self):
        """Returns what the shared arena and the heap hold but no tensor uses to the OS.

        ORT allocates a session's first run tensor by tensor (its memory pattern is recorded
        then), later runs take one planned block: the arena would otherwise keep both for the
        life of the process, and a new session's first run would grow it on top of another
        session's free block. Costs one regrowth (page faults) per new session."""
        session, run_options = _arena_shrinker()
        session.run(None, {"x": np.zeros(1, np.float32)}, run_options)
        _release_freed_heap()


class CudaMemory:
    def __init__(self, torch_device, cuda_options):
        register_shared_cuda_arena(torch_device.index, cuda_options)
        self._device = torch_device

    def config_entries(self):
        """Sessions allocate from one CUDA arena per device instead of one each (up to two per
        cached graph, each keeping its peak)."""
        return {USE_ENV_ALLOCATORS: "1"}

    def output_tensor(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self._device)  # torch's caching allocator

    def release_cached_memory(self):
        """Nothing to hand back: torch and ORT keep their CUDA caches."""


def _recycle(free, block):
    """Called when the caller has dropped the last tensor viewing `block`. Each step is one
    atomic dict operation: finalizers may run in any thread."""
    free[block.nbytes] = block
    free.move_to_end(block.nbytes)
    while len(free) > _MAX_FREE_OUTPUT_SIZES:
        try:
            free.popitem(last=False)
        except KeyError:  # emptied meanwhile by another thread
            break


@functools.cache
def _arena_shrinker():
    """A one-node session on the shared arena: ORT shrinks an arena only at the end of a run."""
    options = quiet_session_options()
    options.intra_op_num_threads = 1
    options.add_session_config_entry(USE_ENV_ALLOCATORS, "1")
    value = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "shrink", [value],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=7)
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    run_options = onnxruntime.RunOptions()
    run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return session, run_options


def _release_freed_heap():
    """Hands freed heap back to the OS (glibc keeps it: export and graph building leave ~50 MiB
    on the seed model, ORT's kernels ~50 MiB more). A no-op where malloc_trim is missing."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
