"""Large CPU tensors the torch nodes write (a vocabulary projection's logits, their log-softmax,
the bf16 copies of logits-sized gradients), reused from step to step.

A fresh allocation of tens of MiB comes from glibc's mmap and pays a page fault per 4 KiB on first
write: on the seed model's 700 x 28,782 logits that cost as much as the kernel writing them
(torch's log_softmax 28.7 ms into fresh memory, 12.6 ms into memory written before). ONNX
Runtime's own kernels write into its arena, which keeps its memory; these buffers do the same for
the torch nodes. A buffer is handed out again only when nothing but this pool holds its storage
(the tensor ONNX Runtime was given, or a graph output the caller kept, holds it otherwise).
"""
import collections
import math
import threading

import torch

_MIN_BYTES = 1 << 22  # below 4 MiB glibc's heap reuses freed memory without page faults
_PER_SHAPE = 4  # buffers kept per (shape, type): more at once are allocated as usual
_SHAPES = 16  # (shape, type) kinds kept, least recently used dropped
_pools: collections.OrderedDict[tuple, list[torch.Tensor]] = collections.OrderedDict()  # (shape, dtype) -> [tensor]
_lock = threading.Lock()  # runs of other threads' sessions take buffers too
_COUNTS_USES = hasattr(torch._C, "_storage_Use_Count")  # a torch without it: no pool (fresh memory each time)


def _held_elsewhere(buffer):
    """Whether anything but the pool's tensor holds `buffer`'s storage (the count includes that
    tensor and the storage object made to ask)."""
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) > 2


def empty(shape, dtype):
    """A CPU tensor of `shape` and `dtype` with unspecified values: a large one from the pool
    when one is free, else new (and pooled while there is room)."""
    shape = tuple(shape)
    if math.prod(shape) * dtype.itemsize < _MIN_BYTES or not _COUNTS_USES:
        return torch.empty(shape, dtype=dtype)
    key = (shape, dtype)
    with _lock:
        pool = _pools.setdefault(key, [])
        _pools.move_to_end(key)
        for buffer in pool:
            if not _held_elsewhere(buffer):
                return buffer.detach()
        buffer = torch.empty(shape, dtype=dtype)
        if len(pool) < _PER_SHAPE:
            pool.append(buffer)
        while len(_pools) > _SHAPES:
            _pools.popitem(last=False)
        return buffer.detach()


def converted(tensor, dtype):
    """`tensor` in `dtype`, written into a pooled buffer (the tensor itself when it has that type)."""
    if tensor.dtype == dtype:
        return tensor
    return empty(tensor.shape, dtype).copy_(tensor)
