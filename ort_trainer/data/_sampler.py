"""Samplers that deal each rank an exclusive share of the dataset, balanced by the samples' complexity.

ONNX Runtime's ``onnxruntime.training.utils.data`` samplers (adapted there from Bagua), with their
arguments and documented behaviour. Every epoch, on every rank alike (seeded by ``seed + epoch``):

1. The samples of the epoch are chosen as ``DistributedSampler`` chooses them: with ``drop_last``
   the last ``len(dataset) % world_size`` of the (shuffled) indices are left out, else the first
   ones are repeated until every rank has ``ceil(len(dataset) / world_size)``.
2. They are sorted by complexity (plus uniform noise of ``random_level`` times the complexity
   range), within consecutive groups of ``group_size`` dataset indices when given, the groups then
   shuffled; ties go in shuffled order.
3. Consecutive runs of ``world_size`` samples form chunks of similar complexity; each rank takes
   one sample of each chunk, which one chosen to even out the ranks' totals (``_dealt``). Without
   ``group_size`` the chunk order is shuffled.

Position j of every rank's indices comes from the same chunk, so batches made position by position
cost about the same on every rank: no rank waits for a straggler at the gradient all-reduce.

Fixed against the original: a second iteration (and so ``set_epoch``) raised a NumPy truth-value
error; rank r always took the r-th smallest of each chunk (the last rank the largest); a repeated
sample was dealt beside the largest one; the batch sampler's ``len`` could differ from what it
yielded, and ranks could yield different numbers of batches (a hang in the first collective).
"""
import math
import numbers
from typing import Callable, Iterator, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _require_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: expected a bool")


def _from_process_group(name, value, query):
    if value is not None:
        return value
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{name}=None takes the value of the torch.distributed process group, but none is "
                         f"initialized: call torch.distributed.init_process_group() first (or launch with "
                         f"torchrun), or pass world_size and rank")
    return query()


def _complexities(dataset, complexity_fn):
    """complexity_fn of every sample, as float64 (computed once: it may load the sample)."""
    values = np.empty(len(dataset), dtype=np.float64)
    for index in range(len(values)):
        value = complexity_fn(dataset[index])
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"complexity_fn(dataset[{index}]) returned {value!r} ({type(value).__name__}); "
                             f"expected a finite real number, such as the sample's length")
        values[index] = value
    return values


def _dealt(chunks, complexity):
    """Which sample of each chunk goes to which rank: column r of the result is rank r's.

    Chunks in order of decreasing spread (largest - smallest complexity): the chunk's largest sample
    goes to the rank with the smallest total so far, its second largest to the second smallest, and
    so on. A pair of ranks then differs by its old difference and the chunk's, of opposite signs,
    so the ranks' totals end at most the largest spread of one chunk apart, on any world size.
    Chunks of equal complexities change no difference and keep their order.
    """
    world_size = chunks.shape[1]
    values = complexity[chunks]
    largest_first = np.argsort(-values, axis=1, kind="stable")
    chunks = np.take_along_axis(chunks, largest_first, axis=1)
    values = np.take_along_axis(values, largest_first, axis=1)
    spread = values[:, 0] - values[:, -1]
    order = np.argsort(-spread, kind="stable")
    order = order[spread[order] > 0]
    totals = [0.0] * world_size
    placed = []
    for row, samples in zip(values[order].tolist(), chunks[order].tolist()):
        ranks = sorted(range(world_size), key=totals.__getitem__)
        chunk = [0] * world_size
        for rank, value, sample in zip(ranks, row, samples):
            totals[rank] += value
            chunk[rank] = sample
        placed.append(chunk)
    if placed:
        chunks[order] = placed
    return chunks


