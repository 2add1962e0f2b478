"""What can be checked about the CUDA kernels without a GPU (runs in CI).

- Every ``kernels/*.cu``, as ``cuda_launch.kernel_source`` hands it to NVRTC, compiles to PTX with
  ``nvcc -ptx`` under the same options (``cuda_launch.NVRTC_OPTIONS`` plus the ``-ftz=true`` CuPy
  appends), warnings as errors, and exports exactly the entry points ``cuda_launch.KERNELS`` names.
  Skipped only where nvcc is not on PATH.
- The mirrors between the C++ and Python sides agree: launch constants, struct sizes, the
  OrtGroup field of every hyperparameter.
- The host-side tables (group table, Lamb chunk table) are right, and a missing CuPy gives the
  ImportError that says what to install.
"""
import ctypes
import dataclasses
import importlib.resources
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ort_trainer._optimizers import cuda_steps as K
from ort_trainer._optimizers import cuda_launch as L
from ort_trainer._optimizers import cuda_tables as T
from ort_trainer._optimizers.flat import FlatLayout
from ort_trainer._optimizers.hyper import AdamHyper, LambHyper
from ort_trainer._runtime.cuda_requirements import NVRTC11, CudaUnavailable, preload_cuda11_libraries

NVCC = shutil.which("nvcc")
# The oldest architecture current nvcc targets, and Hopper (the H100 the project measures on).
ARCHES = ("compute_75", "compute_90")
# CuPy appends this to the caller's NVRTC options (cupy.cuda.compiler), after them.
CUPY_APPENDED_OPTIONS = ("-ftz=true",)


def _files():
    return importlib.resources.files("ort_trainer.kernels")


def nvcc_options(nvrtc_options):
    """NVRTC options in nvcc's spelling; an option without a translation fails the test, so
    that a new entry in NVRTC_OPTIONS gets one here."""
    translated = []
    for option in nvrtc_options:
        if re.fullmatch(r"--?std=c\+\+\d\d", option):
            translated.append("-std=" + option.split("=", 1)[1])
        elif re.fullmatch(r"--?(ftz|prec-div|prec-sqrt|fmad)=(true|false)", option):
            translated.append("-" + option.lstrip("-"))
        elif re.fullmatch(r"-[DU]\w+(=\S*)?", option):
            translated.append(option)
        elif option in ("--use_fast_math", "-use_fast_math"):
            translated.append("-use_fast_math")
        else:
            raise AssertionError(f"no nvcc spelling known for the NVRTC option {option!r}: add one "
                                 f"to tests/test_kernels_compile.py")
    return translated


def test_every_kernel_file_is_known():
    on_disk = sorted(p.name[:-3] for p in _files().iterdir() if p.name.endswith(".cu"))
    assert on_disk == sorted(L.KERNELS)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("family", sorted(L.KERNELS))
def test_kernel_compiles_to_ptx(family, arch, tmp_path):
    source = tmp_path / f"{family}.cu"
    source.write_text(L.kernel_source(family), encoding="utf-8")
    ptx = tmp_path / f"{family}.ptx"
    command = [NVCC, "-ptx", f"-arch={arch}", *nvcc_options(L.NVRTC_OPTIONS + CUPY_APPENDED_OPTIONS),
               "-Werror", "all-warnings", str(source), "-o", str(ptx)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, (f"nvcc failed ({result.returncode}): {' '.join(command)}\n"
                                    f"{result.stdout}{result.stderr}")
    entries = re.findall(r"\.entry\s+(\w+)\s*\(", ptx.read_text())
    assert sorted(entries) == sorted(L.KERNELS[family])


def _nvrtc11():
    """NVRTC 11 (the compiler cupy-cuda11x uses at run time beside ORT's CUDA 11.8 build), loaded as
    the CUDA path loads it (`_cuda.preload_cuda11_libraries`), or None where its wheel is missing."""
    try:
        return preload_cuda11_libraries(NVRTC11)["libnvrtc.so.11.2"]
    except CudaUnavailable:
        return None


def nvrtc_compile(nvrtc, source, name, options):
    """(result code, PTX, log) of NVRTC compiling `source` with `options`, through its C API."""
    program = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None) == 0
    try:
        encoded = [option.encode() for option in options]
        result = nvrtc.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        ptx = b""
        if result == 0:
            nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size))
            buffer = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetPTX(program, buffer)
            ptx = buffer.value
        return result, ptx.decode(), log.value.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


NVRTC11_LIBRARY = _nvrtc11()


