"""pytest plugin (`-p tests.cpu_cuda.plugin`): `import cupy` gives the CPU emulation."""
from tests.cpu_cuda import fake_cupy

fake_cupy.install()
