"""ort_trainer.data's load-balancing samplers: against ONNX Runtime's original and DistributedSampler.

The original (onnxruntime.training.utils.data, installed with the training build) is the reference
for the order of groups and chunks; DistributedSampler for which samples an epoch drops or repeats
and for the balance to beat. The 2-process run under torchrun is tests/sampler_worker.py.
"""
import json
import math
import re
import subprocess
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ort_trainer.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

from . import sampler_worker as worker
from .sampler_worker import complexity_fn, skewed_dataset, token_budget_batches


def distinct_dataset(size, seed=0):
    """(index, length) samples with distinct lengths: no ties, so any correct sort gives one order."""
    lengths = np.random.default_rng(seed).permutation(10 * size)[:size] + 16
    return [(index, int(length)) for index, length in enumerate(lengths)]


def samplers(dataset, world_size, epoch=0, **kwargs):
    """One sampler per rank, at ``epoch``."""
    result = [LoadBalancingDistributedSampler(dataset, complexity_fn, world_size=world_size, rank=rank, **kwargs)
              for rank in range(world_size)]
    for sampler in result:
        sampler.set_epoch(epoch)
    return result


def per_rank(dataset, world_size, **kwargs):
    return [list(sampler) for sampler in samplers(dataset, world_size, **kwargs)]


def totals(dataset, shares):
    return [sum(dataset[index][1] for index in share) for share in shares]


# Lengths 0..9, not shuffled: rank 0 gets 1, 2, 5, 6, 9 and rank 1 gets 0, 3, 4, 7, 8 (totals 23 and 22).
RAMP = [(index, index) for index in range(10)]


def fixed_size_batches(size):
    return lambda indices: [indices[start:start + size] for start in range(0, len(indices), size)]


# ---------------------------------------------------------------- the original's order

def original_per_rank(dataset, world_size, **kwargs):
    from onnxruntime.training.utils.data import sampler as original

    return [[int(index) for index in original.LoadBalancingDistributedSampler(
        dataset, complexity_fn, world_size=world_size, rank=rank, **kwargs)] for rank in range(world_size)]


@pytest.mark.parametrize("kwargs", [{"shuffle": False}, {"shuffle": True}, {"shuffle": False, "group_size": 8},
                                    {"shuffle": True, "group_size": 8}, {"shuffle": True, "seed": 5}],
                         ids=["sorted", "shuffled", "sorted_in_groups", "groups_shuffled", "seed"])
def test_one_rank_gets_the_originals_order(kwargs):
    dataset = distinct_dataset(100)  # 100 = 12 groups of 8 and one of 4
    assert per_rank(dataset, 1, **kwargs) == original_per_rank(dataset, 1, **kwargs)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kwargs", [{"shuffle": False}, {"shuffle": True}, {"shuffle": True, "group_size": 8}],
                         ids=["sorted", "shuffled", "groups_shuffled"])
def test_ranks_share_the_originals_chunks_dealt_to_balance(world_size, kwargs):
    """Position j of every rank holds the original's chunk j; only who gets which sample differs."""
    dataset = distinct_dataset(96)
    ours = per_rank(dataset, world_size, **kwargs)
    original = original_per_rank(dataset, world_size, **kwargs)
    assert [set(chunk) for chunk in zip(*ours)] == [set(chunk) for chunk in zip(*original)]
    assert ours != original  # the original gives rank r the r-th smallest of every chunk


# ---------------------------------------------------------------- exclusive shares, DistributedSampler's epoch

@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True], ids=["padded", "drop_last"])
@pytest.mark.parametrize("kwargs", [{"shuffle": False}, {"shuffle": True}, {"shuffle": True, "group_size": 16},
                                    {"shuffle": True, "random_level": 0.5}],
                         ids=["sorted", "shuffled", "groups", "random_level"])
