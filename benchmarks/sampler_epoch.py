"""Epoch time of a variable-length model under 2 data-parallel processes: DistributedSampler vs load balancing.

    python benchmarks/sampler_epoch.py                      # 2 gloo processes, 1 thread each
    python benchmarks/sampler_epoch.py --repeats 5 --json out.json

The model: embedding, one transformer encoder layer (d_model 64, 4 heads, key padding mask), mean
pooling, linear classifier, over sequences whose lengths are lognormal within 16..512 tokens (a
skewed NLP/speech-like distribution); each batch is padded to its longest sequence; eager PyTorch
under DistributedDataParallel (gloo). Every epoch runs one sampler on
both ranks; the samplers take turns epoch by epoch (``--repeats`` epochs each, after one warmup
epoch each). An epoch's time is the slowest rank's (from a barrier to its last optimizer step),
since the slowest rank sets the pace; the table gives the median and the minimum over the repeats,
the tokens per rank (the sum of the complexity, here the length), the padded tokens per rank
(batch size x longest, what the model computes) and the padded tokens of the slowest rank of each
step, summed over the steps (the work that sets the pace).

* ``DistributedSampler``: torch's, shuffled, fixed batches of ``--batch``.
* ``load balancing``: LoadBalancingDistributedSampler (no groups: sorted chunks in shuffled order)
  and fixed batches of ``--batch``: the same padding as above on average, balanced per step.
* ``load balancing, groups``: with ``group_size=--group-size``: batches of similar lengths.
* ``load balancing, groups, token budget``: batch_fn cuts batches at ``--batch`` x the median
  length padded tokens (variable batch sizes).
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler  # noqa: E402

from examples._report import write_json  # noqa: E402
from ort_trainer.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler  # noqa: E402

WORLD_SIZE = 2
SAMPLERS = ("DistributedSampler", "load balancing", "load balancing, groups", "load balancing, groups, token budget")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=2048, help="dataset size")
    p.add_argument("--batch", type=int, default=16, help="batch size (and the token budget's multiple)")
    p.add_argument("--group-size", type=int, default=256, help="group_size of the grouped samplers")
    p.add_argument("--repeats", type=int, default=3, help="measured epochs per sampler")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def lengths_of(samples, seed=0):
    """Lognormal lengths (median 67 tokens) within 16..512."""
    return np.clip(np.random.default_rng(seed).lognormal(4.2, 0.8, samples), 16, 512).astype(int)


class Sequences(torch.utils.data.Dataset):
    """Sample i: random tokens of lengths[i] and a class label."""

    def __init__(self, lengths, vocab=1000, classes=8):
        generator = torch.Generator().manual_seed(0)
        self.samples = [(torch.randint(vocab, (int(n),), generator=generator), int(torch.randint(
            classes, (), generator=generator))) for n in lengths]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def collate(samples):
    """Tokens padded to the longest, the padding mask (True: padding), labels."""
    tokens = torch.nn.utils.rnn.pad_sequence([tokens for tokens, _ in samples], batch_first=True)
    lengths = torch.tensor([len(tokens) for tokens, _ in samples])
    padding = torch.arange(tokens.shape[1]) >= lengths[:, None]
    return tokens, padding, torch.tensor([label for _, label in samples])


class Classifier(torch.nn.Module):
    def __init__(self, vocab=1000, classes=8, width=64):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, width)
        self.encoder = torch.nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, tokens, padding):
        hidden = self.encoder(self.embedding(tokens), src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * keep).sum(1) / keep.sum(1))


def batch_samplers(dataset, lengths, args, rank):
    """name -> (batch sampler, its set_epoch)."""
    budget = args.batch * int(np.median(lengths))

    def fixed(indices):
        return [indices[start:start + args.batch] for start in range(0, len(indices), args.batch)]

    def token_budget(indices):
        batches, batch, longest = [], [], 0
        for index in indices:
            if batch and (len(batch) + 1) * max(longest, lengths[index]) > budget:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(index)
            longest = max(longest, lengths[index])
        return batches + [batch] if batch else batches

    def balanced(batch_fn, **kwargs):
        sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda sample: len(sample[0]),
                                                  world_size=WORLD_SIZE, rank=rank, **kwargs)
        batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn=batch_fn)
        return batch_sampler, batch_sampler.set_epoch

    distributed = DistributedSampler(dataset, num_replicas=WORLD_SIZE, rank=rank, shuffle=True)
    return {SAMPLERS[0]: (BatchSampler(distributed, args.batch, drop_last=False), distributed.set_epoch),
            SAMPLERS[1]: balanced(fixed), SAMPLERS[2]: balanced(fixed, group_size=args.group_size),
            SAMPLERS[3]: balanced(token_budget, group_size=args.group_size)}


def run_epoch(model, optimizer, loader):
    """Seconds from a barrier to this rank's last optimizer step."""
    dist.barrier()
    start = time.perf_counter()
    for tokens, padding, labels in loader:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(tokens, padding), labels).backward()
        optimizer.step()
    return time.perf_counter() - start


