"""One optimizer step over GPT-2-small's 124 M fp32 parameters (148 tensors) on the GPU.

    python benchmarks/optimizer_step.py                    # 124 M params, 50 timed repeats
    python benchmarks/optimizer_step.py --json out.json    # also write the results as JSON
    python benchmarks/optimizer_step.py --layers 2 --vocab 1000 --repeats 5   # a quick run

Times, with CUDA events (median of ``--repeats`` after ``--warmup``), one step of:

* ours: the CuPy kernels of ``ort_trainer._optimizers.cuda_steps`` over the flat buffers (two param groups:
  matrices with weight decay, biases and LayerNorm without): Adam; Adam with global-norm
  clipping (sum of squares, divisor, Adam: 3 launches, no host sync); Lamb (3 launches); SGD
  with momentum;
* torch, in the same run when torch has CUDA: ``torch.optim.Adam(fused=True)`` and
  ``(foreach=True)`` over the 148 separate tensors;
* the bandwidth floor: the bytes each step must move (Adam 28 bytes/param: read g, w, m, v,
  write w, m, v) at the measured device-to-device copy rate (``cupy`` copy of a 1 GiB buffer:
  read + write bytes / time).

Prints a table; skips with a message (exit 0) where CuPy or a CUDA device is missing.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from examples._report import write_json  # noqa: E402

# Bytes each step moves per parameter (fp32): reads + writes of the flat buffers.
BYTES_PER_PARAM = {
    "sgd": 20,         # read g, w, buf; write w, buf
    "adam": 28,        # read g, w, m, v; write w, m, v
    "adam+clip": 32,   # + read g for the norm
    "lamb": 40,        # read g, w, m, v; write m, v, d; then read w, d; write w
}
LAUNCHES = {"sgd": 1, "adam": 1, "adam+clip": 3, "lamb": 3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12, help="transformer blocks (GPT-2 small: 12)")
    p.add_argument("--width", type=int, default=768, help="model width (GPT-2 small: 768)")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary (GPT-2: 50257)")
    p.add_argument("--context", type=int, default=1024, help="positions (GPT-2: 1024)")
    p.add_argument("--repeats", type=int, default=50, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.optim baselines")
    return p.parse_args(argv)


def gpt2_tensor_sizes(layers, width, vocab, context):
    """[(name, numel, decays)] in GPT-2's order: 2 + 12 per block + 2 tensors."""
    d = width
    sizes = [("wte", vocab * d, True), ("wpe", context * d, True)]
    for i in range(layers):
        sizes += [(f"h{i}.ln_1.weight", d, False), (f"h{i}.ln_1.bias", d, False),
                  (f"h{i}.attn.c_attn.weight", d * 3 * d, True), (f"h{i}.attn.c_attn.bias", 3 * d, False),
                  (f"h{i}.attn.c_proj.weight", d * d, True), (f"h{i}.attn.c_proj.bias", d, False),
                  (f"h{i}.ln_2.weight", d, False), (f"h{i}.ln_2.bias", d, False),
                  (f"h{i}.mlp.c_fc.weight", d * 4 * d, True), (f"h{i}.mlp.c_fc.bias", 4 * d, False),
                  (f"h{i}.mlp.c_proj.weight", 4 * d * d, True), (f"h{i}.mlp.c_proj.bias", d, False)]
    sizes += [("ln_f.weight", d, False), ("ln_f.bias", d, False)]
    return sizes


def hyper_for(family, decays):
    if family == "sgd":
        return dict(momentum=0.9, nesterov=False, lambda_coef=0.01 if decays else 0.0, dampening=0.0)
    if family == "adam":
        return dict(alpha=0.9, beta=0.999, lambda_coef=0.01 if decays else 0.0, epsilon=1e-8,
                    do_bias_correction=True, weight_decay_mode=0)
    return dict(alpha=0.9, beta=0.999, lambda_coef=0.01 if decays else 0.0, epsilon=1e-6,
                ratio_min=-float("inf"), ratio_max=float("inf"), do_bias_correction=False)


def time_it(cupy, fn, repeats, warmup):
    """Per-call milliseconds (CUDA events on the current stream), one sample per call."""
    for _ in range(warmup):
        fn()
    cupy.cuda.Device().synchronize()
    samples = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop))
    return samples


def time_torch(torch, fn, repeats, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop))
    return samples


def copy_rate(cupy, repeats, warmup):
    """Device-to-device copy rate in bytes/s (read + write) on a 1 GiB buffer."""
    n = (1 << 30) // 4
    src = cupy.ones(n, dtype=np.float32)
    dst = cupy.empty_like(src)
    samples = time_it(cupy, lambda: dst.__setitem__(Ellipsis, src), repeats, warmup)
    return 2 * src.nbytes / (statistics.median(samples) * 1e-3), samples


def summarize(samples):
    return {"median_ms": statistics.median(samples), "min_ms": min(samples),
            "max_ms": max(samples), "repeats": len(samples)}


