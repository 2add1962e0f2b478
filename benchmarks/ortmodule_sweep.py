"""fp32 GPT-2 train steps over a sweep of depths and lengths: eager PyTorch vs ORTModule vs ORTTrainer
(issue 37: ORTModule never slower than eager in fp32).

    python benchmarks/ortmodule_sweep.py                       # 2x128, 4x128, 8x128, 2x512 (layers x tokens)
    python benchmarks/ortmodule_sweep.py --points 2x128 --rounds 9 --json out.json

`GPT2LMHeadModel` from a config (width 512, 8 heads, vocabulary 16,000, dropout off), batch 4, its own
loss (`labels=input_ids`), AdamW (lr 1e-4, weight decay 0.01, no clipping), `loss.item()` each step.
Per point, every engine trains its own copy of the same initial model on the same batches, in one
process with the same thread count (ONNX Runtime gets as many intra-op threads):

* eager: zero_grad, forward with the loss, backward, torch.optim.AdamW.step.
* ortmodule: the same loop, the model wrapped in `ORTModule`.
* ortrainer: `ORTTrainer.train_step(input_ids=, labels=)` with ORTTrainer's AdamW (torch's update:
  `DecayMode.BEFORE_WEIGHT_UPDATE`, clipping off), fetching the loss only.

Warmup, then `--rounds` rounds of `--steps` steps per engine, the engine order rotating each round;
reports per point the median (and minimum: the least disturbed round) of the per-round wall ms/step,
each engine's speedup over eager (eager ms / engine ms, > 1: faster) and the worst relative difference
of its losses to eager's; and what `_runtime.product_speed` measured to decide which fp32 products
run in torch.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks.train_step import environment  # noqa: E402
from examples._report import write_json  # noqa: E402
from ort_trainer import ORTTrainer, ORTTrainerOptions, optim  # noqa: E402
from ort_trainer._runtime import product_speed  # noqa: E402
from ort_trainer.ortmodule import ORTModule  # noqa: E402

ENGINES = ("eager", "ortmodule", "ortrainer")
LR, WEIGHT_DECAY = 1e-4, 0.01


def _point(text):
    layers, _, tokens = text.partition("x")
    if not (layers.isdigit() and tokens.isdigit() and int(layers) > 0 and int(tokens) > 0):
        raise argparse.ArgumentTypeError(f"a point is LAYERSxTOKENS (e.g. 2x128), got {text!r}")
    return int(layers), int(tokens)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", type=_point, nargs="+", default=[(2, 128), (4, 128), (8, 128), (2, 512)],
                   help="LAYERSxTOKENS")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--warmup", type=int, default=2, help="steps per engine before timing (the first compiles)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="steps per engine per round")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if "eager" not in args.engines:
        p.error("--engines: eager is the baseline every ratio divides, it must be among them")
    return args


def _eager(model):
    adamw = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def step(ids):
        adamw.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        adamw.step()
        return loss.item()
    return step


def _trainer(model, args):
    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", args.vocab])]}
    config = optim.AdamConfig(lr=LR, lambda_coef=WEIGHT_DECAY, weight_decay_mode=optim.DecayMode.BEFORE_WEIGHT_UPDATE)
    trainer = ORTTrainer(model, desc, config, options=ORTTrainerOptions({"utils": {"grad_norm_clip": False}}))
    trainer.train_step_info.fetches = ["loss"]
    return lambda ids: trainer.train_step(input_ids=ids, labels=ids).item()


def _steps(model, args):
    makers = {"eager": _eager, "ortmodule": lambda m: _eager(ORTModule(m)),
              "ortrainer": lambda m: _trainer(m, args)}
    return {name: makers[name](copy.deepcopy(model)) for name in args.engines}


def measure_point(args, layers, tokens):
    """{"median_ms", "min_ms", "per_round_ms", "speedup_over_eager", "speedup_min_over_eager",
    "worst_relative_loss_difference"} of one point."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=args.vocab, n_layer=layers, n_embd=args.width, n_head=args.heads, n_positions=tokens,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM"))
    model.train()
    steps = _steps(model, args)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch, tokens), generator=generator)
               for _ in range(args.warmup + args.rounds * args.steps)]
    names = tuple(steps)
    losses = {name: [steps[name](ids) for ids in batches[:args.warmup]] for name in names}
    times = {name: [] for name in names}
    for round_ in range(args.rounds):
        todo = batches[args.warmup + round_ * args.steps:][:args.steps]
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            start = time.perf_counter()
            losses[name] += [steps[name](ids) for ids in todo]
            times[name].append((time.perf_counter() - start) * 1000 / args.steps)
    median = {name: statistics.median(values) for name, values in times.items()}
    return {"median_ms": median, "min_ms": {name: min(values) for name, values in times.items()}, "per_round_ms": times,
            "speedup_over_eager": {name: median["eager"] / median[name] for name in names},
            "speedup_min_over_eager": {name: min(times["eager"]) / min(times[name]) for name in names},
            "worst_relative_loss_difference": {
                name: max(abs(a - b) / abs(a) for a, b in zip(losses["eager"], losses[name])) for name in names}}


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    points = {f"{layers}x{tokens}": measure_point(args, layers, tokens) for layers, tokens in args.points}
    ratios = {name: [point["speedup_over_eager"][name] for point in points.values()] for name in args.engines}
    result = {"environment": environment(args),
              "config": {key: value for key, value in vars(args).items() if key not in ("json", "points")},
              "points": points,
              "torch_products": {f"{form} x{threads}": {"mlas_ms": mlas, "torch_ms": torch_ms} for (form, threads), (
                  mlas, torch_ms) in product_speed.measured_products().items()},
              "median_point_speedup": {name: statistics.median(values) for name, values in ratios.items()},
              "worst_point_speedup": {name: min(values) for name, values in ratios.items()}}
    print(f"GPT-2 width {args.width}, {args.heads} heads, vocab {args.vocab}, batch {args.batch}, fp32, AdamW, "
          f"{args.threads} threads, {args.rounds} rounds x {args.steps} steps | {result['environment']['cpu']}")
    print(f"{'layers x tokens':16s}" + "".join(f"{name + ' ms':>14s}" for name in args.engines)
          + "".join(f"{name + ' x':>13s}" for name in args.engines[1:]))
    for label, point in points.items():
        print(f"{label:16s}" + "".join(f"{point['median_ms'][name]:14.1f}" for name in args.engines)
              + "".join(f"{point['speedup_over_eager'][name]:12.2f}x" for name in args.engines[1:]))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
