"""The GPU proof in one command (issue 34): every device check in order, each under its own time
limit, never stopping at a failure; one log per step and summary.json under --out, a table last.

    bash benchmarks/gpu_proof.sh          # on the lent GPU machine, after the bundle's unpack (gpu-bundle.md)
    bash benchmarks/gpu_proof.sh --cpu    # the same steps in their CPU forms: proves the driver (CI)

The cheapest, most telling checks come first, so a run cut off by the device's time still says the
most. Steps that need ONNX Runtime run in the GPU kit's Python 3.11 (`/tmp/og/gpu-env.sh`, where it
is unpacked; else every step runs in `--native-python`, an install with the `gpu` extra); the
torch.compile baselines run in the machine's own Python (`python3`: torch 2.11 with Triton, which
the kit lacks). At most 8 files come back from the device: 7 logs and the summary.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE_PYTHON = "/tmp/og/gpu-env.sh"  # absent: a machine with the `gpu` extra installed, one Python for all
KIT_SMOKES = (Path("/tmp/og/gpu-smoke.py"), ROOT.parent / "shared/tools/gpu-smoke.py")
SMALL_SEED = ["--vocab", "500", "--bptt", "8", "--batch", "4"]
SMALL_GPT2 = ["--gpt2-layers", "1", "--gpt2-width", "64", "--gpt2-heads", "2", "--gpt2-batch", "2",
              "--gpt2-block", "16"]


@dataclass
class Step:
    """One check: its command (`python` stands for the interpreter it runs in), its time limit, and
    what it writes (a JSON result or a JUnit report) for the summary to read."""
    name: str
    what: str
    limit_s: int
    command: list[str]
    interpreter: str = "bundle"  # or "native"
    result: str | None = None  # file name under the scratch folder, passed where the command says {result}
    summary: dict = field(default_factory=dict)


def device_steps() -> list[Step]:
    """In order of what a cut-off run should still have said (the deadline caps the later ones)."""
    return [
        Step("smoke", "the kit's smoke (ORT in fp32): torch CUDA, ORT CUDA session, DLPack, CuPy RawKernel", 60,
             ["benchmarks/kit_smoke.py", str(next((path for path in KIT_SMOKES if path.exists()), KIT_SMOKES[0]))]),
        Step("seed", "seed model: CUDA vs CPU parity (TF32 off), ms/step vs eager (foreach, fused)", 180,
             ["benchmarks/gpu_smoke.py", "--steps", "30", "--json", "{result}"], result="seed.json"),
        Step("optimizer", "Adam/Lamb over 124 M fp32 parameters against the bandwidth floor", 60,
             ["benchmarks/optimizer_step.py", "--repeats", "30", "--json", "{result}"], result="optimizer.json"),
        Step("runtime", "NCCL data-parallel path on one rank; the shared CUDA arena over 8 shapes", 90,
             ["benchmarks/cuda_runtime_checks.py", "--device", "cuda", "--json", "{result}"], result="runtime.json"),
        Step("tests", "pytest tests/gpu: kernels, CUDA graphs, loss scaling, torch nodes, mixed precision", 180,
             ["-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfE", "tests/gpu", "--junitxml", "{result}"],
             result="tests.xml"),
        Step("mixed", "ORTTrainer and ORTModule in fp32/bf16/fp16, seed and GPT-2 small, vs eager", 240,
             ["benchmarks/mixed_precision.py", "--device", "cuda", "--models", "seed", "gpt2",
              "--dtypes", "float32", "bfloat16", "float16", "--engines", "ort", "ortmodule", "torch eager",
              "--rounds", "3", "--steps", "10", "--warmup", "3", "--json", "{result}"], result="mixed.json"),
        Step("compile", "torch.compile baselines (the machine's own torch 2.11 + Triton)", 180,
             ["benchmarks/mixed_precision.py", "--device", "cuda", "--models", "seed", "gpt2",
              "--dtypes", "float32", "bfloat16", "--engines", "torch eager", "torch.compile",
              "--rounds", "3", "--steps", "10", "--warmup", "3", "--json", "{result}"],
             interpreter="native", result="compile.json"),
    ]


def cpu_steps() -> list[Step]:
    """The same steps, sized for CI's CPU: the kernels on the CPU emulation, device 'cpu' elsewhere."""
    return [
        Step("smoke", "the kit's smoke, --cpu (its `import cupy` gets the emulation)", 60,
             ["benchmarks/kit_smoke.py", str(ROOT.parent / "shared/tools/gpu-smoke.py"), "--cpu", "--emulate-cupy"]),
        Step("seed", "seed model on the CPU, one graph run twice", 120,
             ["benchmarks/gpu_smoke.py", "--device", "cpu", "--steps", "4", "--ntokens", "500", "--bptt", "8",
              "--batch", "4", "--no-compile", "--json", "{result}"], result="seed.json"),
        Step("optimizer", "optimizer_step (skips without CuPy)", 60,
             ["benchmarks/optimizer_step.py", "--layers", "1", "--vocab", "100", "--context", "8", "--repeats", "2",
              "--json", "{result}"], result="optimizer.json"),
        Step("runtime", "gloo data-parallel path on one rank; 8 shapes", 120,
             ["benchmarks/cuda_runtime_checks.py", "--device", "cpu", "--vocab", "500", "--steps", "2",
              "--json", "{result}"], result="runtime.json"),
        Step("tests", "a kernel test of tests/gpu on the CPU emulation", 120,
             ["-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "tests.cpu_cuda.plugin", "-rfE",
              "tests/gpu/test_kernels_gpu.py", "-k", "sgd and not needs_no_host_sync", "--junitxml", "{result}"],
             result="tests.xml"),
        Step("mixed", "ORTTrainer and ORTModule fp32, tiny seed and GPT-2, vs eager", 150,
             ["benchmarks/mixed_precision.py", "--device", "cpu", "--models", "seed", "gpt2", "--dtypes", "float32",
              "--engines", "ort", "ortmodule", "torch eager", "--rounds", "1", "--steps", "2", "--warmup", "2",
              *SMALL_SEED, *SMALL_GPT2, "--json", "{result}"], result="mixed.json"),
        Step("compile", "torch eager alone, as the native step runs it", 60,
             ["benchmarks/mixed_precision.py", "--device", "cpu", "--models", "seed", "--dtypes", "float32",
              "--engines", "torch eager", "--rounds", "1", "--steps", "2", "--warmup", "1", *SMALL_SEED,
              "--json", "{result}"], interpreter="native", result="compile.json"),
    ]


