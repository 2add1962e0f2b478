"""CPU train step of a bidirectional LSTM tagger: eager PyTorch vs ORTModule (and ORTTrainer).

    python benchmarks/recurrent_step.py
    python benchmarks/recurrent_step.py --json out.json

A bidirectional (or proj_size) nn.LSTM/GRU and nn.RNN train as one torch node in ONNX Runtime's
graph (`_export.torch_node_symbolics._recurrent`): forward, then one autograd pass of the forward
recomputed for every input's gradient. This measures what that costs against eager: embedding ->
2-layer bidirectional LSTM -> linear -> cross-entropy, torch.optim.Adam. One process, the engines
interleaved round by round; the median of the per-round ms/step, and each engine's ms over eager's.
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
import torch.nn.functional as F  # noqa: E402

from examples._report import write_json  # noqa: E402


class Tagger(torch.nn.Module):
    def __init__(self, vocab, width, hidden, layers, tags):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, width)
        self.lstm = torch.nn.LSTM(width, hidden, num_layers=layers, bidirectional=True, batch_first=True)
        self.tags = torch.nn.Linear(2 * hidden, tags)

    def forward(self, ids, targets):
        scores = self.tags(self.lstm(self.embedding(ids))[0])
        return F.cross_entropy(scores.flatten(0, 1), targets.flatten())


def _engines(args):
    from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
    from ort_trainer.ortmodule import ORTModule
    torch.manual_seed(0)
    model = Tagger(args.vocab, args.width, args.hidden, args.layers, args.tags)

    def torch_loop(module):
        adam = torch.optim.Adam(module.parameters(), lr=1e-3)

        def step(ids, targets):
            adam.zero_grad()
            loss = module(ids, targets)
            loss.backward()
            adam.step()
            return loss.item()
        return step

    def trainer_step():
        desc = {"inputs": [("ids", ["batch", "seq"]), ("targets", ["batch", "seq"])],
                "outputs": [("loss", [], True)]}
        trainer = ORTTrainer(copy.deepcopy(model), desc, optim.AdamConfig(lr=1e-3),
                             options=ORTTrainerOptions({"utils": {"grad_norm_clip": False}}))
        return lambda ids, targets: trainer.train_step(ids, targets).item()

    return {"eager": lambda: torch_loop(copy.deepcopy(model)),
            "ortmodule": lambda: torch_loop(ORTModule(copy.deepcopy(model))), "ortrainer": trainer_step}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tags", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="steps per engine per round")
    p.add_argument("--engines", nargs="+", default=["eager", "ortmodule", "ortrainer"],
                   choices=["eager", "ortmodule", "ortrainer"])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engines = {name: make() for name, make in _engines(args).items() if name in args.engines}
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    targets = torch.randint(0, args.tags, (args.batch, args.seq), generator=generator)
    for step in engines.values():
        for _ in range(args.warmup):
            step(ids, targets)
    per_round = {name: [] for name in engines}
    names = list(engines)
    for round_index in range(args.rounds):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            started = time.perf_counter()
            for _ in range(args.steps):
                engines[name](ids, targets)
            per_round[name].append((time.perf_counter() - started) * 1e3 / args.steps)
    median = {name: statistics.median(values) for name, values in per_round.items()}
    for name, value in median.items():
        print(f"{name:10s} {value:8.1f} ms/step" + (f"  {value / median['eager']:5.2f}x eager's time"
                                                    if "eager" in median else ""))
    write_json(args.json, {"args": vars(args) | {"json": str(args.json)}, "median_ms": median,
                           "per_round_ms": per_round})


if __name__ == "__main__":
    main()
