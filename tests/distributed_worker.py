"""Multi-process runs for tests/test_distributed.py: a torchrun-like launcher and the ranks' scenarios.

``launch(scenario, directory)`` starts ``python -m tests.distributed_worker <scenario> <directory>``
once per rank with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT on a free
port of 127.0.0.1); each rank joins a gloo process group and saves what it measured to
``<directory>/rank<r>.pt``.
"""
import os
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
from ort_trainer.ortmodule import ORTModule
from tests import models

WORLD_SIZE = 2
REPO_ROOT = Path(__file__).resolve().parents[1]

# name -> (optim config, gradient_accumulation_steps, allreduce_post_accumulation)
CONFIGS = {
    "adam": (lambda: optim.AdamConfig(lr=0.02, lambda_coef=0.01, max_norm_clip=0.1), 1, False),
    # The second group (net.3.*) lies in rank 1's shard only: rank 0 has one group, rank 1 two.
    "lamb": (lambda: optim.LambConfig(lr=0.02, lambda_coef=0.01, max_norm_clip=0.1, params=[
        {"params": ["net.3.weight", "net.3.bias"], "lambda_coef": 0.0, "ratio_max": 2.0}]), 1, False),
    "sgd": (lambda: optim.SGDConfig(lr=0.05, momentum=0.9, max_norm_clip=0.1), 1, False),
    "adam_accumulate_post": (lambda: optim.AdamConfig(lr=0.02, max_norm_clip=0.1), 2, True),
    "adam_accumulate_every": (lambda: optim.AdamConfig(lr=0.02, max_norm_clip=0.1), 2, False),
    "lamb_accumulate_post": (lambda: optim.LambConfig(lr=0.02, max_norm_clip=0.1), 2, True),
    "lamb_accumulate_every": (lambda: optim.LambConfig(lr=0.02, max_norm_clip=0.1), 2, False),
}
MICRO_STEPS = 6


def global_batch(step, batch=8):
    """The batch of one micro-step for all ranks; rank r trains on rows [r*b/W, (r+1)*b/W)."""
    return models.mlp_batch(step, batch)


def rank_batch(step, rank):
    per_rank = 8 // WORLD_SIZE
    return tuple(t[rank * per_rank:(rank + 1) * per_rank] for t in global_batch(step))


def make_trainer(config, zero_stage=0, **options):
    make_config, accumulation, post = CONFIGS[config]
    options = {"batch": {"gradient_accumulation_steps": accumulation},
               "distributed": {"deepspeed_zero_optimization": {"stage": zero_stage},
                               "allreduce_post_accumulation": post}, **options}
    return ORTTrainer(models.mlp(), models.MLP_DESC, make_config(), loss_fn=models.mlp_loss,
                      options=ORTTrainerOptions(options))


def train(trainer, steps, batch_of):
    """Losses of ``steps`` micro-steps, starting after the trainer's current step."""
    first = trainer.train_step_info.step
    return [trainer.train_step(*batch_of(step))[0].item() for step in range(first, first + steps)]


