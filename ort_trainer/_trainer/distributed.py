"""Data parallel training and ZeRO stage 1 over torch.distributed, one process per rank (torchrun).

Every rank runs the same training graph on its own part of the global batch.

* Data parallel: the flat gradient buffer is averaged by one all-reduce of the whole buffer,
  after every micro-step (the legacy semantics) or, with ``distributed.allreduce_post_accumulation``,
  once per update after the last micro-step. Every rank then applies the same update.
* ZeRO stage 1: rank r owns the elements [start_r, stop_r) of the flat buffers, equal shards that
  may cut tensors. Gradients are reduce-scattered, each rank updates its shard with the optimizer
  state of that shard only, and the shards are all-gathered into every rank's parameters. The
  global gradient norm (clipping) and Lamb's per-tensor norms are summed over the shards.
* BatchNorm running statistics: rank 0's are broadcast before every training forward, as
  DistributedDataParallel (broadcast_buffers=True) does; each rank then updates them from its own batch.
* Checkpoints: rank 0 writes the full state (under ZeRO gathered from the shards), which loads on
  any world size.

Not bucketed: the graph produces all gradients at once, so there is no backward for buckets to
overlap. Measured on gloo, 2 processes on 2 loaded cores, the example model's 5.0M-element buffer
(medians of 30): one all-reduce 20-25 ms; 4 buckets 19-26 ms (no gain beyond the noise), 16
buckets 22-34 ms, 64 buckets 54-97 ms. ZeRO: reduce-scatter 30-35 ms + all-gather 27-30 ms.
"""
import math
import os

import numpy as np
import torch
import torch.distributed as dist

from .. import _checkpoint_files
from .._optimizers import cuda_steps as _kernels
from .._optimizers.algorithms import Lamb, clip_divisor, make_optimizer
from .._optimizers.cpu import sum_of_squares
from .._optimizers.flat import FlatLayout, GroupSlice, as_torch
from .._optimizers.reference import clip_divisor_from_norm
from .._runtime.placement import torch_device

_HOW_TO_START = ("call torch.distributed.init_process_group() before creating the ORTTrainer (backend 'gloo' "
                 "on CPU, 'nccl' on GPU), or launch with torchrun")


