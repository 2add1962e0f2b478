"""Fine-tune GPT-2 (GPT2LMHeadModel) on WikiText text with ORTTrainer, the plain PyTorch loop, or
Hugging Face's Trainer on ORTModule(model) or on the plain model.

    python -m examples.gpt2 --engine ort                      # offline: small GPT-2 from scratch
    python -m examples.gpt2 --engine torch                    # the same run, eager PyTorch
    python -m examples.gpt2 --engine hf-trainer               # transformers.Trainer on ORTModule(model)
    python -m examples.gpt2 --engine hf-trainer-torch         # the same Trainer run on the plain model
    python -m examples.gpt2 --engine ort --model_name_or_path gpt2 --block-size 512 ...
    python -m examples.gpt2 --compare loss.png        # ort and torch on the same batches: loss.png, loss.csv

The seed's ``run_lm_gpt2.sh`` recipe (Hugging Face's language-modeling example with ORT): blocks
of ``--block-size`` tokens, AdamW (weight decay 0.01, none on biases and LayerNorm weights),
linear warmup then linear decay, gradient-norm clipping, gradient accumulation.

The ort and torch engines share the data, the model initialisation (``--seed``), the loop,
evaluation, checkpointing and reporting; they differ only in one train/eval step. The hf-trainer
engines share the data, the model and the reporting, and leave the loop and evaluation to
``transformers.Trainer`` (README: "Hugging Face Trainer").
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import random
import socket
import statistics
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

if not __package__:   # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import huggingface_hub
import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from examples._cli import add_engine_option, add_option, description, engine_imports, progress
from examples._report import (add_report_options, check_report_packages, log_mlflow, plot_losses, write_json,
                              write_steps_csv)
from examples.gpt2.data import BlockDataset, DataError, load_blocks, read_lines, train_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
ADAM_BETAS, ADAM_EPSILON = (0.9, 0.999), 1e-8   # Hugging Face Trainer's defaults


def no_decay_parameter_names(model) -> list[str]:
    """Biases and LayerNorm weights, which run_clm (Hugging Face Trainer) does not decay."""
    layer_norm_params = {f"{module_name}.{name}" if module_name else name
                         for module_name, module in model.named_modules() if isinstance(module, torch.nn.LayerNorm)
                         for name, _ in module.named_parameters(recurse=False)}
    return [name for name, _ in model.named_parameters() if name in layer_norm_params or name.endswith("bias")]


def linear_warmup_factor(update: int, total_updates: int, warmup_steps: int) -> float:
    """lr / base lr of the ``update``-th update (1, 2, ...), as ``optim.LinearWarmupLRScheduler``
    computes it: a linear ramp over ``warmup_steps`` updates, then a linear decay that reaches 0
    at update ``total_updates``."""
    if update < warmup_steps:
        return update / max(1, warmup_steps)
    return max(0.0, (total_updates - update) / max(1, total_updates - warmup_steps))


def save_torch_checkpoint(path, model, optimizer, scheduler, **counters):
    """Model, optimizer and scheduler state in one ``torch.save`` file; ``['model']`` loads into
    the plain model (``torch.load(path, weights_only=True)``)."""
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "lr_scheduler": scheduler.state_dict(), **counters}, path)


class TorchEngine:
    """The plain PyTorch loop: forward and backward per micro-batch, then clip, AdamW, schedule."""
    name = "torch"

    def __init__(self, model, args, total_updates):
        self.model, self.args = model, args
        no_decay = set(no_decay_parameter_names(model))
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if n not in no_decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=ADAM_BETAS, eps=ADAM_EPSILON)
        # LambdaLR calls the lambda with the number of updates done so far: the next one is +1.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda done: linear_warmup_factor(done + 1, total_updates, args.warmup_steps))
        self.micro_steps = 0
        self.last_lr = None
        dtype = getattr(torch, args.mixed_precision or "float32")  # --mixed-precision: autocast (+ GradScaler)
        self.autocast = dict(device_type=args.device, dtype=dtype, enabled=args.mixed_precision is not None)
        self.scaler = torch.amp.GradScaler(args.device, enabled=dtype == torch.float16)

    def train_step(self, input_ids):
        """One micro-batch; every ``--gradient-accumulation-steps``-th call also updates."""
        with torch.autocast(**self.autocast):
            output = self.model(input_ids=input_ids, labels=input_ids, use_cache=False)
        # The micro-batch losses are not divided by the accumulation steps: ORTTrainer sums the
        # micro-steps' gradients, and clipping and Adam then see the same sum here.
        self.scaler.scale(output.loss).backward()
        self.micro_steps += 1
        if self.micro_steps % self.args.gradient_accumulation_steps == 0:
            self.scaler.unscale_(self.optimizer)
            if self.args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
            self.last_lr = self.scheduler.get_last_lr()[0]
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return output.loss.detach()

    @torch.no_grad()
    def eval_step(self, input_ids):
        """(loss, logits or None): dropout off, the model's train/eval flags restored after."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.autocast(**self.autocast):
                output = self.model(input_ids=input_ids, labels=input_ids, use_cache=False)
        finally:
            self.model.train(was_training)
        return output.loss, output.logits if self.args.fetch_logits else None

    def save_checkpoint(self, path):
        save_torch_checkpoint(path, self.model, self.optimizer, self.scheduler, micro_steps=self.micro_steps)


