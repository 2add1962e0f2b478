"""CPU forward + backward of a GPT-2 whose weights are bf16 or fp16 (`model.bfloat16()`): eager
PyTorch against ORTModule, with the fp32 model beside them.

    python benchmarks/low_precision_model.py
    python benchmarks/low_precision_model.py --dtype float16 --json out.json

ORTModule runs such a model in fp32 with every op's result rounded to the model's type
(`_graph/cpu_low_precision.py`): ONNX Runtime's CPU provider has almost no fp16/bf16 kernels. On a
CPU without bf16 instructions torch's own bf16 kernels are slow, which this shows. One process,
the engines interleaved round by round; medians of the per-round ms.
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

from examples._report import write_json  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    import transformers

    from ort_trainer.ortmodule import ORTModule
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                                     vocab_size=args.vocab, n_positions=args.block, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    base, dtype = transformers.GPT2LMHeadModel(config), getattr(torch, args.dtype)
    ids = torch.randint(0, args.vocab, (args.batch, args.block))
    engines = {"eager fp32": copy.deepcopy(base), f"eager {args.dtype}": copy.deepcopy(base).to(dtype),
               f"ortmodule {args.dtype}": ORTModule(copy.deepcopy(base).to(dtype)),
               "ortmodule fp32": ORTModule(copy.deepcopy(base))}

    def step(model):
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        return (time.perf_counter() - started) * 1e3

    for model in engines.values():  # compile, warm up
        step(model)
    per_round = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, model in engines.items():
            per_round[name].append(step(model))
    median = {name: statistics.median(values) for name, values in per_round.items()}
    for name, value in median.items():
        print(f"{name:18s} {value:9.1f} ms (forward + backward)")
    write_json(args.json, {"args": {**vars(args), "json": str(args.json)}, "median_ms": median})


if __name__ == "__main__":
    main()
