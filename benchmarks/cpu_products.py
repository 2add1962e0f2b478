"""The seed model's matrix products on this CPU: ONNX Runtime's MLAS (a one-node Gemm session)
against torch's CPU kernels (MKL / oneDNN), fp32, and bf16 where torch has it (on CPUs with AMX or
AVX512-BF16 that is where a bf16 step's speed would come from). The measurement that decides
whether a torch kernel inside the graph (`_runtime.torch_ops`) would make a product faster.

    python benchmarks/cpu_products.py --threads 2 --repeats 15

Shapes (seed model, batch 35 x bptt 20 = 700 tokens, d_model 200, vocabulary 28,782, FFN 800):
the vocabulary projection forward and its two backward products, and the FFN's. Medians of
--repeats calls after a warmup; torch writes into a preallocated output (as ORT's arena would).
"""
import argparse
import json
import platform
import statistics
import time

import numpy as np
import onnx
import onnxruntime
import torch

SHAPES = [  # name, transA, transB, M, K, N
    ("vocab forward  Y = A W^T", 0, 1, 700, 200, 28782),
    ("vocab backward dA = dY W", 0, 0, 700, 28782, 200),
    ("vocab backward dW = dY^T A", 1, 0, 28782, 700, 200),
    ("vocab backward dW^T = A^T dY", 1, 0, 200, 700, 28782),  # the form ORT's builder writes
    ("ffn forward", 0, 1, 700, 200, 800),
    ("ffn backward dW", 1, 0, 800, 700, 200),
]


def cpu_description():
    """(model name, the flags that matter for bf16 products: amx*, avx512_bf16, avx512f) from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as file:
            lines = file.read().splitlines()
    except OSError:
        return platform.machine(), []
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return name, sorted(flag for flag in flags if flag.startswith(("amx", "avx512_bf16", "avx512f")))


def gemm_session(trans_a, trans_b, m, k, n, threads):
    a_shape, b_shape = ([k, m] if trans_a else [m, k]), ([n, k] if trans_b else [k, n])
    node = onnx.helper.make_node("Gemm", ["a", "b"], ["y"], transA=trans_a, transB=trans_b)
    graph = onnx.helper.make_graph([node], "g", [
        onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, a_shape),
        onnx.helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, b_shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [m, n])])
    model = onnx.helper.make_model(graph, ir_version=8, opset_imports=[onnx.helper.make_opsetid("", 17)])
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, a_shape, b_shape


def median_ms(call, repeats):
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, trans_a, trans_b, m, k, n in SHAPES:
        session, a_shape, b_shape = gemm_session(trans_a, trans_b, m, k, n, args.threads)
        rng = np.random.default_rng(0)
        a, b = rng.random(a_shape, dtype=np.float32), rng.random(b_shape, dtype=np.float32)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        left, right = (ta.t() if trans_a else ta), (tb.t() if trans_b else tb)
        out, out_bf16 = torch.empty(m, n), torch.empty(m, n, dtype=torch.bfloat16)
        left_bf16, right_bf16 = left.bfloat16(), right.bfloat16()
        rows.append({
            "product": name, "mlas_fp32_ms": median_ms(lambda: session.run(None, {"a": a, "b": b}), args.repeats),
            "torch_fp32_ms": median_ms(lambda: torch.mm(left, right, out=out), args.repeats),
            "torch_bf16_ms": median_ms(lambda: torch.mm(left_bf16, right_bf16, out=out_bf16), args.repeats)})
    name, flags = cpu_description()
    print(json.dumps({"cpu": name, "flags": flags,
                      "threads": args.threads, "torch": torch.__version__, "onnxruntime": onnxruntime.__version__}))
    for row in rows:
        print(f"{row['product']:28s} MLAS fp32 {row['mlas_fp32_ms']:8.2f} ms   torch fp32 {row['torch_fp32_ms']:8.2f} ms"
              f"   torch bf16 {row['torch_bf16_ms']:8.2f} ms")


if __name__ == "__main__":
    main()
