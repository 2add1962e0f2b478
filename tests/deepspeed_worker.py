"""Two gloo processes training with DeepSpeed (CPU accelerator), for tests/test_deepspeed.py.

``launch(directory, stage)`` starts ``python -m tests.deepspeed_worker <directory> <stage>`` once per
rank; each rank trains the same model with ``deepspeed.initialize`` at that ZeRO stage (0: none), in
fp32 and in fp16 (DeepSpeed's loss scaling; stage 0 in fp16 only), three ways: the plain model, the plain model with
``FP16_Optimizer`` around the optimizer DeepSpeed returns, and seed 002's recipe (``ORTModule(model)``
and ``FP16_Optimizer``). It saves each run's losses, gradient norms, weights and the calls of the
DeepSpeed methods FP16_Optimizer replaces to ``<directory>/rank<r>.pt``.
"""
import importlib
import sys
import warnings
from pathlib import Path

import torch

from tests import models, ortmodule_ddp_worker

WORLD_SIZE, STEPS, GLOBAL_BATCH = 2, 6, 8
NON_FINITE_STEP = 3  # the loss times inf: every gradient inf or NaN, the update skipped


def config(stage, fp16):
    """ZeRO stage 3 partitions every parameter (none kept whole for being small)."""
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // WORLD_SIZE, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.5, "zero_optimization": zero, "steps_per_print": 10 ** 9,
            "fp16": {"enabled": fp16, "initial_scale_power": 8}}


def rank_batch(step, rank):
    per_rank = GLOBAL_BATCH // WORLD_SIZE
    return tuple(t[rank * per_rank:(rank + 1) * per_rank] for t in models.mlp_batch(step, GLOBAL_BATCH))


def launch(directory, stage, timeout=300):
    """Runs the ranks; returns [(returncode, stderr)] per rank (returncode None: killed at `timeout`)."""
    return ortmodule_ddp_worker.launch(directory, timeout, worker=__name__, arguments=[stage],
                                       environment={"LOCAL_WORLD_SIZE": str(WORLD_SIZE), "DS_ACCELERATOR": "cpu"})


REPLACED = {  # the DeepSpeed methods FP16_Optimizer replaces, by (module, class)
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"):
        ("get_grad_norm_direct", "has_overflow_serial", "has_overflow_partitioned_grads_serial"),
    ("deepspeed.runtime.utils", "CheckOverflow"): ("has_overflow_serial",),
}
RUNS = ("plain", "fp16_optimizer", "ortmodule")  # the model, FP16_Optimizer or not, ORTModule or not


def precisions(stage):
    """fp16 or not: DeepSpeed without ZeRO and fp16 returns the torch optimizer (nothing to wrap)."""
    return (True,) if stage == 0 else (False, True)


def count_calls(counts):
    """Counts the calls of DeepSpeed's own methods that FP16_Optimizer replaces ('Class.method')."""
    for (module, class_name), names in REPLACED.items():
        cls = getattr(importlib.import_module(module), class_name)
        for name in names:
            def counted(*args, _original=getattr(cls, name), _key=f"{class_name}.{name}", **kwargs):
                counts[_key] += 1
                return _original(*args, **kwargs)
            setattr(cls, name, counted)


def train(stage, fp16, run, counts):
    """One DeepSpeed run: losses, the engine's global gradient norms, the final weights, the
    calls of DeepSpeed's replaced methods."""
    import deepspeed

    from ort_trainer.optim import FP16_Optimizer
    from ort_trainer.ortmodule import ORTModule

    counts.update({key: 0 for key in counts})
    model = models.mlp()
    if run == "ortmodule":
        model = ORTModule(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(stage, fp16))
    if run != "plain":
        optimizer = FP16_Optimizer(optimizer)
    losses, norms, partitioned = [], [], None
    for step in range(STEPS):
        x, target = rank_batch(step, torch.distributed.get_rank())
        loss = models.mlp_loss(engine(x.half() if fp16 else x), target)
        if partitioned is None:  # ZeRO-3: partitioned again after the forward, gathered again for the backward
            partitioned = [p.numel() == 0 for p in engine.module.parameters()]
        engine.backward(loss * float("inf") if step == NON_FINITE_STEP else loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        weights = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights, "kind": getattr(optimizer, "kind", None),
            "partitioned": partitioned,
            "calls": dict(counts), "loss_scale": float(getattr(optimizer, "loss_scale", 1.0))}


def main(directory, stage):
    warnings.filterwarnings("error", message="ORTModule")  # a fallback to PyTorch fails the rank
    torch.set_num_threads(1)
    import deepspeed

    # DeepSpeed's shared-memory all-reduce op for the CPU is compiled on first use (2.5 minutes on 2
    # cores); gloo does the same all-reduces without it. (`deepspeed.comm.torch` is torch itself.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    counts = {f"{class_name}.{name}": 0 for (_, class_name), names in REPLACED.items() for name in names}
    count_calls(counts)
    result = {(fp16, run): train(stage, fp16, run, counts) for fp16 in precisions(stage) for run in RUNS}
    torch.save(result, Path(directory) / f"rank{torch.distributed.get_rank()}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
