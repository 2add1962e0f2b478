"""Mixed precision, side by side in one process: ORTTrainer (`mixed_precision`) and the PyTorch
loop on ORTModule(model) against the PyTorch loop under `torch.autocast` (+ GradScaler for fp16),
eager and `torch.compile`d, and each engine's fp32 step. Seed model (examples/wikitext2) and GPT-2 small (124 M parameters, from its config).

    python benchmarks/mixed_precision.py --device cuda                   # the GPU case: both models, fp16 + bf16
    python benchmarks/mixed_precision.py --device cpu --models seed --dtypes float16 --rounds 3

Per (model, dtype): warmup, then --rounds interleaved rounds of --steps steps per engine (the order
alternates); reports the median of the per-round ms/step, the ratios against ORTTrainer, and the
worst relative loss difference of ORTTrainer's and ORTModule's first --warmup losses from eager
autocast's (same init, same batches, dropout 0). --engines picks engines: the torch ones alone need
no ort_trainer (the GPU machine's own Python runs torch.compile, which the bundle cannot).
CPU peak memory: benchmarks/train_step.py --measure-memory --mixed-precision. On the CPU fp16 is emulated (DESIGN.md, "Mixed precision"): slower than fp32
there, as recorded in BENCHMARKS.md; bf16 runs torch's bf16 products inside the graph on CPUs with
AMX or AVX512-BF16 and is refused on others. The JSON records the CPU's flags.

    python benchmarks/mixed_precision.py --device cpu --models seed gpt2 --dtypes float32 bfloat16 --gpt2-layers 2
"""
import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples._report import write_json  # noqa: E402
from examples.wikitext2.model import TransformerModel  # noqa: E402
from examples.wikitext2.train import make_loss_fn  # noqa: E402

ENGINES = ("ort", "ortmodule", "torch eager", "torch.compile")


