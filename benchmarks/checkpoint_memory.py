"""Gradient checkpointing: peak memory of a training step, eager PyTorch against ORTModule, with and
without torch.utils.checkpoint.

Run from the repository root:

    python benchmarks/checkpoint_memory.py                       # both models, the four configurations
    python benchmarks/checkpoint_memory.py --models mlp --json out.json
    python benchmarks/checkpoint_memory.py --models gpt2 --gpt2-layers 12  # GPT-2 small's depth

Models: `mlp`, 8 residual MLP blocks (width 512, hidden 2048, GELU), 16 x 512 tokens, each block
under torch.utils.checkpoint (use_reentrant=False; --reentrant for the other form); `gpt2`, a GPT-2
from a config (6 layers, width 512, 8 heads, vocab 8192, 8 x 256 tokens, dropout off) with
Hugging Face's `gradient_checkpointing_enable()` (reentrant, its default). Configurations: eager,
eager_checkpointed, ortmodule, ortmodule_checkpointed.

Each configuration runs in its own subprocess: the model and AdamW are made, the resident memory
(VmRSS) taken as the baseline, two warm-up steps run, the peak resident memory is reset (writing 5
to /proc/self/clear_refs) and steps 2-3 run; reported: their peak (VmHWM) over the baseline, in MiB:
what a step needs above the model (activations, gradients, AdamW's state, ONNX Runtime's buffers).
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path.cwd()
sys.path.insert(0, str(REPO_ROOT))

from examples._report import write_json  # noqa: E402

CONFIGS = ("eager", "eager_checkpointed", "ortmodule", "ortmodule_checkpointed")


def _status_mib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _mlp(checkpointed, reentrant):
    import torch
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(512, 2048), torch.nn.Linear(2048, 512)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(8))

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=reentrant) if checkpointed else block(x)
            return x.pow(2).mean()

    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 512, 512, generator=generator),) for _ in range(4)]
    return Net(), batches, lambda model, x: model(x)


def _gpt2(checkpointed, reentrant, layers=6):
    import torch
    import transformers

    config = transformers.GPT2Config(n_layer=layers, n_embd=512, n_head=8, vocab_size=8192, n_positions=256,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    if checkpointed:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=None if reentrant is None else {"use_reentrant": reentrant})
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 8192, (8, 256), generator=generator),) for _ in range(4)]
    return model, batches, lambda model, ids: model(input_ids=ids, labels=ids).loss


def child(model_name, config, threads, reentrant, gpt2_layers=6):
    """One configuration: {baseline_mib, before_step_mib, peak_mib, peak_above_baseline_mib}."""
    import gc

    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    checkpointed = config.endswith("checkpointed")
    model, batches, loss_of = (_mlp(checkpointed, reentrant) if model_name == "mlp"
                               else _gpt2(checkpointed, reentrant, gpt2_layers))
    model.train()
    if config.startswith("ortmodule"):
        from ort_trainer import ORTModule
        model = ORTModule(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gc.collect()
    baseline = _status_mib("VmRSS")
    losses = []
    for step, batch in enumerate(batches):
        if step == 2:
            gc.collect()
            before = _status_mib("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")
        loss = loss_of(model, *batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        del loss
    peak = _status_mib("VmHWM")
    return {"baseline_mib": baseline, "before_step_mib": before, "peak_mib": peak,
            "peak_above_baseline_mib": peak - baseline, "losses": losses}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt2"], choices=["mlp", "gpt2"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gpt2-layers", type=int, default=6, help="the GPT-2's layers (12: GPT-2 small's depth)")
    parser.add_argument("--reentrant", action="store_true",
                        help="mlp: use_reentrant=True; gpt2: Hugging Face's default (reentrant) either way")
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        reentrant = args.reentrant if args.child[0] == "mlp" else None
        print(json.dumps(child(*args.child, args.threads, reentrant, args.gpt2_layers)))
        return
    results = {}
    for model_name in args.models:
        for config in args.configs:
            command = [sys.executable, __file__, "--child", model_name, config, "--threads", str(args.threads),
                       "--gpt2-layers", str(args.gpt2_layers)]
            if args.reentrant:
                command.append("--reentrant")
            done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{model_name} {config} failed:\n{done.stderr}")
            results[f"{model_name}/{config}"] = result = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{model_name:5} {config:24} peak above baseline {result['peak_above_baseline_mib']:8,.0f} MiB "
                  f"(baseline {result['baseline_mib']:,.0f}, before step 2 {result['before_step_mib']:,.0f}) "
                  f"losses {[round(loss, 5) for loss in result['losses']]}", flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