class ORTEngine:
    """ORTTrainer: forward, loss, backward, accumulation, clipping, AdamW and the schedule in one call."""
    name = "ort"

    def __init__(self, model, args, total_updates):
        ORTTrainer, ORTTrainerOptions, optim = engine_imports("ort", "ort_trainer", "ORTTrainer", "ORTTrainerOptions",
                                                              "optim")
        self.args = args
        outputs = [("loss", [], True)]
        if args.fetch_logits:
            outputs.append(("logits", ["batch", "block", model.config.vocab_size]))
        model_desc = {"inputs": [("input_ids", ["batch", "block"]), ("labels", ["batch", "block"])],
                      "outputs": outputs}
        # DecayMode.BEFORE_WEIGHT_UPDATE is torch.optim.AdamW's update; biases and LayerNorm
        # weights get a group of their own without decay.
        optim_config = optim.AdamConfig(
            params=[{"params": no_decay_parameter_names(model), "lambda_coef": 0.0}],
            lr=args.learning_rate, alpha=ADAM_BETAS[0], beta=ADAM_BETAS[1], epsilon=ADAM_EPSILON,
            lambda_coef=args.weight_decay, weight_decay_mode=optim.DecayMode.BEFORE_WEIGHT_UPDATE,
            **({"max_norm_clip": args.max_grad_norm} if args.max_grad_norm > 0 else {}))
        options = ORTTrainerOptions({
            "device": {"id": args.device},
            "batch": {"gradient_accumulation_steps": args.gradient_accumulation_steps},
            "lr_scheduler": optim.LinearWarmupLRScheduler(total_updates, warmup=args.warmup_steps / total_updates),
            "utils": {"grad_norm_clip": args.max_grad_norm > 0},
            "mixed_precision": {"enabled": True, "dtype": args.mixed_precision} if args.mixed_precision else {},
        })
        self.trainer = ORTTrainer(model, model_desc, optim_config, loss_fn=None, options=options)

    @property
    def model(self):
        return self.trainer.model   # its parameters are views of the trainer's weights

    @property
    def last_lr(self):
        return self.trainer.options.lr_scheduler.get_last_lr()[0]

    def train_step(self, input_ids):
        outputs = self.trainer.train_step(input_ids=input_ids, labels=input_ids)
        return outputs[0] if self.args.fetch_logits else outputs

    def eval_step(self, input_ids):
        outputs = self.trainer.eval_step(input_ids=input_ids, labels=input_ids)
        return tuple(outputs) if self.args.fetch_logits else (outputs, None)

    def save_checkpoint(self, path):
        self.trainer.save_checkpoint(path)


