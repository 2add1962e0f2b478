"""Train the notebook's Transformer language model on WikiText-2 with PyTorch or with ORTTrainer.

    python -m examples.wikitext2 --engine ort        # or: python examples/wikitext2/train.py ...
    python -m torch.distributed.run --nproc_per_node=2 -m examples.wikitext2 --engine ort [--zero-stage 1]

Under torchrun every rank trains on its slice of each batch's columns (data parallel ORTTrainer,
or ZeRO stage 1 with ``--zero-stage 1``); rank 0 alone prints and writes the metrics.

Both engines share the data, the model initialisation (``--seed``), the epoch loop, evaluation,
best-model selection, checkpointing and reporting; they differ only in one train/eval step.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

if not __package__:   # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn
from tqdm import tqdm

from examples.wikitext2.data import (DEFAULT_CACHE_DIR, DataError, batchify, download_wikitext2,
                                     get_batch, load_corpus)
from examples.wikitext2.model import TransformerModel

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt"


def make_loss_fn(ntokens):
    criterion = nn.CrossEntropyLoss()

    def calculate_loss(output, targets):
        return criterion(output.view(-1, ntokens), targets)
    return calculate_loss


class PyTorchEngine:
    """The notebook's baseline: eager PyTorch, Adam, ``clip_grad_norm_``; with --mixed-precision,
    under ``torch.autocast`` with a ``GradScaler`` (fp16)."""
    name = "pytorch"

    def __init__(self, model, loss_fn, args):
        self.model, self.loss_fn, self.clip = model, loss_fn, args.clip
        self.optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        dtype = getattr(torch, args.mixed_precision or "float32")
        self.autocast = dict(device_type=args.device, dtype=dtype, enabled=args.mixed_precision is not None)
        self.scaler = torch.amp.GradScaler(args.device, enabled=dtype == torch.float16)

    def train_step(self, data, targets):
        self.model.train()
        self.optimizer.zero_grad()
        with torch.autocast(**self.autocast):
            loss = self.loss_fn(self.model(data), targets)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss

    @torch.no_grad()
    def eval_step(self, data, targets):
        self.model.eval()
        with torch.autocast(**self.autocast):
            return self.loss_fn(self.model(data), targets)

    def save_checkpoint(self, path):
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict()}, path)

    def load_checkpoint(self, path):
        state = torch.load(path, map_location=next(self.model.parameters()).device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state.get("scaler", {}))


class ORTEngine:
    """The notebook's accelerated run: ORTTrainer does forward, loss, backward, clipping and Adam."""
    name = "ort"

    def __init__(self, model, loss_fn, args):
        try:
            from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
        except ImportError as exc:
            raise SystemExit(f"error: --engine ort needs a working ort_trainer "
                             f"(pip install -e '.[cpu]' from the repository root): {exc}") from exc
        ntokens = model.decoder.out_features
        model_desc = {'inputs': [('src', ['bptt', 'batch_size']), ('label', ['bptt_x_batch_size'])],
                      'outputs': [('loss', [], True), ('output', ['bptt', 'batch_size', ntokens])]}
        mixed_precision = {'enabled': True, 'dtype': args.mixed_precision} if args.mixed_precision else {}
        options = ORTTrainerOptions({'device': {'id': args.device}, 'utils': {'grad_norm_clip': True},
                                     'distributed': {'deepspeed_zero_optimization': {'stage': args.zero_stage}},
                                     'mixed_precision': mixed_precision})
        self.trainer = ORTTrainer(model, model_desc, optim.AdamConfig(lr=args.lr, max_norm_clip=args.clip),
                                  loss_fn=loss_fn, options=options)
        # The loop only uses the loss: not fetching the logits saves their memory and copy.
        self.trainer.train_step_info.fetches = ["loss"]

    @property
    def model(self):
        return self.trainer.model

    def train_step(self, data, targets):
        return self.trainer.train_step(data, targets)

    def eval_step(self, data, targets):
        return self.trainer.eval_step(data, targets)

    def save_checkpoint(self, path):
        self.trainer.save_checkpoint(path)

    def load_checkpoint(self, path):
        self.trainer.load_checkpoint(path)


ENGINES = {engine.name: engine for engine in (PyTorchEngine, ORTEngine)}