def test_ranks_get_exclusive_equal_shares_of_distributed_samplers_epoch(world_size, drop_last, kwargs):
    dataset = skewed_dataset(301)  # 301 % 2 == 301 % 3 == 1
    shares = per_rank(dataset, world_size, drop_last=drop_last, **kwargs)
    expected_len = len(dataset) // world_size if drop_last else math.ceil(len(dataset) / world_size)
    assert [len(share) for share in shares] == [expected_len] * world_size
    assert all(isinstance(index, int) for share in shares for index in share)
    counts = Counter(index for share in shares for index in share)
    if drop_last:  # len(dataset) % world_size samples left out, none repeated
        assert max(counts.values()) == 1 and len(counts) == len(dataset) - len(dataset) % world_size
    else:  # every sample, and enough of them twice to fill every rank
        assert set(counts) == set(range(len(dataset))) and sum(counts.values()) == expected_len * world_size
    if not kwargs["shuffle"]:  # the same samples as DistributedSampler: its tail dropped, its head repeated
        reference = Counter(index for rank in range(world_size) for index in DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=False, drop_last=drop_last))
        assert counts == reference


def test_fewer_samples_than_ranks():
    dataset = skewed_dataset(3)
    assert per_rank(dataset, 4, drop_last=True) == [[]] * 4
    shares = per_rank(dataset, 4)
    assert [len(share) for share in shares] == [1] * 4 and set(sum(shares, [])) == {0, 1, 2}


def test_a_chunks_largest_sample_goes_to_the_rank_with_the_smallest_total():
    assert per_rank(RAMP, 2, shuffle=False) == [[1, 2, 5, 6, 9], [0, 3, 4, 7, 8]]


# ---------------------------------------------------------------- balance

@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kwargs", [{"shuffle": False}, {"shuffle": True}, {"shuffle": True, "group_size": 64}],
                         ids=["sorted", "shuffled", "groups"])
def test_totals_per_rank_balance_far_better_than_distributed_sampler(world_size, kwargs):
    dataset = skewed_dataset(4001)
    shares = per_rank(dataset, world_size, **kwargs)
    ours = totals(dataset, shares)
    reference = totals(dataset, [list(DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                                         shuffle=kwargs["shuffle"])) for rank in range(world_size)])
    # The documented bound: the largest spread of one chunk (the ranks' samples at one position).
    chunk_lengths = np.array([[dataset[index][1] for index in share] for share in shares])
    assert max(ours) - min(ours) <= np.ptp(chunk_lengths, axis=0).max()
    assert max(ours) / min(ours) - 1 < (max(reference) / min(reference) - 1) / 20, (ours, reference)


def waiting(dataset, batches_per_rank):
    """Straggler cost: per step, the slowest rank's padded tokens minus the mean rank's, summed over steps."""
    cost = np.array([[len(batch) * max(dataset[index][1] for index in batch) for batch in batches]
                     for batches in batches_per_rank])
    return float((cost.max(axis=0) - cost.mean(axis=0)).sum()), float(cost.mean(axis=0).sum())


def test_every_step_costs_about_the_same_on_every_rank():
    dataset, world_size, batch = skewed_dataset(4000), 2, 16
    ours = [LoadBalancingDistributedBatchSampler(sampler, fixed_size_batches(batch))
            for sampler in samplers(dataset, world_size, group_size=256)]
    ours_wait, ours_work = waiting(dataset, [list(batch_sampler) for batch_sampler in ours])
    reference = [list(torch.utils.data.BatchSampler(DistributedSampler(dataset, world_size, rank), batch, False))
                 for rank in range(world_size)]
    reference_wait, reference_work = waiting(dataset, reference)
    assert ours_wait < reference_wait / 10
    assert ours_work < reference_work / 2  # batches of similar lengths: less padding


def test_random_level_trades_balance_for_mixing():
    dataset = skewed_dataset(2000)

    def mean_gap(shares):  # between the ranks' samples at the same position
        return np.mean([abs(dataset[a][1] - dataset[b][1]) for a, b in zip(*shares)])

    def imbalance(shares):
        return np.ptp(totals(dataset, shares))

    balanced, mixed = per_rank(dataset, 2), per_rank(dataset, 2, random_level=1.0)
    assert mean_gap(mixed) > 5 * mean_gap(balanced)
    assert imbalance(mixed) > 100 * max(imbalance(balanced), 1)


