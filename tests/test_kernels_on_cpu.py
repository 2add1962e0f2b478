"""The CUDA kernels run, without a GPU, on the CPU emulation of tests/cpu_cuda (g++, x86-64).

The GPU kernel tests (tests/gpu/test_kernels_gpu.py: every kernel against the NumPy reference on
random layouts, one step and a hundred, misaligned buffers, the argument checks;
tests/gpu/test_loss_scaling_gpu.py: loss-scaled updates decided on the device) run in a
subprocess where `import cupy` gives the emulation; the emulation itself is checked here: what it
must catch (out-of-bounds writes, a barrier not every thread reaches, arguments of the wrong C
type) and that its warps and barriers compute what CUDA's do.
"""
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or platform.machine() != "x86_64"
                                or sys.platform != "linux",
                                reason="the CPU emulation of the kernels needs g++ on x86-64 Linux")

ROOT = Path(__file__).resolve().parents[1]
# Needs a real stream and a busy GPU (the launches must not wait for the host).
GPU_ONLY = "not needs_no_host_sync"


@pytest.fixture(scope="module")
def cp():
    from tests.cpu_cuda import fake_cupy
    return fake_cupy


def test_the_gpu_kernel_tests_pass_on_the_emulation():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.cpu_cuda.plugin",
         "tests/gpu/test_kernels_gpu.py", "tests/gpu/test_loss_scaling_gpu.py", "-k", GPU_ONLY],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "passed" in summary and "skipped" not in summary, summary


SUM_KERNEL = r"""
extern "C" __global__ void block_sum(const double* x, int n, double* out) {
    __shared__ double shm[32];
    double s = 0.0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) s += x[i];
    for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
    if ((threadIdx.x & 31) == 0) shm[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += shm[w];
        out[blockIdx.x] = total;
    }
}
extern "C" __global__ void write_past_end(float* x, int n) {
    if (threadIdx.x == 0 && blockIdx.x == 0) x[n] = 1.0f;
}
extern "C" __global__ void divergent_barrier(float* x) {
    if (threadIdx.x < 32) __syncthreads();
    x[threadIdx.x] = 0.0f;
}
"""


def test_warp_shuffles_and_barriers_sum_like_cuda(cp):
    x = np.random.default_rng(0).standard_normal(10_000)
    out = cp.empty(3, dtype=np.float64)
    cp.RawKernel(SUM_KERNEL, "block_sum")((3,), (256,), (cp.asarray(x), np.int32(x.size), out))
    np.testing.assert_allclose(out.get().sum(), x.sum(), rtol=1e-12)
    assert np.all(np.isfinite(out.get()))  # every block wrote its sum


def test_an_out_of_bounds_write_fails_the_launch(cp):
    x = cp.zeros(5, dtype=np.float32)
    with pytest.raises(RuntimeError, match=r"write_past_end wrote 4 byte\(s\) after an allocation of 20 bytes"):
        cp.RawKernel(SUM_KERNEL, "write_past_end")((1,), (32,), (x, np.int32(5)))


def test_a_barrier_some_threads_skip_is_a_deadlock(cp):
    x = cp.zeros(64, dtype=np.float32)
    with pytest.raises(RuntimeError, match="divergent __syncthreads: a thread exited while others wait"):
        cp.RawKernel(SUM_KERNEL, "divergent_barrier")((1,), (64,), (x,))


@pytest.mark.parametrize("value,message", [
    (np.int64(5), "CuPy would pass a int64 \\(8 bytes\\) where the kernel reads a int32"),
    (5, "pass a NumPy scalar \\(int32\\), got the Python int 5"),
])
def test_an_argument_of_another_c_type_is_refused(cp, value, message):
    x = cp.zeros(8, dtype=np.float32)
    with pytest.raises(TypeError, match=r"write_past_end argument 1 \(int n\): " + message):
        cp.RawKernel(SUM_KERNEL, "write_past_end")((1,), (32,), (x, value))
