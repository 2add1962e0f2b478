"""The CUDA path in one command (on a GPU machine with the `gpu` extra or the cuda11 bundle).

Trains the seed Wikitext-2 transformer for --steps steps on CUDA with ORTTrainer, compares every
loss with a CPU run of the same graph (dropout off), and prints ms/step for ORTTrainer and for the
PyTorch loop (Adam + clip 0.5) on the GPU: eager with foreach and with fused Adam, and torch.compile
where this torch can compile (the GPU bundle's cannot: no Triton; the reason is recorded). TF32 stays
off (torch's default, which ORTTrainer follows), so the two devices differ only by rounding:

    python benchmarks/gpu_smoke.py --steps 50
"""
import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.wikitext2.model import TransformerModel  # noqa: E402
from examples._report import write_json  # noqa: E402
from examples.wikitext2.train import make_loss_fn  # noqa: E402
from ort_trainer import ORTTrainer, ORTTrainerOptions, optim  # noqa: E402


def batches(ntokens, steps, bptt, batch):
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, ntokens, (steps, bptt + 1, batch), generator=generator)
    return [(d[:-1], d[1:].reshape(-1)) for d in data]


def ort_run(model, ntokens, data, device):
    desc = {"inputs": [("src", ["bptt", "batch_size"]), ("label", ["bptt_x_batch_size"])],
            "outputs": [("loss", [], True), ("output", ["bptt", "batch_size", ntokens])]}
    trainer = ORTTrainer(copy.deepcopy(model).to(device), desc, optim.AdamConfig(lr=1e-3, max_norm_clip=0.5),
                         loss_fn=make_loss_fn(ntokens), options=ORTTrainerOptions({"device": {"id": device}}))
    losses, times = [], []
    for src, label in data:
        src, label = src.to(device), label.to(device)
        start = time.perf_counter()
        loss = trainer.train_step(src, label)[0]
        synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, times


def pytorch_run(model, ntokens, data, device, *, adam, compiled=False):
    """Step times of the PyTorch loop; `adam`: 'foreach' or 'fused'; `compiled`: torch.compile the
    forward and backward."""
    model = copy.deepcopy(model).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, **{adam: True})
    loss_fn = make_loss_fn(ntokens)

    def forward_backward(src, label):
        loss = loss_fn(model(src), label)
        loss.backward()
        return loss
    forward_backward = torch.compile(forward_backward) if compiled else forward_backward
    times = []
    for src, label in data:
        src, label = src.to(device), label.to(device)
        start = time.perf_counter()
        optimizer.zero_grad()
        forward_backward(src, label)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def synchronize(device):
    if device != "cpu":
        torch.cuda.synchronize()


def compiled_ms(model, args, data, warmup):
    """ms/step of the torch.compile'd loop, or why it cannot run here."""
    try:
        return median_ms(pytorch_run(model, args.ntokens, data, args.device, adam="fused", compiled=True), warmup)
    except Exception as error:  # no Triton (the GPU bundle), no C++ compiler
        return f"unavailable: {type(error).__name__}: {str(error)[:200]}"


def median_ms(times, warmup):
    ordered = sorted(times[warmup:])
    return 1000 * ordered[len(ordered) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--ntokens", type=int, default=28782)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TransformerModel(args.ntokens, dropout=0.0)
    data = batches(args.ntokens, args.steps, args.bptt, args.batch)
    cuda_losses, cuda_times = ort_run(model, args.ntokens, data, args.device)
    cpu_losses, _ = ort_run(model, args.ntokens, data, "cpu")
    worst = max(abs(a - b) / abs(b) for a, b in zip(cuda_losses, cpu_losses))
    warmup = min(5, args.steps // 2)
    result = {"steps": args.steps, "worst_relative_loss_difference": worst,
              "ort_ms_per_step": median_ms(cuda_times, warmup),
              "device": torch.cuda.get_device_name() if args.device != "cpu" else args.device}
    for adam in ("foreach", "fused"):
        result[f"pytorch_eager_{adam}_ms_per_step"] = median_ms(
            pytorch_run(model, args.ntokens, data, args.device, adam=adam), warmup)
    result["pytorch_compile_fused_ms_per_step"] = "not run: --no-compile" if args.no_compile else compiled_ms(
        model, args, data, warmup)
    print(json.dumps(result, indent=2))
    write_json(args.json, result)
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
