"""What the READMEs promise is what a reader gets: the first snippet runs as written, and every error
message they quote (`"..."` in backticks) is the message the code raises today."""
import contextlib
import importlib
import io
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from examples.gpt2 import train as gpt2
from examples.wikitext2 import train as wikitext2
from ort_trainer import ORTTrainer, ORTTrainerOptions, optim

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "DESIGN.md", *sorted((ROOT / "examples").glob("*/README.md"))]


def quoted_messages():
    """Every `"..."` of the docs: by the docs' convention, an error message quoted verbatim."""
    return sorted({message for doc in DOCS for message in re.findall(r'`"([^`]+)"`', doc.read_text(encoding="utf-8"))})


def _message(call):
    """The message of what ``call`` raises; for the examples' command-line errors (SystemExit), the
    text after ``error: `` (on stderr for argparse's)."""
    stderr = io.StringIO()
    with pytest.raises(BaseException) as error, contextlib.redirect_stderr(stderr):
        call()
    if isinstance(error.value, SystemExit):
        text = error.value.code if isinstance(error.value.code, str) else stderr.getvalue().strip()
        return text.split("error: ", 1)[1]
    return str(error.value)


def _without(module, call):
    def run():
        with pytest.MonkeyPatch.context() as patch:
            for name in {module, *(name for name in sys.modules if name.split(".")[0] == module)}:
                patch.setitem(sys.modules, name, None)   # `import module(.sub)` now raises ImportError
            call()
    return run


def _untrained_export():
    trainer = ORTTrainer(nn.Linear(3, 2), {"inputs": [("x", ["b", 3]), ("y", ["b"])], "outputs": [("loss", [], True)]},
                         optim.SGDConfig(), loss_fn=nn.functional.cross_entropy)
    trainer.export_onnx("never-written.onnx")


# How to make each quoted message happen; a new quote needs a line here.
TRIGGERS = {
    "Invalid options: mixed_precision.enabled: must be a bool, got 1 (int)":
        lambda: ORTTrainerOptions({"mixed_precision": {"enabled": 1}}),
    "Invalid AdamConfig: params[0].lr: cannot be set per parameter group (lr is global), got 0.1":
        lambda: optim.AdamConfig(params=[{"params": ["w"], "lr": 0.1}]),
    "export_onnx() needs a sample batch: call train_step() or eval_step() once first": _untrained_export,
    "--mixed-precision applies to --engine ort and torch; transformers.Trainer has its own (its fp16/bf16 arguments)":
        lambda: gpt2.parse_args(["--engine", "hf-trainer", "--mixed-precision", "--train-file", __file__]),
    "--compare draws its picture with matplotlib, which is not installed: pip install matplotlib (or pip install -e "
    "'.[examples]')": _without("matplotlib", lambda: wikitext2.parse_args(["--data", __file__, "--compare", "x.png"])),
    "--mlflow needs MLflow, which is not installed: pip install mlflow-skinny (or pip install -e '.[examples]')":
        _without("mlflow", lambda: wikitext2.parse_args(["--data", __file__, "--mlflow"])),
}


@pytest.mark.parametrize("message", quoted_messages())
def test_every_quoted_message_is_what_the_code_says(message):
    assert message in TRIGGERS, f"the docs quote {message!r}: add how to trigger it to TRIGGERS"
    assert _message(TRIGGERS[message]) == message


def test_every_trigger_is_still_quoted():
    assert sorted(TRIGGERS) == quoted_messages()


def test_the_readme_snippet_runs_as_written(tmp_path, monkeypatch):
    snippet = (ROOT / "README.md").read_text(encoding="utf-8").split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="fixed to the sample batch's sizes"):   # MultiheadAttention's bptt
        exec(compile(snippet.replace("ntokens = 1000", "ntokens = 50"), "README.md", "exec"), {})
    assert (tmp_path / "model.onnx").stat().st_size > 0


