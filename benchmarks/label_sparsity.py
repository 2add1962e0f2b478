"""Label sparsity (`graph_transformer.label_sparsity`): a GPT-2 train step whose first half of every
row's labels is -100 (a masked prompt), ORTTrainer dense (the option off) vs sparse (on, the default)
vs eager PyTorch.

    python benchmarks/label_sparsity.py                 # vocab 32,000, 2 layers, width 256, 8 x 128 tokens
    python benchmarks/label_sparsity.py --json out.json

One process, the same thread count for every engine. Each engine trains its own copy of the same
initial model on the same batches: GPT-2's own loss (`labels=`), AdamW (weight decay 0.01, torch's
update: `DecayMode.BEFORE_WEIGHT_UPDATE`), gradient-norm clipping to 1.0, `fetches=['loss']` for
ORTTrainer, `loss.item()` every step. Warmup, then `--rounds` interleaved rounds of `--steps` steps per
engine (the order rotates each round); reports the median of the per-round wall ms/step, the
ratios against sparse (> 1: sparse is faster), and the largest relative difference between the
dense and sparse losses (the same steps: they should agree to float rounding).
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

from examples._report import write_json  # noqa: E402
from ort_trainer import ORTTrainer, ORTTrainerOptions, optim  # noqa: E402

ENGINES = ("dense", "sparse", "eager")
WEIGHT_DECAY, MAX_NORM, LR = 0.01, 1.0, 1e-4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gpt2_arguments(p)
    add_timing_arguments(p)
    return p.parse_args(argv)


def add_gpt2_arguments(p):
    """The GPT-2 these benchmarks train: vocabulary 32,000, 2 layers, width 256, 8 x 128 tokens."""
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)


def add_timing_arguments(p):
    """The arguments of an interleaved run (`interleaved`) and its --json."""
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--warmup", type=int, default=2, help="steps per engine before timing")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per engine per round")
    p.add_argument("--json", type=Path, help="write the results here")


def interleaved(steps, batches, args):
    """Each engine's step ({engine: step(*batch) -> loss}) on `batches`: args.warmup steps each, then
    args.rounds rounds of args.steps steps per engine, the engines' order rotating each round.
    Returns ({engine: every loss}, {engine: median ms/step over the rounds})."""
    engines = list(steps)
    losses = {engine: [steps[engine](*batch) for batch in batches[:args.warmup]] for engine in engines}
    times = {engine: [] for engine in engines}
    for round_ in range(args.rounds):
        todo = batches[args.warmup + round_ * args.steps:][:args.steps]
        shift = round_ % len(engines)
        for engine in engines[shift:] + engines[:shift]:
            start = time.perf_counter()
            losses[engine] += [steps[engine](*batch) for batch in todo]
            times[engine].append((time.perf_counter() - start) * 1000 / args.steps)
    return losses, {engine: statistics.median(values) for engine, values in times.items()}


def _batches(args, count):
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
        labels = ids.clone()
        labels[:, : args.seq // 2] = -100
        batches.append((ids, labels))
    return batches


def _trainer(model, args, sparse):
    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", args.vocab])]}
    config = optim.AdamConfig(lr=LR, lambda_coef=WEIGHT_DECAY, weight_decay_mode=optim.DecayMode.BEFORE_WEIGHT_UPDATE,
                              max_norm_clip=MAX_NORM)
    trainer = ORTTrainer(model, desc, config, options=ORTTrainerOptions(
        {"graph_transformer": {"label_sparsity": sparse}, "utils": {"grad_norm_clip": True}}))
    trainer.train_step_info.fetches = ["loss"]
    return lambda ids, labels: trainer.train_step(input_ids=ids, labels=labels).item()


def torch_adamw_step(model, loss_fn, *, max_norm=None):
    """A train step of `model` in torch: loss_fn(ids, labels), backward, clipping to `max_norm`
    (None: none), AdamW; returns the loss as a float."""
    adam = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def step(ids, labels):
        adam.zero_grad()
        loss = loss_fn(ids, labels)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        adam.step()
        return loss.item()
    return step


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=args.vocab, n_layer=args.layers, n_embd=args.width, n_head=args.heads, n_positions=args.seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM"))
    model.train()
    steps = {"dense": _trainer(copy.deepcopy(model), args, sparse=False),
             "sparse": _trainer(copy.deepcopy(model), args, sparse=True), "eager": torch_adamw_step(
                 model, lambda ids, labels: model(input_ids=ids, labels=labels).loss, max_norm=MAX_NORM)}
    losses, median = interleaved(steps, _batches(args, args.warmup + args.rounds * args.steps), args)
    worst = max(abs(d - s) / abs(d) for d, s in zip(losses["dense"], losses["sparse"]))
    result = {"config": {key: value for key, value in vars(args).items() if key != "json"},
              "median_ms_per_step": median,
              "dense_over_sparse": median["dense"] / median["sparse"],
              "eager_over_sparse": median["eager"] / median["sparse"],
              "dense_vs_sparse_worst_relative_loss_difference": worst}
    print(f"GPT-2 vocab {args.vocab}, {args.layers} layers, width {args.width}, {args.batch} x {args.seq} tokens, "
          f"half the labels -100, {args.threads} threads; median ms/step of {args.rounds} rounds x {args.steps}:")
    for engine in ENGINES:
        print(f"  {engine:6s} {median[engine]:9.1f}")
    print(f"  dense / sparse {result['dense_over_sparse']:.2f}x, eager / sparse {result['eager_over_sparse']:.2f}x; "
          f"dense vs sparse loss: worst relative difference {worst:.1e}")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
