"""A stand-in for the part of CuPy that ort_trainer._optimizers.cuda_steps and tests/gpu/test_kernels_gpu.py use,
running the real kernels/*.cu on the CPU (emulator.hpp, compiled with g++): the kernels and
their launch code are exercised where no GPU is.

- Arrays are NumPy arrays (a subclass with CuPy's ``.device``, ``.data.ptr``, ``.get()``) on one
  fake device. Each allocation has guard bytes on both sides; every launch checks them, so a
  kernel writing out of bounds fails its launch. ``empty`` fills floats with NaN (memory a
  kernel must write is never silently right).
- ``RawModule(code=...)`` / ``RawKernel`` compile the source with emulator.hpp in front; a launch
  packs its arguments as CuPy does (arrays as device pointers, NumPy scalars as their C type) and
  checks each against the kernel's C signature: a NumPy int64 given for an ``int`` parameter
  would shift every later argument on a GPU, and fails here. Python numbers are refused (CuPy
  picks their C type, not the kernel).
- Launches run synchronously; streams are not modelled (tests of stream order need a GPU).

``install()`` puts it in ``sys.modules['cupy']``.
"""
import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import types
import weakref
from pathlib import Path

import numpy as np

_HEADER = Path(__file__).with_name("emulator.hpp")
_GUARD = 256  # bytes of guard on each side of an allocation (and CuPy's allocation alignment)
_GUARD_BYTE = 0xA5
_SM_COUNT = 2
_BUILD_DIR = Path(tempfile.gettempdir()) / f"ort_trainer_cpu_cuda_{os.getuid()}"


class _Device:
    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)
        if self.id != 0:
            raise ValueError(f"the CPU emulation has one device (0), got {device!r}")
        self.attributes = {"MultiProcessorCount": _SM_COUNT}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Pointer:
    def __init__(self, ptr):
        self.ptr = ptr


class ndarray(np.ndarray):
    """A NumPy array standing for device memory."""

    @property
    def device(self):
        return _Device(0)

    @property
    def data(self):
        return _Pointer(self.ctypes.data)

    def get(self):
        return np.array(self, copy=True).view(np.ndarray)

    def set(self, host):
        self[...] = host

    def __getitem__(self, key):
        """Indexing one element gives a 0-d device array, as in CuPy (a view, not a host number)."""
        result = super().__getitem__(key)
        if isinstance(result, np.ndarray):
            return result
        return super().__getitem__((*key, Ellipsis) if isinstance(key, tuple) else (key, Ellipsis))


_allocations = weakref.WeakValueDictionary()  # id -> raw byte buffer with guards, alive


def _allocate(shape, dtype):
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    raw = np.full(nbytes + 3 * _GUARD, _GUARD_BYTE, dtype=np.uint8).view(_Raw)
    start = -raw.ctypes.data % _GUARD + _GUARD  # the data 256-byte aligned, a guard before it
    raw.span = (start, start + nbytes)
    _allocations[id(raw)] = raw
    array = raw[start:start + nbytes].view(dtype).reshape(shape).view(ndarray)
    if dtype.kind in "fc":
        array.fill(np.nan)
    return array


class _Raw(np.ndarray):
    """An allocation's bytes, guards included (weak-referenceable, remembers where the data is)."""


def _check_guards(kernel):
    for raw in list(_allocations.values()):
        start, stop = raw.span
        for side, guard in (("before", raw[:start]), ("after", raw[stop:])):
            bad = np.flatnonzero(guard.view(np.ndarray) != _GUARD_BYTE)
            if bad.size:
                guard[...] = _GUARD_BYTE  # reported once, not again by every later launch
                raise RuntimeError(f"{kernel} wrote {bad.size} byte(s) {side} an allocation of "
                                   f"{stop - start} bytes (out of bounds)")


def empty(shape, dtype=np.float64):
    return _allocate((int(shape),) if np.isscalar(shape) else tuple(shape), dtype)


def full(shape, fill_value, dtype=None):
    array = empty(shape, dtype if dtype is not None else np.asarray(fill_value).dtype)
    array[...] = fill_value
    return array


def zeros(shape, dtype=np.float64):
    return full(shape, 0, dtype)


def ones(shape, dtype=np.float64):
    return full(shape, 1, dtype)


def asarray(a, dtype=None):
    if isinstance(a, ndarray) and (dtype is None or a.dtype == dtype):
        return a
    host = np.asarray(a, dtype=dtype)
    array = empty(host.shape, host.dtype)
    array[...] = host
    return array


def asnumpy(a):
    return np.array(a, copy=True).view(np.ndarray)


def copyto(dst, src):
    np.copyto(dst, src)


float32, float64, int32, int64 = np.float32, np.float64, np.int32, np.int64

# ------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------

_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)')
_SCALARS = {"int": np.int32, "unsigned": np.uint32, "unsigned int": np.uint32, "ort_i64": np.int64,
            "long long": np.int64, "double": np.float64, "float": np.float32, "bool": np.bool_}


def _parameters(text):
    """[(C type, name)] of a kernel's parameter list."""
    params = []
    for param in " ".join(text.split()).split(","):
        match = re.fullmatch(r"(.*?)\s*(\w+)", param.strip())
        params.append((match.group(1).replace(" *", "*"), match.group(2)))
    return params


