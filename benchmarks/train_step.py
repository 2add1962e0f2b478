"""CPU train/eval step: the seed model (examples/wikitext2) in eager PyTorch vs ORTTrainer.

    python benchmarks/train_step.py                          # vocab 28,782, synthetic tokens
    python benchmarks/train_step.py --data /path/valid.txt   # real text (vocab of its 90% split)
    python benchmarks/train_step.py --measure-memory --json out.json
    python benchmarks/train_step.py --mixed-precision        # fp16: torch.autocast + GradScaler vs ORT's

One process, the same thread count for both engines (``torch.set_num_threads(N)``; ORTTrainer
gives ONNX Runtime the same number of intra-op threads). Warmup, then ``--rounds`` interleaved
rounds of ``--steps`` steps per engine (the order alternates each round); reports the median and
the minimum of the per-round wall ms/step (the minimum: the round least disturbed by other load
on a shared machine), the median process CPU ms/step, and the ratios torch / ort (> 1: ORT is
faster).

* train step, PyTorch: the notebook's loop: zero_grad, forward, CrossEntropyLoss, backward,
  clip_grad_norm_(0.5), torch.optim.Adam (default: foreach), loss.item().
* train step, ORT: ``trainer.train_step(src, targets)`` (AdamConfig(lr, max_norm_clip=0.5),
  grad_norm_clip on), returning loss and logits as examples/wikitext2 does, loss.item().
* eval step: model.eval() + no_grad forward + the same loss vs ``trainer.eval_step``.

Peak memory (``--measure-memory``): one subprocess per engine (``--memory-only``) creates the
model, takes its resident anonymous memory (``RssAnon``) as the baseline, then samples it in a
background thread (every 0.5 ms) through 2 train steps (ORT: export and session creation
included), ``--memory-steps`` - 2 more train steps, one eval step (which starts on what training
holds) and ``--memory-steps`` - 1 more eval steps, and reports the whole run's and each phase's
peak over the baseline: the largest of ``--memory-repeats`` runs, since a sampler can miss a
short peak. ``ru_maxrss`` growth is reported too, but on this VM mapped
library pages are reclaimed and faulted back at will, which makes it unreliable (often 0).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from examples._report import write_json  # noqa: E402
from examples.wikitext2.model import TransformerModel  # noqa: E402
from examples.wikitext2.train import make_loss_fn  # noqa: E402

ENGINES = ("torch", "ort")


def add_seed_step_arguments(p):
    """The arguments of a timed seed-model step shared by the benchmarks that run one."""
    p.add_argument("--vocab", type=int, default=28782, help="ntokens for synthetic data")
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--bptt", type=int, default=35)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=2, help="torch threads = ORT intra-op threads")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per engine (and phase)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="steps per engine per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed-precision", choices=["float16", "bfloat16"], nargs="?", const="float16",
                   help="torch (ORTModule too): autocast (+ GradScaler for fp16); ORTTrainer: mixed_precision")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_seed_step_arguments(p)
    p.add_argument("--data", type=Path, help="a text file: its 90%% split (the examples' tokenizer) gives "
                   "the vocabulary and the batches (--vocab is then ignored)")
    p.add_argument("--no-eval", action="store_true", help="skip the eval-step comparison")
    p.add_argument("--fetch", choices=("all", "loss"), default="all",
                   help="ORTTrainer outputs: loss and logits (as the notebook's loop), or the loss only "
                        "(train_step_info.fetches); torch computes its logits either way")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--measure-memory", action="store_true",
                   help="also measure peak RSS per engine, one subprocess each")
    p.add_argument("--memory-steps", type=int, default=10)
    p.add_argument("--memory-repeats", type=int, default=3,
                   help="child runs per engine; each measure is the largest seen")
    p.add_argument("--engine", choices=ENGINES, help="with --memory-only: the engine to measure")
    p.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_only and not args.engine:
        p.error("--memory-only needs --engine")
    return args


# ------------------------------------------------------------------------------------------- data
def make_batches(args, count=8):
    """(ntokens, [(src [bptt, batch] int64, targets [bptt*batch] int64)]), full-bptt batches only."""
    if args.data is not None:
        from examples.wikitext2.data import batchify, get_batch, load_corpus
        corpus = load_corpus(args.data)
        train = batchify(corpus.train, args.batch)
        starts = [i for i in range(0, train.size(0) - 1, args.bptt) if i + args.bptt < train.size(0)]
        if not starts:
            raise SystemExit(f"error: {args.data} gives no full batch of bptt {args.bptt} x batch {args.batch}")
        return len(corpus.vocab), [get_batch(train, i, args.bptt) for i in starts[:count]]
    generator = torch.Generator().manual_seed(args.seed + 1)
    batches = []
    for _ in range(count):
        data = torch.randint(0, args.vocab, (args.bptt + 1, args.batch), generator=generator)
        batches.append((data[:-1].contiguous(), data[1:].reshape(-1).contiguous()))
    return args.vocab, batches


# ---------------------------------------------------------------------------------------- engines
class TorchEngine:
    name = "torch"

    def __init__(self, ntokens, args):
        torch.manual_seed(args.seed)
        self.model = TransformerModel(ntokens, dropout=args.dropout)
        self.loss_fn = make_loss_fn(ntokens)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.clip = args.clip
        dtype = getattr(torch, args.mixed_precision or "float32")
        self.autocast = dict(device_type="cpu", dtype=dtype, enabled=args.mixed_precision is not None)
        self.scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)

    def train_step(self, data, targets):
        self.model.train()
        self.optimizer.zero_grad()
        with torch.autocast(**self.autocast):
            loss = self.loss(data, targets)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.item()

    def loss(self, data, targets):
        return self.loss_fn(self.model(data), targets)

    @torch.no_grad()
    def eval_step(self, data, targets):
        self.model.eval()
        with torch.autocast(**self.autocast):
            return self.loss(data, targets).item()


class ORTEngine:
    name = "ort"

    def __init__(self, ntokens, args):
        from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
        torch.manual_seed(args.seed)
        model = TransformerModel(ntokens, dropout=args.dropout)
        desc = {"inputs": [("src", ["bptt", "batch_size"]), ("label", ["bptt_x_batch_size"])],
                "outputs": [("loss", [], True), ("output", ["bptt", "batch_size", ntokens])]}
        self.trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=args.lr, max_norm_clip=args.clip),
                                  loss_fn=make_loss_fn(ntokens),
                                  options=ORTTrainerOptions({"utils": {"grad_norm_clip": True}, "mixed_precision": (
                                      {"enabled": True, "dtype": args.mixed_precision} if args.mixed_precision
                                      else {})}))
        if args.fetch == "loss":
            self.trainer.train_step_info.fetches = ["loss"]

    def train_step(self, data, targets):
        return _loss(self.trainer.train_step(data, targets)).item()

    def eval_step(self, data, targets):
        return _loss(self.trainer.eval_step(data, targets)).item()


def _loss(outputs):
    """The loss from train_step/eval_step's return: bare with fetches ['loss'], else first."""
    return outputs if isinstance(outputs, torch.Tensor) else outputs[0]