def run_ours(cupy, sizes, args):
    from ort_trainer._optimizers import cuda_steps as _kernels
    from ort_trainer._optimizers.flat import FlatLayout
    from ort_trainer._optimizers.hyper import HYPER_TYPES

    groups = [[n for _, n, decays in sizes if decays], [n for _, n, decays in sizes if not decays]]
    n = sum(map(sum, groups))
    rng = cupy.random.default_rng(0)

    def randn(count, scale=1.0):
        return cupy.asarray(rng.standard_normal(count, dtype=np.float32) * np.float32(scale))

    params = randn(n, 0.02)
    grads = randn(n, 1e-3)
    state_a, state_b = randn(n, 1e-3), cupy.abs(randn(n, 1e-6))
    clip_out = cupy.empty(3, dtype=np.float64)
    results = {}
    for family in ("adam", "lamb", "sgd"):
        layout = FlatLayout.from_sizes(groups, [HYPER_TYPES[family](**hyper_for(family, decays))
                                                for decays in (True, False)])
        table = _kernels.layout_table(layout, family)
        counter = {"t": 0}

        def step(family=family, table=table, clip=False):
            counter["t"] += 1
            divisor = 1.0
            if clip:
                divisor, _ = _kernels.clip_divisor(grads, 1.0, out=clip_out)
            if family == "adam":
                _kernels.adam_step(table, params, grads, state_a, state_b, step=counter["t"],
                                   lr=1e-4, grad_divisor=divisor)
            elif family == "lamb":
                _kernels.lamb_step(table, params, grads, state_a, state_b, step=counter["t"],
                                   lr=1e-4, grad_divisor=divisor)
            else:
                _kernels.sgd_step(table, params, grads, state_a, lr=1e-4, grad_divisor=divisor,
                                  first_step=counter["t"] == 1)

        results[family] = time_it(cupy, step, args.repeats, args.warmup)
        if family == "adam":
            results["adam+clip"] = time_it(cupy, lambda: step(clip=True), args.repeats, args.warmup)
        del table
    finite = bool(cupy.all(cupy.isfinite(params)))
    return n, results, finite


def run_torch(sizes, args):
    """torch.optim.Adam fused / foreach over separate tensors, or the reason it cannot run."""
    try:
        import torch
    except ImportError as error:
        return None, f"torch is not importable ({error})"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} has no CUDA here"
    generator = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for _, numel, _ in sizes:
        p = torch.nn.Parameter(torch.randn(numel, device="cuda", generator=generator) * 0.02)
        p.grad = torch.randn(numel, device="cuda", generator=generator) * 1e-3
        params.append(p)
    results = {}
    for label, flags in (("torch Adam fused", dict(fused=True)),
                         ("torch Adam foreach", dict(foreach=True))):
        optimizer = torch.optim.Adam(params, lr=1e-4, **flags)
        results[label] = time_torch(torch, optimizer.step, args.repeats, args.warmup)
        del optimizer
    del params
    torch.cuda.empty_cache()
    return results, None


def main(argv=None):
    args = parse_args(argv)
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # ImportError, or CUDARuntimeError without a driver
        count, reason = 0, f"{type(error).__name__}: {error}"
    else:
        reason = "no CUDA device" if count == 0 else None
    if count == 0:
        message = f"optimizer_step: skipped, needs CuPy and a CUDA device ({reason})"
        print(message)
        write_json(args.json, {"skipped": message})
        return 0

    sizes = gpt2_tensor_sizes(args.layers, args.width, args.vocab, args.context)
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    device_name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    rate, rate_samples = copy_rate(cupy, args.repeats, args.warmup)
    n, ours, finite = run_ours(cupy, sizes, args)
    cupy.get_default_memory_pool().free_all_blocks()  # room for torch's copies
    theirs, torch_note = (None, "--no-torch") if args.no_torch else run_torch(sizes, args)

    rows = []
    for label, samples in ours.items():
        floor_ms = BYTES_PER_PARAM[label] * n / rate * 1e3
        stats = summarize(samples)
        rows.append({"name": f"ours {label}", "launches": LAUNCHES[label],
                     "bytes_per_param": BYTES_PER_PARAM[label], "floor_ms": floor_ms,
                     "effective_GBps": BYTES_PER_PARAM[label] * n / (stats["median_ms"] * 1e-3) / 1e9,
                     **stats})
    for label, samples in (theirs or {}).items():
        stats = summarize(samples)
        rows.append({"name": label, "launches": None, "bytes_per_param": 28,
                     "floor_ms": 28 * n / rate * 1e3,
                     "effective_GBps": 28 * n / (stats["median_ms"] * 1e-3) / 1e9, **stats})

    print(f"device: {device_name}; {n / 1e6:.1f} M fp32 params in {len(sizes)} tensors; "
          f"copy rate {rate / 1e9:.0f} GB/s (read + write); median of {args.repeats}")
    print(f"{'':24} {'median ms':>10} {'min ms':>8} {'floor ms':>9} {'x floor':>8} {'GB/s':>7} "
          f"{'launches':>8}")
    for row in rows:
        print(f"{row['name']:24} {row['median_ms']:10.3f} {row['min_ms']:8.3f} {row['floor_ms']:9.3f} "
              f"{row['median_ms'] / row['floor_ms']:8.2f} {row['effective_GBps']:7.0f} "
              f"{row['launches'] if row['launches'] is not None else '-':>8}")
    adam_floor = 28 * n / rate * 1e3
    print(f"bandwidth floor for Adam (28 bytes/param at the copy rate): {adam_floor:.3f} ms")
    if torch_note:
        print(f"torch baselines: not run ({torch_note})")
    if not finite:
        print("WARNING: parameters became non-finite during the runs")

    if args.json:
        result = {"device": device_name, "params": n, "tensors": len(sizes),
                  "copy_rate_Bps": rate, "copy_ms": summarize(rate_samples),
                  "adam_floor_ms": adam_floor, "rows": rows, "torch_note": torch_note,
                  "params_finite": finite, "python": platform.python_version(),
                  "cupy": getattr(cupy, "__version__", None), "args": {k: str(v) for k, v in vars(args).items()}}
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
