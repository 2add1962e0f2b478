"""Large CPU tensors the torch nodes write (a vocabulary projection's logits, their log-softmax,
the bf16 copies of logits-sized gradients), reused from step to step.

A fresh allocation of tens of MiB comes from glibc's mmap and pays a page fault per 4 KiB on first
write: on the seed model's 700 x 28,782 logits that cost as much as the kernel writing them
(torch's log_softmax 28.7 ms into fresh memory, 12.6 ms into memory written before). ONNX
Runtime's own kernels write into its arena, which keeps its memory; these buffers do the same for
the torch nodes. A buffer is handed out again only when nothing but this pool holds its storage
(the tensor ONNX Runtime was given, or a graph output the caller kept, holds it otherwise).

A torch node writing a graph output the caller bound a buffer to (`bound_outputs`: ORTTrainer's
gradients and fetched outputs) writes into that buffer (`output`): ONNX Runtime copies a node's
output into the bound buffer unless it is that buffer.
"""
import contextlib
import math
import threading

import torch

_MIN_BYTES = 1 << 22  # below 4 MiB glibc's heap reuses freed memory without page faults
_KEPT = 32  # buffers kept per type: more at once are allocated as usual
_REUSE = 1.5  # a buffer serves a request of down to 1 / _REUSE of its size
_HEADROOM = 1.25  # a request just above a free buffer's size (its size varies) gets this much more
_pools: dict[torch.dtype, list[torch.Tensor]] = {}  # dtype -> flat buffers, oldest first
_lock = threading.Lock()  # runs of other threads' sessions take buffers too
_COUNTS_USES = hasattr(torch._C, "_storage_Use_Count")  # a torch without it: no pool (fresh memory each time)
_bound = threading.local()  # `tensors`: the current run's bound outputs, on the thread that runs its nodes


def _held_elsewhere(buffer):
    """Whether anything but the pool's tensor holds `buffer`'s storage (the count includes that
    tensor and the storage object made to ask)."""
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) > 2


def empty(shape, dtype):
    """A CPU tensor of `shape` and `dtype` with unspecified values: a large one from the pool
    when a free buffer is large enough but not much larger, else new (and pooled while there is
    room). Sizes need not repeat exactly: a masked LM's labelled rows differ in count from batch to
    batch, and a buffer per exact shape paid the page faults of fresh memory on every step."""
    shape = tuple(shape)
    count = math.prod(shape)
    if count * dtype.itemsize < _MIN_BYTES or not _COUNTS_USES:
        return torch.empty(shape, dtype=dtype)
    with _lock:
        pool = _pools.setdefault(dtype, [])
        free = [buffer for buffer in pool if not _held_elsewhere(buffer)]
        fitting = [buffer for buffer in free if count <= buffer.numel() <= count * _REUSE]
        if fitting:
            return min(fitting, key=torch.Tensor.numel)[:count].view(shape)
        outgrown = next((buffer for buffer in free if count / _REUSE <= buffer.numel() < count), None)
        buffer = torch.empty(count if outgrown is None else math.ceil(count * _HEADROOM), dtype=dtype)
        _drop(pool, free, outgrown)
        if len(pool) < _KEPT:
            pool.append(buffer)
        return buffer[:count].view(shape)


def _drop(pool, free, outgrown):
    """Drops `outgrown` (a free buffer the new one replaces, or None) and, beyond the `_KEPT` a new
    buffer leaves room for, the oldest free buffers (identities compared: `==` on tensors compares values)."""
    dropped = [] if outgrown is None else [outgrown]
    dropped += [buffer for buffer in free if buffer is not outgrown][:max(len(pool) - len(dropped) + 1 - _KEPT, 0)]
    ids = {id(buffer) for buffer in dropped}
    pool[:] = [buffer for buffer in pool if id(buffer) not in ids]


def converted(tensor, dtype):
    """`tensor` in `dtype`, written into a pooled buffer (the tensor itself when it has that type)."""
    if tensor.dtype == dtype:
        return tensor
    return empty(tensor.shape, dtype).copy_(tensor)


@contextlib.contextmanager
def bound_outputs(tensors):
    """Within: the caller's tensors bound to graph outputs ({graph output name: CPU tensor}) for this
    thread's runs (ONNX Runtime runs a sequential graph's nodes on the thread that called run)."""
    previous = getattr(_bound, "tensors", None)
    _bound.tensors = tensors
    try:
        yield
    finally:
        _bound.tensors = previous


def output(params, k, shape, dtype, inputs=()):
    """Output k of a torch node, a `shape` tensor of `dtype`: `bound_output` where there is one, else `empty`."""
    found = bound_output(params, k, shape, dtype, inputs)
    return empty(shape, dtype) if found is None else found


def bound_output(params, k, shape, dtype, inputs=()):
    """The caller's buffer bound to output k of a torch node, as a `shape` tensor, where that output
    is a graph output (`params['graph_outputs']`, `_graph.cpu_kernels.name_graph_outputs`) bound
    in `bound_outputs` to a contiguous tensor of that size and `dtype` apart from the node's
    `inputs`; else None."""
    names, tensors = params.get("graph_outputs"), getattr(_bound, "tensors", None)
    found = tensors.get(names[k]) if names and tensors and names[k] else None
    if (found is None or found.dtype != dtype or found.numel() != math.prod(shape) or not found.is_contiguous()
            or any(_overlap(found, tensor) for tensor in inputs)):
        return None
    return found.view(shape)


def _overlap(a, b):
    """Whether the memory of tensors `a` and `b` may overlap (their extents' address ranges)."""
    start_a, start_b = a.data_ptr(), b.data_ptr()
    return start_a < start_b + _extent(b) and start_b < start_a + _extent(a)


def _extent(tensor):
    """The bytes from a tensor's first element to just past its last (strides non-negative)."""
    if tensor.numel() == 0:
        return 0
    return (sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1) * tensor.element_size()