def _compile(code):
    """{kernel name: (launcher, parameters)} of a CUDA source, built once per source text."""
    kernels = {name: _parameters(params) for name, params in _KERNEL.findall(code)}
    wrappers = []
    for name, params in kernels.items():
        args = ", ".join(f"*reinterpret_cast<{ctype}*>(args[{k}])" for k, (ctype, _) in enumerate(params))
        wrappers.append(f'extern "C" const char* ortemu_launch_{name}(unsigned grid, unsigned block, void** args) '
                        f"{{ return ortemu_launch(grid, block, [&]() {{ {name}({args}); }}); }}")
    source = f'#include "{_HEADER}"\n#line 1 "kernel.cu"\n{code}\n' + "\n".join(wrappers) + "\n"
    digest = hashlib.sha256(source.encode() + _HEADER.read_bytes()).hexdigest()[:16]
    _BUILD_DIR.mkdir(exist_ok=True)
    library = _BUILD_DIR / f"{digest}.so"
    if not library.exists():
        cpp = _BUILD_DIR / f"{digest}.{os.getpid()}.cpp"
        cpp.write_text(source)
        partial = library.with_suffix(f".{os.getpid()}.so")
        # maybe-uninitialized: g++ cannot see that a kernel sets an Op's group before its first use
        command = ["g++", "-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-Wall", "-Werror",
                   "-Wno-unused-function", "-Wno-maybe-uninitialized", str(cpp), "-o", str(partial)]
        result = subprocess.run(command, capture_output=True, text=True)
        cpp.unlink()
        if result.returncode:
            raise RuntimeError(f"g++ could not compile the kernel source:\n{result.stderr}")
        os.replace(partial, library)
    lib = ctypes.CDLL(str(library))
    launchers = {}
    for name, params in kernels.items():
        launcher = getattr(lib, f"ortemu_launch_{name}")
        launcher.restype = ctypes.c_char_p
        launcher.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)]
        launchers[name] = (launcher, params)
    return launchers


_libraries = {}


class RawKernel:
    def __init__(self, code, name, options=(), **_):
        if code not in _libraries:
            _libraries[code] = _compile(code)
        if name not in _libraries[code]:
            raise RuntimeError(f"no extern \"C\" __global__ kernel {name!r} in the source")
        self.name = name
        self._launcher, self._params = _libraries[code][name]

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None):
        grid, block = tuple(grid), tuple(block)
        if any(size != 1 for size in (*grid[1:], *block[1:])):
            raise ValueError(f"{self.name}: only 1-d grids and blocks are emulated, got {grid}, {block}")
        if shared_mem:
            raise ValueError(f"{self.name}: dynamic shared memory is not emulated")
        if len(args) != len(self._params):
            raise TypeError(f"{self.name} takes {len(self._params)} arguments, got {len(args)}")
        holders = [self._pack(k, arg) for k, arg in enumerate(args)]
        pointers = (ctypes.c_void_p * len(holders))(*(holder.ctypes.data for holder in holders))
        error = self._launcher(grid[0], block[0], pointers)
        if error:
            raise RuntimeError(f"{self.name}<<<{grid[0]}, {block[0]}>>>: {error.decode()}")
        _check_guards(self.name)

    def _pack(self, k, arg):
        """The bytes CuPy would pass for `arg`, checked against parameter k's C type."""
        ctype, pname = self._params[k]
        where = f"{self.name} argument {k} ({ctype} {pname})"
        if ctype.endswith("*"):
            if isinstance(arg, ndarray):
                return np.array([arg.ctypes.data], dtype=np.uint64)
            if isinstance(arg, np.uint64):
                return np.array([arg], dtype=np.uint64)
            raise TypeError(f"{where}: a pointer needs a device array or a numpy.uint64 address, got "
                            f"{type(arg).__name__}")
        expected = _SCALARS.get(ctype)
        if expected is None:
            raise TypeError(f"{where}: the emulation knows no C type {ctype!r}")
        if not isinstance(arg, np.generic):
            raise TypeError(f"{where}: pass a NumPy scalar ({np.dtype(expected).name}), got the Python "
                            f"{type(arg).__name__} {arg!r}, whose C type CuPy chooses, not the kernel")
        if arg.dtype != expected:
            raise TypeError(f"{where}: CuPy would pass a {arg.dtype} ({arg.dtype.itemsize} bytes) where the "
                            f"kernel reads a {np.dtype(expected).name}")
        return np.array([arg], dtype=expected)


class RawModule:
    def __init__(self, code, options=(), **_):
        self.code = code

    def get_function(self, name):
        return RawKernel(self.code, name)


def _get_device_count():
    return 1


cuda = types.SimpleNamespace(Device=_Device, runtime=types.SimpleNamespace(getDeviceCount=_get_device_count))


def __getattr__(name):
    """Other array functions: NumPy's, results as device arrays."""
    function = getattr(np, name)
    if not callable(function):
        return function

    def wrapped(*args, **kwargs):
        result = function(*args, **kwargs)
        return result.view(ndarray) if isinstance(result, np.ndarray) else result
    return wrapped


def install():
    """Makes `import cupy` give this module (before anything imports the real one)."""
    sys.modules["cupy"] = sys.modules[__name__]
