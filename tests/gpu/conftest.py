"""Tests under tests/gpu/ need CuPy and a CUDA device: they are marked `gpu` and skipped
(with the reason) where either is missing. The `gpu` marker is registered in pytest.ini."""
import functools
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def _unavailable() -> str | None:
    """Why GPU tests cannot run here, or None."""
    try:
        import cupy
    except ImportError as error:
        return f"CuPy is not installed ({error})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CUDARuntimeError without a driver
        return f"no CUDA device ({type(error).__name__}: {error})"
    return None if count > 0 else "no CUDA device"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        reason = _unavailable()
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def torch_tf32_off():
    """TF32 off in torch for a module's tests (ONNX Runtime's is off through `use_tf32`): fp32 products on both."""
    import torch

    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