class HFTrainerEngine:
    """``transformers.Trainer`` with default behaviour on ``ORTModule(model)``: Trainer's own loop,
    AdamW, linear schedule, clipping and evaluation; the model's forward and backward run in ONNX
    Runtime. ``fit`` and ``evaluate`` take the place of the example's ``train`` and ``evaluate``."""
    name = "hf-trainer"
    ort = True

    def __init__(self, model, args, total_updates):
        if args.lora:
            model = with_lora_adapters(model)
            if args.gradient_checkpointing:  # reentrant checkpointing needs inputs that require grad (PEFT's advice)
                model.enable_input_require_grads()
        self.args, self.plain, self.trainer = args, model, None
        self.wrapped = model
        if self.ort:
            ORTModule, = engine_imports(self.name, "ort_trainer.ortmodule", "ORTModule")
            self.wrapped = ORTModule(model)
        # Trainer needs an output folder even when it writes nothing there (save_strategy="no").
        self._scratch = None if args.output_dir else tempfile.TemporaryDirectory(prefix="gpt2-trainer-")
        try:
            self.training_args = TrainingArguments(
                output_dir=str(args.output_dir or self._scratch.name), report_to=[], seed=args.seed,
                use_cpu=args.device == "cpu", per_device_train_batch_size=args.per_device_train_batch_size,
                per_device_eval_batch_size=args.per_device_eval_batch_size,
                gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.learning_rate,
                weight_decay=args.weight_decay, adam_beta1=ADAM_BETAS[0], adam_beta2=ADAM_BETAS[1],
                adam_epsilon=ADAM_EPSILON, max_grad_norm=args.max_grad_norm, warmup_steps=args.warmup_steps,
                max_steps=total_updates, logging_steps=1, disable_tqdm=True,
                eval_strategy="epoch" if args.eval_each_epoch else "no",
                gradient_checkpointing=args.gradient_checkpointing,  # Trainer's default: reentrant
                # The example writes its own outputs (save_model). Trainer's periodic checkpoint of
                # an ORTModule would be a bare state dict (README, "ORTModule with transformers.Trainer").
                save_strategy="no")
        except ImportError as exc:   # Trainer's PyTorch backend, accelerate, is missing
            raise SystemExit(f"error: --engine {self.name}: {exc}") from exc
        self.recorder = _TrainerRecorder(args, total_updates, self.name)

    @property
    def model(self):
        return self.plain   # save_pretrained() on the model itself: its own class in config.json

    def fit(self, blocks):
        """Trainer.train() over ``blocks.train`` (``blocks.eval`` after every epoch with
        --eval-each-epoch); returns the history ``train`` returns."""
        metrics = {"compute_metrics": next_token_accuracy, "preprocess_logits_for_metrics": predicted_tokens}
        self.trainer = Trainer(model=self.wrapped, args=self.training_args, train_dataset=BlockDataset(blocks.train),
                               eval_dataset=BlockDataset(blocks.eval), callbacks=[self.recorder],
                               **(metrics if self.args.fetch_logits else {}))
        self.trainer.remove_callback(PrinterCallback)   # the recorder prints the example's lines instead
        try:
            self.trainer.train()
        finally:
            self.recorder.close()
        return self.recorder.history

    def evaluate(self, blocks):
        """Trainer.evaluate() on ``blocks``: loss, perplexity (and accuracy with --fetch-logits)."""
        return evaluation_result(self.trainer.evaluate(BlockDataset(blocks)))

    def save_checkpoint(self, path):
        save_torch_checkpoint(path, self.plain, self.trainer.optimizer, self.trainer.lr_scheduler,
                              global_step=self.trainer.state.global_step)


def with_lora_adapters(model):
    """``model`` with PEFT LoRA adapters on its attention projections (rank 8): only the adapters
    train; ``save_pretrained`` then writes the adapter alone."""
    try:
        import peft
    except ImportError as exc:
        raise SystemExit(f"error: --lora needs peft (pip install peft): {exc}") from exc
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM",
                             fan_in_fan_out=True)  # GPT-2's Conv1D keeps its weight transposed
    return peft.get_peft_model(model, config)


class HFTrainerTorchEngine(HFTrainerEngine):
    """The same Trainer run on the plain model (eager PyTorch), for comparison."""
    name = "hf-trainer-torch"
    ort = False


