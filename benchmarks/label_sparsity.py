"""Label sparsity (`graph_transformer.label_sparsity`, ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER): a GPT-2
train step whose first half of every row's labels is -100 (a masked prompt; `--ignored` sets the
share), or a BERT masked LM whose labels are valid at a random 15% of the positions (`--model bert`),
ORTTrainer and ORTModule each dense (the switch off) vs sparse (on, the default) vs eager PyTorch.
ORTModule's forward() returns the logits too (Hugging Face's output): its sparse graph keeps them
dense and computes the loss, and the backward, on the labelled rows (`_graph.label_sparsity`'s
LABELLED_PROJECTION).

    python benchmarks/label_sparsity.py                 # vocab 32,000, 2 layers, width 256, 8 x 128 tokens
    python benchmarks/label_sparsity.py --model bert    # the same sizes, 85% of the labels -100 at random
    python benchmarks/label_sparsity.py --json out.json

One process, the same thread count for every engine. Each engine trains its own copy of the same
initial model on the same batches: GPT-2's own loss (`labels=`), AdamW (weight decay 0.01, torch's
update: `DecayMode.BEFORE_WEIGHT_UPDATE`), gradient-norm clipping to 1.0, `fetches=['loss']` for
ORTTrainer, `loss.item()` every step. Warmup, then `--rounds` interleaved rounds of `--steps` steps per
engine (the order rotates each round); reports the median of the per-round wall ms/step, per front
end the ratios against its sparse graph (> 1: sparse is faster), and the largest relative difference
between its dense and sparse losses (the same steps: they should agree to float rounding).
"""
from __future__ import annotations

import argparse
import copy
import os
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
from ort_trainer import ORTModule, ORTTrainer, ORTTrainerOptions, optim  # noqa: E402

FRONTS = ("ortrainer", "ortmodule")
ENGINES = (*(f"{front} {kind}" for front in FRONTS for kind in ("dense", "sparse")), "eager")
WEIGHT_DECAY, MAX_NORM, LR, SWITCH = 0.01, 1.0, 1e-4, "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER"
MODELS = {"gpt2": 0.5, "bert": 0.85}  # the share of labels ignored by default


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gpt2_arguments(p)
    p.add_argument("--model", choices=MODELS, default="gpt2",
                   help="gpt2: the first labels of each row ignored; bert: a masked LM, random positions ignored")
    p.add_argument("--ignored", type=float,
                   help="share of the labels that are -100 (default: gpt2 0.5, the first of each row; bert 0.85)")
    add_timing_arguments(p)
    args = p.parse_args(argv)
    if args.ignored is None:
        args.ignored = MODELS[args.model]
    return args


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
        if args.model == "bert":  # masked LM: the labelled positions are random
            labels[torch.rand(ids.shape, generator=generator) < args.ignored] = -100
        else:  # a masked prompt: the first positions of each row
            labels[:, : round(args.seq * args.ignored)] = -100
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


def _ortmodule(model, sparse):
    """ORTModule's step of a Hugging Face model (its output holds the loss and the logits), label sparsity on
    or off."""
    before = os.environ.get(SWITCH)
    os.environ[SWITCH] = "1" if sparse else "0"  # read when the ORTModule is made
    try:
        wrapped = ORTModule(model)
    finally:
        os.environ.pop(SWITCH) if before is None else os.environ.__setitem__(SWITCH, before)
    return torch_adamw_step(wrapped, lambda ids, labels: wrapped(input_ids=ids, labels=labels).loss,
                            max_norm=MAX_NORM)


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


def _model(args):
    """GPT-2 or BERT's masked LM from a config of the arguments' sizes, dropout off."""
    if args.model == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=args.vocab, num_hidden_layers=args.layers, hidden_size=args.width,
            num_attention_heads=args.heads, intermediate_size=4 * args.width, max_position_embeddings=args.seq,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=args.vocab, n_layer=args.layers, n_embd=args.width, n_head=args.heads, n_positions=args.seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM"))


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = _model(args).train()
    steps = {"ortrainer dense": _trainer(copy.deepcopy(model), args, sparse=False),
             "ortrainer sparse": _trainer(copy.deepcopy(model), args, sparse=True),
             "ortmodule dense": _ortmodule(copy.deepcopy(model), sparse=False),
             "ortmodule sparse": _ortmodule(copy.deepcopy(model), sparse=True),
             "eager": torch_adamw_step(model, lambda ids, labels: model(input_ids=ids, labels=labels).loss,
                                       max_norm=MAX_NORM)}
    losses, median = interleaved(steps, _batches(args, args.warmup + args.rounds * args.steps), args)
    result = {"config": {key: value for key, value in vars(args).items() if key != "json"},
              "median_ms_per_step": median}
    for front in FRONTS:
        dense, sparse = losses[f"{front} dense"], losses[f"{front} sparse"]
        result[f"{front}_dense_over_sparse"] = median[f"{front} dense"] / median[f"{front} sparse"]
        result[f"{front}_eager_over_sparse"] = median["eager"] / median[f"{front} sparse"]
        result[f"{front}_dense_vs_sparse_worst_relative_loss_difference"] = max(
            abs(d - s) / abs(d) for d, s in zip(dense, sparse))
    where = "at random" if args.model == "bert" else "the first of each row"
    print(f"{args.model} vocab {args.vocab}, {args.layers} layers, width {args.width}, "
          f"{args.batch} x {args.seq} tokens, "
          f"{100 * args.ignored:.0f}% of the labels -100 ({where}), {args.threads} threads; median ms/step of "
          f"{args.rounds} rounds x {args.steps}:")
    for engine in ENGINES:
        print(f"  {engine:17s} {median[engine]:9.1f}")
    for front in FRONTS:
        print(f"  {front}: dense / sparse {result[f'{front}_dense_over_sparse']:.2f}x, eager / sparse "
              f"{result[f'{front}_eager_over_sparse']:.2f}x; dense vs sparse loss: worst relative difference "
              f"{result[f'{front}_dense_vs_sparse_worst_relative_loss_difference']:.1e}")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