def setup(options):
    """The trainer's strategy for ``options.distributed`` and the initialized process group.

    Left at their defaults, world_rank and world_size are the process group's; values given
    explicitly must agree with it, and local_rank with torchrun's LOCAL_RANK.
    """
    settings = options.distributed
    device = torch_device(options.device.id)
    zero = settings.deepspeed_zero_optimization.stage == 1
    if zero and options.device.id != "cpu":
        raise NotImplementedError(f"distributed.deepspeed_zero_optimization.stage=1 runs on the CPU only for now, "
                                  f"got device.id={options.device.id!r}")
    if not (dist.is_available() and dist.is_initialized()):
        asked = [f"options.distributed.{key}={getattr(settings, key)}"
                 for key, default in (("world_size", 1), ("world_rank", 0)) if getattr(settings, key) != default]
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            asked.append(f"WORLD_SIZE={os.environ['WORLD_SIZE']} in the environment (torchrun)")
        if asked:
            raise RuntimeError(f"ORTTrainer: distributed training is asked for ({', '.join(asked)}), but no "
                               f"torch.distributed process group is initialized: {_HOW_TO_START}")
        return SingleProcess(device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if settings.world_size not in (1, world_size):
        raise ValueError(f"Invalid options: distributed.world_size={settings.world_size}, but the torch.distributed "
                         f"process group's world size is {world_size}")
    if settings.world_rank not in (0, rank):
        raise ValueError(f"Invalid options: distributed.world_rank={settings.world_rank}, but this process is rank "
                         f"{rank} of the torch.distributed process group")
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and settings.local_rank not in (0, int(local_rank)):
        raise ValueError(f"Invalid options: distributed.local_rank={settings.local_rank}, but the environment says "
                         f"LOCAL_RANK={local_rank}")
    if world_size == 1:
        return SingleProcess(device)
    return (ZeroStage1 if zero else DataParallel)(device, rank, world_size, settings.allreduce_post_accumulation)


def _collective(what, operation, *args, **kwargs):
    """Runs a collective; a failure (a rank that stopped, a timeout) becomes an error that says so."""
    try:
        operation(*args, **kwargs)
    except RuntimeError as error:
        raise RuntimeError(f"ORTTrainer: {what} failed on rank {dist.get_rank()} of {dist.get_world_size()}: "
                           "another rank stopped (an error or a crash) or did not get there within the process "
                           "group's timeout") from error


class SingleProcess:
    """One process: no communication. ``torch_device`` (options.device.id, with its index) picks
    the optimizer's implementation and the clip divisor's; CUDA buffers are made on its device
    (the trainer's ``Placement.allocating``)."""

    def __init__(self, torch_device):
        self.torch_device = torch_device
        self.device = torch_device.type
        self._clip_buffers = None  # CUDA: the clip's device scratch, made once

    def reduce_gradients(self, grads, accumulated):
        pass

    def broadcast_buffers(self, buffers):
        pass

    def clip_divisor(self, grads, max_norm, loss_scale):
        if self.device == "cuda" and self._clip_buffers is None:
            self._clip_buffers = _kernels.clip_buffers(grads.size, self.torch_device.index)
        return clip_divisor(grads, max_norm, loss_scale, self.device, self._clip_buffers)

    def make_optimizer(self, config_name, flat):
        """The optimizer of ``flat``'s layout on this strategy's device."""
        return make_optimizer(config_name, flat.layout, self.device)

    def save_checkpoint(self, path, state):
        """Writes ``path``: ``state`` holds the full optimizer state."""
        _checkpoint_files.save(path, state)


class DataParallel(SingleProcess):
    """Every rank holds all weights and all optimizer state; gradients are averaged."""

    def __init__(self, device, rank, world_size, post_accumulation):
        super().__init__(device)
        self.rank, self.world_size = rank, world_size
        self.post_accumulation = post_accumulation

    def reduce_gradients(self, grads, accumulated):
        """Averages gradients over the ranks at the reduction point: each micro-step's
        (``accumulated=False``), or with allreduce_post_accumulation the accumulated ones
        (``accumulated=True``). Sums commute with the average, so both give the same update."""
        if accumulated == self.post_accumulation:
            self._reduce(as_torch(grads))

    def _reduce(self, grads):
        _collective("averaging the gradients", dist.all_reduce, grads, op=dist.ReduceOp.AVG)

    def broadcast_buffers(self, buffers):
        """Rank 0's `buffers` (BatchNorm running statistics) copied to every rank, in place, as
        DistributedDataParallel (broadcast_buffers=True) does before every forward: one broadcast
        per dtype."""
        by_dtype = {}
        for buffer in buffers:
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
        for group in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(group)
            _collective("broadcasting the BatchNorm running statistics", dist.broadcast, flat, src=0)
            for buffer, value in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                buffer.copy_(value)

    def make_optimizer(self, config_name, flat):
        self._broadcast_weights(flat)
        return super().make_optimizer(config_name, flat)

    @staticmethod
    def _broadcast_weights(flat):
        """Starts every rank from rank 0's weights, as DistributedDataParallel does."""
        _collective("broadcasting the initial weights", dist.broadcast, as_torch(flat.params), src=0)

    def save_checkpoint(self, path, state):
        """Rank 0 writes ``path`` (``state`` holds the full optimizer state, under ZeRO gathered
        from every rank). Returns on every rank once it is written, or raises on
        every rank if writing failed."""
        failed = torch.zeros(self.world_size, device=self.torch_device if dist.get_backend() == "nccl" else "cpu")
        try:
            if self.rank == 0:
                _checkpoint_files.save(path, state)
        except Exception:
            failed[self.rank] = 1
            _collective("save_checkpoint", dist.all_reduce, failed)
            raise
        _collective("save_checkpoint", dist.all_reduce, failed)
        if failed.any():
            raise RuntimeError(f"ORTTrainer: save_checkpoint({os.fspath(path)!r}) failed on rank(s) "
                               f"{failed.nonzero().flatten().tolist()}; see the error there")


class ZeroStage1(DataParallel):
    """DataParallel with the optimizer state partitioned: see ``ShardedOptimizer``."""

    def __init__(self, device, rank, world_size, post_accumulation):
        super().__init__(device, rank, world_size, post_accumulation)
        self._shards = None

    def _reduce(self, grads):
        """Only this rank's shard of ``grads`` is averaged; the rest is left stale."""
        self._shards.reduce_scatter(grads)

    def clip_divisor(self, grads, max_norm, loss_scale):
        """The clip rule on the global norm, from every shard's sum of squares."""
        total = torch.tensor([sum_of_squares(grads[self._shards.start:self._shards.stop])], dtype=torch.float64)
        _collective("the global gradient norm", dist.all_reduce, total)
        norm = math.sqrt(total.item())
        return clip_divisor_from_norm(norm, max_norm, loss_scale), norm

    def make_optimizer(self, config_name, flat):
        self._broadcast_weights(flat)
        self._shards = Shards(flat.layout.size, self.rank, self.world_size)
        return ShardedOptimizer(config_name, flat.layout, self._shards)


class Shards:
    """A flat buffer of ``size`` elements cut into ``world_size`` equal shards (the last one may be
    shorter); rank r owns [start, stop). Collectives need equal sizes, so a shorter last shard
    travels through a zero-padded copy; the other shards are views, nothing else is copied."""

    def __init__(self, size, rank, world_size):
        self.shard_size = -(-size // world_size)
        last_size = size - (world_size - 1) * self.shard_size
        if last_size < 1:
            raise ValueError(f"ZeRO stage 1: {size} trainable elements cannot be cut into {world_size} non-empty "
                             "equal shards; use deepspeed_zero_optimization.stage=0 for so small a model")
        self.rank, self.world_size = rank, world_size
        self.start = rank * self.shard_size
        self.stop = min(self.start + self.shard_size, size)
        self._last_size = last_size
        self._padded_last = torch.zeros(self.shard_size) if last_size < self.shard_size else None

    def _split(self, tensor):
        chunks = list(tensor.split(self.shard_size))
        if self._padded_last is not None:
            self._padded_last[:self._last_size].copy_(chunks[-1])
            chunks[-1] = self._padded_last
        return chunks

    def _unpad(self, tensor):
        if self._padded_last is not None:
            tensor[-self._last_size:].copy_(self._padded_last[:self._last_size])

    def reduce_scatter(self, tensor):
        """In place: this rank's shard of ``tensor`` becomes the average over the ranks."""
        chunks = self._split(tensor)
        _collective("reduce-scattering the gradients", dist.reduce_scatter, chunks[self.rank], chunks,
                    op=dist.ReduceOp.AVG)
        if self.rank == self.world_size - 1:
            self._unpad(tensor)

    def all_gather(self, tensor):
        """In place: every rank's shard of ``tensor`` is copied to all ranks."""
        chunks = self._split(tensor)
        _collective("all-gathering the shards", dist.all_gather, chunks, chunks[self.rank])
        self._unpad(tensor)


def shard_layout(layout, start, stop):
    """The FlatLayout of elements [start, stop) of ``layout``: tensors cut at the bounds, each
    group's hyperparameters kept. Also returns each of its segments' index in ``layout``."""
    offsets = layout.seg_offsets
    first = int(np.searchsorted(offsets, start, side="right")) - 1
    end = int(np.searchsorted(offsets, stop, side="left"))  # one past the last segment overlapped
    local_offsets = np.clip(offsets[first:end + 1], start, stop) - start
    groups = []
    for group in layout.groups:
        seg_start, seg_stop = max(group.seg_start, first) - first, min(group.seg_stop, end) - first
        if seg_start < seg_stop:
            groups.append(GroupSlice(int(local_offsets[seg_start]), int(local_offsets[seg_stop]),
                                     seg_start, seg_stop, group.hyper))
    return FlatLayout(local_offsets, tuple(groups)), np.arange(first, end)


class ShardedOptimizer:
    """ZeRO stage 1: the optimizer of this rank's shard of the flat buffers, with the interface
    the trainer uses (``step``, ``step_count``, ``state``, ``load_state_dict``) on full buffers.

    ``step`` reads this rank's shard of ``grads`` (reduce-scattered), updates that shard of
    ``params`` with the same optimizer code as one process, then all-gathers ``params``.
    """

    def __init__(self, config_name, layout, shards):
        self._shards = shards
        self._layout = layout
        self._shard = slice(shards.start, shards.stop)
        local_layout, self._segments = shard_layout(layout, shards.start, shards.stop)
        if config_name == Lamb.config_name:  # its trust ratios are per whole tensor
            self._inner = Lamb(local_layout, "cpu", segment_sums=self._sum_over_shards)
        else:
            self._inner = make_optimizer(config_name, local_layout, "cpu")

    @property
    def step_count(self):
        return self._inner.step_count

    def step(self, params: np.ndarray, grads: np.ndarray, lr: float, grad_divisor: float = 1.0) -> None:
        self._inner.step(params[self._shard], grads[self._shard], lr, grad_divisor)
        self._shards.all_gather(torch.from_numpy(params))

    def _sum_over_shards(self, params_sumsq: np.ndarray, direction_sumsq: np.ndarray) -> None:
        """Lamb's per-tensor sums of squares, in place: this shard's pieces -> whole tensors."""
        sums = np.zeros((2, self._layout.seg_offsets.size - 1))
        sums[:, self._segments] = params_sumsq, direction_sumsq
        _collective("Lamb's per-tensor norms", dist.all_reduce, torch.from_numpy(sums))
        params_sumsq[...], direction_sumsq[...] = sums[:, self._segments]

    @property
    def state(self):
        """The full flat state arrays, gathered from every shard: a collective, every rank must ask."""
        full = {}
        for name, local in self._inner.state.items():
            full[name] = np.empty(self._layout.size, dtype=np.float32)
            full[name][self._shard] = local
            self._shards.all_gather(torch.from_numpy(full[name]))
        return full

    def load_state_dict(self, state_dict):
        """Takes full flat state arrays (of any world size's checkpoint) and keeps this shard."""
        self._inner.load_state_dict({"step_count": state_dict["step_count"],
                                     "state": {name: array[self._shard]
                                               for name, array in state_dict["state"].items()}})
