"""What the CUDA path needs before a CUDA session can exist, each with an error naming what is missing.

onnxruntime-training 1.19.2's CUDA provider links CUDA 11.8 libraries at load time; they come
from the nvidia-*-cu11 wheels of the `gpu` extra and are loaded from there, so users need no
LD_LIBRARY_PATH.
"""
import ctypes
import importlib.util
import os
import sys

_GPU_EXTRA = "pip install 'ort-trainer[gpu]'"
# (library soname, wheel package directory under site-packages/nvidia, wheel name), load order.
_CUDA11_LIBRARIES = (
    ("libcudart.so.11.0", "cuda_runtime", "nvidia-cuda-runtime-cu11"),
    ("libcublasLt.so.11", "cublas", "nvidia-cublas-cu11"),
    ("libcublas.so.11", "cublas", "nvidia-cublas-cu11"),
    ("libcudnn.so.8", "cudnn", "nvidia-cudnn-cu11==8.9.*"),
    ("libcurand.so.10", "curand", "nvidia-curand-cu11"),
    ("libcufft.so.10", "cufft", "nvidia-cufft-cu11"),
)


class CudaUnavailable(RuntimeError):
    """device.id asks for CUDA and something it needs is missing; never a silent CPU fallback."""


def _nvidia_lib_dir(package):
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        directory = os.path.join(root, package, "lib")
        if os.path.isdir(directory):
            return directory
    return None


def preload_cuda11_libraries():
    """Loads the CUDA 11 libraries from the installed wheels (RTLD_GLOBAL) before ORT needs them."""
    for soname, package, wheel in _CUDA11_LIBRARIES:
        directory = _nvidia_lib_dir(package)
        path = os.path.join(directory, soname) if directory else soname
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as error:
            raise CudaUnavailable(f"device.id asks for CUDA, but {soname} cannot be loaded ({error}); "
                                  f"install the {wheel} wheel ({_GPU_EXTRA})") from error


def require_cuda(device_index):
    """Checks, in order, everything the CUDA path needs; returns the cupy module."""
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
        hint = ("; onnxruntime-training's GPU build is published for CPython <= 3.11, this is " + python
                if sys.version_info >= (3, 12) else "")
        raise CudaUnavailable(f"device.id asks for CUDA, but the installed ONNX Runtime "
                              f"{onnxruntime.__version__} has no CUDAExecutionProvider (a CPU build?): "
                              f"{_GPU_EXTRA}{hint}")
    try:
        import cupy
    except ImportError as error:
        raise CudaUnavailable(f"device.id asks for CUDA, but CuPy is not importable ({error}): {_GPU_EXTRA}") from error
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:
        raise CudaUnavailable(f"device.id asks for CUDA, but no CUDA driver/device is usable ({error})") from error
    if device_index >= count:
        raise CudaUnavailable(f"device.id asks for cuda:{device_index}, but only {count} CUDA device(s) exist")
    preload_cuda11_libraries()
    return cupy
