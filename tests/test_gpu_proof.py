"""benchmarks/gpu_proof.py, the driver of the device checks (issue 34): its CPU forms run end to end
(CI also runs them all through `benchmarks/gpu_proof.sh --cpu`), a step past its limit or crashing
does not stop the next, and the table reads what the device steps write."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_proof  # noqa: E402


def test_the_cpu_forms_of_two_steps_write_logs_and_the_summary(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/gpu_proof.py", "--cpu", "--only", "smoke", "tests",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["smoke.log", "summary.json", "tests.log"]
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert steps["smoke"]["headline"] == "gpu-smoke: OK"
    assert steps["tests"]["result"]["failures"] == 0 and steps["tests"]["result"]["passed"] > 0
    assert done.stdout.splitlines()[-3].startswith("step ")


def test_a_step_past_its_limit_is_reported_and_the_next_one_runs(tmp_path):
    interpreters = gpu_proof.interpreters_for(type("Args", (), {"cpu": True})())
    slow = gpu_proof.Step("slow", "sleeps", 1, ["-c", "import time; time.sleep(30)"])
    crash = gpu_proof.Step("crash", "aborts", 30, ["-c", "import os; os.abort()"])
    fine = gpu_proof.Step("fine", "prints", 30, ["-c", "print('done')"])
    deadline = gpu_proof.time.monotonic() + 60
    for step in (slow, crash, fine):
        gpu_proof.run_step(step, interpreters=interpreters, out=tmp_path, scratch=tmp_path, deadline=deadline)
    assert slow.summary["status"] == "timed out (1 s)"
    assert crash.summary["status"] == "failed (exit -6)"
    assert fine.summary["status"] == "ok" and "done" in (tmp_path / "fine.log").read_text()


def test_an_unknown_step_is_named(capsys):
    with pytest.raises(SystemExit):
        gpu_proof.main(["--cpu", "--only", "seed", "nope"])
    assert ("--only: no step named nope; steps: smoke, seed, optimizer, runtime, tests, mixed, compile"
            in capsys.readouterr().err)


def _headline(name, result):
    step = gpu_proof.Step(name, "", 1, [])
    step.summary = {"result": result}
    return gpu_proof.headline(step)


def test_the_table_reads_what_the_device_steps_wrote():
    """The shapes below are those the first GPU run (an H200) returned."""
    rows = [{"name": "ours adam", "median_ms": 0.895, "floor_ms": 0.832},
            {"name": "ours lamb", "median_ms": 1.249, "floor_ms": 1.189},
            {"name": "torch Adam fused", "median_ms": 1.394, "floor_ms": 0.832}]
    assert _headline("optimizer", {"rows": rows}) == ("Adam 0.895 ms = 1.08x floor; Lamb/Adam 1.40; "
                                                      "torch fused Adam 1.394 ms")
    compiled = {"results": [{"model": "seed", "dtype": "float32",
                             "ms_per_step": {"torch eager": 5.2, "torch.compile": 6.4}}]}
    assert _headline("compile", compiled) == "seed float32: torch eager 5.2, torch.compile 6.4"
    failed = {"data_parallel_one_rank": {"ok": False, "error": "RuntimeError: x"},
              "arena_over_8_shapes": {"ok": True, "mib_in_use": [1.0, 2.0]}}
    assert _headline("runtime", failed) == "None None loss diff RuntimeError: x; arena MiB [1.0, 2.0]"
    assert _headline("seed", {}) == "no result written (see its log)"


def test_a_crashed_pytest_still_says_what_ran_and_where_it_stopped():
    log = ("tests/gpu/test_kernels_gpu.py::test_adam[3] PASSED [ 1%]\n"
           "tests/gpu/test_kernels_gpu.py::test_sgd SKIPPED (why) [ 2%]\n"
           "tests/gpu/test_trainer_gpu.py::test_parity FAILED [ 3%]\n"
           "Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n"
           '  File "/x/onnxruntime_inference_collection.py", line 331 in run_with_iobinding\n'
           '  File "/work/main/tests/gpu/test_torch_ops_gpu.py", line 30 in test_torch_nodes_train\n')
    result = gpu_proof.outcomes_in_log(log)
    assert (result["passed"], result["failures"], result["skipped"]) == (1, 1, 1)
    assert result["failed_tests"] == ["tests/gpu/test_trainer_gpu.py::test_parity"]
    assert result["crashed_in"] == "Aborted in tests/gpu/test_torch_ops_gpu.py:30 (test_torch_nodes_train)"


def test_the_kit_smoke_runs_onnx_runtime_s_cuda_sessions_in_fp32():
    """The kit's check of ORT's MatMul (1e-3 against torch's fp32 product) fails at ORT's default TF32
    (2e-2 on the H200), before its DLPack and CuPy checks: ours, as ort-trainer's sessions, are fp32."""
    import kit_smoke

    assert kit_smoke.in_fp32(["CUDAExecutionProvider", "CPUExecutionProvider"]) == [
        ("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    assert kit_smoke.in_fp32([("CUDAExecutionProvider", {"use_tf32": "1", "device_id": "0"})]) == [
        ("CUDAExecutionProvider", {"use_tf32": "1", "device_id": "0"})]  # a setting given stays