def evaluation_result(metrics):
    """Trainer's evaluation metrics as ``evaluate`` reports them: loss, perplexity (accuracy)."""
    result = {"loss": metrics["eval_loss"], "ppl": math.exp(metrics["eval_loss"])}
    if "eval_accuracy" in metrics:
        result["accuracy"] = metrics["eval_accuracy"]
    return result


def predicted_tokens(logits, labels):
    """Trainer's preprocess_logits_for_metrics (as run_clm.py): keep the argmax, not the logits."""
    return logits.argmax(-1)


def next_token_accuracy(prediction):
    """Trainer's compute_metrics: next-token accuracy, as ``evaluate`` computes it."""
    predicted, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
    return {"accuracy": float((predicted == labels).mean())}


class _TrainerRecorder(TrainerCallback):
    """The example's history and log lines from Trainer's callbacks: update time from
    on_step_begin to on_step_end, loss and lr from Trainer's log of every update (its loss is
    rounded to 4 decimals), evaluation after each epoch (--eval-each-epoch)."""

    def __init__(self, args, total_updates, name):
        self.args, self.total_updates = args, total_updates
        self.history = {"update_losses": [], "learning_rates": [], "update_seconds": [], "epochs": []}
        self.bar = progress(total=total_updates, desc=name, unit="update", leave=True, args=args)
        self.eval_bar = None   # one per evaluation
        self.start, self.training = None, False

    def on_train_begin(self, args, state, control, **kwargs):
        self.training = True

    def on_train_end(self, args, state, control, **kwargs):
        self.training = False

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available() and self.args.device == "cuda":
            torch.cuda.synchronize()   # the update's kernels are done, as the other engines' .item()
        self.history["update_seconds"].append(time.perf_counter() - self.start)
        self.bar.update()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" not in logs:   # evaluation and the end-of-training summary
            return
        self.history["update_losses"].append(logs["loss"])
        self.history["learning_rates"].append(logs["learning_rate"])
        report_progress(self.args, self.history, math.ceil(state.epoch), self.total_updates)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if self.eval_bar is None:
            self.eval_bar = progress(total=len(eval_dataloader), desc="eval", unit="batch", args=self.args)
        self.eval_bar.update()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None
        if not self.training:   # the final evaluation: main() reports it
            return
        result = evaluation_result(metrics)
        epoch = math.ceil(state.epoch)   # as the loop engines: a last short epoch counts
        self.history["epochs"].append({"epoch": epoch, "updates": state.global_step, **result})
        tqdm.write(f"| end of epoch {epoch:2d} | eval loss {result['loss']:6.3f} "
                   f"| eval ppl {result['ppl']:9.2f} |")

    def close(self):
        self.bar.close()


ENGINES = {engine.name: engine for engine in (ORTEngine, TorchEngine, HFTrainerEngine, HFTrainerTorchEngine)}


def evaluate(engine, blocks, batch_size):
    """Mean loss per predicted token over ``blocks``, its perplexity, and with --fetch-logits the
    next-token accuracy (all blocks have the same length, so batches weigh by their size)."""
    total_loss, correct = 0.0, 0
    for start in progress(range(0, len(blocks), batch_size), desc="eval", unit="batch", args=engine.args):
        batch = blocks[start:start + batch_size]
        loss, logits = engine.eval_step(batch)
        total_loss += loss.item() * len(batch)
        if logits is not None:
            correct += (logits[:, :-1].argmax(-1) == batch[:, 1:]).sum().item()
    loss = total_loss / len(blocks)
    result = {"loss": loss, "ppl": math.exp(loss)}
    if engine.args.fetch_logits:
        result["accuracy"] = correct / (blocks.shape[0] * (blocks.shape[1] - 1))
    return result


