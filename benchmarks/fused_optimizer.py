"""One optimizer step, as a training loop calls it: ``ort_trainer.optim.FusedAdam`` / ``FusedLamb``
against ``torch.optim.Adam(fused=True)`` and ``(foreach=True)``, on GPT-2-like lists of tensors.

    python benchmarks/fused_optimizer.py                          # ~12 M and ~124 M params, CPU
    python benchmarks/fused_optimizer.py --device cuda            # the same on the GPU
    python benchmarks/fused_optimizer.py --models small --repeats 5 --json out.json

Every variant owns its parameters (the torch variants share theirs) and keeps the same gradients
set on them, so each timed ``step()`` does what it does in training: ours copies the gradients
into its flat buffer and updates it; torch's updates the tensors one by one (fused: one kernel per
tensor on the CPU, one multi-tensor launch per chunk of tensors on CUDA). Rounds are interleaved
(variant after variant, ``--repeats`` times) in one process; the table gives the median and the
spread. ``grad copy`` times the gradient copy alone (part of FusedAdam's and FusedLamb's step).
Adam: lr 1e-4, weight decay 0.01 on matrices only (two param groups, as GPT-2 is trained); Lamb:
apex's defaults (global clip at 1.0) with the same groups.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.optimizer_step import gpt2_tensor_sizes  # noqa: E402
from examples._report import write_json  # noqa: E402
from ort_trainer.optim import FusedAdam, FusedLamb  # noqa: E402

# (layers, width, vocab, context): ~12 M parameters (the seed's vocabulary) and GPT-2 small.
MODELS = {"small": (6, 256, 28782, 512), "gpt2": (12, 768, 50257, 1024)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["small", "gpt2"])
    for name in ("layers", "width", "vocab", "context"):
        p.add_argument(f"--{name}", type=int, help=f"override every model's {name} (a quick run)")
    p.add_argument("--device", default="cpu", help="'cpu' or 'cuda'")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=20, help="timed rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def make_params(sizes, device, generator):
    """[(parameter, decays)], each with a gradient, in GPT-2's order."""
    params = []
    for _, numel, decays in sizes:
        p = torch.nn.Parameter(torch.randn(numel, generator=generator).mul_(0.02).to(device))
        p.grad = torch.randn(numel, generator=generator).mul_(1e-3).to(device)
        params.append((p, decays))
    return params


def groups(params):
    return [{"params": [p for p, decays in params if decays], "weight_decay": 0.01},
            {"params": [p for p, decays in params if not decays], "weight_decay": 0.0}]


def variants(sizes, device):
    """{label: step function}; the torch variants share one set of parameters."""
    generator = torch.Generator().manual_seed(0)
    shared = make_params(sizes, device, generator)
    steps = {}
    for label, flags in (("torch Adam fused", dict(fused=True)),
                         ("torch Adam foreach", dict(foreach=True))):
        steps[label] = torch.optim.AdamW(groups(shared), lr=1e-4, **flags).step
    ours = make_params(sizes, device, generator)
    steps["FusedAdam"] = FusedAdam(groups(ours), lr=1e-4).step
    lamb = [(torch.nn.Parameter(p.detach().clone()), decays) for p, decays in ours]
    for (p, _), (q, _) in zip(lamb, ours):
        p.grad = q.grad  # read only: the gradients can be shared
    steps["FusedLamb"] = FusedLamb(groups(lamb), lr=1e-4).step
    flat = torch.empty(sum(numel for _, numel, _ in sizes), device=device)
    views = list(flat.split([numel for _, numel, _ in sizes]))
    grads = [p.grad for p, _ in ours]
    steps["grad copy"] = lambda: torch._foreach_copy_(views, grads)
    return steps


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(steps, device, repeats, warmup):
    """{label: [ms per step]}, rounds interleaved."""
    samples = {label: [] for label in steps}
    for round_index in range(warmup + repeats):
        for label, step in steps.items():
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            if round_index >= warmup:
                samples[label].append((time.perf_counter() - start) * 1e3)
    return samples


def summarize(samples):
    return {"median_ms": statistics.median(samples), "min_ms": min(samples),
            "max_ms": max(samples), "repeats": len(samples)}


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"torch {torch.__version__} has no CUDA here: nothing to measure")
        return 0
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    results = {"device": str(device), "machine": machine, "torch": torch.__version__, "models": {}}
    print(f"{device} ({machine}), torch {torch.__version__}, median of {args.repeats} rounds")
    for model in args.models:
        shape = [override or default for override, default in
                 zip((args.layers, args.width, args.vocab, args.context), MODELS[model])]
        sizes = gpt2_tensor_sizes(*shape)
        n = sum(numel for _, numel, _ in sizes)
        steps = variants(sizes, device)
        summary = {label: summarize(s) for label, s in
                   measure(steps, device, args.repeats, args.warmup).items()}
        del steps
        baseline = summary["torch Adam fused"]["median_ms"]
        print(f"\n{model}: {n / 1e6:.1f} M parameters in {len(sizes)} tensors")
        print(f"{'variant':<20}{'median ms':>11}{'min':>9}{'max':>9}{'vs torch fused':>16}")
        for label, s in summary.items():
            print(f"{label:<20}{s['median_ms']:>11.2f}{s['min_ms']:>9.2f}{s['max_ms']:>9.2f}"
                  f"{s['median_ms'] / baseline:>15.2f}x")
        results["models"][model] = {"params": n, "tensors": len(sizes), "steps": summary}
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