class LoadBalancingDistributedSampler(Sampler[int]):
    """An exclusive share of a map-style dataset for this rank, balanced by ``complexity_fn``.

    ``complexity_fn(sample)`` is a sample's cost (e.g. its length); it is called once per sample,
    here, and must give the same values in every process. ``world_size`` and ``rank`` default to
    the torch.distributed process group's. ``group_size``: sort within consecutive groups of that
    many dataset indices, shuffle the groups and keep the order within them, rather than sort the
    whole dataset and shuffle the chunks: a rank's consecutive samples then have similar
    complexities (batches with little padding). ``random_level`` in [0, 1]: 0 is the best balance,
    1 mixes complexities the most. ``drop_last`` as in ``DistributedSampler``.
    Call ``set_epoch(epoch)`` before each epoch to reshuffle.
    """

    def __init__(self, dataset, complexity_fn: Callable[..., float], world_size: Optional[int] = None,
                 rank: Optional[int] = None, shuffle: bool = True, group_size: Optional[int] = None,
                 seed: int = 0, drop_last: bool = False, random_level: float = 0) -> None:
        if not callable(complexity_fn):
            raise TypeError(f"complexity_fn={complexity_fn!r}: expected a callable (sample -> complexity)")
        world_size = _from_process_group("world_size", world_size, dist.get_world_size)
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}: expected an int >= 1")
        rank = _from_process_group("rank", rank, dist.get_rank)
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r}: expected an int in [0, {world_size - 1}] (world_size={world_size})")
        _require_bool("shuffle", shuffle)
        _require_bool("drop_last", drop_last)
        if group_size is not None and (not _is_int(group_size) or group_size < 1):
            raise ValueError(f"group_size={group_size!r}: expected None or an int >= 1")
        if not _is_int(seed):
            raise TypeError(f"seed={seed!r}: expected an int")
        if (not isinstance(random_level, numbers.Real) or isinstance(random_level, bool)
                or not 0 <= random_level <= 1):
            raise ValueError(f"random_level={random_level!r}: expected a number in [0, 1]")
        try:
            dataset_len = len(dataset)
        except TypeError:
            raise TypeError(f"dataset: expected a map-style dataset (with __len__ and __getitem__), "
                            f"got {type(dataset).__name__}") from None
        if dataset_len == 0:
            raise ValueError("dataset is empty: there is nothing to sample")
        self._complexities = _complexities(dataset, complexity_fn)
        self.dataset = dataset
        self.complexity_fn = complexity_fn
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.shuffle = shuffle
        self.group_size = group_size
        self.seed = int(seed)
        self.drop_last = drop_last
        self.random_level = float(random_level)
        self.epoch = 0
        self.num_samples = dataset_len // self.world_size if drop_last else math.ceil(dataset_len / self.world_size)
        self.total_size = self.num_samples * self.world_size

    def set_epoch(self, epoch: int) -> None:
        """The epoch seeds the shuffle (``seed + epoch``): every epoch its own order, the same on every rank."""
        if not _is_int(epoch):
            raise TypeError(f"epoch={epoch!r}: expected an int")
        self.epoch = int(epoch)

    def _chunks(self) -> np.ndarray:
        """This epoch's samples of every rank: (num_samples, world_size) dataset indices, column r for rank r.

        The random draws come in the original's order (noise, then the order of the groups or of the
        chunks), so that without noise the groups and chunks come in the same order as there.
        """
        complexity = self._complexities
        size = len(complexity)
        generator = torch.Generator().manual_seed((self.seed + self.epoch) % 2**64)
        if self.random_level > 0:
            noise = torch.rand(size, generator=generator, dtype=torch.float64).numpy()
            complexity = complexity + noise * (complexity.max() - complexity.min()) * self.random_level
        group_position = chunk_order = None
        if self.shuffle and self.group_size is not None:
            num_groups = math.ceil(size / self.group_size)
            group_position = np.argsort(torch.randperm(num_groups, generator=generator).numpy())
        elif self.shuffle:
            chunk_order = torch.randperm(self.num_samples, generator=generator).numpy()
        order = torch.randperm(size, generator=generator).numpy() if self.shuffle else np.arange(size)
        chosen = np.resize(order, self.total_size)  # as DistributedSampler: the tail dropped or the head repeated
        group = np.zeros(self.total_size, dtype=np.int64)
        if self.group_size is not None:
            group = chosen // self.group_size
            if group_position is not None:
                group = group_position[group]
        # lexsort: the last key first; ties stay in the order of `chosen` (shuffled or dataset order).
        chunks = chosen[np.lexsort((np.arange(self.total_size), complexity[chosen], group))]
        chunks = _dealt(chunks.reshape(self.num_samples, self.world_size), complexity)
        return chunks if chunk_order is None else chunks[chunk_order]

    def __iter__(self) -> Iterator[int]:
        return iter(self._chunks()[:, self.rank].tolist())

    def __len__(self) -> int:
        return self.num_samples


