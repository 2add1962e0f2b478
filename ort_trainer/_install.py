"""Checks that ONNX Runtime's *training* build is importable, and says what to install if not."""
import importlib
import importlib.abc
import sys
from importlib import metadata

_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-training", "onnxruntime-training-cpu")
# ort-trainer is not on PyPI: these install it, with its ONNX Runtime, from a checkout (README, Install).
CPU_INSTALL = "pip install -e '.[cpu]'"
GPU_INSTALL = "pip install -e '.[gpu]'"
FROM_CHECKOUT = "in the ort-trainer checkout"
_INSTALL = f"{CPU_INSTALL} (CPU) or {GPU_INSTALL} (CUDA) {FROM_CHECKOUT} (README, Install)"


def _installed():
    found = []
    for name in _DISTRIBUTIONS:
        try:
            found.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return found


class _WithoutOrtModule(importlib.abc.MetaPathFinder):
    """Refuses ONNX Runtime's own ORTModule while onnxruntime is first imported: its package check
    imports it only to learn whether it exists, which took half of the import's time and imported
    DeepSpeed where installed (and fails with torch 2.13 after all: its exporter hooks are gone).
    ort-trainer never uses it."""

    def find_spec(self, name, path=None, target=None):
        if name == "onnxruntime.training.ortmodule":
            raise ImportError("not imported by ort-trainer")
        return None


def _import_onnxruntime():
    if "onnxruntime" in sys.modules:
        return
    finder = _WithoutOrtModule()
    sys.meta_path.insert(0, finder)
    try:
        importlib.import_module("onnxruntime")
    finally:
        sys.meta_path.remove(finder)


def require_training_build():
    try:
        _import_onnxruntime()
    except ImportError as error:
        raise ImportError(f"ort-trainer needs ONNX Runtime's training build, and onnxruntime is not "
                          f"importable ({error}): {_INSTALL}") from error
    if not hasattr(importlib.import_module("onnxruntime.capi._pybind_state"), "GradientGraphBuilder"):
        installed = ", ".join(_installed()) or "an onnxruntime build"
        raise ImportError(f"ort-trainer needs ONNX Runtime's training build, but {installed} is installed, "
                          f"an inference-only build without the gradient builder. Uninstall it, then "
                          f"{_INSTALL}")
