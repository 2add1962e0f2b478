"""What bf16 on the CPU costs beyond its matrix products: per ORTTrainer step of the seed model
(`mixed_precision.dtype='bfloat16'`), the time inside the bf16 torch nodes (products, their
gradients, the factors' bf16 copies) against the bare bf16 products they compute, replayed on
bf16 tensors made beforehand (no conversion, no fp32 result). The difference is the overhead:
conversions at node boundaries and per-node work.

Any CPU runs it: where the CPU has no bf16 instructions the bf16 decision is forced (the products
are slow there, the conversions are not), and the JSON says so.

    python benchmarks/bf16_overhead.py --rounds 5
"""
import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.wikitext2.model import TransformerModel  # noqa: E402
from examples._report import write_json  # noqa: E402
from examples.wikitext2.train import make_loss_fn  # noqa: E402
from ort_trainer import ORTTrainer, ORTTrainerOptions, optim  # noqa: E402
from ort_trainer._graph import autocast  # noqa: E402
from ort_trainer._onnx import in_operand_order  # noqa: E402
from ort_trainer._runtime import torch_ops  # noqa: E402

_BF16_NODES = ("ort_trainer::bf16_product", "ort_trainer::bf16_product_grad", "ort_trainer::to_bf16")


class NodeTimes:
    """Wraps the bf16 nodes' kernels: their time per step, and the products they computed."""

    def __init__(self):
        self.seconds, self.products, self.recording = collections.Counter(), [], False
        for operator in _BF16_NODES:
            kernel = torch_ops.IMPLEMENTATIONS.get(operator)
            if kernel is not None:
                torch_ops.IMPLEMENTATIONS[operator] = self._timed(operator, kernel)

    def _timed(self, operator, kernel):
        def timed(inputs, params):
            start = time.perf_counter()
            result = kernel(inputs, params)
            self.seconds[operator] += time.perf_counter() - start
            if self.recording:
                self.products.append(_bare_product(operator, inputs, params))
            return result
        return timed


def _bare_product(operator, inputs, params):
    """What a product or gradient node multiplies, on bf16 copies made here: (kind, tensors,
    params, the factors whose gradients it computes); None for a conversion node."""
    if params.get("kind") == "convolution" or operator == "ort_trainer::to_bf16":
        return None
    count = len(params["operands"])
    if operator == "ort_trainer::bf16_product":
        factors = in_operand_order(inputs[:count], params)[:2]
        return "forward", [t.detach().to(torch.bfloat16, copy=True) for t in factors], params, ()
    if "wanted" in params:  # one node for every operand: the factors' bf16 copies follow the output gradient
        factors, wanted = inputs[1:3], [params["operands"][k] for k in params["wanted"]]
    else:  # one node per operand, reading the fp32 operands
        factors, wanted = in_operand_order(inputs[1:], params)[:2], [params["operands"][params["input"]]]
    tensors = [t.detach().to(torch.bfloat16, copy=True) for t in (inputs[0], *factors)]  # ONNX Runtime reuses its memory
    return "gradient", tensors, params, [k for k in wanted if k < 2]


def _replay(products):
    """Seconds to compute the recorded products on bf16 tensors, results left in bf16."""
    start = time.perf_counter()
    for kind, tensors, params, wanted in filter(None, products):
        if kind == "forward":
            a, b = tensors
            torch.matmul(a.mT if params["trans_a"] else a, b.mT if params["trans_b"] else b)
            continue
        grad, a, b = tensors
        a, b = a.mT if params["trans_a"] else a, b.mT if params["trans_b"] else b
        if 0 in wanted:
            torch.matmul(grad, b.mT)
        if 1 in wanted:  # a weight times a batch of rows: one product over all rows
            if b.dim() == 2 and a.dim() > 2:
                a.reshape(-1, a.shape[-1]).mT.mm(grad.reshape(-1, grad.shape[-1]))
            else:
                torch.matmul(a.mT, grad)
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="steps per round")
    p.add_argument("--vocab", type=int, default=28782)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    forced = not autocast.cpu_has_bf16_instructions()
    if forced:
        autocast.cpu_has_bf16_instructions = lambda: True
    times = NodeTimes()
    torch.manual_seed(0)
    model = TransformerModel(args.vocab, dropout=0.0)
    desc = {"inputs": [("src", ["bptt", "batch_size"]), ("label", ["bptt_x_batch_size"])],
            "outputs": [("loss", [], True), ("output", ["bptt", "batch_size", args.vocab])]}
    trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=1e-3), loss_fn=make_loss_fn(args.vocab),
                         options=ORTTrainerOptions({"mixed_precision": {"enabled": True, "dtype": "bfloat16"}}))
    trainer.train_step_info.fetches = ["loss"]
    data = torch.randint(0, args.vocab, (36, 20), generator=torch.Generator().manual_seed(1))
    batch = (data[:-1], data[1:].reshape(-1))
    for _ in range(3):
        trainer.train_step(*batch)
    times.recording = True
    trainer.train_step(*batch)
    times.recording = False
    products = times.products
    rows = []
    for _ in range(args.rounds):
        times.seconds.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step(*batch)
        step = (time.perf_counter() - start) / args.steps
        nodes = sum(times.seconds.values()) / args.steps
        bare = _replay(products)
        rows.append({"step_ms": 1000 * step, "bf16_nodes_ms": 1000 * nodes, "bare_products_ms": 1000 * bare,
                     "overhead_ms": 1000 * (nodes - bare),
                     **{f"{operator.split('::')[1]}_ms": 1000 * seconds / args.steps
                        for operator, seconds in times.seconds.items()}})
    result = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    result.update(cpu=torch.backends.cpu.get_cpu_capability(), bf16_decision_forced=forced, rounds=args.rounds)
    print(json.dumps(result, indent=1))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