def _checked_batches(batch_fn, indices, rank):
    """batch_fn(indices) as lists of ints, each batch non-empty and drawn from ``indices``."""
    result = batch_fn(list(indices))
    try:
        batches = [list(batch) for batch in result]
    except TypeError:
        raise TypeError(f"batch_fn must return a list of batches (lists of dataset indices); for rank {rank} "
                        f"it returned {result!r:.200}") from None
    given = set(indices)
    for number, batch in enumerate(batches):
        if not batch or any(not _is_int(index) or index not in given for index in batch):
            raise ValueError(f"batch_fn returned {batch!r:.200} as batch {number} of rank {rank}; expected a "
                             f"non-empty list of the dataset indices it was given")
    return [[int(index) for index in batch] for batch in batches]


class LoadBalancingDistributedBatchSampler(Sampler[List[int]]):
    """Batches of a :class:`LoadBalancingDistributedSampler`'s indices, the same number on every rank.

    ``batch_fn(indices) -> list of batches`` (lists of dataset indices) cuts a rank's indices, in
    order, into batches, e.g. fixed sizes or a token budget. It must be deterministic: every rank
    calls it on every rank's indices to learn their batch counts. Ranks with fewer batches repeat
    their first ones up to the largest count, or with ``drop_last`` every rank stops at the smallest.
    """

    def __init__(self, sampler: LoadBalancingDistributedSampler, batch_fn: Callable[[List[int]], List[List[int]]],
                 drop_last: bool = False) -> None:
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise TypeError(f"sampler: expected a LoadBalancingDistributedSampler, got {type(sampler).__name__}")
        if not callable(batch_fn):
            raise TypeError(f"batch_fn={batch_fn!r}: expected a callable (indices -> list of batches)")
        _require_bool("drop_last", drop_last)
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = drop_last
        self._cached = None  # (epoch, this rank's batches)

    def set_epoch(self, epoch: int) -> None:
        """Sets the sampler's epoch: the next iteration reshuffles."""
        self.sampler.set_epoch(epoch)

    def _batches(self) -> List[List[int]]:
        if self._cached is None or self._cached[0] != self.sampler.epoch:
            chunks = self.sampler._chunks()
            per_rank = [_checked_batches(self.batch_fn, chunks[:, rank].tolist(), rank)
                        for rank in range(self.sampler.world_size)]
            counts = [len(batches) for batches in per_rank]
            count = min(counts) if self.drop_last else max(counts)
            if count and not min(counts):
                empty = counts.index(0)
                raise ValueError(f"batch_fn returned no batch for rank {empty}'s {len(chunks)} indices, while "
                                 f"rank {counts.index(count)} has {count}: every rank must yield as many batches "
                                 f"(use drop_last=True to stop every rank at the smallest count)")
            mine = per_rank[self.sampler.rank]
            self._cached = (self.sampler.epoch, [mine[i % len(mine)] for i in range(count)])
        return self._cached[1]

    def __iter__(self) -> Iterator[List[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())
