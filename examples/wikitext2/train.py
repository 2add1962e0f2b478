"""Train the notebook's Transformer language model on WikiText-2 with PyTorch or with ORTTrainer.

    python -m examples.wikitext2 --engine ort        # or: python examples/wikitext2/train.py ...
    python -m examples.wikitext2 --compare loss.png  # both engines on the same batches: loss.png, loss.csv
    python -m torch.distributed.run --nproc_per_node=2 -m examples.wikitext2 --engine ort [--zero-stage 1]

Under torchrun every rank trains on its slice of each batch's columns (data parallel ORTTrainer,
or ZeRO stage 1 with ``--zero-stage 1``); rank 0 alone prints and writes the metrics.

Both engines share the data, the model initialisation (``--seed``), the epoch loop, evaluation,
best-model selection, checkpointing and reporting; they differ only in one train/eval step.
"""
from __future__ import annotations

import argparse
import copy
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

from examples._cli import add_engine_option, add_option, canonical_engine, description, engine_imports, progress
from examples._report import (add_report_options, check_report_packages, log_mlflow, plot_losses, write_json,
                              write_steps_csv)
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
    name = "torch"

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
        ORTTrainer, ORTTrainerOptions, optim = engine_imports("ort", "ort_trainer", "ORTTrainer", "ORTTrainerOptions",
                                                              "optim")
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


def train_epoch(engine, train_data, epoch, args, steps):
    """One pass over (at most --max-batches of) the training data; appends each batch's loss and
    milliseconds to ``steps``; returns ms per batch."""
    starts = range(0, train_data.size(0) - 1, args.bptt)[:args.max_batches]
    total_loss, epoch_start = 0.0, time.time()
    start_time = epoch_start
    for batch, i in enumerate(progress(starts, desc=f"epoch {epoch}", unit="batch", args=args)):
        step_start = time.perf_counter()
        data, targets = get_batch(train_data, i, args.bptt)
        loss = engine.train_step(data, targets).item()
        steps["ms"].append(1000 * (time.perf_counter() - step_start))
        steps["loss"].append(loss)
        total_loss += loss
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
    for i in progress(range(0, source.size(0) - 1, args.bptt)[:args.max_batches], desc="eval", unit="batch",
                      args=args):
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
        if canonical_engine(meta["engine"]) != self.engine.name:
            raise SystemExit(f"error: {self.directory} holds {meta['engine']} checkpoints, not "
                             f"{self.engine.name} ones; pass another --checkpoint-dir")
        self.engine.load_checkpoint(self.directory / f"epoch{meta['epoch']:04d}.{meta['engine']}")
        torch.set_rng_state(meta.pop("rng"))
        del meta["engine"]
        return meta


def make_parser():
    """The example's flags (README, Options: tests/test_example_cli.py checks the table against them)."""
    p = argparse.ArgumentParser(prog="python -m examples.wikitext2", description=description(__doc__))

    def option(name, **kwargs):
        add_option(p, name, **kwargs)

    add_engine_option(p, ENGINES, "torch", "who does the training step: ORTTrainer or eager PyTorch")
    option("data", type=Path, help="WikiText-2 directory (wiki.{train,valid,test}.tokens or "
           "{train,valid,test}.txt) or one text file, split 90/5/5 by lines "
           f"(default: {DEFAULT_DATA}, if it exists)")
    option("download", action="store_true", help="fetch the official wikitext-2-v1.zip into --cache-dir")
    option("cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    option("epochs", type=int, default=3)
    option("device", choices=["cpu", "cuda"], default="cpu")
    option("max-batches", type=int, help="at most N train batches per epoch and N batches per evaluation")
    option("seed", type=int, default=0, help="model initialisation and dropout seed")
    option("checkpoint-dir", type=Path, help="checkpoint every epoch; resume from the newest one")
    option("dropout", type=float, default=0.2)
    option("bptt", type=int, default=35)
    option("batch-size", type=int, default=20)
    option("eval-batch-size", type=int, default=10)
    option("lr", type=float, default=0.001)
    option("clip", type=float, default=0.5, help="max gradient norm")
    option("log-interval", type=int, default=50)
    option("json", type=Path, help="write the final metrics and every batch's loss and ms to this file")
    option("quiet", action="store_true", help="no progress bar and no per-batch log lines")
    option("zero-stage", type=int, choices=[0, 1], default=0,
           help="ORTTrainer's deepspeed_zero_optimization.stage under torchrun")
    option("mixed-precision", choices=["float16", "bfloat16"], nargs="?", const="float16",
           help="matrix products in fp16 (default) or bf16 on fp32 master weights: ORTTrainer's "
                "mixed_precision, torch.autocast (+ GradScaler for fp16) for --engine torch")
    add_report_options(p, "both engines", "batch", "valid and test loss")
    return p


def parse_args(argv=None):
    p = make_parser()
    args = p.parse_args(argv)
    if args.max_batches is not None and args.max_batches < 1:
        p.error("--max-batches must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: PyTorch sees no CUDA device")
    if args.compare and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("--compare runs both engines in one process; not under torchrun")
    check_report_packages(args)
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
    """One run with --engine; with --compare, one with each engine (their metrics by engine name)."""
    args = parse_args(argv)
    if not args.compare:
        return run(args)
    results, runs = {}, {}
    for name in ENGINES:
        engine_args = copy.copy(args)
        engine_args.engine, engine_args.json = name, None
        if args.checkpoint_dir:
            engine_args.checkpoint_dir = args.checkpoint_dir / name
        results[name] = run(engine_args)
        runs[name] = {"loss": results[name]["train_losses"], "ms": results[name]["train_ms"]}
    args.compare.parent.mkdir(parents=True, exist_ok=True)
    write_steps_csv(args.compare.with_suffix(".csv"), runs, "batch")
    plot_losses(args.compare, runs, "examples.wikitext2: training loss per batch", "batch")
    print(f"| loss curves: {args.compare}, {args.compare.with_suffix('.csv')} |")
    write_json(args.json, results)
    return results


def run(args):
    """Trains with ``args.engine``; returns the metrics (also written to --json, logged with --mlflow)."""
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

    state = {"epoch": 0, "best_val_loss": math.inf, "best_state": None, "history": [],
             "steps": {"loss": [], "ms": []}}
    checkpoints = Checkpoints(args.checkpoint_dir, engine, rank) if args.checkpoint_dir else None
    if checkpoints and (resumed := checkpoints.resume()):
        state = {"steps": {"loss": [], "ms": []}, **resumed}   # checkpoints before per-batch steps lack them
        print(f"| resumed from {args.checkpoint_dir} after epoch {state['epoch']} |")

    for epoch in range(state["epoch"] + 1, args.epochs + 1):
        epoch_start = time.time()
        ms_per_batch = train_epoch(engine, train_data, epoch, args, state["steps"])
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
               "test_loss": test_loss, "test_ppl": math.exp(test_loss),
               "train_losses": state["steps"]["loss"], "train_ms": state["steps"]["ms"]}
    write_json(args.json, metrics)
    if args.mlflow and rank == 0:
        summary = {"valid_loss": state["best_val_loss"], "test_loss": test_loss, "test_ppl": math.exp(test_loss)}
        log_mlflow("examples.wikitext2", args.engine, vars(args), state["steps"], "batch", summary)
    return metrics


if __name__ == "__main__":
    main()