@pytest.mark.skipif(NVRTC11_LIBRARY is None, reason="nvidia-cuda-nvrtc-cu11 is not installed")
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("family", sorted(L.KERNELS))
def test_kernel_compiles_with_nvrtc_11(family, arch):
    """What CuPy does on a user's GPU: NVRTC 11.8 compiles the source with our options and the
    device's architecture, no warning (nvcc above is CUDA 13's)."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    NVRTC11_LIBRARY.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    assert major.value == 11
    options = [*L.NVRTC_OPTIONS, *CUPY_APPENDED_OPTIONS, f"--gpu-architecture={arch}"]
    result, ptx, log = nvrtc_compile(NVRTC11_LIBRARY, L.kernel_source(family), f"{family}.cu", options)
    assert result == 0 and not log.strip(), f"NVRTC {major.value}.{minor.value} failed ({result}):\n{log}"
    entries = re.findall(r"\.entry\s+(\w+)\s*\(", ptx)
    assert sorted(entries) == sorted(L.KERNELS[family])


def test_kernel_source_inlines_common_header():
    for family in L.KERNELS:
        text = L.kernel_source(family)
        assert '#include "common.cuh"' not in [line.strip() for line in text.splitlines()]
        assert "struct OrtGroup" in text and text.startswith(f'#line 1 "{family}.cu"')


# ----------------------------------------------------------------------------------------------
# C++ <-> Python mirrors
# ----------------------------------------------------------------------------------------------


def _defines(text):
    return {name: int(value) for name, value in re.findall(r"#define\s+(\w+)\s+(\d+)\b", text)}


def test_launch_constants_match_common_header():
    defines = _defines(_files().joinpath("common.cuh").read_text())
    assert (defines["ORT_BLOCK"], defines["ORT_CHUNK"], defines["ORT_MAX_PARTIALS"]) == (
        T.BLOCK, T.CHUNK, T.MAX_PARTIALS)
    assert T.CHUNK % 4 == 0 and T.BLOCK % 32 == 0


def test_struct_sizes_match_static_asserts():
    text = _files().joinpath("common.cuh").read_text()
    sizes = dict(re.findall(r"static_assert\(sizeof\((\w+)\) == (\d+)", text))
    assert int(sizes["OrtGroup"]) == T.GROUP_DTYPE.itemsize
    assert int(sizes["OrtChunk"]) == T.CHUNK_DTYPE.itemsize


@pytest.mark.parametrize("family", sorted(T.GROUP_FIELDS))
def test_group_fields_match_kernel_defines(family):
    text = _files().joinpath(f"{family}.cu").read_text()
    fields = {name: (field, int(index)) for name, index, field in re.findall(
        rf"#define\s+ORT_{family.upper()}_(\w+)\s+(\d+)\s*//\s*(f|d|flags)\[", text)}
    assert fields == T.GROUP_FIELDS[family]
    for name, (field, index) in fields.items():  # the comment's index is the define's value
        assert re.search(rf"ORT_{family.upper()}_{name}\s+{index}\s*//\s*{field}\[{index}\]", text)


# ----------------------------------------------------------------------------------------------
# Host-side tables
# ----------------------------------------------------------------------------------------------

ADAM = AdamHyper(alpha=0.9, beta=0.999, lambda_coef=0.01, epsilon=1e-8, do_bias_correction=True,
                 weight_decay_mode=1)
LAMB = LambHyper(alpha=0.8, beta=0.99, lambda_coef=0.0, epsilon=1e-6, ratio_min=-np.inf,
                 ratio_max=2.0, do_bias_correction=False)


def test_group_table_packs_hyperparameters():
    layout = FlatLayout.from_sizes([[3, 5], [7]], [ADAM, dataclasses.replace(ADAM, weight_decay_mode=0)])
    table = T.group_table(layout, "adam")
    assert table.dtype == T.GROUP_DTYPE and table.size == 2
    assert table["start"].tolist() == [0, 8] and table["stop"].tolist() == [8, 15]
    f, d, flags = table[0]["f"], table[0]["d"], table[0]["flags"]
    assert f[1] == np.float32(1 - 0.9) and f[3] == np.float32(1 - 0.999)  # rounded from double
    assert d[0] == 0.9 and d[1] == 0.999 and f[4] == np.float32(0.01) and f[5] == np.float32(1e-8)
    assert flags[:2].tolist() == [1, 1] and table[1]["flags"][1] == 0
    lamb = T.group_table(FlatLayout.from_sizes([[4]], [LAMB]), "lamb")
    assert lamb[0]["d"][2] == -np.inf and lamb[0]["d"][3] == 2.0
    with pytest.raises(ValueError, match=re.escape(
            "layout.groups[0].hyper is AdamHyper, the lamb kernels need LambHyper")):
        T.group_table(layout, "lamb")


@pytest.mark.parametrize("sizes", [[[1]], [[1, 1, 2, 3], [16383, 16385]], [[40000, 16384], [5]],
                                   [[16384 * 3 + 1]]])
def test_chunk_table_invariants(sizes):
    layout = FlatLayout.from_sizes(sizes, [LAMB] * len(sizes))
    chunks, seg_chunk = T.chunk_table(layout)
    offsets = layout.seg_offsets
    starts, stops = chunks["start"], chunks["stop"]
    assert starts[0] == 0 and stops[-1] == layout.size and np.all(starts[1:] == stops[:-1])
    assert np.all(stops > starts) and np.all(stops - starts <= T.CHUNK)
    assert np.all(offsets[chunks["seg"]] <= starts) and np.all(stops <= offsets[chunks["seg"] + 1])
    interior = starts[~np.isin(starts, offsets)]
    assert np.all(interior % T.CHUNK == 0)  # so that float4 bodies stay aligned
    assert seg_chunk.dtype == np.int32 and seg_chunk[0] == 0 and seg_chunk[-1] == chunks.size
    for seg in range(offsets.size - 1):
        mine = chunks[seg_chunk[seg]:seg_chunk[seg + 1]]
        assert mine.size >= 1 and np.all(mine["seg"] == seg)
        assert mine["start"][0] == offsets[seg] and mine["stop"][-1] == offsets[seg + 1]
    for index, group in enumerate(layout.groups):
        in_group = (chunks["seg"] >= group.seg_start) & (chunks["seg"] < group.seg_stop)
        assert np.all(chunks["group"][in_group] == index)


def test_missing_cupy_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ImportError
    monkeypatch.setattr(L, "_cupy", None)
    monkeypatch.setattr(L, "_cupy_error", None)
    layout = FlatLayout.from_sizes([[4]], [ADAM])
    for _ in range(2):  # the recorded error is raised again, with the same context
        with pytest.raises(ImportError, match=re.escape(
                "CuPy is required for the GPU optimizer: pip install -e '.[gpu]' in the ort-trainer checkout")):
            K.layout_table(layout, "adam")
