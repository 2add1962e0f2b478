"""The GPU kit's gpu-smoke.py with ONNX Runtime's CUDA sessions in fp32 (`use_tf32=0`), as ort-trainer
makes them by default (torch's TF32 switch is off): the kit's check compares ORT's MatMul with torch's
fp32 product at 1e-3, which ORT's default TF32 misses by 2e-2 (measured on an H200), so its DLPack and
CuPy checks were never reached.

    python benchmarks/kit_smoke.py /tmp/og/gpu-smoke.py                          # on the GPU machine
    python benchmarks/kit_smoke.py ../shared/tools/gpu-smoke.py --cpu --emulate-cupy   # CI: CuPy emulated
"""
import runpy
import sys

import onnxruntime

CUDA = "CUDAExecutionProvider"


def in_fp32(providers):
    """`providers` with the CUDA provider's `use_tf32` set to 0 unless it is given."""
    result = []
    for provider in providers or []:
        name, options = (provider, {}) if isinstance(provider, str) else provider
        result.append((name, {"use_tf32": "0", **options}) if name == CUDA else provider)
    return result


class _Fp32Session(onnxruntime.InferenceSession):
    def __init__(self, model, sess_options=None, providers=None, provider_options=None, **kwargs):
        if provider_options is not None:  # the parallel-lists form: one options dict per provider
            providers = list(zip(providers, provider_options))
        super().__init__(model, sess_options, providers=in_fp32(providers), **kwargs)


def main(argv):
    script, *args = argv
    if "--emulate-cupy" in args:
        args.remove("--emulate-cupy")
        from tests.cpu_cuda import fake_cupy
        fake_cupy.install()
    onnxruntime.InferenceSession = _Fp32Session
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
