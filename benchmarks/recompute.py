"""Recomputation (graph_transformer recompute options): peak memory and step time, with and without.

Run from the repository root:

    python benchmarks/recompute.py --model seed                 # examples/wikitext2's model as the seed runs it
    python benchmarks/recompute.py --model deep                 # 6 layers of width 512, batch 64, 1,000 tokens
    python benchmarks/recompute.py --model gelu                 # 6 GELU feed-forward blocks (256 -> 2048 -> 256)

Configurations: none, priority_order (no recomputation, in the PRIORITY_BASED order the recompute
options bring along: what the order alone does), attn_dropout, gelu, layers, all.

Memory: one subprocess per configuration creates its trainer, takes its resident anonymous memory
(RssAnon) as the baseline and samples it (benchmarks/train_step.AnonPeakSampler) through
--memory-steps train steps; reported: the steady peak (steps after the first) over the baseline,
the largest of --memory-repeats runs. Time: every configuration's trainer in one process, warmup,
then --rounds interleaved rounds of --steps train steps each (the order rotates every round);
reported: the median and the minimum of the per-round ms/step, and the median ratio to no
recomputation (> 1: slower). The same thread count for every trainer (--threads).
"""
import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path.cwd()
sys.path.insert(0, str(REPO_ROOT))

import onnxruntime  # noqa: E402
import torch  # noqa: E402

from benchmarks.train_step import AnonPeakSampler, _rss_anon_mib  # noqa: E402
from examples._report import write_json  # noqa: E402
from ort_trainer import ORTTrainer, ORTTrainerOptions, optim  # noqa: E402

CONFIGS = {  # graph_transformer options; "priority_order": none, in the order recomputation brings along
    "none": {},
    "priority_order": {},
    "attn_dropout": {"attn_dropout_recompute": True},
    "gelu": {"gelu_recompute": True},
    "layers": {"transformer_layer_recompute": True},
    "all": {"attn_dropout_recompute": True, "gelu_recompute": True, "transformer_layer_recompute": True},
}


class _GeluBlock(torch.nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _GeluNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[_GeluBlock(256, 2048) for _ in range(6)])
        self.head = torch.nn.Linear(256, 10)

    def forward(self, x):
        return self.head(self.blocks(x))


def make(model_name, seed=0):
    """(model, model_desc, loss_fn, batches)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    if model_name == "gelu":
        desc = {"inputs": [("x", ["batch", 256]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
        batches = [(torch.randn(4096, 256, generator=generator), torch.randint(0, 10, (4096,), generator=generator))
                   for _ in range(4)]
        return _GeluNet(), desc, torch.nn.functional.cross_entropy, batches
    from examples.wikitext2.model import TransformerModel
    from examples.wikitext2.train import make_loss_fn
    vocab, width, layers, batch = (28782, 200, 2, 20) if model_name == "seed" else (1000, 512, 6, 64)
    desc = {"inputs": [("src", ["bptt", "batch_size"]), ("label", ["bptt_x_batch_size"])],
            "outputs": [("loss", [], True), ("output", ["bptt", "batch_size", vocab])]}
    batches = []
    for _ in range(4):
        data = torch.randint(0, vocab, (36, batch), generator=generator)
        batches.append((data[:-1], data[1:].reshape(-1)))
    return TransformerModel(vocab, width, 2, width, layers, dropout=0.2), desc, make_loss_fn(vocab), batches


def trainer_for(model_name, config):
    model, desc, loss_fn, batches = make(model_name)
    options = {"graph_transformer": CONFIGS[config]}
    if config == "priority_order":
        options["session_options"] = onnxruntime.SessionOptions()
        options["session_options"].execution_order = onnxruntime.ExecutionOrder.PRIORITY_BASED
    options = ORTTrainerOptions(options)
    return ORTTrainer(model, desc, optim.AdamConfig(lr=1e-3, max_norm_clip=0.5), loss_fn=loss_fn,
                      options=options), batches


def _loss(outputs):
    return float(outputs[0] if isinstance(outputs, list) else outputs)


def memory_child(args):
    trainer, batches = trainer_for(args.model, args.config)
    gc.collect()
    baseline = _rss_anon_mib()
    sampler = AnonPeakSampler()
    sampler.start()
    losses = [_loss(trainer.train_step(*batches[0]))]
    first = sampler.take() - baseline
    for step in range(1, args.memory_steps):
        losses.append(_loss(trainer.train_step(*batches[step % len(batches)])))
    steady = sampler.take() - baseline
    sampler.stop()
    print(json.dumps({"first_step_peak_mib": first, "steady_peak_mib": steady, "losses": losses}))


def measure_memory(args, configs):
    result = {}
    for config in configs:
        runs = []
        for _ in range(args.memory_repeats):
            done = subprocess.run([sys.executable, __file__, "--memory-child", "--model", args.model, "--config", config,
                                   "--threads", str(args.threads), "--memory-steps", str(args.memory_steps)],
                                  capture_output=True, text=True, check=True, cwd=REPO_ROOT)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        result[config] = {"steady_peak_mib": max(run["steady_peak_mib"] for run in runs),
                          "first_step_peak_mib": max(run["first_step_peak_mib"] for run in runs),
                          "same_losses_every_run": all(run["losses"] == runs[0]["losses"] for run in runs),
                          "losses": runs[0]["losses"]}
    return result


def measure_time(args, configs):
    trainers = {config: trainer_for(args.model, config) for config in configs}
    for trainer, batches in trainers.values():
        for step in range(args.warmup):
            trainer.train_step(*batches[step % len(batches)])
    per_round = {config: [] for config in configs}
    for round_index in range(args.rounds):
        order = configs[round_index % len(configs):] + configs[:round_index % len(configs)]
        for config in order:
            trainer, batches = trainers[config]
            started = time.perf_counter()
            for step in range(args.steps):
                trainer.train_step(*batches[step % len(batches)])
            per_round[config].append(1000 * (time.perf_counter() - started) / args.steps)
    base = per_round["none"]
    return {config: {"median_ms": statistics.median(times), "min_ms": min(times),
                     "median_ratio_to_none": statistics.median(t / b for t, b in zip(times, base))}
            for config, times in per_round.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("seed", "deep", "gelu"), default="seed")
    parser.add_argument("--configs", default=None, help="comma-separated subset of " + ",".join(CONFIGS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--memory-steps", type=int, default=6)
    parser.add_argument("--memory-repeats", type=int, default=2)
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args)
        return
    configs = args.configs.split(",") if args.configs else list(CONFIGS)
    result = {"model": args.model, "threads": args.threads, "torch": torch.__version__,
              "memory": measure_memory(args, configs), "time": measure_time(args, configs)}
    print(json.dumps(result, indent=1))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