def report_progress(args, history, epoch, total_updates):
    """After every --logging-steps updates: their mean time, mean loss and the last lr."""
    update = len(history["update_losses"])
    if update % args.logging_steps or args.quiet:
        return
    ms = 1000 * sum(history["update_seconds"][-args.logging_steps:]) / args.logging_steps
    mean = sum(history["update_losses"][-args.logging_steps:]) / args.logging_steps
    tqdm.write(f"| epoch {epoch:2d} | update {update:5d}/{total_updates} | lr {history['learning_rates'][-1]:.2e} "
               f"| ms/update {ms:7.1f} | loss {mean:6.3f} | ppl {math.exp(mean):9.2f} |")


def train(engine, blocks, args, total_updates):
    """The training loop: shuffled blocks each epoch (same order for both engines), one update per
    ``--gradient-accumulation-steps`` micro-batches; returns the history and the timings."""
    batch, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    updates_per_epoch = len(blocks.train) // (batch * accumulation)   # an epoch's leftover blocks are skipped
    shuffle = torch.Generator().manual_seed(args.seed)
    history = {"update_losses": [], "learning_rates": [], "update_seconds": [], "epochs": []}
    bar = progress(total=total_updates, desc=args.engine, unit="update", leave=True, args=args)
    for epoch in range(1, math.ceil(total_updates / updates_per_epoch) + 1):
        order = torch.randperm(len(blocks.train), generator=shuffle).to(blocks.train.device)
        for index in range(min(updates_per_epoch, total_updates - len(history["update_losses"]))):
            start = time.perf_counter()
            first = index * batch * accumulation
            micro_batches = order[first:first + batch * accumulation].view(accumulation, batch)
            loss = sum(engine.train_step(blocks.train[rows]).item() for rows in micro_batches) / accumulation
            history["update_seconds"].append(time.perf_counter() - start)
            history["update_losses"].append(loss)
            history["learning_rates"].append(engine.last_lr)
            bar.update()
            report_progress(args, history, epoch, total_updates)
        if args.eval_each_epoch:
            result = evaluate(engine, blocks.eval, args.per_device_eval_batch_size)
            history["epochs"].append({"epoch": epoch, "updates": len(history["update_losses"]), **result})
            tqdm.write(f"| end of epoch {epoch:2d} | eval loss {result['loss']:6.3f} | eval ppl {result['ppl']:9.2f} |")
    bar.close()
    return history


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


HUB_PROBE_TIMEOUT_S = 3.0
_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_unreachable():
    """Why the Hugging Face hub cannot be reached now (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set, or
    one TCP connection to it failing within a few seconds), or None when it can."""
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(variable, "").upper() in _TRUE:
            return f"{variable}={os.environ[variable]}"
    endpoint = urllib.parse.urlsplit(huggingface_hub.constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return f"{endpoint.hostname} does not answer: {exc}"
    return None


def pretrained_source(name):
    """from_pretrained's keyword arguments for ``name``: a folder or a reachable hub as they are, the
    Hugging Face cache alone when the hub is out of reach; with neither, a SystemExit at once
    (instead of a minute of Hugging Face's retries)."""
    if Path(name).is_dir():
        return {}
    reason = hub_unreachable()
    if reason is None:
        return {}
    try:
        cached = isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str)
    except ValueError:   # not a valid hub name either
        cached = False
    if cached:
        return {"local_files_only": True}
    raise SystemExit(f"error: --model_name_or_path {name}: no such folder, not in the Hugging Face cache, and the "
                     f"hub is out of reach ({reason}); download it where there is network "
                     f"(save_pretrained) and pass its folder")


def build_model_and_tokenizer(args, train_lines):
    """The pretrained GPT-2 and its tokenizer (--model_name_or_path), or a small GPT-2 from scratch
    with a BPE tokenizer trained on the training text. The model comes back in train mode."""
    dropout = {} if args.dropout is None else {key: args.dropout for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if args.model_name_or_path:
        source = pretrained_source(args.model_name_or_path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, **source)
            model = GPT2LMHeadModel.from_pretrained(args.model_name_or_path, **dropout, **source)
        except (OSError, ValueError) as exc:   # not a model folder, no network, not a GPT-2 checkpoint
            where = "" if Path(args.model_name_or_path).is_dir() else "no such folder, and from the Hugging Face hub: "
            raise SystemExit(f"error: --model_name_or_path {args.model_name_or_path}: {where}{exc}") from exc
        if args.block_size > model.config.n_positions:
            raise SystemExit(f"error: --block-size {args.block_size} exceeds the model's "
                             f"{model.config.n_positions} positions")
    else:
        tokenizer = train_tokenizer(train_lines, args.vocab_size)
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.block_size, n_embd=args.n_embd,
                            n_layer=args.n_layer, n_head=args.n_head, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, **dropout)
        model = GPT2LMHeadModel(config)
    return model.train(), tokenizer   # from_pretrained() returns eval mode: dropout would be off