def test_the_test_command_says_how_long_and_gives_a_quick_first_check():
    from tests.conftest import QUICK

    development = (ROOT / "README.md").read_text(encoding="utf-8").split("## Development\n")[1]
    assert re.search(r"`python -m pytest -q`: about [\d,]+ tests, about \d+ minutes on 2 idle CPU cores", development)
    assert "`python -m pytest -q -m quick`" in development
    assert "quick:" in (ROOT / "pytest.ini").read_text(encoding="utf-8")   # a registered marker
    assert len({test.split("::")[0] for test in QUICK}) >= 5   # across the stages
    for test in QUICK:
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(encoding="utf-8"), re.M), test


# ---------------------------------------------------------------- DESIGN.md's module table and module paths

DESIGN = ROOT / "DESIGN.md"
PACKAGE = ROOT / "ort_trainer"


def _module_rows():
    """The files and folders (relative to ort_trainer/) each row of DESIGN.md's module table names; a
    bare name after a path is in that path's folder (`_optimizers/cuda_steps.py`, `cuda_launch.py`)."""
    table = DESIGN.read_text(encoding="utf-8").split("## Modules (one concern each)\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        folder, names = "", []
        for name in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            if "/" in name.rstrip("/"):
                folder = name.rsplit("/", 1)[0] + "/"
            names.append(name if "/" in name.rstrip("/") else folder + name)
        rows.append(names)
    return rows


def test_every_module_has_a_row_and_every_row_names_a_module():
    named = [name for row in _module_rows() for name in row]
    assert [name for name in named if not (PACKAGE / name).exists()] == []
    modules = sorted(path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py"))
    covered = set(named) | {module for module in modules for name in named if name.endswith("/")
                            and module.startswith(name)}
    empty_packages = {module for module in modules if module.endswith("__init__.py")
                      and not (PACKAGE / module).read_text(encoding="utf-8").strip()}  # a stage: its row is in Stages
    assert [module for module in modules if module not in covered | empty_packages] == []


def test_the_module_rows_run_in_stage_order():
    from tests.test_layering import STAGES

    order = [(row[0], STAGES[stage]) for row in _module_rows()
             if (stage := row[0].split("/")[0].removesuffix(".py")).startswith("_") and not stage.startswith("__")]
    misplaced = [f"{name} after {previous}" for (previous, before), (name, stage) in zip(order, order[1:])
                 if stage < before]
    assert misplaced == []


def _design_references():
    """Module paths DESIGN.md names in backticks: files (`_export/trace.py`, `kernels/amp.cu`) and dotted
    or slashed names under a private stage (`_graph.recompute`, `_export/trace.export_training_model`,
    `ort_trainer._configuration.model_desc.parse_model_desc`)."""
    spans = re.findall(r"`([^`\n]+)`", DESIGN.read_text(encoding="utf-8"))
    files = {path for span in spans for path in re.findall(r"(?<![\w./*<{-])((?:[\w-]+/)+[\w-]+\.(?:py|cu|yaml|md))\b",
                                                             span)}
    stages = {path.stem for path in PACKAGE.iterdir() if path.name.startswith("_") and not path.name.startswith("__")}
    dotted = {match.group(0) for span in spans
              for match in re.finditer(r"(?<![\w./])(ort_trainer\.)?(_[a-z]\w*)(?:[./][A-Za-z_]\w*)+", span)
              if (match.group(1) or match.group(2) in stages) and not match.group(0).endswith(".py")}
    return sorted(files), sorted(dotted)


def _resolves(dotted):
    parts = dotted.removeprefix("ort_trainer.").replace("/", ".").split(".")
    for end in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(["ort_trainer", *parts[:end]]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[end:]:
            found = getattr(found, attribute, None)
        return found is not None
    return False


def test_every_module_path_the_design_names_exists():
    files, dotted = _design_references()
    assert len(files) > 50 and len(dotted) > 20  # the patterns still find DESIGN.md's references
    assert [path for path in files if not (ROOT / path).exists() and not (PACKAGE / path).exists()] == []
    assert [name for name in dotted if not _resolves(name)] == []
