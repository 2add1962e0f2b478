"""The benchmark scripts run end to end on a tiny configuration (their numbers are not checked)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script, *arguments, tmp_path):
    """Runs `benchmarks/<script>` with `arguments` and --json; returns (its result, the run)."""
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, f"benchmarks/{script}", *arguments, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done


def test_train_step_benchmark_runs_and_writes_every_measure(tmp_path):
    result, done = _run("train_step.py", "--vocab", "40", "--bptt", "5", "--batch", "3",
        "--threads", "1", "--warmup", "1", "--rounds", "2", "--steps", "1", "--fetch", "loss",
        "--measure-memory", "--memory-steps", "3", "--memory-repeats", "2", tmp_path=tmp_path)
    for phase in ("train", "eval"):
        assert set(result[phase]["median_ms"]) == {"torch", "ort"}
    for engine in ("torch", "ort"):
        memory = result["memory"][engine]
        assert memory["anon_peak_delta_process_mib"] >= max(
            memory[key] for key in ("anon_peak_delta_first_steps_mib", "anon_peak_delta_train_mib",
                                    "anon_peak_delta_first_eval_mib", "anon_peak_delta_eval_mib"))
        assert memory["repeats"] == 2
    assert "peak anon, whole run" in done.stdout


def test_mixed_precision_benchmark_runs_on_the_cpu(tmp_path):
    result, _ = _run("mixed_precision.py", "--device", "cpu", "--models", "seed", "--dtypes",
        "float32", "float16", "--rounds", "1", "--steps", "2", "--warmup", "2", "--vocab", "40", "--bptt", "5",
        "--batch", "3", "--no-compile", tmp_path=tmp_path)
    assert [(r["model"], r["dtype"]) for r in result["results"]] == [("seed", "float32"), ("seed", "float16")]
    for row in result["results"]:
        assert set(row["ms_per_step"]) == {"ort", "ortmodule", "torch eager"}
        assert set(row["worst_relative_loss_difference_from_eager"]) == {"ort", "ortmodule"}
        assert max(row["worst_relative_loss_difference_from_eager"].values()) < 1e-3


def test_train_step_benchmark_takes_mixed_precision(tmp_path):
    result, _ = _run("train_step.py", "--vocab", "40", "--bptt", "5", "--batch", "3",
        "--threads", "1", "--warmup", "1", "--rounds", "1", "--steps", "1", "--no-eval", "--mixed-precision",
        tmp_path=tmp_path)
    assert result["config"]["mixed_precision"] == "float16"


def test_cpu_products_benchmark_runs():
    done = subprocess.run([sys.executable, "benchmarks/cpu_products.py", "--threads", "1", "--repeats", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    # DeepSpeed, where installed, logs a line of its own when ONNX Runtime's training package imports it
    header, *rows = [line for line in done.stdout.strip().splitlines() if "[real_accelerator.py" not in line]
    assert set(json.loads(header)) == {"cpu", "flags", "threads", "torch", "onnxruntime"}
    assert len(rows) == 6 and all("MLAS fp32" in row and "torch bf16" in row for row in rows)


def test_ortmodule_benchmark_compares_the_products_in_torch_with_onnx_runtimes(tmp_path):
    result, _ = _run("ortmodule_step.py", "--vocab", "40", "--bptt", "5", "--batch", "3",
        "--threads", "1", "--warmup", "1", "--rounds", "2", "--steps", "1", "--compare-products", tmp_path=tmp_path)
    assert set(result["median_ms"]) == {"eager", "ortmodule", "ortmodule_loss", "ortrainer", "ortmodule_ort_products",
                                        "ortrainer_ort_products"}
    assert result["torch_products"] == {}  # products this small are not measured


def test_recurrent_benchmark_runs(tmp_path):
    result, _ = _run("recurrent_step.py", "--vocab", "30", "--width", "8", "--hidden", "6",
        "--batch", "3", "--seq", "5", "--threads", "1", "--warmup", "1", "--rounds", "2", "--steps", "1",
        tmp_path=tmp_path)
    assert set(result["median_ms"]) == {"eager", "ortmodule", "ortrainer"}


def test_low_precision_model_benchmark_runs(tmp_path):
    result, _ = _run("low_precision_model.py", "--layers", "1", "--width", "16", "--heads", "2",
        "--vocab", "40", "--batch", "2", "--block", "8", "--threads", "1", "--rounds", "1", tmp_path=tmp_path)
    assert set(result["median_ms"]) == {"eager fp32", "eager bfloat16", "ortmodule bfloat16",
                                                              "ortmodule fp32"}


@pytest.mark.parametrize("model", ["gpt2", "bert"])
def test_label_sparsity_benchmark_runs_and_dense_and_sparse_agree(tmp_path, model):
    result, _ = _run("label_sparsity.py", "--model", model, "--vocab", "1024", "--width", "32", "--heads", "2",
        "--batch", "2", "--seq", "8", "--threads", "1", "--warmup", "1", "--rounds", "2", "--steps", "1",
        tmp_path=tmp_path)  # sparse from 1,024 classes
    assert set(result["median_ms_per_step"]) == {"ortrainer dense", "ortrainer sparse", "ortmodule dense",
                                                 "ortmodule sparse", "eager"}
    assert result["ortrainer_dense_vs_sparse_worst_relative_loss_difference"] <= 1e-5
    assert result["ortmodule_dense_vs_sparse_worst_relative_loss_difference"] <= 1e-5


def test_embedding_sparsity_benchmark_runs_and_dense_and_sparse_agree(tmp_path):
    result, _ = _run("embedding_sparsity.py", "--vocab", "40", "--width", "16", "--blocks", "1", "--batch", "2",
        "--seq", "8", "--threads", "1", "--warmup", "1", "--rounds", "2", "--steps", "1", tmp_path=tmp_path)
    assert set(result["median_ms_per_step"]) == {"ortmodule dense", "ortmodule sparse", "ortrainer dense",
                                                 "ortrainer sparse", "eager"}
    assert result["ortmodule_dense_vs_sparse_worst_relative_loss_difference"] <= 1e-5
    assert result["ortrainer_dense_vs_sparse_worst_relative_loss_difference"] <= 1e-5


def test_bf16_overhead_benchmark_runs(tmp_path):
    result, _ = _run("bf16_overhead.py", "--vocab", "40", "--rounds", "1", "--steps", "1", tmp_path=tmp_path)
    assert result["bare_products_ms"] > 0 and result["bf16_nodes_ms"] > 0
    assert {"bf16_product_ms", "bf16_product_grad_ms", "to_bf16_ms"} <= set(result)


def test_export_cache_benchmark_reads_the_warm_process_graphs_from_disk(tmp_path):
    result, done = _run("export_cache.py", "--vocab", "50", "--layers", "1", "--width", "16", "--heads", "2",
                        "--batch", "2", "--seq", "4", "--threads", "1", "--repeats", "1", "--engines", "ortmodule",
                        tmp_path=tmp_path)
    runs = result["engines"]["ortmodule"]["runs"]  # ORTTrainer's path: tests/test_export_cache.py
    assert [run["traces"] for run in runs["cold"] + runs["warm"]] == [1, 0]
    assert "warm / cold" in done.stdout


def test_ortmodule_sweep_benchmark_runs_every_engine_at_every_point(tmp_path):
    result, _ = _run("ortmodule_sweep.py", "--points", "1x8", "2x4", "--width", "16", "--heads", "2", "--vocab", "40",
        "--batch", "2", "--threads", "1", "--warmup", "1", "--rounds", "2", "--steps", "1", tmp_path=tmp_path)
    assert set(result["points"]) == {"1x8", "2x4"}
    for point in result["points"].values():
        assert set(point["median_ms"]) == {"eager", "ortmodule", "ortrainer"}
        assert max(point["worst_relative_loss_difference"].values()) < 1e-5
    assert set(result["median_point_speedup"]) == {"eager", "ortmodule", "ortrainer"}