def save_model(engine, tokenizer, output_dir):
    """The engine's checkpoint, and the trained model + tokenizer as a Hugging Face folder
    (reloadable with --model_name_or_path)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(output_dir / f"checkpoint.{engine.name}.pt")
    engine.model.save_pretrained(output_dir / "model")
    tokenizer.save_pretrained(output_dir / "model")


def _int_at_least(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def _float_in(low, high, high_open=False):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low <= value and (value < high if high_open else value <= high)):
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}{')' if high_open else ']'}, got {value}")
        return value
    return parse


def make_parser():
    """The example's flags (README, Options: tests/test_example_cli.py checks the table against them)."""
    p = argparse.ArgumentParser(prog="python -m examples.gpt2", description=description(__doc__))

    def option(name, **kwargs):
        add_option(p, name, **kwargs)

    add_engine_option(p, ENGINES, "ort", "who does the training step: ORTTrainer, the PyTorch loop, or "
                      "transformers.Trainer on ORTModule(model) / on the plain model")
    option("model-name-or-path", help="pretrained GPT-2: a Hugging Face hub name or a local folder "
           "(default: a small GPT-2 from scratch with a BPE tokenizer trained on --train-file)")
    option("mixed-precision", choices=["float16", "bfloat16"], nargs="?", const="float16",
           help="matrix products in fp16 (default) or bf16 on fp32 master weights: ORTTrainer's "
                "mixed_precision, torch.autocast (+ GradScaler for fp16) for --engine torch")
    option("train-file", type=Path, help=f"training text (default: {DEFAULT_DATA})")
    option("eval-file", type=Path, help="evaluation text (default: the last --validation-split-percentage "
           "of the training blocks)")
    option("validation-split-percentage", type=_float_in(0, 100, high_open=True), default=10.0)
    option("block-size", type=_int_at_least(2), default=128, help="tokens per training example")
    option("vocab-size", type=_int_at_least(257), default=4096, help="BPE vocabulary size (from scratch)")
    option("n-layer", type=_int_at_least(1), help="from scratch (default 4)")
    option("n-head", type=_int_at_least(1), help="from scratch (default 4)")
    option("n-embd", type=_int_at_least(1), help="from scratch (default 256)")
    option("dropout", type=_float_in(0, 1, high_open=True),
           help="resid/embd/attn dropout (default: the model's, 0.1 for GPT-2); 0 for exact engine parity")
    option("per-device-train-batch-size", type=_int_at_least(1), default=8)
    option("per-device-eval-batch-size", type=_int_at_least(1), default=16)
    option("gradient-accumulation-steps", type=_int_at_least(1), default=1,
           help="micro-batches per update; their gradients are summed, as ORTTrainer does "
           "(hf-trainer engines: averaged over the update's tokens, as Trainer does)")
    option("learning-rate", type=_float_in(0, math.inf), help="peak AdamW lr (default: 5e-5 with "
           "--model_name_or_path, as Hugging Face's Trainer; 1e-3 from scratch)")
    option("weight-decay", type=_float_in(0, math.inf), default=0.01, help="AdamW decay, not on biases and LayerNorm")
    option("warmup-steps", type=_int_at_least(0), default=0, help="updates of linear lr warmup, then linear decay to 0")
    option("max-grad-norm", type=_float_in(0, math.inf), default=1.0, help="global gradient-norm clip (0: off)")
    option("num-train-epochs", type=_int_at_least(1), default=1)
    option("max-steps", type=_int_at_least(1), help="stop after this many updates (overrides --num-train-epochs)")
    option("logging-steps", type=_int_at_least(1), default=50, help="a log line every N updates")
    option("eval-each-epoch", action="store_true", help="also evaluate after every epoch")
    option("fetch-logits", action="store_true", help="ORT: declare the logits as an output too, returned by "
           "every step (costs their memory and copy); evaluation then reports next-token accuracy (hf-trainer "
           "engines: through Trainer's compute_metrics)")
    option("gradient-checkpointing", action="store_true", help="hf-trainer engines: Trainer's "
           "gradient_checkpointing=True (each block's activations recomputed in the backward)")
    option("lora", action="store_true", help="hf-trainer engines: train PEFT LoRA adapters (rank 8, attention "
           "projections) instead of the model; model/ then holds the adapter")
    option("seed", type=int, default=42, help="model initialisation, dropout and data order")
    option("device", choices=["cpu", "cuda"], default="cpu")
    option("output-dir", type=Path, help="write checkpoint.<engine>.pt, model/ (save_pretrained) and metrics.json")
    option("quiet", action="store_true", help="no progress bar and no log lines")
    add_report_options(p, "--engine ort and torch", "update", "eval loss")
    return p