def train_epoch(engine, train_data, epoch, args):
    """One pass over (at most --max-batches of) the training data; returns ms per batch."""
    starts = range(0, train_data.size(0) - 1, args.bptt)[:args.max_batches]
    bar = tqdm(starts, desc=f"epoch {epoch}", unit="batch", leave=False,
               disable=args.quiet or not sys.stderr.isatty())
    total_loss, epoch_start = 0.0, time.time()
    start_time = epoch_start
    for batch, i in enumerate(bar):
        data, targets = get_batch(train_data, i, args.bptt)
        loss = engine.train_step(data, targets)
        total_loss += loss.item()
        if batch % args.log_interval == 0 and batch > 0:
            # As in the notebook, the first window holds log_interval + 1 losses.
            cur_loss = total_loss / args.log_interval
            ms = (time.time() - start_time) * 1000 / args.log_interval
            if not args.quiet:
                tqdm.write(f"| epoch {epoch:3d} | {batch:5d}/{len(starts):5d} batches | lr {args.lr:02.3f} "
                           f"| ms/batch {ms:5.2f} | loss {cur_loss:5.2f} | ppl {math.exp(cur_loss):8.2f}")
            total_loss, start_time = 0.0, time.time()
    return (time.time() - epoch_start) * 1000 / len(starts)


def evaluate(engine, source, args):
    """The notebook's ``evaluate``: mean loss per row, each batch weighted by its length."""
    total_loss, rows = 0.0, 0
    for i in range(0, source.size(0) - 1, args.bptt)[:args.max_batches]:
        data, targets = get_batch(source, i, args.bptt)
        total_loss += len(data) * engine.eval_step(data, targets).item()
        rows += len(data)
    return total_loss / rows   # rows == len(source) - 1 when every batch is evaluated


class Checkpoints:
    """``epochNNNN.<engine>`` (the engine's own checkpoint) + ``epochNNNN.meta.pt`` (loop state),
    the meta file written last, so the newest meta file marks the newest complete checkpoint."""

    def __init__(self, directory, engine, rank=0):
        self.directory, self.engine, self.rank = Path(directory), engine, rank
        self.directory.mkdir(parents=True, exist_ok=True)

    def save(self, epoch, state):
        self.engine.save_checkpoint(self.directory / f"epoch{epoch:04d}.{self.engine.name}")  # every rank
        if self.rank == 0:
            torch.save({**state, "engine": self.engine.name, "rng": torch.get_rng_state()},
                       self.directory / f"epoch{epoch:04d}.meta.pt")

    def resume(self):
        metas = sorted(self.directory.glob("epoch*.meta.pt"))
        if not metas:
            return None
        meta = torch.load(metas[-1])
        if meta["engine"] != self.engine.name:
            raise SystemExit(f"error: {self.directory} holds {meta['engine']} checkpoints, not "
                             f"{self.engine.name} ones; pass another --checkpoint-dir")
        self.engine.load_checkpoint(self.directory / f"epoch{meta['epoch']:04d}.{self.engine.name}")
        torch.set_rng_state(meta.pop("rng"))
        del meta["engine"]
        return meta


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m examples.wikitext2", description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=sorted(ENGINES), default="pytorch")
    p.add_argument("--data", type=Path, help="WikiText-2 directory (wiki.{train,valid,test}.tokens or "
                   "{train,valid,test}.txt) or one text file, split 90/5/5 by lines "
                   f"(default: {DEFAULT_DATA}, if it exists)")
    p.add_argument("--download", action="store_true", help="fetch the official wikitext-2-v1.zip into --cache-dir")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--max-batches", type=int, help="at most N train batches per epoch and N batches per evaluation")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and dropout seed")
    p.add_argument("--checkpoint-dir", type=Path, help="checkpoint every epoch; resume from the newest one")
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--bptt", type=int, default=35)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--eval-batch-size", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--clip", type=float, default=0.5, help="max gradient norm")
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--json", type=Path, help="write the final metrics to this file")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no per-batch log lines")
    p.add_argument("--zero-stage", type=int, choices=[0, 1], default=0,
                   help="ORTTrainer's deepspeed_zero_optimization.stage under torchrun")
    p.add_argument("--mixed-precision", choices=["float16", "bfloat16"], nargs="?", const="float16",
                   help="matrix products in fp16 (default) or bf16 on fp32 master weights: ORTTrainer's "
                        "mixed_precision, torch.autocast (+ GradScaler for fp16) for --engine pytorch")
    args = p.parse_args(argv)
    if args.max_batches is not None and args.max_batches < 1:
        p.error("--max-batches must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: PyTorch sees no CUDA device")
    if args.data is None and not args.download:
        if not DEFAULT_DATA.is_file():
            p.error(f"no data: pass --data DIR_OR_FILE, or --download to fetch WikiText-2 "
                    f"({DEFAULT_DATA} does not exist)")
        args.data = DEFAULT_DATA
    return args