# ---------------------------------------------------------------- epochs and seeds

def test_shuffle_depends_on_seed_and_epoch_only():
    dataset = skewed_dataset(301)
    first = per_rank(dataset, 2, group_size=32)
    assert per_rank(dataset, 2, group_size=32) == first
    sampler = samplers(dataset, 2, group_size=32)[1]
    assert list(sampler) == list(sampler) == first[1]  # the original raised on a second iteration
    sampler.set_epoch(1)
    assert list(sampler) != first[1]
    assert per_rank(dataset, 2, group_size=32, epoch=1)[1] == list(sampler)
    assert per_rank(dataset, 2, group_size=32, seed=1) != first
    assert per_rank(dataset, 2, shuffle=False, epoch=3) == per_rank(dataset, 2, shuffle=False)


def test_epochs_vary_the_ranks_shares_among_equal_complexities():
    dataset = skewed_dataset(300)  # every epoch the same samples, sorted alike but for ties
    epoch0, epoch1 = per_rank(dataset, 2), per_rank(dataset, 2, epoch=1)
    assert set(epoch0[0]) != set(epoch1[0])


# ---------------------------------------------------------------- the batch sampler

def test_ranks_yield_as_many_batches_the_short_ones_repeating_their_first():
    dataset = skewed_dataset(301)
    batch_fn = token_budget_batches(dataset)
    unequal = 0
    for epoch in range(3):
        shares = per_rank(dataset, 2, group_size=64, epoch=epoch)
        own = [batch_fn(share) for share in shares]
        counts = [len(batches) for batches in own]
        unequal += counts[0] != counts[1]
        for drop_last, count in ((False, max(counts)), (True, min(counts))):
            for rank, sampler in enumerate(samplers(dataset, 2, group_size=64, epoch=epoch)):
                batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn, drop_last=drop_last)
                assert len(batch_sampler) == count
                assert list(batch_sampler) == [own[rank][i % counts[rank]] for i in range(count)]
    assert unequal  # this data does give the ranks different counts


def test_the_original_broke_equal_batch_counts():
    from onnxruntime.training.utils.data import sampler as original

    def batch_fn(indices):
        return [[index] for index in indices] if 0 in indices else [indices]

    yielded = []
    for rank in range(2):
        sampler = original.LoadBalancingDistributedSampler(RAMP, complexity_fn, world_size=2, rank=rank, shuffle=False)
        yielded.append(len(list(original.LoadBalancingDistributedBatchSampler(sampler, batch_fn))))
    assert yielded == [5, 2]  # a hang in the first collective
    ours = [LoadBalancingDistributedBatchSampler(sampler, batch_fn) for sampler in samplers(RAMP, 2, shuffle=False)]
    assert [len(list(batch_sampler)) for batch_sampler in ours] == [5, 5]


def test_batches_follow_set_epoch_of_either_sampler():
    dataset = skewed_dataset(301)
    sampler = samplers(dataset, 2)[0]
    batch_sampler = LoadBalancingDistributedBatchSampler(sampler, fixed_size_batches(8))
    first = list(batch_sampler)
    batch_sampler.set_epoch(1)
    assert sampler.epoch == 1 and list(batch_sampler) != first
    sampler.set_epoch(0)
    assert list(batch_sampler) == first == fixed_size_batches(8)(list(sampler))


def test_the_seeds_loop_runs_as_written():
    dataset = skewed_dataset(301)
    sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=complexity_fn, world_size=2, rank=1)
    batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn=token_budget_batches(dataset))
    loader = DataLoader(dataset, batch_sampler=batch_sampler)
    for epoch in range(2):
        batch_sampler.set_epoch(epoch)
        seen = [(indices.tolist(), lengths.tolist()) for indices, lengths in loader]
        assert len(seen) == len(loader) == len(batch_sampler)
        assert [indices for indices, _ in seen] == list(batch_sampler)
        assert all(length == dataset[index][1] for indices, lengths in seen for index, length in zip(indices, lengths))


