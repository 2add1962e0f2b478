"""CPU train step of the seed model (examples/wikitext2): eager PyTorch vs ORTModule vs ORTTrainer.

    python benchmarks/ortmodule_step.py                 # vocab 28,782, synthetic tokens
    python benchmarks/ortmodule_step.py --json out.json

One process, the same thread count for all (``torch.set_num_threads(N)``; ONNX Runtime gets as many
intra-op threads). Warmup, then ``--rounds`` rounds of ``--steps`` steps per engine, the engine
order rotating each round; reports the median and minimum of the per-round wall ms/step, the median
process CPU ms/step, and each engine's speedup over eager (eager ms / engine ms, > 1: faster).

* eager: the notebook's loop: zero_grad, forward, CrossEntropyLoss, backward, clip_grad_norm_(0.5),
  torch.optim.Adam (on the CPU its default is the per-parameter loop, not foreach), loss.item().
* ortmodule: the same loop, the model wrapped: ``ORTModule(model)``. The forward and backward of the
  model run in ONNX Runtime, the loss, clip and Adam in torch.
* ortmodule_loss: the same loop, the model and its loss wrapped together (``ORTModule(WithLoss(model))``,
  as Hugging Face models carry their loss): the loss runs in the graph too.
* ortrainer: ``ORTTrainer.train_step(src, targets)``: forward, loss, backward in one ONNX Runtime
  graph, clip and Adam over the flat buffers (benchmarks/train_step.py).

The fp32 products torch computes faster on this machine run in torch (`_runtime.product_speed`;
its measurements are in the JSON); ``--compare-products`` adds ortmodule and ortrainer with every
product in ONNX Runtime (``*_ort_products``), interleaved with the others in the same process.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.train_step import (ORTEngine, TorchEngine, add_seed_step_arguments, environment,  # noqa: E402
                                   make_batches)
from examples._report import write_json  # noqa: E402
from ort_trainer._runtime import product_speed  # noqa: E402


class ORTModuleEngine(TorchEngine):
    """The eager loop with the model wrapped in ORTModule (optimizer over the same parameters)."""

    def __init__(self, ntokens, args):
        from ort_trainer.ortmodule import ORTModule
        super().__init__(ntokens, args)
        self.model = ORTModule(self.model)


class WithLoss(torch.nn.Module):
    def __init__(self, model, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, data, targets):
        return self.loss_fn(self.model(data), targets)


class ORTModuleLossEngine(TorchEngine):
    """The eager loop with the model and its loss wrapped in one ORTModule."""

    def __init__(self, ntokens, args):
        from ort_trainer.ortmodule import ORTModule
        super().__init__(ntokens, args)
        self.model = ORTModule(WithLoss(self.model, self.loss_fn))

    def loss(self, data, targets):
        return self.model(data, targets)


def _with_ort_products(ntokens, args, batch):
    """ortmodule and ortrainer whose graphs keep every matrix product in ONNX Runtime, and their
    first step's losses (the graphs are built then)."""
    measured = product_speed.torch_product_faster
    product_speed.torch_product_faster = lambda form, threads: False
    try:
        engines = {"ortmodule_ort_products": ORTModuleEngine(ntokens, args),
                   "ortrainer_ort_products": ORTEngine(ntokens, args)}
        return engines, {name: engine.train_step(*batch) for name, engine in engines.items()}
    finally:
        product_speed.torch_product_faster = measured


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_seed_step_arguments(p)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--compare-products", action="store_true",
                   help="also ortmodule and ortrainer with every matrix product in ONNX Runtime's kernels")
    args = p.parse_args(argv)
    args.data, args.fetch = None, "all"  # what benchmarks/train_step.py's engines and batches read
    return args


def run_steps(engine, batches, count, offset):
    """(wall ms/step, process CPU ms/step) over ``count`` train steps."""
    cpu, start = time.process_time(), time.perf_counter()
    for k in range(count):
        engine.train_step(*batches[(offset + k) % len(batches)])
    return (time.perf_counter() - start) * 1000 / count, (time.process_time() - cpu) * 1000 / count


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ntokens, batches = make_batches(args)
    engines = {"eager": TorchEngine(ntokens, args), "ortmodule": ORTModuleEngine(ntokens, args),
               "ortmodule_loss": ORTModuleLossEngine(ntokens, args), "ortrainer": ORTEngine(ntokens, args)}
    first_loss = {name: engine.train_step(*batches[0]) for name, engine in engines.items()}
    if args.compare_products:
        ort_products, first_losses = _with_ort_products(ntokens, args, batches[0])
        engines.update(ort_products)
        first_loss.update(first_losses)
    names = tuple(engines)
    for engine in engines.values():
        run_steps(engine, batches, args.warmup, 1)
    per_round = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            per_round[name].append(run_steps(engines[name], batches, args.steps, r * args.steps))
    wall = {name: [w for w, _ in rounds] for name, rounds in per_round.items()}
    cpu = {name: [c for _, c in rounds] for name, rounds in per_round.items()}
    median = {name: statistics.median(values) for name, values in wall.items()}
    minimum = {name: min(values) for name, values in wall.items()}
    cpu_median = {name: statistics.median(values) for name, values in cpu.items()}
    result = {"environment": environment(args),
              "config": {"ntokens": ntokens, "bptt": args.bptt, "batch": args.batch, "threads": args.threads,
                         "mixed_precision": args.mixed_precision, "dropout": args.dropout, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup},
              "compare_products": args.compare_products,
              "torch_products": {str(form): {"mlas_ms": mlas, "torch_ms": torch_ms}
                                 for form, (mlas, torch_ms) in product_speed.measured_products().items()},
              "first_step_loss": first_loss, "median_ms": median, "min_ms": minimum, "cpu_median_ms": cpu_median,
              "per_round_ms": wall,
              "speedup_over_eager": {name: median["eager"] / median[name] for name in names},
              "speedup_min_over_eager": {name: minimum["eager"] / minimum[name] for name in names}}
    print(f"vocab {ntokens} | bptt {args.bptt} x batch {args.batch} | threads {args.threads} | "
          f"{args.rounds} rounds x {args.steps} steps | {result['environment']['cpu']}")
    print(f"{'train step':15s} {'median ms':>10s} {'min ms':>10s} {'CPU ms':>10s} {'vs eager':>9s}")
    for name in names:
        print(f"{name:15s} {median[name]:10.1f} {minimum[name]:10.1f} {cpu_median[name]:10.1f} "
              f"{result['speedup_over_eager'][name]:8.2f}x")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