def read_result(step: Step, path: Path | None, log: str) -> dict:
    """The numbers the table shows, from the step's JSON, JUnit report or log."""
    if step.name == "smoke":
        return {"ok_line": bool(re.search(r"gpu-smoke.*OK", log))}
    if path is None or not path.exists():
        return outcomes_in_log(log) if step.name == "tests" else {}
    if path.suffix == ".xml":
        suite = ElementTree.parse(path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
        failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                  if case.find("failure") is not None or case.find("error") is not None]
        return counts | {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
                         "failed_tests": failed}
    return json.loads(path.read_text())


def outcomes_in_log(log: str) -> dict:
    """pytest -v's outcome of each test that ran, from its log: what is left when the process
    crashed before writing its JUnit report (the first GPU run lost its failures' names so)."""
    found = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", log, flags=re.MULTILINE)
    if not found:
        return {}
    count = {kind: sum(1 for _, outcome in found if outcome == kind)
             for kind in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    return {"tests": len(found), "passed": count["PASSED"], "failures": count["FAILED"], "errors": count["ERROR"],
            "skipped": count["SKIPPED"],
            "failed_tests": [name for name, outcome in found if outcome in ("FAILED", "ERROR")],
            "crashed_in": crash_site(log)}


def crash_site(log: str) -> str | None:
    """The test a fatal error stopped in (faulthandler's stack names its file and line), if any."""
    match = re.search(r"Fatal Python error: (\w+).*?File \"[^\"]*/(tests/gpu/[^\"]+)\", line (\d+) in (\w+)", log,
                      flags=re.DOTALL)
    return f"{match.group(1)} in {match.group(2)}:{match.group(3)} ({match.group(4)})" if match else None


def headline(step: Step) -> str:
    """One line of the step's key numbers."""
    r = step.summary.get("result") or {}
    if not r:
        return "no result written (see its log)"
    try:
        if step.name == "smoke":
            return "gpu-smoke: OK" if r.get("ok_line") else "no OK line"
        if step.name == "seed":
            return (f"loss diff {r['worst_relative_loss_difference']:.1e}; ORT {r['ort_ms_per_step']:.2f} ms, "
                    f"eager foreach {r['pytorch_eager_foreach_ms_per_step']:.2f}, "
                    f"fused {r['pytorch_eager_fused_ms_per_step']:.2f}")
        if step.name == "optimizer":
            if "skipped" in r:
                return r["skipped"]
            rows = {row["name"]: row for row in r["rows"]}
            adam, lamb = rows["ours adam"], rows["ours lamb"]
            fused = rows.get("torch Adam fused", {}).get("median_ms")
            return (f"Adam {adam['median_ms']:.3f} ms = {adam['median_ms'] / adam['floor_ms']:.2f}x floor; Lamb/Adam "
                    f"{lamb['median_ms'] / adam['median_ms']:.2f}; torch fused Adam {fused} ms")
        if step.name == "tests":
            crashed = f"; {r['crashed_in']}" if r.get("crashed_in") else ""
            return f"{r['passed']} passed, {r['failures'] + r['errors']} failed, {r['skipped']} skipped{crashed}"
        if step.name in ("mixed", "compile"):
            return "; ".join(f"{row['model']} {row['dtype']}: " + ", ".join(
                f"{name} {ms:.1f}" for name, ms in row["ms_per_step"].items()) for row in r["results"])
        if step.name == "runtime":
            parallel, arena = r["data_parallel_one_rank"], r["arena_over_8_shapes"]
            return (f"{parallel.get('backend')} {parallel.get('strategy')} loss diff "
                    f"{parallel.get('worst_relative_loss_difference', parallel.get('error'))}; "
                    f"arena MiB {arena.get('mib_in_use', arena.get('error'))}")
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        return f"(no numbers: {type(error).__name__} {error})"
    return ""


def run_step(step: Step, *, interpreters: dict, out: Path, scratch: Path, deadline: float) -> None:
    """Runs `step` under min(its limit, the time left), its output in out/<name>.log."""
    limit = min(step.limit_s, max(1, int(deadline - time.monotonic())))
    result = scratch / step.result if step.result else None
    command = [*interpreters[step.interpreter],
               *[str(result) if part == "{result}" else part for part in step.command]]
    log_path = out / f"{step.name}.log"
    start = time.monotonic()
    with log_path.open("w") as log:
        log.write(f"$ {' '.join(command)}  (limit {limit} s)\n")
        log.flush()
        try:
            done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=limit,
                                  env=interpreters["env"][step.interpreter])
            status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timed out ({limit} s)"
        except OSError as error:
            status = f"not started ({error})"
    text = log_path.read_text(errors="replace")
    step.summary = {"what": step.what, "status": status, "seconds": round(time.monotonic() - start, 1),
                    "limit_s": limit, "result": read_result(step, result, text)}
    step.summary["headline"] = headline(step)