class Workload:
    """A model, its batches and how each engine calls it."""

    def __init__(self, name, args):
        self.name = name
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(1)
        if name == "seed":
            self.model = TransformerModel(args.vocab, dropout=0.0)
            data = torch.randint(0, args.vocab, (args.steps, args.bptt + 1, args.batch), generator=generator)
            self.batches = [((d[:-1],), {"label": d[1:].reshape(-1)}) for d in data]
            self.loss_fn = make_loss_fn(args.vocab)
            self.desc = {"inputs": [("src", ["bptt", "batch_size"]), ("label", ["bptt_x_batch_size"])],
                         "outputs": [("loss", [], True), ("output", ["bptt", "batch_size", args.vocab])]}
        else:
            import transformers

            config = transformers.GPT2Config(n_layer=args.gpt2_layers, n_embd=args.gpt2_width, n_head=args.gpt2_heads,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            self.model = transformers.GPT2LMHeadModel(config)
            ids = torch.randint(0, config.vocab_size, (args.steps, args.gpt2_batch, args.gpt2_block),
                                generator=generator)
            self.batches = [((), {"input_ids": d, "labels": d}) for d in ids]
            self.loss_fn = None
            self.desc = {"inputs": [("input_ids", ["batch", "block"]), ("labels", ["batch", "block"])],
                         "outputs": [("loss", [], True)]}

    def torch_loss(self, model, args, kwargs):
        if self.loss_fn is None:
            return model(**kwargs, use_cache=False).loss
        return self.loss_fn(model(*args), kwargs["label"])


def torch_step(workload, model, device, dtype, *, compiled):
    """The PyTorch loop's step (Adam, clip 1.0) under autocast in `dtype` (None: fp32)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=device == "cuda")
    scaler = torch.amp.GradScaler(device, enabled=dtype == "float16")
    autocast = dict(device_type=device, dtype=getattr(torch, dtype or "float32"), enabled=dtype is not None)

    def forward_backward(args, kwargs):
        with torch.autocast(**autocast):
            loss = workload.torch_loss(model, args, kwargs)
        scaler.scale(loss).backward()
        return loss

    forward_backward = torch.compile(forward_backward) if compiled else forward_backward

    def step(args, kwargs):
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(args, kwargs)
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        return loss
    return step


def ort_step(workload, model, device, dtype):
    from ort_trainer import ORTTrainer, ORTTrainerOptions, optim

    options = {"device": {"id": device}}
    if dtype is not None:
        options["mixed_precision"] = {"enabled": True, "dtype": dtype}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "mixed_precision.dtype='float16' on device 'cpu'")
        trainer = ORTTrainer(model, workload.desc, optim.AdamConfig(lr=1e-4, max_norm_clip=1.0),
                             loss_fn=workload.loss_fn, options=ORTTrainerOptions(options))
    trainer.train_step_info.fetches = ["loss"]
    return lambda args, kwargs: trainer.train_step(*args, *kwargs.values()) if workload.loss_fn else \
        trainer.train_step(**kwargs)


def engines(workload, device, dtype, names):
    """{engine name: step function} for `names`, each on its own copy of the model. ort_trainer is
    imported only for its engines: the torch engines run where it is not installed (the GPU
    machine's own Python, whose torch.compile the bundle's lacks)."""
    def fresh():
        return copy.deepcopy(workload.model).to(device).train()

    def ortmodule():
        from ort_trainer import ORTModule
        return torch_step(workload, ORTModule(fresh()), device, dtype, compiled=False)
    makers = {"ort": lambda: ort_step(workload, fresh(), device, dtype), "ortmodule": ortmodule,
              "torch eager": lambda: torch_step(workload, fresh(), device, dtype, compiled=False),
              "torch.compile": lambda: torch_step(workload, fresh(), device, dtype, compiled=True)}
    return {name: makers[name]() for name in names}


def on_device(batch, device):
    args, kwargs = batch
    return tuple(t.to(device) for t in args), {k: t.to(device) for k, t in kwargs.items()}


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(workload, device, dtype, args):
    """Median ms/step per engine, and each ORT engine's worst relative loss difference from eager's."""
    batches = [on_device(batch, device) for batch in workload.batches]
    steps = engines(workload, device, dtype, args.engines)
    losses = {}
    for name, step in steps.items():  # warmup (compiles), and the losses of the first steps
        losses[name] = [step(*batch).item() for batch in batches[:args.warmup]]
    times = {name: [] for name in steps}
    for round_index in range(args.rounds):
        order = list(steps) if round_index % 2 == 0 else list(reversed(steps))
        for name in order:
            synchronize(device)
            start = time.perf_counter()
            for batch in batches:
                steps[name](*batch)
            synchronize(device)
            times[name].append(1000 * (time.perf_counter() - start) / len(batches))
    eager = losses.get("torch eager")
    worst = {name: max(abs(a - b) / abs(b) for a, b in zip(losses[name], eager))
             for name in ("ort", "ortmodule") if name in losses and eager}
    return {name: statistics.median(values) for name, values in times.items()}, worst


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--models", nargs="+", default=["seed", "gpt2"], choices=["seed", "gpt2"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"],
                   choices=["float32", "float16", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps per engine per round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--vocab", type=int, default=28782)
    p.add_argument("--bptt", type=int, default=35)
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--gpt2-layers", type=int, default=12)
    p.add_argument("--gpt2-width", type=int, default=768)
    p.add_argument("--gpt2-heads", type=int, default=12)
    p.add_argument("--gpt2-batch", type=int, default=8)
    p.add_argument("--gpt2-block", type=int, default=512)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES,
                   help="which engines to run (ratios are against 'ort' when it runs)")
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.no_compile:
        args.engines = [name for name in args.engines if name != "torch.compile"]
    if args.device == "cpu" and "bfloat16" in args.dtypes and "ort" in args.engines and not _cpu_has_bf16():
        p.error("--dtypes bfloat16: this CPU has no bf16 instructions (AMX or AVX512-BF16), ORTTrainer refuses bf16 "
                "on it (DESIGN.md, 'Mixed precision')")
    return args


def _cpu_has_bf16():
    from ort_trainer._graph.autocast import cpu_has_bf16_instructions
    return cpu_has_bf16_instructions()


def main(argv=None):
    """Runs every (model, dtype); the JSON is rewritten after each, so a run cut short keeps what it measured."""
    args = parse_args(argv)
    device = torch.cuda.get_device_name() if args.device == "cuda" else {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "amx": torch.cpu._is_amx_tile_supported(),
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "threads": torch.get_num_threads()}
    results = []
    for model_name in args.models:
        workload = Workload(model_name, args)
        for dtype in args.dtypes:
            ms, worst = measure(workload, args.device, None if dtype == "float32" else dtype, args)
            results.append({"model": model_name, "dtype": dtype, "ms_per_step": ms,
                            "torch_over_ort": {name: value / ms["ort"] for name, value in ms.items()}
                            if "ort" in ms else None,
                            "worst_relative_loss_difference_from_eager": worst})
            print(f"{model_name:5s} {dtype:9s} " + " | ".join(f"{name} {value:8.2f} ms" for name, value in ms.items())
                  + "".join(f" | {name} vs eager loss {value:.1e}" for name, value in worst.items()), flush=True)
            write_json(args.json, {"device": device, "config": vars(args) | {"json": str(args.json)},
                                   "results": results})
    return results


if __name__ == "__main__":
    main()