def weights(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


# ---------------------------------------------------------------- scenarios (run on every rank)

def scenario_train(rank, directory):
    """Every config, data parallel and ZeRO stage 1."""
    results = {}
    for zero_stage in (0, 1):
        for config in CONFIGS:
            trainer = make_trainer(config, zero_stage)
            losses = train(trainer, MICRO_STEPS, partial(rank_batch, rank=rank))
            results[zero_stage, config] = {"losses": losses, "weights": weights(trainer)}
    return results


def scenario_checkpoint(rank, directory):
    """ZeRO: 3 updates, save, 3 more; a fresh ZeRO trainer loads the file and does the same 3.
    Then a data-parallel save that fails on rank 0 (missing directory) must fail on every rank."""
    batch_of = partial(rank_batch, rank=rank)
    trainer = make_trainer("lamb", zero_stage=1)
    train(trainer, 3, batch_of)
    trainer.save_checkpoint(directory / "zero.pt", user_dict={"note": "zero"})
    continued = train(trainer, 3, batch_of)
    reloaded = make_trainer("lamb", zero_stage=1)
    user_dict = reloaded.load_checkpoint(directory / "zero.pt")
    result = {"continued": continued, "weights": weights(trainer), "user_dict": user_dict,
              "reloaded": train(reloaded, 3, batch_of), "reloaded_weights": weights(reloaded)}
    data_parallel = make_trainer("adam")
    train(data_parallel, 1, batch_of)
    try:
        data_parallel.save_checkpoint(directory / "missing" / "dp.pt")
    except Exception as error:
        result["save_error"] = f"{type(error).__name__}: {error}"
    data_parallel.save_checkpoint(directory / "dp.pt")
    result["dp_weights"] = weights(data_parallel)
    return result


def scenario_rank_fails(rank, directory):
    """Rank 1 raises after its first step and exits; rank 0 goes on training."""
    trainer = make_trainer("adam")
    train(trainer, 1, partial(rank_batch, rank=rank))
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    train(trainer, 1, partial(rank_batch, rank=rank))


def scenario_rank_stalls(rank, directory):
    """Rank 1 stays alive without training, longer than the process group's timeout: rank 0 must
    time out (under ZeRO: in the reduce-scatter)."""
    trainer = make_trainer("adam", zero_stage=1)
    train(trainer, 1, partial(rank_batch, rank=rank))
    if rank == 1:
        time.sleep(float(os.environ["GROUP_TIMEOUT"]) + 2)
        return
    train(trainer, 1, partial(rank_batch, rank=rank))


def scenario_batch_norm(rank, directory):
    """A BatchNorm in training mode, on each rank's half of the batches, three ways: ORTTrainer
    data parallel, DistributedDataParallel(ORTModule(model)) and DistributedDataParallel(model)
    (the reference); the loss and the buffers after every step."""
    def record(loss, model):
        return {"loss": loss, "buffers": {name: b.detach().clone() for name, b in model.named_buffers()}}

    warnings.filterwarnings("error", message="ORTModule")  # a fallback to PyTorch fails the rank
    batches = [tuple(t[rank * 4:(rank + 1) * 4] for t in models.conv_batch_norm_batch(step)) for step in range(5)]
    trainer = ORTTrainer(models.conv_batch_norm(), models.CONV_BATCH_NORM_DESC, optim.SGDConfig(lr=0.1),
                         loss_fn=models.mlp_loss, options=ORTTrainerOptions({"utils": {"grad_norm_clip": False}}))
    results = {"ORTTrainer": [record(trainer.train_step(*batch)[0].item(), trainer.model) for batch in batches]}
    for name, wrap in (("DDP(ORTModule)", ORTModule), ("DDP", lambda model: model)):
        model = torch.nn.parallel.DistributedDataParallel(wrap(models.conv_batch_norm()))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        results[name] = []
        for x, target in batches:
            optimizer.zero_grad()
            loss = models.mlp_loss(model(x), target)
            loss.backward()
            optimizer.step()
            results[name].append(record(loss.item(), model.module))
    return results


# ---------------------------------------------------------------- launcher

def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(scenario, directory, timeout=60, group_timeout=30):
    """Runs ``scenario`` on WORLD_SIZE processes; returns [(returncode, stderr, seconds)] per rank.

    Processes still running after ``timeout`` seconds are killed (returncode None).
    """
    port = _free_port()
    processes = []
    for rank in range(WORLD_SIZE):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "GROUP_TIMEOUT": str(group_timeout)}
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "tests.distributed_worker", scenario, str(directory)], cwd=REPO_ROOT, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    start, results = time.monotonic(), []
    for process in processes:
        try:
            _, stderr = process.communicate(timeout=max(0.0, start + timeout - time.monotonic()))
            results.append((process.returncode, stderr, time.monotonic() - start))
        except subprocess.TimeoutExpired:
            process.kill()
            results.append((None, process.communicate()[1], time.monotonic() - start))
    return results


def main(scenario, directory):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ["GROUP_TIMEOUT"])))
    rank = dist.get_rank()
    result = globals()[f"scenario_{scenario}"](rank, Path(directory))
    torch.save(result, Path(directory) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