def test_the_sampler_alone_feeds_a_data_loader():
    dataset = skewed_dataset(301)
    sampler = LoadBalancingDistributedSampler(dataset, complexity_fn, world_size=2, rank=0)
    batches = [indices.tolist() for indices, _ in DataLoader(dataset, sampler=sampler, batch_size=16)]
    assert sum(batches, []) == list(sampler)


# ---------------------------------------------------------------- world size and rank from torch.distributed

@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
    yield
    dist.destroy_process_group()


def test_world_size_and_rank_come_from_the_process_group(one_rank_group):
    sampler = LoadBalancingDistributedSampler(skewed_dataset(10), complexity_fn)
    assert (sampler.world_size, sampler.rank, len(sampler)) == (1, 0, 10)


@pytest.mark.parametrize("kwargs, name", [({}, "world_size"), ({"world_size": 2}, "rank")])
def test_without_a_process_group_world_size_and_rank_are_needed(kwargs, name):
    message = (f"{name}=None takes the value of the torch.distributed process group, but none is initialized: call "
               f"torch.distributed.init_process_group() first (or launch with torchrun), or pass world_size and rank")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        LoadBalancingDistributedSampler(skewed_dataset(10), complexity_fn, **kwargs)


@pytest.fixture(scope="module")
def torchrun_results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sampler_torchrun")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "tests.sampler_worker", str(directory)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_under_torchrun_ranks_yield_what_one_process_computes(torchrun_results):
    dataset = skewed_dataset()
    for rank, result in enumerate(torchrun_results):
        assert (result["rank"], result["world_size"]) == (rank, 2)
        for epoch, batches in enumerate(result["epochs"]):
            sampler = samplers(dataset, 2, epoch=epoch, group_size=64)[rank]
            assert batches == list(LoadBalancingDistributedBatchSampler(sampler, token_budget_batches(dataset)))
    assert [len(batches) for batches in torchrun_results[0]["epochs"]] == [
        len(batches) for batches in torchrun_results[1]["epochs"]]


def test_under_torchrun_ranks_share_the_dataset_exclusively(torchrun_results):
    dataset = skewed_dataset()
    for epoch in range(worker.EPOCHS):
        seen = [{index for batch in result["epochs"][epoch] for index in batch} for result in torchrun_results]
        assert seen[0] | seen[1] == set(range(len(dataset)))
        assert len(seen[0] & seen[1]) <= 1  # 301 samples: one repeated to give both ranks 151
    assert torchrun_results[0]["epochs"][0] != torchrun_results[0]["epochs"][1]


# ---------------------------------------------------------------- bad arguments

class NotAMapStyleDataset:
    def __iter__(self):
        return iter([])


@pytest.mark.parametrize("kwargs, error, message", [
    ({"complexity_fn": 3}, TypeError, "complexity_fn=3: expected a callable (sample -> complexity)"),
    ({"world_size": 0}, ValueError, "world_size=0: expected an int >= 1"),
    ({"world_size": 2.0}, ValueError, "world_size=2.0: expected an int >= 1"),
    ({"rank": 2}, ValueError, "rank=2: expected an int in [0, 1] (world_size=2)"),
    ({"rank": -1}, ValueError, "rank=-1: expected an int in [0, 1] (world_size=2)"),
    ({"shuffle": "yes"}, TypeError, "shuffle='yes': expected a bool"),
    ({"drop_last": 1}, TypeError, "drop_last=1: expected a bool"),
    ({"group_size": 0}, ValueError, "group_size=0: expected None or an int >= 1"),
    ({"group_size": True}, ValueError, "group_size=True: expected None or an int >= 1"),
    ({"seed": 1.5}, TypeError, "seed=1.5: expected an int"),
    ({"random_level": 1.5}, ValueError, "random_level=1.5: expected a number in [0, 1]"),
    ({"random_level": float("nan")}, ValueError, "random_level=nan: expected a number in [0, 1]"),
    ({"dataset": NotAMapStyleDataset()}, TypeError,
     "dataset: expected a map-style dataset (with __len__ and __getitem__), got NotAMapStyleDataset"),
    ({"dataset": []}, ValueError, "dataset is empty: there is nothing to sample"),
    ({"complexity_fn": lambda sample: torch.tensor(sample[1])}, ValueError,
     "complexity_fn(dataset[0]) returned tensor(73) (Tensor); expected a finite real number, such as the "
     "sample's length"),
    ({"complexity_fn": lambda sample: None}, ValueError,
     "complexity_fn(dataset[0]) returned None (NoneType); expected a finite real number"),
    ({"complexity_fn": lambda sample: float("inf")}, ValueError,
     "complexity_fn(dataset[0]) returned inf (float); expected a finite real number"),
])
def test_bad_sampler_arguments_are_named(kwargs, error, message):
    arguments = {"dataset": skewed_dataset(10), "complexity_fn": complexity_fn, "world_size": 2, "rank": 0, **kwargs}
    with pytest.raises(error, match=f"^{re.escape(message)}"):
        LoadBalancingDistributedSampler(**arguments)