def rank_main(rank, args, port, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=120))
    lengths = lengths_of(args.samples)
    dataset = Sequences(lengths)
    torch.manual_seed(0)
    model = DistributedDataParallel(Classifier())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    samplers = batch_samplers(dataset, lengths, args, rank)
    loaders = {name: DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
               for name, (sampler, _) in samplers.items()}
    seconds = {name: [] for name in SAMPLERS}
    for repeat in range(args.repeats + 1):  # repeat 0: warmup
        for name in SAMPLERS:
            samplers[name][1](repeat)
            elapsed = run_epoch(model, optimizer, loaders[name])
            if repeat:
                seconds[name].append(elapsed)
    work = {}
    for name in SAMPLERS:  # the last epoch's batches: tokens and padded tokens of this rank
        batches = list(samplers[name][0])
        work[name] = {"tokens": int(sum(lengths[i] for batch in batches for i in batch)),
                      "padded": [int(len(batch) * max(lengths[i] for i in batch)) for batch in batches]}
    gathered = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, {"seconds": seconds, "work": work})
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def summarize(gathered, args):
    results = {}
    for name in SAMPLERS:
        epochs = [max(per_rank["seconds"][name][i] for per_rank in gathered) for i in range(args.repeats)]
        work = [per_rank["work"][name] for per_rank in gathered]
        tokens = [w["tokens"] for w in work]
        padded = np.array([w["padded"] for w in work])  # (rank, step): every rank has as many steps
        results[name] = {"median_epoch_s": statistics.median(epochs), "min_epoch_s": min(epochs),
                         "epoch_s": epochs, "steps_per_rank": padded.shape[1], "tokens_per_rank": tokens,
                         "tokens_max_over_min": max(tokens) / min(tokens),
                         "padded_tokens_per_rank": padded.sum(axis=1).tolist(),
                         "padded_tokens_slowest_per_step": int(padded.max(axis=0).sum())}
    return results


def print_table(results, args):
    print(f"{args.samples} sequences (lognormal lengths 16..512), batch {args.batch}, group_size "
          f"{args.group_size}, {WORLD_SIZE} gloo processes x 1 thread, "
          f"{os.cpu_count()} CPUs, {args.repeats} epochs each")
    header = (f"{'sampler':<38} {'epoch s (median)':>16} {'min':>6} {'vs DS':>6} {'steps':>5} "
              f"{'tokens per rank':>15} {'max/min':>7} {'padded per rank':>15} {'padded, slowest/step':>20}")
    print(header)
    print("-" * len(header))
    base = results[SAMPLERS[0]]["median_epoch_s"]
    for name, r in results.items():
        print(f"{name:<38} {r['median_epoch_s']:>16.2f} {r['min_epoch_s']:>6.2f} {base / r['median_epoch_s']:>5.2f}x "
              f"{r['steps_per_rank']:>5} {'/'.join(map(str, r['tokens_per_rank'])):>15} "
              f"{r['tokens_max_over_min']:>7.4f} {'/'.join(map(str, r['padded_tokens_per_rank'])):>15} "
              f"{r['padded_tokens_slowest_per_step']:>20}")


def main(argv=None):
    args = parse_args(argv)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(args, port, queue), nprocs=WORLD_SIZE)
    results = summarize(queue.get(), args)
    print_table(results, args)
    if args.json:
        meta = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                "args": {key: str(value) for key, value in vars(args).items()}}
        write_json(args.json, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