def make_engine(name, ntokens, args):
    return {"torch": TorchEngine, "ort": ORTEngine}[name](ntokens, args)


# ------------------------------------------------------------------------------------------ timing
def run_steps(step, batches, count, offset):
    """(wall ms/step, process CPU ms/step) over ``count`` steps."""
    cpu, start = time.process_time(), time.perf_counter()
    for k in range(count):
        step(*batches[(offset + k) % len(batches)])
    return ((time.perf_counter() - start) * 1000 / count, (time.process_time() - cpu) * 1000 / count)


def time_phase(engines, phase, batches, args):
    """{engine: [(wall, cpu) ms/step per round]}: warmup, then interleaved rounds (order alternating)."""
    for engine in engines:
        run_steps(getattr(engine, phase), batches, args.warmup, 0)
    per_round = {engine.name: [] for engine in engines}
    for r in range(args.rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for engine in order:
            per_round[engine.name].append(run_steps(getattr(engine, phase), batches, args.steps, r * args.steps))
    return per_round


def summarize(per_round):
    """Medians (and minima: the rounds least disturbed by other load) of wall ms/step, median CPU
    ms/step (all threads of the process), and the ratios torch / ort."""
    wall = {name: [w for w, _ in values] for name, values in per_round.items()}
    cpu = {name: [c for _, c in values] for name, values in per_round.items()}
    medians = {name: statistics.median(values) for name, values in wall.items()}
    minima = {name: min(values) for name, values in wall.items()}
    cpu_medians = {name: statistics.median(values) for name, values in cpu.items()}
    return {"median_ms": medians, "min_ms": minima, "cpu_median_ms": cpu_medians,
            "per_round_ms": wall, "per_round_cpu_ms": cpu,
            "ratio_torch_over_ort": medians["torch"] / medians["ort"],
            "ratio_min_torch_over_ort": minima["torch"] / minima["ort"],
            "ratio_cpu_torch_over_ort": cpu_medians["torch"] / cpu_medians["ort"]}


# ------------------------------------------------------------------------------------------ memory
def _rss_peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _rss_anon_mib():
    """Resident anonymous memory (heap, tensors, ORT arenas), without mapped library code."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class AnonPeakSampler(threading.Thread):
    """Samples RssAnon every ``interval`` s in the background and keeps the peak.

    ru_maxrss also counts the pages of mapped libraries (libtorch alone is hundreds of MiB), which
    this VM's kernel reclaims and faults back in at will (DAMON pageout), so its growth over a
    baseline is unreliable here; the anonymous peak is what the engines allocate. The largest
    tensors (~80 MiB of logits) take milliseconds to fill, far longer than the sampling interval.
    """

    def __init__(self, interval=0.0005):
        super().__init__(daemon=True)
        self.interval, self.peak, self._stop_event = interval, _rss_anon_mib(), threading.Event()

    def run(self):
        while not self._stop_event.is_set():
            self.peak = max(self.peak, _rss_anon_mib())
            time.sleep(self.interval)

    def take(self):
        """The peak since the last take (including now), then restart from the current value."""
        peak, self.peak = max(self.peak, _rss_anon_mib()), _rss_anon_mib()
        return peak

    def stop(self):
        self._stop_event.set()
        self.join()


def memory_only(args):
    """Runs in the child: prints one JSON line with the peak memory growth of one engine."""
    ntokens, batches = make_batches(args)
    engine = make_engine(args.engine, ntokens, args)
    gc.collect()
    baseline_rss, baseline_anon = _rss_peak_mib(), _rss_anon_mib()
    sampler = AnonPeakSampler()
    sampler.start()
    warm = min(2, args.memory_steps)
    for k in range(warm):
        engine.train_step(*batches[k % len(batches)])
    setup_peak = sampler.take()
    for k in range(warm, args.memory_steps):
        engine.train_step(*batches[k % len(batches)])
    train_peak = sampler.take()
    engine.eval_step(*batches[0])
    first_eval_peak = sampler.take()
    for k in range(1, args.memory_steps):
        engine.eval_step(*batches[k % len(batches)])
    eval_peak = sampler.take()
    sampler.stop()
    result = {
        "engine": args.engine, "steps": args.memory_steps, "baseline_anon_mib": baseline_anon,
        "anon_peak_delta_first_steps_mib": setup_peak - baseline_anon,   # export + sessions included
        "anon_peak_delta_train_mib": train_peak - baseline_anon,         # steady-state train steps
        "anon_peak_delta_first_eval_mib": first_eval_peak - baseline_anon,  # on what training holds
        "anon_peak_delta_eval_mib": eval_peak - baseline_anon,           # steady-state eval steps
        "anon_peak_delta_process_mib": max(setup_peak, train_peak, first_eval_peak, eval_peak) - baseline_anon,
        "anon_after_mib": _rss_anon_mib() - baseline_anon,               # held between steps
        "ru_maxrss_delta_mib": _rss_peak_mib() - baseline_rss,
    }
    print("MEMORY " + json.dumps(result))


def measure_memory(args, argv):
    """Per engine, the largest value of each measure over ``--memory-repeats`` child runs: the
    sampler can miss a peak that lasts a few ms (torch's train peak read 370 instead of ~415 MiB
    in about one run of five), never invent one."""
    results = {}
    for name in ENGINES:
        command = [sys.executable, str(Path(__file__).resolve()), *argv, "--engine", name, "--memory-only"]
        command = [c for c in command if c != "--measure-memory"]
        for _ in range(args.memory_repeats):
            done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
            lines = [line for line in done.stdout.splitlines() if line.startswith("MEMORY ")]
            if done.returncode or not lines:
                raise SystemExit(f"error: memory run for {name} failed:\n{done.stdout}\n{done.stderr}")
            run = json.loads(lines[-1][len("MEMORY "):])
            best = results.setdefault(name, run)
            for key, value in run.items():
                if key.endswith("_mib"):
                    best[key] = max(best[key], value)
        results[name]["repeats"] = args.memory_repeats
    return results


# -------------------------------------------------------------------------------------------- main
def environment(args):
    import numpy
    import onnx
    import onnxruntime
    model_name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model_name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": model_name, "cpus": os.cpu_count(), "threads": args.threads,
            "python": platform.python_version(), "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__, "numpy": numpy.__version__}


def print_table(result):
    config, train = result["config"], result["train"]
    print(f"\nvocab {config['ntokens']} | bptt {config['bptt']} x batch {config['batch']} | "
          f"threads {config['threads']} | {config['rounds']} rounds x {config['steps']} steps | "
          f"{result['environment']['cpu']}")
    print(f"{'':28s} {'torch ms':>10s} {'ort ms':>10s} {'torch/ort':>10s}")
    rows = [("train", train)] + ([("eval", result["eval"])] if "eval" in result else [])
    for label, phase in rows:
        for key, ratio, what in [("median_ms", "ratio_torch_over_ort", "median wall"),
                                 ("min_ms", "ratio_min_torch_over_ort", "min wall"),
                                 ("cpu_median_ms", "ratio_cpu_torch_over_ort", "median CPU")]:
            m = phase[key]
            print(f"{label + ' step, ' + what:28s} {m['torch']:10.1f} {m['ort']:10.1f} {phase[ratio]:10.2f}x")
    if "memory" in result:
        mem = result["memory"]
        print(f"{'':28s} {'torch MiB':>10s} {'ort MiB':>10s}")
        for key, label in [("anon_peak_delta_process_mib", "peak anon, whole run"),
                           ("anon_peak_delta_first_steps_mib", "peak anon, first 2 steps"),
                           ("anon_peak_delta_train_mib", "peak anon, train steps"),
                           ("anon_peak_delta_first_eval_mib", "peak anon, first eval step"),
                           ("anon_peak_delta_eval_mib", "peak anon, later eval steps"),
                           ("anon_after_mib", "anon held after"),
                           ("ru_maxrss_delta_mib", "ru_maxrss delta")]:
            values = [mem[name].get(key) for name in ENGINES]
            if None not in values:
                print(f"{label:28s} {values[0]:10.1f} {values[1]:10.1f}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_only:
        memory_only(args)
        return None
    ntokens, batches = make_batches(args)
    engines = [make_engine(name, ntokens, args) for name in ENGINES]
    first = {engine.name: engine.train_step(*batches[0]) for engine in engines}
    result = {"environment": environment(args),
              "config": {"ntokens": ntokens, "bptt": args.bptt, "batch": args.batch, "threads": args.threads,
                         "mixed_precision": args.mixed_precision,
                         "dropout": args.dropout, "rounds": args.rounds, "steps": args.steps,
                         "warmup": args.warmup, "fetch": args.fetch,
                         "data": str(args.data) if args.data else "synthetic"},
              "first_step_loss": first}
    result["train"] = summarize(time_phase(engines, "train_step", batches, args))
    if not args.no_eval:
        result["eval"] = summarize(time_phase(engines, "eval_step", batches, args))
    if args.measure_memory:
        result["memory"] = measure_memory(args, argv)
    print_table(result)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