def parse_args(argv=None):
    p = make_parser()
    args = p.parse_args(argv)

    if args.compare and args.engine.startswith("hf-trainer"):
        p.error(f"--compare trains with --engine ort and torch; not with --engine {args.engine}")
    check_report_packages(args)
    if args.mixed_precision and args.engine.startswith("hf-trainer"):
        p.error("--mixed-precision applies to --engine ort and torch; transformers.Trainer has its own "
                "(its fp16/bf16 arguments)")
    for flag in ("gradient_checkpointing", "lora"):
        if getattr(args, flag) and not args.engine.startswith("hf-trainer"):
            p.error(f"--{flag.replace('_', '-')} applies to --engine hf-trainer and hf-trainer-torch")
    scratch_flags = [flag for flag in ("n_layer", "n_head", "n_embd") if getattr(args, flag) is not None]
    if args.model_name_or_path and scratch_flags:
        p.error(f"--{scratch_flags[0].replace('_', '-')} applies only to a model from scratch, "
                f"not with --model_name_or_path {args.model_name_or_path}")
    args.n_layer, args.n_head, args.n_embd = args.n_layer or 4, args.n_head or 4, args.n_embd or 256
    if not args.model_name_or_path and args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if args.learning_rate is None:
        args.learning_rate = 5e-5 if args.model_name_or_path else 1e-3
    if args.train_file is None:
        if not DEFAULT_DATA.is_file():
            p.error(f"no training text: pass --train-file FILE ({DEFAULT_DATA} does not exist)")
        args.train_file = DEFAULT_DATA
    for flag in ("train_file", "eval_file"):
        path = getattr(args, flag)
        if path is not None and not path.is_file():
            p.error(f"--{flag.replace('_', '-')} {path}: no such file")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: PyTorch sees no CUDA device")
    return args


def main(argv=None):
    """One run with --engine; with --compare, one with each loop engine (their metrics by engine name)."""
    args = parse_args(argv)
    if not args.compare:
        return run(args)
    results, runs = {}, {}
    for name in ("ort", "torch"):
        engine_args = copy.copy(args)
        engine_args.engine = name
        if args.output_dir:
            engine_args.output_dir = args.output_dir / name
        results[name] = run(engine_args)
        runs[name] = {"loss": results[name]["update_losses"],
                      "ms": [1000 * seconds for seconds in results[name]["update_seconds"]]}
    args.compare.parent.mkdir(parents=True, exist_ok=True)
    write_steps_csv(args.compare.with_suffix(".csv"), runs, "update")
    plot_losses(args.compare, runs, "examples.gpt2: training loss per update", "update")
    print(f"| loss curves: {args.compare}, {args.compare.with_suffix('.csv')} |")
    return results


