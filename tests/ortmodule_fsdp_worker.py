"""Two gloo processes training FSDP2 (`fully_shard`) and ZeroRedundancyOptimizer runs, each once with
ORTModule and once without, for tests/test_ortmodule_composition.py.

``launch(directory)`` (tests/ortmodule_ddp_worker.py's launcher) starts ``python -m
tests.ortmodule_fsdp_worker <directory>`` once per rank; each rank runs every scenario of SCENARIOS
on its own batches and saves, per scenario and run ("ort", "eager"), the losses of every step and
the full trained weights to ``<directory>/rank<r>.pt``.
"""
import functools
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ort_trainer.ortmodule import ORTModule
from tests import ortmodule_ddp_worker

WORLD_SIZE = ortmodule_ddp_worker.WORLD_SIZE
STEPS, BATCH, WIDTH, CLASSES = 5, 6, 16, 5
launch = functools.partial(ortmodule_ddp_worker.launch, worker=__name__)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(12, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stack():
    torch.manual_seed(0)
    return Stack()


def batch(step, rank):
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(BATCH, 12, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator)


def fsdp_nested(ort, **sharding):
    """fully_shard on each block (ORTModule(block) in the "ort" run), then on the model holding them.
    By default (reshard_after_forward, True below the root) FSDP frees each block's gathered
    parameters after its forward and gathers them again, into new memory, before its backward."""
    model = stack()
    for index, block in enumerate(model.blocks):
        model.blocks[index] = fully_shard(ORTModule(block) if ort else block, **sharding)
    return fully_shard(model), (lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.1))


def fsdp_root(ort):
    """fully_shard on the whole (ORTModule-wrapped) model."""
    return fully_shard(ORTModule(stack()) if ort else stack()), (lambda p: torch.optim.AdamW(p, lr=0.02))


def fsdp_root_wrapped(ort):
    """ORTModule around a model fully_shard sharded already (FSDP's hooks run around the graph)."""
    return (ORTModule(fully_shard(stack())) if ort else fully_shard(stack())), (lambda p: torch.optim.AdamW(p, lr=0.02))


def zero_ddp(ort):
    """DistributedDataParallel(ORTModule(model)) with ZeroRedundancyOptimizer's sharded AdamW."""
    model = nn.parallel.DistributedDataParallel(ORTModule(stack()) if ort else stack())
    return model, (lambda p: ZeroRedundancyOptimizer(p, optimizer_class=torch.optim.AdamW, lr=0.02))


SCENARIOS = {"fsdp_nested": fsdp_nested,
             "fsdp_nested_kept": functools.partial(fsdp_nested, reshard_after_forward=False),
             "fsdp_root": fsdp_root, "fsdp_root_wrapped": fsdp_root_wrapped, "zero_ddp": zero_ddp}


def train(make, ort, rank):
    model, make_optimizer = make(ort)
    optimizer = make_optimizer(model.parameters())
    losses, freed = [], None
    for step in range(STEPS):
        x, target = batch(step, rank)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), target)
        if freed is None:  # whether each block below the root freed its gathered parameters after its forward
            freed = [module._get_fsdp_state()._fsdp_param_group.is_sharded for module in model.modules()
                     if isinstance(module, FSDPModule) and module is not model]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    weights = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
               for name, p in model.named_parameters()}
    graphs = sum(len(module._graphs) for module in model.modules() if isinstance(module, ORTModule))
    return {"losses": losses, "weights": weights, "graphs": graphs, "freed": freed}


def refusals():
    """The errors of ORTModule on a model whose blocks fully_shard sharded on their own, and on a model
    with a DTensor parameter FSDP does not manage."""
    errors = {}
    nested = stack()
    fully_shard(nested.blocks[1])
    model_parallel = Block()
    model_parallel.up.weight = nn.Parameter(distribute_tensor(model_parallel.up.weight.detach(),
                                                              init_device_mesh("cpu", (WORLD_SIZE,)), [Shard(0)]))
    for name, model in (("sharded blocks", fully_shard(nested)), ("sharded parameters", model_parallel)):
        try:
            ORTModule(model)
        except TypeError as error:
            errors[name] = str(error)
    return errors


def main(directory):
    os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"  # a fallback to PyTorch fails the rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {(name, run): train(make, run == "ort", rank) for name, make in SCENARIOS.items()
               for run in ("eager", "ort")}
    results["refusals"] = refusals()
    torch.save(results, Path(directory) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
