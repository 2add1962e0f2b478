"""Two checks of the CUDA runtime path that a single GPU can make (issue 34, `gpu_proof.py`'s step 6).

* The data-parallel path on one rank: a process group of one (NCCL on CUDA, gloo on the CPU) and
  ORTTrainer's DataParallel strategy forced in (torch.distributed picks SingleProcess for one rank),
  so the gradient all-reduce, the weights' broadcast and the device-side failure flag run on the
  device; the losses must equal a plain trainer's (an average over one rank is the identity).
* The shared CUDA arena over 8 shapes: one trainer fed 8 batch shapes (the largest first), the
  device memory in use read after each; with one arena per device, later (smaller) shapes reuse
  what the first took, so the memory held stays near the first shape's.

    python benchmarks/cuda_runtime_checks.py --device cuda --json out.json
"""
import argparse
import copy
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples._report import write_json  # noqa: E402
from examples.wikitext2.model import TransformerModel  # noqa: E402
from examples.wikitext2.train import make_loss_fn  # noqa: E402
from ort_trainer import ORTTrainer, ORTTrainerOptions, optim  # noqa: E402
from ort_trainer._trainer import distributed as _distributed  # noqa: E402

SHAPES = [(64, 32), (64, 16), (48, 32), (32, 32), (35, 20), (16, 32), (24, 8), (8, 4)]  # (bptt, batch)


def trainer_for(model, vocab, device):
    desc = {"inputs": [("src", ["bptt", "batch_size"]), ("label", ["bptt_x_batch_size"])],
            "outputs": [("loss", [], True), ("output", ["bptt", "batch_size", vocab])]}
    return ORTTrainer(copy.deepcopy(model).to(device), desc, optim.AdamConfig(lr=1e-3),
                      loss_fn=make_loss_fn(vocab), options=ORTTrainerOptions({
                          "device": {"id": device}, "utils": {"grad_norm_clip": False}}))


def batch(vocab, bptt, size, step, device):
    data = torch.randint(0, vocab, (bptt + 1, size), generator=torch.Generator().manual_seed(step))
    return data[:-1].to(device), data[1:].reshape(-1).to(device)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_parallel_on_one_rank(model, vocab, device, steps):
    """Losses of the DataParallel strategy on a one-rank group against a plain trainer's."""
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    setup = _distributed.setup
    try:
        plain = trainer_for(model, vocab, device)
        _distributed.setup = lambda options: _distributed.DataParallel(
            torch.device(device, 0) if device == "cuda" else torch.device(device), 0, 1, False)
        parallel = trainer_for(model, vocab, device)
        strategy = type(parallel._distributed).__name__
        pairs = []
        for step in range(steps):
            data = batch(vocab, 35, 20, step, device)
            pairs.append((plain.train_step(*data)[0].item(), parallel.train_step(*data)[0].item()))
    finally:
        _distributed.setup = setup
        dist.destroy_process_group()
    worst = max(abs(a - b) / abs(a) for a, b in pairs)
    return {"backend": backend, "strategy": strategy, "steps": steps, "losses": pairs,
            "worst_relative_loss_difference": worst, "ok": strategy == "DataParallel" and worst <= 1e-6}


def device_memory_in_use(device):
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def arena_over_shapes(model, vocab, device):
    """MiB of device memory in use after the first step of each shape, largest shape first."""
    trainer = trainer_for(model, vocab, device)
    held = []
    for step, (bptt, size) in enumerate(SHAPES):
        trainer.train_step(*batch(vocab, bptt, size, step, device))
        held.append(device_memory_in_use(device))
    growth = None if held[0] is None else (max(held) - held[0]) / held[0]
    return {"shapes": SHAPES, "mib_in_use": held, "growth_after_first": growth,
            "ok": growth is None or growth <= 0.25}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--vocab", type=int, default=28782)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    torch.manual_seed(0)
    model = TransformerModel(args.vocab, dropout=0.0)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    for name, check in (("data_parallel_one_rank", lambda: data_parallel_on_one_rank(model, args.vocab, args.device,
                                                                                       args.steps)),
                        ("arena_over_8_shapes", lambda: arena_over_shapes(model, args.vocab, args.device))):
        try:
            result[name] = check()
        except Exception as error:  # report and go on: the next check says something too
            result[name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        print(name, result[name], flush=True)
    write_json(args.json, result)
    return 0 if all(result[name]["ok"] for name in ("data_parallel_one_rank", "arena_over_8_shapes")) else 1


if __name__ == "__main__":
    sys.exit(main())