def run(args):
    """Trains with ``args.engine``; returns the metrics (also written to --output-dir, logged with --mlflow)."""
    wall_start = time.perf_counter()
    train_lines = read_lines(args.train_file)
    eval_lines = read_lines(args.eval_file) if args.eval_file else None
    seed_everything(args.seed)   # before the model exists: both engines start from the same weights
    model, tokenizer = build_model_and_tokenizer(args, train_lines)
    device = torch.device(args.device)
    try:
        blocks = load_blocks(tokenizer, train_lines, eval_lines, args.block_size,
                             args.validation_split_percentage / 100)
    except DataError as exc:
        raise SystemExit(f"error: {exc}") from exc
    blocks = type(blocks)(*(part.to(device) for part in blocks))
    per_update = args.per_device_train_batch_size * args.gradient_accumulation_steps
    updates_per_epoch = len(blocks.train) // per_update
    if updates_per_epoch and hasattr(ENGINES[args.engine], "fit"):   # Trainer: the short last batch trains too
        updates_per_epoch = math.ceil(len(blocks.train) / args.per_device_train_batch_size) // \
            args.gradient_accumulation_steps
    if updates_per_epoch == 0:
        raise SystemExit(f"error: one update takes --per-device-train-batch-size {args.per_device_train_batch_size} x "
                         f"--gradient-accumulation-steps {args.gradient_accumulation_steps} = {per_update} blocks, "
                         f"but there are only {len(blocks.train)} training blocks")
    total_updates = args.max_steps or args.num_train_epochs * updates_per_epoch
    if args.warmup_steps >= total_updates:
        raise SystemExit(f"error: --warmup-steps {args.warmup_steps} must be below the run's {total_updates} updates")

    config = model.config
    parameters = sum(p.numel() for p in model.parameters())
    print(f"| {args.engine} on {device} | GPT-2 {config.n_layer} layers, {config.n_embd} dims, {config.n_head} heads, "
          f"{parameters / 1e6:.2f}M params | vocab {config.vocab_size} | block {args.block_size} | train "
          f"{len(blocks.train)} blocks -> {updates_per_epoch} updates/epoch, {total_updates} in all "
          f"| eval {len(blocks.eval)} blocks |")
    engine = ENGINES[args.engine](model.to(device), args, total_updates)
    train_start = time.perf_counter()
    if hasattr(engine, "fit"):   # transformers.Trainer: its own loop and evaluation
        history = engine.fit(blocks)
    else:
        history = train(engine, blocks, args, total_updates)
    train_time = time.perf_counter() - train_start
    if args.output_dir:   # before evaluating: the trained weights are safe whatever happens next
        save_model(engine, tokenizer, args.output_dir)
    result = (engine.evaluate(blocks.eval) if hasattr(engine, "fit")
              else evaluate(engine, blocks.eval, args.per_device_eval_batch_size))
    seconds = history["update_seconds"]
    print("=" * 89)
    accuracy = f" accuracy {result['accuracy']:.3f} |" if "accuracy" in result else ""
    print(f"| end of training | {len(seconds)} updates in {train_time:.1f}s | first {seconds[0]:.2f}s | "
          f"median {1000 * statistics.median(seconds[1:] or seconds):.1f} ms/update | eval loss {result['loss']:6.3f} "
          f"| eval ppl {result['ppl']:9.2f} |{accuracy}")
    print("=" * 89)

    metrics = {
        "engine": args.engine, "device": str(device), "model": args.model_name_or_path or "scratch",
        "config": {key: getattr(config, key) for key in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")},
        "parameters": parameters, "block_size": args.block_size, "train_blocks": len(blocks.train),
        "eval_blocks": len(blocks.eval), "updates": len(seconds),
        "first_update_s": seconds[0], "median_update_ms": 1000 * statistics.median(seconds[1:] or seconds),
        "train_time_s": train_time, "eval": result, **history, "wall_time_s": time.perf_counter() - wall_start,
    }
    if args.output_dir:
        write_json(args.output_dir / "metrics.json", metrics)
    if args.mlflow:
        steps = {"loss": history["update_losses"], "ms": [1000 * s for s in seconds]}
        log_mlflow("examples.gpt2", args.engine, vars(args), steps, "update",
                   {f"eval_{key}": value for key, value in result.items()})
    return metrics


if __name__ == "__main__":
    main()