def interpreters_for(args) -> dict:
    """The command prefix and environment of each interpreter: the bundle's Python and the
    machine's own (whose environment must not carry the bundle's PYTHONHOME or libraries)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}  # a crash's Python stack in the log
    if args.cpu or not Path(BUNDLE_PYTHON).exists():
        own = [sys.executable] if args.cpu else [args.native_python]
        return {"bundle": own, "native": own,
                "env": {"bundle": env | {"PYTHONPATH": str(ROOT)}, "native": env | {"PYTHONPATH": str(ROOT)}}}
    # CUDA 11.8's runtime loads (and JIT-compiles from PTX: ORT has no sm_90 code) kernels eagerly
    # unless told otherwise: lazily, only the kernels a graph uses are compiled
    bundle_env = env | {"GPU_PROOF_EXTRA_PATH": args.extra_path, "CUDA_MODULE_LOADING": "LAZY"}
    return {"bundle": ["bash", "-c", f". {BUNDLE_PYTHON} && export PYTHONPATH=$PYTHONPATH${{GPU_PROOF_EXTRA_PATH:+:"
                       '$GPU_PROOF_EXTRA_PATH} && exec python3.11 "$@"', "bundle-python"],
            "native": [args.native_python], "env": {"bundle": bundle_env, "native": env}}


def table(steps: list[Step]) -> str:
    lines = [f"{'step':10} {'status':22} {'s':>6}  numbers"]
    for step in steps:
        s = step.summary or {"status": "not reached", "seconds": 0, "headline": ""}
        lines.append(f"{step.name:10} {s['status']:22} {s['seconds']:6.0f}  {s['headline']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="the CPU forms of the steps (CI)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-proof-out"))
    p.add_argument("--deadline-s", type=int, default=480, help="all steps together end by then")
    p.add_argument("--only", nargs="+", help="run these steps alone (a rerun of failed ones)")
    p.add_argument("--native-python", default="python3", help="the machine's own Python: torch.compile's steps, every step where no kit is unpacked")
    p.add_argument("--extra-path", default="", help="added to the bundle's PYTHONPATH (carried transformers)")
    args = p.parse_args(argv)
    steps = cpu_steps() if args.cpu else device_steps()
    if args.only:
        unknown = sorted(set(args.only) - {step.name for step in steps})
        if unknown:
            p.error(f"--only: no step named {', '.join(unknown)}; steps: {', '.join(s.name for s in steps)}")
        steps = [step for step in steps if step.name in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = args.out / "scratch"
    scratch.mkdir(exist_ok=True)
    interpreters = interpreters_for(args)
    deadline = time.monotonic() + args.deadline_s
    for step in steps:
        if time.monotonic() >= deadline - 5:
            step.summary = {"what": step.what, "status": "not reached (deadline)", "seconds": 0, "headline": ""}
            continue
        print(f"[gpu_proof] {step.name}: {step.what}", flush=True)
        run_step(step, interpreters=interpreters, out=args.out, scratch=scratch, deadline=deadline)
        print(f"[gpu_proof] {step.name}: {step.summary['status']} in {step.summary['seconds']} s "
              f"| {step.summary['headline']}", flush=True)
    summary = {"mode": "cpu" if args.cpu else "device", "steps": {step.name: step.summary for step in steps}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for path in scratch.iterdir():  # the device returns 8 files: the results live in summary.json
        path.unlink()
    scratch.rmdir()
    print(table(steps), flush=True)
    return 0 if all(step.summary["status"] == "ok" for step in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
