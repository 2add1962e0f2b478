"""Two gloo processes training DistributedDataParallel(ORTModule(model)), for tests/test_ortmodule_ddp.py.

``launch(directory)`` starts ``python -m tests.ortmodule_ddp_worker <directory>`` once per rank with
torchrun's environment (as tests/distributed_worker.py does); each rank trains on its half of every
global batch and saves its losses and weights to ``<directory>/rank<r>.pt``.
"""
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ort_trainer.ortmodule import ORTModule
from tests import models

WORLD_SIZE, STEPS, GLOBAL_BATCH = 2, 6, 8
REPO_ROOT = Path(__file__).resolve().parents[1]


def make_optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def rank_batch(step, rank):
    per_rank = GLOBAL_BATCH // WORLD_SIZE
    return tuple(t[rank * per_rank:(rank + 1) * per_rank] for t in models.mlp_batch(step, GLOBAL_BATCH))


def launch(directory, timeout=120, worker=__name__, arguments=(), environment=None):
    """Runs the ranks of `python -m <worker> <directory> <arguments...>` (`environment`: more
    variables); returns [(returncode, stderr)] per rank (returncode None: killed at `timeout`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = [subprocess.Popen(
        [sys.executable, "-m", worker, str(directory), *map(str, arguments)], cwd=REPO_ROOT,
        env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE), "LOCAL_RANK": str(rank),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **(environment or {})},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for rank in range(WORLD_SIZE)]
    results = []
    for process in processes:
        try:
            _, stderr = process.communicate(timeout=timeout)
            results.append((process.returncode, stderr))
        except subprocess.TimeoutExpired:
            process.kill()
            results.append((None, process.communicate()[1]))
    return results


def main(directory):
    warnings.filterwarnings("error", message="ORTModule")  # a fallback to PyTorch fails the rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(ORTModule(models.mlp()))
    optimizer = make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        x, target = rank_batch(step, rank)
        optimizer.zero_grad()
        loss = models.mlp_loss(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    weights = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    torch.save({"losses": losses, "weights": weights, "graphs": len(model.module._graphs)},
               Path(directory) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
