"""Whether torch's CPU kernel computes an fp32 matrix product faster than ONNX Runtime's MLAS
(`torch_product_faster`), by measuring both on this machine: the decision of
`_graph.cpu_products`, which depends on the CPU (MKL or oneDNN against MLAS) and on the shape.

Measured once per process per form and thread count: a one-node Gemm session against `torch.mm`
on random operands of the product's shape (a product above `_MEASURED_FLOPS` is measured with its
largest dim scaled down, so that a large model's compile stays quick), interleaved, the fastest
of `_ROUNDS` runs after a warmup: other processes on the cores only ever add time, and a library's
threads that wait on a preempted one add much more (torch's OpenMP barrier more than ONNX Runtime's
pool), so the median of a busy machine's runs decided by the load, the fastest by the kernels.
A near tie goes to torch (`_MARGIN`): alone, each product measures as it does, but in a graph the
products alternate between the two libraries' thread pools, and each switch wakes the other pool.
On the Xeon of BENCHMARKS.md (the GPT-2 sweep, width 512) torch on near ties (margin 1.1) made
ORTModule's step 5-11% faster at 4 and 8 layers than torch only where it won by 10% (margin 0.9),
and as fast as every product in torch. A product whose timings are within noise of the margin can
still go either way from one run to the next (the results then differ by rounding), which is why
deterministic compute keeps every product in ONNX Runtime (`Sessions.faster_in_torch`).
"""
import threading
import time

import numpy as np
import onnx
import onnxruntime
import torch

from .._onnx import quiet_session_options

# Products under half a GFLOP stay in ONNX Runtime: a torch node's call costs ~10 us and the
# measurement 12 runs (the seed model's feed-forward products, 0.2 GFLOP, differ by ~0.1 ms; a
# GPT-2 width 512's attention input projection over 512 rows, 0.8 GFLOP: its weight gradient
# takes MLAS 6.4 ms, torch 4.8 on one thread of the Xeon of BENCHMARKS.md).
MIN_FLOPS = 5e8
_MEASURED_FLOPS = 4e9
_ROUNDS = 5
_MARGIN = 1.1  # torch unless MLAS is 10% faster
_lock = threading.Lock()
_timings = {}  # (form, threads) -> (MLAS ms, torch ms): what was measured, for benchmarks and logs


def torch_product_faster(form, *, threads):
    """`form`: (trans_a, trans_b, m, k, n) of alpha op(A) op(B), as ONNX Runtime would run it;
    `threads`: ONNX Runtime's intra-op threads (torch runs on its own, the same count by default)."""
    _, _, m, k, n = form
    if 2 * m * k * n < MIN_FLOPS:
        return False
    with _lock:  # one measurement at a time: two would share the cores
        if (form, threads) not in _timings:
            _timings[form, threads] = _measured(form, threads)
    mlas_ms, torch_ms = _timings[form, threads]
    return torch_ms < _MARGIN * mlas_ms


def measured_products():
    """{(form, threads): (MLAS ms, torch ms)} of the measurements made in this process."""
    with _lock:
        return dict(_timings)


def _measured(form, threads):
    trans_a, trans_b, m, k, n = _scaled(form)
    a_shape, b_shape = ([k, m] if trans_a else [m, k]), ([n, k] if trans_b else [k, n])
    generator = np.random.default_rng(0)
    a, b = (generator.standard_normal(shape, dtype=np.float32) for shape in (a_shape, b_shape))
    session = _gemm_session(trans_a, trans_b, a_shape, b_shape, threads)
    torch_a, torch_b = torch.from_numpy(a), torch.from_numpy(b)
    torch_a, torch_b = (torch_a.t() if trans_a else torch_a), (torch_b.t() if trans_b else torch_b)
    runs = {"mlas": lambda: session.run(None, {"a": a, "b": b}), "torch": lambda: torch.mm(torch_a, torch_b)}
    times = {name: [] for name in runs}
    for name, run in runs.items():
        run()  # warmup
    for _ in range(_ROUNDS):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    return min(times["mlas"]), min(times["torch"])


def _scaled(form):
    """The form with its largest dim scaled down to keep the measured product near _MEASURED_FLOPS."""
    trans_a, trans_b, *dims = form
    scale = _MEASURED_FLOPS / (2 * dims[0] * dims[1] * dims[2])
    if scale < 1:
        largest = dims.index(max(dims))
        dims[largest] = max(1, int(dims[largest] * scale))
    return (trans_a, trans_b, *dims)


def _gemm_session(trans_a, trans_b, a_shape, b_shape, threads):
    """A one-node Gemm session, set up as our sessions are (intra-op threads, no spinning)."""
    node = onnx.helper.make_node("Gemm", ["a", "b"], ["y"], transA=int(trans_a), transB=int(trans_b))
    graph = onnx.helper.make_graph([node], "product", [
        onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, a_shape),
        onnx.helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, b_shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=7)
    options = quiet_session_options()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
