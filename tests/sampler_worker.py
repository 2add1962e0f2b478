"""One rank of tests/test_data_sampler.py's torchrun run, and the data both share.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.sampler_worker <directory>

World size and rank come from the gloo process group. Every rank runs the seed's loop for EPOCHS
epochs, all-reducing once per batch as data parallel training does (unequal batch counts would
hang), and writes the batches it saw to ``<directory>/rank<r>.json``.
"""
import json
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ort_trainer.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

EPOCHS = 2
TOKEN_BUDGET = 600


def skewed_dataset(size=301, seed=0):
    """(index, length) samples, lengths lognormal within 16..512 as in NLP/speech corpora."""
    lengths = np.clip(np.random.default_rng(seed).lognormal(4.2, 0.8, size), 16, 512).astype(int)
    return [(index, int(length)) for index, length in enumerate(lengths)]


def complexity_fn(sample):
    return sample[1]


def token_budget_batches(dataset):
    """batch_fn: consecutive indices while the padded batch (count x longest) fits TOKEN_BUDGET."""
    def batch_fn(indices):
        batches, batch, longest = [], [], 0
        for index in indices:
            length = dataset[index][1]
            if batch and (len(batch) + 1) * max(longest, length) > TOKEN_BUDGET:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(index)
            longest = max(longest, length)
        return batches + [batch] if batch else batches
    return batch_fn


def main(directory):
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    dataset = skewed_dataset()
    sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=complexity_fn, group_size=64)
    batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn=token_budget_batches(dataset))
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler)
    epochs = []
    for epoch in range(EPOCHS):
        batch_sampler.set_epoch(epoch)
        batches = []
        for indices, _ in loader:
            dist.all_reduce(torch.ones(1))
            batches.append(indices.tolist())
        epochs.append(batches)
    rank = dist.get_rank()
    result = {"rank": rank, "world_size": dist.get_world_size(), "epochs": epochs}
    (Path(directory) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