def join_process_group(args):
    """Under torchrun (WORLD_SIZE > 1) joins the process group; returns (rank, world size)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    if args.engine != "ort":
        raise SystemExit("error: under torchrun use --engine ort (ORTTrainer trains data parallel)")
    if args.batch_size % world_size:
        raise SystemExit(f"error: --batch-size {args.batch_size} must be a multiple of the {world_size} ranks")
    if args.device == "cuda":
        args.device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(args.device)  # NCCL's own buffers and barriers go on this rank's GPU
    torch.distributed.init_process_group("gloo" if args.device == "cpu" else "nccl", timeout=timedelta(minutes=5))
    return torch.distributed.get_rank(), world_size


def main(argv=None):
    args = parse_args(argv)
    rank, world_size = join_process_group(args)
    if rank > 0:   # rank 0 alone prints and writes the metrics
        args.quiet, args.json = True, None
        sys.stdout = open(os.devnull, "w")
    try:
        corpus = load_corpus(download_wikitext2(args.cache_dir) if args.download else args.data)
    except DataError as exc:
        raise SystemExit(f"error: {exc}") from exc
    device = torch.device(args.device)
    columns = args.batch_size // world_size   # this rank's slice of every batch
    train_data = batchify(corpus.train, args.batch_size)[:, rank * columns:(rank + 1) * columns].contiguous().to(device)
    val_data = batchify(corpus.valid, args.eval_batch_size).to(device)
    test_data = batchify(corpus.test, args.eval_batch_size).to(device)
    if min(len(train_data), len(val_data), len(test_data)) < 2:
        raise SystemExit("error: a split is too small for one batch; use more text or smaller batch sizes")
    ntokens = len(corpus.vocab)
    nbatches = len(range(0, train_data.size(0) - 1, args.bptt)[:args.max_batches])
    print(f"| {args.engine} on {device} | vocab {ntokens} | train {tuple(train_data.shape)} -> {nbatches} "
          f"batches | valid {tuple(val_data.shape)} | test {tuple(test_data.shape)} |")

    torch.manual_seed(args.seed)   # same initial weights for both engines
    model = TransformerModel(ntokens, dropout=args.dropout).to(device)
    engine = ENGINES[args.engine](model, make_loss_fn(ntokens), args)

    state = {"epoch": 0, "best_val_loss": math.inf, "best_state": None, "history": []}
    checkpoints = Checkpoints(args.checkpoint_dir, engine, rank) if args.checkpoint_dir else None
    if checkpoints and (resumed := checkpoints.resume()):
        state = resumed
        print(f"| resumed from {args.checkpoint_dir} after epoch {state['epoch']} |")

    for epoch in range(state["epoch"] + 1, args.epochs + 1):
        epoch_start = time.time()
        ms_per_batch = train_epoch(engine, train_data, epoch, args)
        val_loss = evaluate(engine, val_data, args)
        elapsed = time.time() - epoch_start
        print("-" * 89)
        print(f"| end of epoch {epoch:3d} | time: {elapsed:5.2f}s | valid loss {val_loss:5.2f} "
              f"| valid ppl {math.exp(val_loss):8.2f}")
        print("-" * 89)
        state["history"].append({"epoch": epoch, "train_ms_per_batch": ms_per_batch, "epoch_time_s": elapsed,
                                 "valid_loss": val_loss, "valid_ppl": math.exp(val_loss)})
        if val_loss < state["best_val_loss"]:
            state["best_val_loss"] = val_loss
            state["best_state"] = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        state["epoch"] = epoch
        if checkpoints:
            checkpoints.save(epoch, state)

    if state["best_state"] is not None:
        engine.model.load_state_dict(state["best_state"])
    test_loss = evaluate(engine, test_data, args)
    print("=" * 89)
    print(f"| End of training | test loss {test_loss:5.2f} | test ppl {math.exp(test_loss):8.2f}")
    print("=" * 89)

    metrics = {"engine": args.engine, "device": str(device), "ntokens": ntokens, "train_batches": nbatches,
               "epochs": state["history"], "best_valid_loss": state["best_val_loss"],
               "test_loss": test_loss, "test_ppl": math.exp(test_loss)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


if __name__ == "__main__":
    main()
