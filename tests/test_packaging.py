"""Install-level behaviour: the ImportError without a training build, package data in the wheel."""
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_inference_only_onnxruntime_is_named_in_the_import_error(tmp_path):
    fake = tmp_path / "onnxruntime"
    (fake / "capi").mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '1.30.0'\n")
    (fake / "capi" / "__init__.py").write_text("")
    (fake / "capi" / "_pybind_state.py").write_text("")  # no GradientGraphBuilder: inference only
    result = subprocess.run([sys.executable, "-c", "import ort_trainer"], capture_output=True, text=True,
                            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ort-trainer needs ONNX Runtime's training build, but onnxruntime-training-cpu==")
    assert last.endswith("is installed, an inference-only build without the gradient builder. Uninstall it, then "
                         "pip install -e '.[cpu]' (CPU) or pip install -e '.[gpu]' (CUDA) in the ort-trainer "
                         "checkout (README, Install)")


def test_missing_onnxruntime_says_which_extra_to_install(tmp_path):
    (tmp_path / "onnxruntime.py").write_text("raise ImportError('No module named onnxruntime')\n")
    result = subprocess.run([sys.executable, "-c", "import ort_trainer"], capture_output=True, text=True,
                            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: ort-trainer needs ONNX Runtime's training build, and onnxruntime is not importable "
        "(No module named onnxruntime): pip install -e '.[cpu]' (CPU) or pip install -e '.[gpu]' (CUDA) in the "
        "ort-trainer checkout (README, Install)")


def test_importing_ort_trainer_leaves_onnxruntimes_own_ortmodule_and_deepspeed_unimported():
    script = ("import sys, ort_trainer.ortmodule; "
              "print(sorted(m for m in sys.modules if m.startswith(('onnxruntime.training.ortmodule', 'deepspeed'))))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_install_advice_names_checkout_commands_the_readme_gives():
    """ort-trainer is not on PyPI: every install command an error names installs the checkout with
    one of setup.py's extras, and README's Install section gives that same command."""
    from ort_trainer import _install
    from ort_trainer._optimizers import cuda_launch
    from ort_trainer._runtime import cuda_requirements

    install_section = (ROOT / "README.md").read_text(encoding="utf-8").split("## Install\n")[1].split("\n## ")[0]
    extras = (ROOT / "setup.py").read_text(encoding="utf-8").split("extras_require=")[1]
    named = []
    for message in (_install._INSTALL, cuda_requirements._GPU_EXTRA, cuda_launch._INSTALL_HINT):
        commands = re.findall(r"pip install [^(]*?'[^']*'", message)
        assert commands, message
        for command in commands:
            extra = re.fullmatch(r"pip install -e '\.\[(\w+)\]'", command)
            assert extra, f"{command!r} does not install the checkout"
            assert f'"{extra[1]}": [' in extras
            assert f"`{command}`" in install_section
            named.append(extra[1])
    assert set(named) == {"cpu", "gpu"}


@pytest.mark.slow
def test_wheel_ships_kernels_and_schemas(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), "."], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("ort_trainer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ("ort_trainer/kernels/adam.cu", "ort_trainer/kernels/common.cuh", "ort_trainer/schemas/options.yaml",
                     "ort_trainer/schemas/model_desc.yaml", "ort_trainer/amp/__init__.py",
                     "ort_trainer/optim/lr_scheduler.py", "ort_trainer/data/_sampler.py",
                     "ort_trainer/ortmodule/__init__.py"):
        assert expected in names
    sources = {path.relative_to(ROOT).as_posix() for path in (ROOT / "ort_trainer").rglob("*.py")}
    assert sources - names == set()  # every module ships: setup.py's packages list each stage
