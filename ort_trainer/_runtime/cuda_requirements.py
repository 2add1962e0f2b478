"""What the CUDA path needs before a CUDA session can exist, each with an error naming what is missing.

onnxruntime-training 1.19.2's CUDA provider links CUDA 11.8 libraries at load time and cuDNN 8
loads its sub-libraries by name when first used; CuPy (cupy-cuda11x) compiles our kernels with
NVRTC 11. They come from the nvidia-*-cu11 wheels of the `gpu` extra and are loaded from there
(RTLD_GLOBAL, by path), so users need no LD_LIBRARY_PATH. Those wheels share their folders
(`nvidia/cublas/lib`, ...) with the CUDA 12/13 wheels a CUDA torch brings: a folder is used only
if it holds the CUDA 11 soname. Every soname differs between the CUDA generations, so both sets
live in one process, each bound to its own.
"""
import ctypes
import importlib.util
import os
import sys
import warnings

from .._configuration.ortmodule_settings import FallbackPolicy
from .._configuration.refusals import Refusal
from .._install import FROM_CHECKOUT, GPU_INSTALL

_GPU_EXTRA = f"{GPU_INSTALL} {FROM_CHECKOUT}"
_CUDNN_WHEEL = "nvidia-cudnn-cu11==8.9.*"
# (library soname, wheel package directory under site-packages/nvidia, wheel name), load order:
# each after the libraries it needs.
CUDA11_LIBRARIES = (
    ("libcudart.so.11.0", "cuda_runtime", "nvidia-cuda-runtime-cu11"),
    ("libcublasLt.so.11", "cublas", "nvidia-cublas-cu11"),
    ("libcublas.so.11", "cublas", "nvidia-cublas-cu11"),
    ("libcudnn_ops_infer.so.8", "cudnn", _CUDNN_WHEEL),
    ("libcudnn_ops_train.so.8", "cudnn", _CUDNN_WHEEL),
    ("libcudnn_cnn_infer.so.8", "cudnn", _CUDNN_WHEEL),
    ("libcudnn_cnn_train.so.8", "cudnn", _CUDNN_WHEEL),
    ("libcudnn_adv_infer.so.8", "cudnn", _CUDNN_WHEEL),
    ("libcudnn_adv_train.so.8", "cudnn", _CUDNN_WHEEL),
    ("libcudnn.so.8", "cudnn", _CUDNN_WHEEL),
    ("libcurand.so.10", "curand", "nvidia-curand-cu11"),
    ("libcufft.so.10", "cufft", "nvidia-cufft-cu11"),
    ("libnvrtc-builtins.so.11.8", "cuda_nvrtc", "nvidia-cuda-nvrtc-cu11"),
    ("libnvrtc.so.11.2", "cuda_nvrtc", "nvidia-cuda-nvrtc-cu11"),
)
NVRTC11 = ("libnvrtc-builtins.so.11.8", "libnvrtc.so.11.2")
# cuDNN opens these by name only for convolutions and recurrent layers: a CUDA path without them
# (a trimmed install) still trains every other model, so their absence is a warning, not a refusal.
FIRST_USE_ONLY = ("libcudnn_cnn_infer.so.8", "libcudnn_cnn_train.so.8", "libcudnn_adv_infer.so.8",
                  "libcudnn_adv_train.so.8")


class CudaUnavailable(Refusal, RuntimeError):
    """device.id asks for CUDA and something it needs is missing; never a silent CPU fallback."""

    fallback = FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE


def _nvidia_roots():
    """The folders of the `nvidia` namespace package (one per site-packages holding nvidia wheels)."""
    spec = importlib.util.find_spec("nvidia")
    return list(spec.submodule_search_locations) if spec else []


def nvidia_library(soname, package):
    """The path of `soname` in the first `nvidia/<package>/lib` folder that holds it, else None."""
    for root in _nvidia_roots():
        path = os.path.join(root, package, "lib", soname)
        if os.path.isfile(path):
            return path
    return None


def preload_cuda11_libraries(sonames=None):
    """Loads the CUDA 11 libraries (all, or `sonames`, in CUDA11_LIBRARIES' order) with RTLD_GLOBAL
    before ORT or CuPy need them: from the nvidia wheels where installed, else by soname (the
    system's library path). Returns {soname: ctypes.CDLL}."""
    loaded, missing = {}, []
    for soname, package, wheel in CUDA11_LIBRARIES:
        if sonames is not None and soname not in sonames:
            continue
        path = nvidia_library(soname, package) or soname
        try:
            loaded[soname] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as error:
            if soname not in FIRST_USE_ONLY:
                raise CudaUnavailable(f"device.id asks for CUDA, but {soname} cannot be loaded ({error}); "
                                      f"install the {wheel} wheel ({_GPU_EXTRA})") from error
            missing.append((soname, wheel))
    if missing:
        warnings.warn(f"{', '.join(soname for soname, _ in missing)} cannot be loaded: convolutions and recurrent "
                      f"layers on CUDA will fail in cuDNN, other models train; install the {missing[0][1]} wheel "
                      f"({_GPU_EXTRA})", RuntimeWarning, stacklevel=2)
    return loaded


def require_cuda(device_index):
    """Checks, in order, everything the CUDA path needs; returns the cupy module."""
    import onnxruntime
    import torch

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
        hint = ("; onnxruntime-training's GPU build is published for CPython <= 3.11, this is " + python
                if sys.version_info >= (3, 12) else "")
        raise CudaUnavailable(f"device.id asks for CUDA, but the installed ONNX Runtime "
                              f"{onnxruntime.__version__} has no CUDAExecutionProvider (a CPU build?): "
                              f"{_GPU_EXTRA}{hint}")
    if not torch.cuda.is_available():
        build = "a CPU build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        raise CudaUnavailable(f"device.id asks for CUDA, but torch {torch.__version__} cannot use a GPU here "
                              f"({build}; torch.cuda.is_available() is False): install a CUDA build of torch "
                              "(https://pytorch.org/get-started) and check the NVIDIA driver (nvidia-smi)")
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


def require_cuda_provider(session_providers):
    """ONNX Runtime builds a CPU session, with only a logged error, when its CUDA provider library
    (libonnxruntime_providers_cuda.so) fails to load: refuse that session by name."""
    if "CUDAExecutionProvider" not in session_providers:
        raise CudaUnavailable(
            f"device.id asks for CUDA, but ONNX Runtime created the session with {list(session_providers)} only: "
            "its CUDA provider failed to load (see ONNX Runtime's error log above; usually a CUDA 11.8 / cuDNN 8 "
            f"library it links is missing or from another CUDA version): {_GPU_EXTRA}")
