"""The examples' shared command line (examples/_cli.py, examples/_report.py): one vocabulary for both,
option tables that match argparse, progress bars, the offline GPT-2 check, --compare and --mlflow."""
import argparse
import csv
import io
import re
import socket
import sys
from pathlib import Path

import pytest

from examples.gpt2 import train as gpt2
from examples.wikitext2 import train as wikitext2

from . import models

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {"wikitext2": wikitext2, "gpt2": gpt2}


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return models.shared_text_slice(tmp_path_factory, 300)


def readme_options(name):
    """{flag: first cell} of the README's Options table."""
    readme = (ROOT / "examples" / name / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Options\n")[1].split("\n## ")[0]
    rows = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `--")]
    return {flag.replace("_", "-"): row for row in rows for flag in re.findall(r"--[a-z0-9_-]+", row)}


def parser_options(parser):
    return {action.option_strings[0]: action for action in parser._actions if action.option_strings[0] != "-h"}


@pytest.mark.parametrize("name", EXAMPLES)
def test_options_table_lists_every_flag_and_only_those(name):
    table, flags = readme_options(name), parser_options(EXAMPLES[name].make_parser())
    assert sorted(table) == sorted(flags)
    for flag, action in flags.items():
        if action.choices:   # the row names every choice
            listed = re.findall(r"[\w-]+", table[flag].replace("_", "-").split(flag)[1])
            assert set(listed) == set(map(str, action.choices)), flag
        underscored = "--" + flag[2:].replace("-", "_")   # every flag has its underscore spelling too
        assert action.option_strings[1:] == ([underscored] if "-" in flag[2:] else [])


@pytest.mark.parametrize("name, spelling, extra", [
    ("wikitext2", "pytorch", ["--max_batches", "2"]), ("wikitext2", "torch", []),
    ("gpt2", "pytorch", ["--max_steps", "2"]), ("gpt2", "torch", [])])
def test_one_engine_vocabulary_with_aliases_and_underscore_flags(name, spelling, extra, text):
    data = ["--data" if name == "wikitext2" else "--train-file", str(text)]
    args = EXAMPLES[name].parse_args(["--engine", spelling, *data, *extra])
    assert args.engine == "torch" and EXAMPLES[name].ENGINES["torch"].name == "torch"
    assert (args.max_batches if name == "wikitext2" else args.max_steps) == (2 if extra else None)


@pytest.mark.parametrize("name", EXAMPLES)
def test_help_shows_the_whole_first_paragraph(name, capsys):
    with pytest.raises(SystemExit):
        EXAMPLES[name].parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    first_paragraph = " ".join(EXAMPLES[name].__doc__.split("\n\n")[0].split())
    assert first_paragraph.endswith(".") and first_paragraph in out


class _Terminal(io.StringIO):
    def isatty(self):
        return True


class _ConstantLoss:
    def __init__(self, args):
        self.args = args

    def eval_step(self, *batch):
        import torch
        return (torch.tensor(2.0), None) if len(batch) == 1 else torch.tensor(2.0)


@pytest.mark.parametrize("name", EXAMPLES)
def test_evaluation_shows_a_progress_bar_on_a_terminal(name, monkeypatch):
    import torch
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    args = argparse.Namespace(quiet=False, fetch_logits=False, bptt=4, max_batches=None)
    if name == "gpt2":
        result = gpt2.evaluate(_ConstantLoss(args), torch.zeros(6, 5, dtype=torch.long), 2)["loss"]
    else:
        result = wikitext2.evaluate(_ConstantLoss(args), torch.zeros(13, 2, dtype=torch.long), args)
    assert result == pytest.approx(2.0)
    assert re.search(r"eval: +\d+%.*/3 ", terminal.getvalue())
    args.quiet = True
    monkeypatch.setattr(sys, "stderr", quiet_terminal := _Terminal())
    wikitext2.evaluate(_ConstantLoss(args), torch.zeros(13, 2, dtype=torch.long), args)
    assert quiet_terminal.getvalue() == ""


def test_trainer_evaluation_shows_a_progress_bar_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", terminal := _Terminal())
    args = argparse.Namespace(quiet=False, logging_steps=1)
    recorder = gpt2._TrainerRecorder(args, total_updates=1, name="hf-trainer")
    for _ in range(3):   # as transformers.Trainer.evaluate calls its callbacks
        recorder.on_prediction_step(None, None, None, eval_dataloader=[0, 1, 2])
    assert re.search(r"eval: +\d+%.*/3 ", terminal.getvalue())
    recorder.on_evaluate(None, None, None, metrics={"eval_loss": 1.0})
    assert recorder.eval_bar is None
    recorder.close()


def _no_probe(*args, **kwargs):
    raise AssertionError("probed the network although HF_HUB_OFFLINE is set")


def test_offline_hub_name_is_refused_at_once(monkeypatch):
    monkeypatch.setattr(socket, "create_connection", _no_probe)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit, match=re.escape(
            "error: --model_name_or_path ort-trainer-tests/not-cached: no such folder, not in the Hugging Face "
            "cache, and the hub is out of reach (HF_HUB_OFFLINE=1); download it where there is network")):
        gpt2.pretrained_source("ort-trainer-tests/not-cached")


def test_an_unreachable_hub_is_found_by_one_short_probe(monkeypatch):
    probes = []

    def unreachable(address, timeout):
        probes.append((address, timeout))
        raise OSError("Network is unreachable")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    with pytest.raises(SystemExit, match=re.escape("the hub is out of reach (huggingface.co does not answer: "
                                                   "Network is unreachable)")):
        gpt2.pretrained_source("ort-trainer-tests/not-cached")
    assert probes == [(("huggingface.co", 443), gpt2.HUB_PROBE_TIMEOUT_S)]
    # cached: loaded from the cache alone, no retries
    monkeypatch.setattr(gpt2.huggingface_hub, "try_to_load_from_cache", lambda name, file: f"/cache/{name}/{file}")
    assert gpt2.pretrained_source("gpt2") == {"local_files_only": True}


def test_a_local_folder_needs_no_probe(monkeypatch, tmp_path):
    monkeypatch.setattr(socket, "create_connection", _no_probe)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert gpt2.pretrained_source(str(tmp_path)) == {}


@pytest.mark.parametrize("module, flag, message", [
    ("matplotlib", ["--compare", "x.png"], "--compare draws its picture with matplotlib, which is not installed: "
     "pip install matplotlib (or pip install -e '.[examples]')"),
    ("mlflow", ["--mlflow"], "--mlflow needs MLflow, which is not installed: pip install mlflow-skinny "
     "(or pip install -e '.[examples]')")])
@pytest.mark.parametrize("name", EXAMPLES)
def test_a_missing_report_package_is_named_before_training(name, module, flag, message, monkeypatch, text):
    for loaded in {module, *(loaded for loaded in sys.modules if loaded.split(".")[0] == module)}:
        monkeypatch.setitem(sys.modules, loaded, None)   # `import module(.sub)` now raises ImportError
    data = ["--data" if name == "wikitext2" else "--train-file", str(text)]
    with pytest.raises(SystemExit, match=re.escape(f"error: {message}")):
        EXAMPLES[name].parse_args([*data, *flag])


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_ort_engine_without_a_working_ort_trainer_says_how_to_install_it(name, monkeypatch):
    for loaded in {"ort_trainer", *(loaded for loaded in sys.modules if loaded.split(".")[0] == "ort_trainer")}:
        monkeypatch.setitem(sys.modules, loaded, None)   # `import ort_trainer` now raises ImportError
    with pytest.raises(SystemExit, match=re.escape("error: --engine ort needs a working ort_trainer (pip install -e "
                                                   "'.[cpu]' from the repository root): import of ort_trainer halted")):
        EXAMPLES[name].ORTEngine(None, None, None)   # the import comes first


def _runs(store, experiment):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store.as_uri())
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, {run.info.run_name: run for run in runs}


def _compare_outputs(png, unit, steps):
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(png.with_suffix(".csv").open()))
    assert [(row["engine"], int(row[unit])) for row in rows] == [
        (engine, step) for engine in steps for step in range(1, steps[engine] + 1)]
    return rows


def test_wikitext2_compare_and_mlflow(text, tmp_path, monkeypatch):
    """Both engines from the same weights on the same batches: a PNG, the CSV of both loss curves
    (equal with dropout off), the per-batch losses in --json, one MLflow run per engine."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    results = wikitext2.main(["--data", str(text), "--epochs", "1", "--max-batches", "3", "--dropout", "0",
                              "--bptt", "8", "--batch-size", "4", "--eval-batch-size", "4", "--quiet",
                              "--compare", "out/loss.png", "--mlflow", "--json", "out/metrics.json"])
    rows = _compare_outputs(tmp_path / "out" / "loss.png", "batch", {"torch": 3, "ort": 3})
    assert [float(row["loss"]) for row in rows[:3]] == results["torch"]["train_losses"]
    assert results["ort"]["train_losses"] == pytest.approx(results["torch"]["train_losses"], rel=1e-4)
    assert '"train_losses"' in (tmp_path / "out" / "metrics.json").read_text(encoding="utf-8")
    client, runs = _runs(tmp_path / "mlruns", "examples.wikitext2")
    assert sorted(runs) == ["ort", "torch"]
    for engine, run in runs.items():
        assert run.data.params["engine"] == engine
        for key in ("loss", "ppl", "ms_per_batch"):
            history = client.get_metric_history(run.info.run_id, key)
            assert [metric.step for metric in history] == [1, 2, 3], key
        losses = [metric.value for metric in client.get_metric_history(run.info.run_id, "loss")]
        assert losses == results[engine]["train_losses"]
        assert run.data.metrics["test_loss"] == results[engine]["test_loss"]


def test_gpt2_compare_and_mlflow(text, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tiny = ["--block-size", "16", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--vocab-size", "300",
            "--per-device-train-batch-size", "2", "--per-device-eval-batch-size", "64", "--dropout", "0", "--quiet"]
    results = gpt2.main(["--train-file", str(text), "--max-steps", "2", *tiny, "--compare", "loss.png", "--mlflow"])
    rows = _compare_outputs(tmp_path / "loss.png", "update", {"ort": 2, "torch": 2})
    assert [float(row["loss"]) for row in rows[2:]] == results["torch"]["update_losses"]
    assert results["ort"]["update_losses"] == pytest.approx(results["torch"]["update_losses"], rel=1e-5)
    client, runs = _runs(tmp_path / "mlruns", "examples.gpt2")
    assert sorted(runs) == ["ort", "torch"]
    for engine, run in runs.items():
        history = client.get_metric_history(run.info.run_id, "ms_per_update")
        assert [metric.step for metric in history] == [1, 2]
        assert run.data.metrics["eval_loss"] == results[engine]["eval"]["loss"]
    with pytest.raises(SystemExit):
        gpt2.parse_args(["--train-file", str(text), "--engine", "hf-trainer", "--compare", "loss.png"])
