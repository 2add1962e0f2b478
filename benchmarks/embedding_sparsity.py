"""Embedding sparsity (ORTModule's ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER, ORTTrainer's
`graph_transformer.embedding_sparsity`): a train step of a per-token model (an embedding with
padding_idx 0, `--blocks` residual MLP blocks of LayerNorm -> width x 4 -> GELU -> width, a
vocabulary head, cross-entropy with the padded positions' labels -100) on batches whose rows end in
`--padding` of padding, dense (the switch off) vs sparse (on, the default) vs eager PyTorch.

    python benchmarks/embedding_sparsity.py                 # 50% padding, width 256, 4 blocks, 8 x 128 tokens
    python benchmarks/embedding_sparsity.py --padding 0     # no padding: the rewrite's own cost
    python benchmarks/embedding_sparsity.py --json out.json

One process, the same thread count for every engine. Each engine trains its own copy of the same
initial model on the same batches with AdamW (ORTTrainer: its Adam in torch's AdamW form),
`loss.item()` every step. Warmup, then `--rounds` interleaved rounds of `--steps` steps per engine
(the order rotates each round); reports the median of the per-round wall ms/step, the dense/sparse
ratios (> 1: sparse is faster), and the largest relative difference between each front end's dense
and sparse losses (the same steps: they should agree to float rounding).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.label_sparsity import add_timing_arguments, interleaved, torch_adamw_step  # noqa: E402
from examples._report import write_json  # noqa: E402
from ort_trainer import ORTModule, ORTTrainer, ORTTrainerOptions, optim  # noqa: E402

ENGINES = ("ortmodule dense", "ortmodule sparse", "ortrainer dense", "ortrainer sparse", "eager")
WEIGHT_DECAY, LR, SWITCH = 0.01, 1e-4, "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER"


class TokenMLP(nn.Module):
    def __init__(self, vocab, width, blocks):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(blocks))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, ids):
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.head(self.norm(hidden))


def loss_of(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


class WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return loss_of(self.model(ids), labels)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--padding", type=float, default=0.5, help="share of each row's positions that are padding")
    add_timing_arguments(p)
    return p.parse_args(argv)


def _batches(args, count):
    generator = torch.Generator().manual_seed(0)
    padded = round(args.seq * args.padding)
    batches = []
    for _ in range(count):
        ids = torch.randint(1, args.vocab, (args.batch, args.seq), generator=generator)
        ids[:, args.seq - padded:] = 0
        batches.append((ids, torch.where(ids == 0, -100, ids)))
    return batches


def _ortmodule(model, sparse):
    before = os.environ.get(SWITCH)
    os.environ[SWITCH] = "1" if sparse else "0"  # read when the ORTModule is made
    try:
        wrapped = ORTModule(WithLoss(model))
    finally:
        os.environ.pop(SWITCH) if before is None else os.environ.__setitem__(SWITCH, before)
    return torch_adamw_step(wrapped, wrapped)


def _trainer(model, args, sparse):
    desc = {"inputs": [("ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", args.vocab])]}
    config = optim.AdamConfig(lr=LR, lambda_coef=WEIGHT_DECAY, weight_decay_mode=optim.DecayMode.BEFORE_WEIGHT_UPDATE)
    trainer = ORTTrainer(model, desc, config, loss_fn=loss_of, options=ORTTrainerOptions(
        {"graph_transformer": {"embedding_sparsity": sparse}, "utils": {"grad_norm_clip": False}}))
    trainer.train_step_info.fetches = ["loss"]
    return lambda ids, labels: trainer.train_step(ids, labels).item()


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = TokenMLP(args.vocab, args.width, args.blocks)
    steps = {"ortmodule dense": _ortmodule(copy.deepcopy(model), sparse=False),
             "ortmodule sparse": _ortmodule(copy.deepcopy(model), sparse=True),
             "ortrainer dense": _trainer(copy.deepcopy(model), args, sparse=False),
             "ortrainer sparse": _trainer(copy.deepcopy(model), args, sparse=True),
             "eager": torch_adamw_step(model, lambda ids, labels: loss_of(model(ids), labels))}
    losses, median = interleaved(steps, _batches(args, args.warmup + args.rounds * args.steps), args)
    result = {"config": {key: value for key, value in vars(args).items() if key != "json"},
              "median_ms_per_step": median}
    for front in ("ortmodule", "ortrainer"):
        dense, sparse = losses[f"{front} dense"], losses[f"{front} sparse"]
        result[f"{front}_dense_over_sparse"] = median[f"{front} dense"] / median[f"{front} sparse"]
        result[f"{front}_eager_over_sparse"] = median["eager"] / median[f"{front} sparse"]
        result[f"{front}_dense_vs_sparse_worst_relative_loss_difference"] = max(
            abs(d - s) / abs(d) for d, s in zip(dense, sparse))
    print(f"Per-token MLP, vocab {args.vocab}, width {args.width}, {args.blocks} blocks, {args.batch} x {args.seq} "
          f"tokens, {100 * args.padding:.0f}% padding, {args.threads} threads; median ms/step of {args.rounds} rounds "
          f"x {args.steps}:")
    for engine in ENGINES:
        print(f"  {engine:17s} {median[engine]:9.1f}")
    for front in ("ortmodule", "ortrainer"):
        print(f"  {front}: dense / sparse {result[f'{front}_dense_over_sparse']:.2f}x, eager / sparse "
              f"{result[f'{front}_eager_over_sparse']:.2f}x; dense vs sparse loss: worst relative difference "
              f"{result[f'{front}_dense_vs_sparse_worst_relative_loss_difference']:.1e}")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