def test_a_rejected_epoch_changes_nothing():
    sampler = samplers(skewed_dataset(10), 2, epoch=3)[0]
    with pytest.raises(TypeError, match=r"^epoch='4': expected an int$"):
        sampler.set_epoch("4")
    with pytest.raises(TypeError, match=r"^epoch=1.0: expected an int$"):
        LoadBalancingDistributedBatchSampler(sampler, fixed_size_batches(2)).set_epoch(1.0)
    assert sampler.epoch == 3


@pytest.mark.parametrize("kwargs, error, message", [
    ({"sampler": DistributedSampler(range(4), 1, 0)}, TypeError,
     "sampler: expected a LoadBalancingDistributedSampler, got DistributedSampler"),
    ({"batch_fn": None}, TypeError, "batch_fn=None: expected a callable (indices -> list of batches)"),
    ({"drop_last": "no"}, TypeError, "drop_last='no': expected a bool"),
])
def test_bad_batch_sampler_arguments_are_named(kwargs, error, message):
    arguments = {"sampler": samplers(skewed_dataset(10), 2)[0], "batch_fn": fixed_size_batches(2), **kwargs}
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        LoadBalancingDistributedBatchSampler(**arguments)


@pytest.mark.parametrize("batch_fn, error, message", [
    (lambda indices: len(indices), TypeError,
     "batch_fn must return a list of batches (lists of dataset indices); for rank 0 it returned 5"),
    (lambda indices: [indices, []], ValueError, "batch_fn returned [] as batch 1 of rank 0; expected a non-empty "
                                                "list of the dataset indices it was given"),
    (lambda indices: [list(range(len(indices)))], ValueError,
     "batch_fn returned [0, 1, 2, 3, 4] as batch 0 of rank 0; expected a non-empty list of the dataset indices"),
    (lambda indices: [[float(index) for index in indices]], ValueError,
     "batch_fn returned [1.0, 2.0, 5.0, 6.0, 9.0] as batch 0 of rank 0"),
    (lambda indices: [] if 0 in indices else [indices], ValueError,
     "batch_fn returned no batch for rank 1's 5 indices, while rank 0 has 1: every rank must yield as many "
     "batches (use drop_last=True to stop every rank at the smallest count)"),
])
def test_bad_batches_are_named(batch_fn, error, message):
    batch_sampler = LoadBalancingDistributedBatchSampler(samplers(RAMP, 2, shuffle=False)[0], batch_fn)
    with pytest.raises(error, match=f"^{re.escape(message)}"):
        len(batch_sampler)


def test_drop_last_stops_every_rank_at_the_smallest_count_even_zero():
    batch_sampler = LoadBalancingDistributedBatchSampler(samplers(RAMP, 2, shuffle=False)[0],
                                                         lambda indices: [] if 0 in indices else [indices],
                                                         drop_last=True)
    assert len(batch_sampler) == 0 and list(batch_sampler) == []
