"""The exported-model cache on disk: a new process's first forward + backward, cold (an empty cache
directory: probe, export, builder, sessions) then warm (the graph read from the directory), for
ORTModule (ORTMODULE_CACHE_DIR) and ORTTrainer (`utils.graph_cache_dir`).

    python benchmarks/export_cache.py          # GPT-2, vocab 32,000, 2 layers, width 256, 8 x 128 tokens
    python benchmarks/export_cache.py --json out.json

Each measurement is its own process (`--child`): the model built and seeded, then the clock runs from
`ORTModule(model)` (ORTTrainer(...)) to the end of the first backward (the first `train_step`, AdamW);
one more step is timed for comparison. Per repeat and engine: a new empty directory, the cold process,
then the warm one (which must not export: it reports how many traces it made). Reports the medians of
`--repeats` repeats and warm / cold; the losses of the cold and warm first steps must be equal.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("ortmodule", "ortrainer")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--child", nargs=2, metavar=("ENGINE", "CACHE_DIR"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args):
    """One process: the first step (and one more) timed; prints JSON."""
    sys.path.insert(0, str(REPO_ROOT))
    import torch
    import transformers

    from ort_trainer import ORTModule, ORTTrainer, optim
    from ort_trainer._compile import exports, module_compiler

    traces = []
    for module in (exports, module_compiler):
        original = module.export_training_model
        module.export_training_model = lambda *a, _original=original, **k: traces.append(1) or _original(*a, **k)
    engine, directory = args.child
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=args.vocab, n_layer=args.layers, n_embd=args.width, n_head=args.heads, n_positions=args.seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM"))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    times, losses = [], []
    start = time.perf_counter()
    if engine == "ortmodule":
        os.environ["ORTMODULE_CACHE_DIR"] = directory
        wrapped = ORTModule(model)
        adam = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)

        def step():
            loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
            adam.step()
            adam.zero_grad()
            return loss.item()
    else:
        desc = {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
                "outputs": [("loss", [], True), ("logits", ["batch", "seq", args.vocab])]}
        trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=1e-4), options={"utils": {"graph_cache_dir": directory}})
        trainer.train_step_info.fetches = ["loss"]

        def step():
            return trainer.train_step(input_ids=ids, labels=ids).item()
    for _ in range(2):
        losses.append(step())
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
    print(json.dumps({"first_s": times[0], "next_s": times[1], "loss": losses[0], "traces": len(traces)}))


def _measure(args, engine, directory):
    command = [sys.executable, __file__, "--child", engine, directory, "--vocab", str(args.vocab),
               "--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads),
               "--batch", str(args.batch), "--seq", str(args.seq), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "random"})
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    runs = {engine: {"cold": [], "warm": []} for engine in args.engines}
    for _ in range(args.repeats):
        for engine in args.engines:
            with tempfile.TemporaryDirectory() as directory:
                cold, warm = (_measure(args, engine, directory) for _ in range(2))
            if warm["traces"] or warm["loss"] != cold["loss"]:
                raise RuntimeError(f"{engine}: the warm process traced {warm['traces']} times, loss {warm['loss']} "
                                   f"against the cold one's {cold['loss']}")
            runs[engine]["cold"].append(cold)
            runs[engine]["warm"].append(warm)
    result = {"config": {key: value for key, value in vars(args).items() if key not in ("json", "child")},
              "engines": {}}
    print(f"GPT-2 vocab {args.vocab}, {args.layers} layers, width {args.width}, {args.batch} x {args.seq} tokens, "
          f"{args.threads} threads; first forward + backward of a new process, median of {args.repeats}:")
    for engine, kinds in runs.items():
        medians = {kind: {measure: statistics.median(run[measure] for run in values)
                          for measure in ("first_s", "next_s")} for kind, values in kinds.items()}
        ratio = medians["warm"]["first_s"] / medians["cold"]["first_s"]
        result["engines"][engine] = {"median": medians, "warm_over_cold_first": ratio, "runs": kinds}
        print(f"  {engine:9s} cold {medians['cold']['first_s']:6.2f} s, warm {medians['warm']['first_s']:6.2f} s "
              f"(warm / cold {ratio:.2f}); the next step {medians['cold']['next_s']:.2f} / "
              f"{medians['warm']['next_s']:.2f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
