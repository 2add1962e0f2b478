"""PyTorch kernels inside ONNX Runtime graphs (`_runtime.torch_ops`, `_graph.torch_nodes`): the
executor's pitfalls, each pinned (errors raised by name, never a crash or a silent result; no
leak; no output aliasing an input; threads; ORT_PARALLEL refused), and the CPU gradients ONNX
Runtime lacks (ResizeGrad, ConvTransposeGrad) in step with eager PyTorch in both front ends."""
import copy
import ctypes
import functools
import re
import resource
import threading

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ort_trainer import ORTTrainer, _install, optim
from ort_trainer._configuration.runtime_settings import RuntimeSettings
from ort_trainer._export.trace import ExportError
from ort_trainer._onnx import TORCH_NODE_DOMAIN as DOMAIN
from ort_trainer._onnx import torch_node
from ort_trainer._runtime import torch_ops
from ort_trainer._runtime.placement import Placement
from ort_trainer._runtime.sessions import Sessions
from ort_trainer.ortmodule import ORTModule

pytestmark = pytest.mark.filterwarnings("ignore:parameters .* are not used by the model's forward")

# fp32 on both sides; the substituted gradients are torch's own kernels, the rest ORT's: rounding only.
LOSS_RTOL = 1e-5


def assert_losses_close(losses, expected):
    np.testing.assert_allclose(losses, expected, rtol=LOSS_RTOL)


@pytest.fixture
def implementations(monkeypatch):
    """Test-only torch implementations, removed after the test."""
    table = dict(torch_ops.IMPLEMENTATIONS)
    monkeypatch.setattr(torch_ops, "IMPLEMENTATIONS", table)
    return table


def _session(operator, *, outputs=1, params=None, options=None):
    """A session of one torch node over x (float [N]), its outputs y0.. float."""
    names = [f"y{k}" for k in range(outputs)]
    graph = onnx.helper.make_graph(
        [torch_node(operator, ["x"], names, params=params or {}, name="node")], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"])],
        [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in names])
    model = onnx.helper.make_model(graph, ir_version=8, opset_imports=[onnx.helper.make_opsetid("", 17),
                                                                      onnx.helper.make_opsetid(DOMAIN, 1)])
    settings = RuntimeSettings(threads=1, session_options=options)
    return Sessions(Placement("cpu"), settings).create(model.SerializeToString())


def _run(session, x):
    with torch_ops.raising_torch_op_errors():
        return session.run(None, {"x": x})


def test_a_torch_node_runs_its_implementation(implementations):
    implementations["ort_trainer::test_scale"] = lambda inputs, params: [inputs[0] * params["by"], inputs[0] + 1]
    session = _session("ort_trainer::test_scale", outputs=2, params={"by": 3.0})
    x = np.arange(5, dtype=np.float32)
    scaled, shifted = _run(session, x)
    np.testing.assert_array_equal(scaled, x * 3)
    np.testing.assert_array_equal(shifted, x + 1)


def test_a_graph_with_a_torch_node_plans_no_buffer_reuse_and_no_memory_pattern(implementations):
    """ONNX Runtime plans an output into a dead tensor's buffer, held until that output dies, and its
    memory pattern keeps room for every output; a torch node brings its own memory, so both held
    memory for nothing (`Sessions.session_options`)."""
    implementations["ort_trainer::test_shift"] = lambda inputs, params: [inputs[0] + 1]
    options = _session("ort_trainer::test_shift").get_session_options()
    assert not options.enable_mem_reuse and not options.enable_mem_pattern
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    plain = onnx.helper.make_model(graph, ir_version=8, opset_imports=[onnx.helper.make_opsetid("", 17)])
    session = Sessions(Placement("cpu"), RuntimeSettings(threads=1)).create(plain.SerializeToString())
    assert session.get_session_options().enable_mem_reuse and session.get_session_options().enable_mem_pattern


def test_a_failing_implementation_fails_the_run_with_its_error(implementations):
    def fails(inputs, params):
        raise ValueError("the kernel's own message")
    implementations["ort_trainer::test_fails"] = fails
    session = _session("ort_trainer::test_fails")
    expected = "the torch kernel 'ort_trainer::test_fails' inside the ONNX Runtime graph failed: ValueError: "
    with pytest.raises(torch_ops.TorchOpError, match=expected + "the kernel's own message") as info:
        _run(session, np.ones(3, np.float32))
    assert isinstance(info.value.__cause__, ValueError)
    assert torch_ops.take_errors() == []  # reported once; the next run starts clean
    implementations["ort_trainer::test_fails"] = lambda inputs, params: [inputs[0] * 2]
    np.testing.assert_array_equal(_run(session, np.ones(3, np.float32))[0], [2, 2, 2])


def test_unknown_operators_and_wrong_output_counts_are_errors(implementations):
    with pytest.raises(torch_ops.TorchOpError, match=r"no torch implementation named 'ort_trainer::nothing' "
                                                     r"\(known: \[.*'ort_trainer::resize_grad'"):
        _run(_session("ort_trainer::nothing"), np.ones(3, np.float32))
    implementations["ort_trainer::test_two"] = lambda inputs, params: [inputs[0], inputs[0]]
    with pytest.raises(torch_ops.TorchOpError, match="ValueError: 2 outputs for the node's 1"):
        _run(_session("ort_trainer::test_two"), np.ones(3, np.float32))


def test_an_output_never_aliases_an_input(implementations):
    """ONNX Runtime reuses the input's memory after the run: a returned input (or a view of it) is copied."""
    implementations["ort_trainer::test_identity"] = lambda inputs, params: [inputs[0][1:]]
    session = _session("ort_trainer::test_identity")
    kept = [_run(session, np.full(4, float(k), np.float32))[0] for k in range(3)]
    for k, result in enumerate(kept):
        np.testing.assert_array_equal(result, [k, k, k])


def test_many_calls_leak_nothing(implementations):
    """4 MB in and out per call: 300 calls would leak 2.4 GB if an input or output were never freed."""
    implementations["ort_trainer::test_double"] = lambda inputs, params: [inputs[0] * 2]
    session = _session("ort_trainer::test_double")
    x = np.ones(1 << 20, np.float32)
    for _ in range(20):
        _run(session, x)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(300):
        assert _run(session, x)[0][0] == 2.0
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 200, f"peak memory grew by {grown_mb:.0f} MB over 300 calls"


def test_threads_run_torch_nodes_concurrently(implementations):
    implementations["ort_trainer::test_square"] = lambda inputs, params: [inputs[0] * inputs[0]]
    session = _session("ort_trainer::test_square")
    failures = []

    def work(k):
        try:
            for _ in range(50):
                np.testing.assert_array_equal(_run(session, np.full(7, k, np.float32))[0], np.full(7, k * k))
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            failures.append(error)
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a run deadlocked"
    assert failures == []


def test_each_thread_raises_its_own_runs_errors(implementations):
    def fails(inputs, params):
        raise ValueError("only in the failing thread")
    implementations["ort_trainer::test_fails"] = fails
    implementations["ort_trainer::test_square"] = lambda inputs, params: [inputs[0] * inputs[0]]
    failing, working = _session("ort_trainer::test_fails"), _session("ort_trainer::test_square")
    outcomes = []

    def fail_repeatedly():
        for _ in range(100):
            try:
                _run(failing, np.ones(3, np.float32))
            except torch_ops.TorchOpError:
                outcomes.append("raised by name")
            except Exception as error:  # noqa: BLE001 - ORT's own error: the recorded one was lost
                outcomes.append(type(error).__name__)
    thread = threading.Thread(target=fail_repeatedly)
    thread.start()
    for _ in range(100):
        np.testing.assert_array_equal(_run(working, np.full(3, 3, np.float32))[0], [9, 9, 9])
    thread.join(timeout=60)
    assert outcomes == ["raised by name"] * 100


def test_parallel_execution_is_refused_for_graphs_with_torch_nodes():
    options = onnxruntime.SessionOptions()
    options.execution_mode = onnxruntime.ExecutionMode.ORT_PARALLEL
    with pytest.raises(ValueError, match="session_options.execution_mode=ORT_PARALLEL cannot run this graph: it runs "
                                         "torch kernels inside ONNX Runtime"):
        _session("ort_trainer::resize_grad", options=options)


@pytest.mark.parametrize("version", ["1.20.0", "1.19.0"])
def test_another_onnx_runtime_release_is_refused_before_the_executor_answers_its_callback(monkeypatch, version):
    """ONNX Runtime after 1.19.2 inverted the ATen argument callback's meaning: a wrong answer, not an error."""
    monkeypatch.setattr(onnxruntime, "__version__", version)
    with pytest.raises(ImportError, match=re.escape(
            "this graph runs torch kernels inside ONNX Runtime, whose ATen argument callback ort-trainer answers "
            f"as onnxruntime 1.19.2 reads it (a later release inverted its meaning), but onnxruntime {version} is "
            f"installed: install onnxruntime 1.19.2 ({_install._INSTALL})")):
        _session("ort_trainer::resize_grad")


def test_a_build_tag_of_the_release_is_accepted(implementations, monkeypatch):
    monkeypatch.setattr(onnxruntime, "__version__", "1.19.2+cu118")
    implementations["ort_trainer::test_double"] = lambda inputs, params: [inputs[0] * 2]
    np.testing.assert_array_equal(_run(_session("ort_trainer::test_double"), np.full(3, 3, np.float32))[0], [6, 6, 6])


# ------------------------------------------------------------------ gradients the CPU provider lacks


class Resized(nn.Module):
    """A conv, then F.interpolate (the ResizeGrad ORT's CPU provider lacks), then a head."""

    def __init__(self, **interpolate):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 2)
        self.interpolate = interpolate

    def forward(self, x):
        y = F.interpolate(self.conv(x), **self.interpolate)
        return self.head(y.mean(dim=(2, 3)) + y.std(dim=(2, 3)))


class Transposed(nn.Module):
    """ConvTranspose (its gradient has no CPU kernel in ORT) over an input that needs no gradient."""

    def __init__(self, dims=2, **conv):
        super().__init__()
        torch.manual_seed(0)
        layer = nn.ConvTranspose2d if dims == 2 else nn.ConvTranspose1d
        self.pre = nn.Conv2d(4, 4, 1) if dims == 2 else nn.Conv1d(4, 4, 1)
        self.up = layer(4, 6, **conv)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        y = self.up(self.pre(x))
        return self.head(y.flatten(2).mean(-1) + y.flatten(2).pow(2).mean(-1))


CASES = {
    "nearest x2": (lambda: Resized(scale_factor=2, mode="nearest"), (2, 3, 6, 6)),
    "nearest to size": (lambda: Resized(size=(9, 11), mode="nearest"), (2, 3, 6, 6)),
    "bilinear x1.5": (lambda: Resized(scale_factor=1.5, mode="bilinear", align_corners=False), (2, 3, 6, 7)),
    "bilinear align_corners": (lambda: Resized(size=(10, 13), mode="bilinear", align_corners=True), (2, 3, 6, 7)),
    "bicubic x2": (lambda: Resized(scale_factor=2, mode="bicubic", align_corners=False), (2, 3, 5, 6)),
    "conv_transpose2d": (lambda: Transposed(kernel_size=3, stride=2, padding=1, output_padding=1), (2, 4, 5, 6)),
    "conv_transpose2d groups dilation": (lambda: Transposed(kernel_size=2, stride=3, groups=2, dilation=2),
                                         (2, 4, 4, 5)),
    "conv_transpose1d": (lambda: Transposed(dims=1, kernel_size=4, stride=2, padding=1), (2, 4, 9)),
}


def desc_for(shape):
    """model_desc of the cases: input x of `shape`, class targets; the loss and the two logits."""
    return {"inputs": [("x", list(shape)), ("target", [shape[0]])],
            "outputs": [("loss", [], True), ("y", [shape[0], 2])]}


def _batches(shape, steps=5):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(*shape, generator=generator), torch.randint(0, 2, (shape[0],), generator=generator))
            for _ in range(steps)]


def _eager_losses(model, batches, seeds=None):
    """SGD steps of `model` on `batches`, each after torch.manual_seed(its seed) if `seeds` are given."""
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step, (x, target) in enumerate(batches):
        if seeds is not None:
            torch.manual_seed(seeds[step])
        sgd.zero_grad()
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        sgd.step()
        losses.append(loss.item())
    return losses


def test_a_failing_torch_kernel_in_train_step_changes_nothing(implementations):
    def fails(inputs, params):
        raise RuntimeError("out of memory (simulated)")
    implementations["ort_trainer::resize_grad"] = fails
    make, shape = CASES["nearest x2"]
    model, (x, target) = make(), _batches(shape, steps=1)[0]
    before = copy.deepcopy(model.state_dict())
    trainer = ORTTrainer(model, desc_for(shape), optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
    with pytest.raises(torch_ops.TorchOpError, match="'ort_trainer::resize_grad' inside the ONNX Runtime graph failed: "
                                                     r"RuntimeError: out of memory \(simulated\)"):
        trainer.train_step(x, target)
    assert trainer.train_step_info.step == 0 and trainer.train_step_info.optimization_step == 0
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


# ------------------------------------------------------------------ ops exported as torch nodes


class Einsum(nn.Module):
    """Layers written with einsum (ONNX Runtime has no Einsum gradient)."""

    def __init__(self, equation, *, weight_first=False):
        super().__init__()
        torch.manual_seed(0)
        self.equation, self.weight_first = equation, weight_first
        self.pre, self.w, self.head = nn.Linear(6, 6), nn.Parameter(torch.randn(6, 5) / 3), nn.Linear(5, 2)

    def forward(self, x):
        if self.equation == "three":  # the input needs no gradient and comes first
            y = torch.einsum("bi,ij,jk->bk", x, self.w @ self.w.T, self.w)
        elif self.equation == "activations":  # two activations, batched
            h = self.pre(x)
            y = torch.einsum("bi,bj->bij", h, h).sum(-1) @ self.w
        elif self.weight_first:
            y = torch.einsum(self.equation, self.w, self.pre(x))
        else:
            y = torch.einsum(self.equation, x, self.w)  # the input, which needs no gradient, first
        return self.head(y)


class Pooled(nn.Module):
    """adaptive_avg_pool{1,2,3}d to a size that does not divide the input (not exportable to ONNX)."""

    def __init__(self, dims, size):
        super().__init__()
        torch.manual_seed(0)
        self.conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1](3, 4, 1)
        self.pool = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)[dims - 1](size)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        y = self.pool(self.conv(x))
        return self.head(y.flatten(2).pow(2).mean(-1))


def _scaled_without_gradient(h):
    """A scale computed under torch.no_grad() (torch does not differentiate through it); an
    in-place update of a copy there."""
    with torch.no_grad():
        scale = h.norm(dim=1, keepdim=True) + h.mean()
        scale.mul_(0.5)
    return h / scale


def _euclidean_distances(h):
    """torch's export of cdist (compute_mode 'use_mm_for_euclid_dist') in torch ops: two
    concatenations of ones of one shape (ONNX Runtime's optimizer makes them one tensor, whose
    gradient ORTModule's builder then defines twice)."""
    x1, x2 = h, h * 2 + 1
    norms1, norms2 = x1.pow(2).sum(-1, keepdim=True), x2.pow(2).sum(-1, keepdim=True)
    a = torch.cat([x1 * -2, norms1, torch.ones_like(norms1)], -1)
    b = torch.cat([x2, torch.ones_like(norms2), norms2], -1)
    return (a @ b.T).clamp_min(1e-30).sqrt()[:, :4]


class Function(nn.Module):
    """A linear layer, then a function ONNX cannot export or ONNX Runtime cannot differentiate."""

    FUNCTIONS = {
        "atan": torch.atan, "asin": lambda h: torch.asin(torch.tanh(h) * 0.9),
        "acos": lambda h: torch.acos(torch.tanh(h) * 0.9), "tan": lambda h: torch.tan(h * 0.3),
        "sinh": torch.sinh, "cosh": torch.cosh, "asinh": torch.asinh, "acosh": lambda h: torch.acosh(h.abs() + 1.5),
        "atanh": lambda h: torch.atanh(torch.tanh(h) * 0.9), "erfinv": lambda h: torch.erfinv(torch.tanh(h) * 0.9),
        "expm1": torch.expm1, "trunc": lambda h: torch.trunc(h * 3) + h, "round": lambda h: torch.round(h * 3) * h,
        "round decimals": lambda h: torch.round(h, decimals=1) * h, "floor": lambda h: torch.floor(h * 3) * h,
        "ceil": lambda h: torch.ceil(h * 3) * h, "frac": lambda h: torch.frac(h * 3),
        "sign": lambda h: torch.sign(h) * h,
        "fmod": lambda h: torch.fmod(h * 3, 1.0), "remainder": lambda h: torch.remainder(h * 3, 1.0),
        "fmod tensor": lambda h: torch.fmod(h * 3, h.detach().abs() + 0.5),
        "cumprod": lambda h: torch.cumprod(torch.sigmoid(h), dim=1), "logcumsumexp": lambda h: torch.logcumsumexp(h, 1),
        "det": lambda h: torch.det(h.view(-1, 2, 2)).view(h.shape[0], -1).repeat(1, 4),
        "detach": lambda h: h * h.detach(),  # the exporter drops detach: gradients would flow through it
        "detach after conv-like op": lambda h: h * F.linear(h, torch.eye(4)).detach(),
        "no_grad": _scaled_without_gradient,
        "pixel_shuffle": lambda h: F.pixel_shuffle(h.reshape(-1, 4, 1, 1), 2).reshape(-1, 4),
        "prod": lambda h: torch.prod(torch.sigmoid(h), dim=1, keepdim=True) * h,
        "atan2": lambda h: torch.atan2(h, h.abs() + 1), "xlogy": lambda h: torch.xlogy(h, h.abs() + 1),
        "hypot": lambda h: torch.hypot(h, h * 2), "logaddexp": lambda h: torch.logaddexp(h, -h * 2),
        "inverse": lambda h: torch.inverse(h.reshape(-1, 2, 2) + 3 * torch.eye(2)).reshape(-1, 4),
        "bitwise_or": lambda h: h * ((h > 0).int() | (h < 0.5).int()).float(),
        "einsum": lambda h: torch.einsum("bi,bi->b", h, h).unsqueeze(1) * h,
        "cummax": lambda h: torch.cummax(h, 1).values + h.gather(1, torch.cummin(h, 1).indices),
        "median": lambda h: torch.median(h) * h + torch.median(h, dim=1, keepdim=True).values,
        "kthvalue": lambda h: torch.kthvalue(h, 2, dim=1).values.unsqueeze(1) * h,
        "straight-through": lambda h: h + (torch.round(h * 2) / 2 - h).detach(),
        # ORT's Pow gradient ignores the exponent's: trained silently wrong before
        "pow base and exponent": lambda h: torch.pow(h.abs() + 1, torch.tanh(h)),
        "pow of a constant": lambda h: torch.pow(2.0, h),  # the builder failed: the base needs no gradient
        "prod of all": lambda h: torch.prod(torch.sigmoid(h)) * h,
        "l1 norm": lambda h: h * torch.norm(h, p=1, dim=1, keepdim=True),
        "l1 norm of all": lambda h: h * torch.linalg.vector_norm(h, 1),
        "l2 norm of all": lambda h: h * torch.linalg.vector_norm(h),  # ReduceL2 without keepdims: ORT's graph failed
        "l2 norms of rows": lambda h: (h.T / torch.linalg.vector_norm(h, 2, 1)).T,
        "xlogy of a constant": lambda h: torch.xlogy(torch.full((4,), 2.0), h.abs() + 1),
        "xlogy of a detached value": lambda h: torch.xlogy(h.detach().abs() + 1, h.abs() + 1),
        "cdist": lambda h: torch.cdist(h, h * 2 + 1, compute_mode="use_mm_for_euclid_dist")[:, :4],
        "mode": lambda h: torch.mode(torch.round(h * 2), 1, keepdim=True).values + h * torch.mode(
            torch.round(h * 2), 0).values,
        "exp2 sinc erfc": lambda h: torch.exp2(h) + torch.sinc(h) + torch.erfc(h),
        "lgamma digamma mvlgamma": lambda h: torch.lgamma(h.abs() + 1) * torch.digamma(h.abs() + 1)
        + torch.mvlgamma(h.abs() + 2, 2),
        "i0 rad2deg deg2rad": lambda h: torch.i0(h) + torch.rad2deg(h) * torch.deg2rad(h),
        "special ndtr ndtri log_ndtr entr xlog1py": lambda h: torch.special.ndtr(h) + torch.special.log_ndtr(h)
        + torch.special.ndtri(torch.sigmoid(h)) + torch.special.entr(torch.sigmoid(h))
        + torch.special.xlog1py(h, h.abs()),
        "copysign fmin fmax logaddexp2 ldexp": lambda h: torch.copysign(h, h - 0.2) + torch.copysign(h, -1.0)
        + torch.fmin(h, h * 0.5) * torch.fmax(h, -h) + torch.logaddexp2(h, h * h) + torch.ldexp(h, torch.tensor(2)),
        "nansum nanmean": lambda h: h * torch.nansum(h) + h * torch.nanmean(h, 1, keepdim=True),
        "renorm threshold": lambda h: torch.renorm(h, 2, 0, 1.0) + F.threshold(h, 0.1, 2.0),
        # ORT's Pad gradient is for constant padding only
        "reflect padding": lambda h: F.pad(h.unsqueeze(1), (2, 1), mode="reflect")[:, 0, 1:5] * h,
        "replicate padding 2d": lambda h: F.pad(h.reshape(-1, 1, 2, 2), (1, 0, 0, 1), mode="replicate").reshape(
            h.shape[0], -1)[:, 2:6] * h,
        "channel_shuffle": lambda h: torch.channel_shuffle(h.reshape(-1, 4, 1), 2).reshape(-1, 4) * h,
        "rms_norm": lambda h: F.rms_norm(h, (4,), torch.linspace(0.5, 1.5, 4)) + F.rms_norm(h * h, (4,), eps=0.1),
        # the export's gradient at a zero distance (each row and itself) was NaN: the weights became NaN
        "cdist of itself": lambda h: torch.cdist(h, h)[:, :4] * h + torch.cdist(h, h, p=1.0)[:, 2:],
        "trace diag": lambda h: torch.trace(h[:4]) * h + torch.diag(h[:4]) + torch.diag(h[0], -1)[1:, :4].sum(0),
        "kron pdist": lambda h: torch.kron(h[:, :2], h[:1, 2:]) + torch.pdist(h)[:4] * h,
        "nearest-exact": lambda h: F.interpolate(h.unsqueeze(1), scale_factor=1.5, mode="nearest-exact")[:, 0, 1:5]
        + F.interpolate(h.reshape(-1, 1, 2, 2), size=(3, 3), mode="nearest-exact").reshape(h.shape[0], -1)[:, :4],
        "ones concatenated twice": _euclidean_distances,
    }

    def __init__(self, name):
        super().__init__()
        torch.manual_seed(0)
        self.name, self.linear, self.head = name, nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.FUNCTIONS[self.name](self.linear(x)))


CASES.update({f"function {name}": (functools.partial(Function, name), (6, 4)) for name in Function.FUNCTIONS})


class Recurrent(nn.Module):
    """nn.RNN (ONNX Runtime has no gradient for ONNX's RNN), or a GRU / LSTM it cannot train
    (bidirectional, proj_size) on [batch, seq, features]: its last step's output (and,
    `reads_last_hidden`, h_n: else its gradient is zeros) into two logits."""

    def __init__(self, kind="RNN", layers=1, bidirectional=False, reads_last_hidden=False, batch_first=True,
                 **options):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = getattr(nn, kind)(3, 5, layers, bidirectional=bidirectional, batch_first=batch_first, **options)
        output_size = options.get("proj_size") or 5
        self.head = nn.Linear(output_size * (2 if bidirectional else 1), 2)
        self.reads_last_hidden, self.batch_first = reads_last_hidden, batch_first

    def forward(self, x):
        output, state = self.rnn(x if self.batch_first else x.transpose(0, 1))
        y = self.head(output[:, -1] if self.batch_first else output[-1])
        if not self.reads_last_hidden:
            return y
        states = state if isinstance(state, tuple) else (state,)  # an LSTM's (h_n, c_n)
        return y + sum(state[-1, :, :2] for state in states)


CASES.update({
    "rnn tanh": (Recurrent, (4, 6, 3)),
    "rnn relu two layers reading h_n": (
        lambda: Recurrent(layers=2, reads_last_hidden=True, batch_first=False, nonlinearity="relu"), (4, 6, 3)),
    "rnn bidirectional reading h_n": (lambda: Recurrent(layers=2, bidirectional=True, reads_last_hidden=True),
                                      (4, 6, 3)),
    "gru bidirectional": (lambda: Recurrent("GRU", bidirectional=True, reads_last_hidden=True), (4, 6, 3)),
    "lstm bidirectional two layers reading h_n and c_n": (
        lambda: Recurrent("LSTM", layers=2, bidirectional=True, reads_last_hidden=True, batch_first=False), (4, 6, 3)),
    "lstm proj_size": (lambda: Recurrent("LSTM", proj_size=3), (4, 6, 3)),
})
CASES.update({
    "einsum input first": (lambda: Einsum("bi,ij->bj"), (4, 6)),
    "einsum implicit": (lambda: Einsum("bi,ij"), (4, 6)),
    "einsum ellipsis": (lambda: Einsum("...i,ij->...j"), (4, 6)),
    "einsum weight first": (lambda: Einsum("ij,bi->bj", weight_first=True), (4, 6)),
    "einsum three operands": (lambda: Einsum("three"), (4, 6)),
    "einsum activations": (lambda: Einsum("activations"), (4, 6)),
    "adaptive_avg_pool1d": (lambda: Pooled(1, 3), (2, 3, 7)),
    "adaptive_avg_pool2d": (lambda: Pooled(2, (3, 4)), (2, 3, 7, 9)),
    "adaptive_avg_pool3d": (lambda: Pooled(3, (2, 3, 2)), (2, 3, 5, 7, 3)),
})


@pytest.mark.parametrize("frozen", [None, "second"])
def test_a_torch_nodes_backward_is_one_autograd_pass_for_all_its_inputs(monkeypatch, frozen):
    """One gradient node per torch node, the forward recomputed once for every input that needs a
    gradient (an nn.LSTM has a dozen: one pass each was 12x slower than eager), the gradients
    of only those: a frozen weight gets none."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    calls = []
    hypot = torch.hypot
    monkeypatch.setattr(torch, "hypot", lambda *args, **kwargs: calls.append(1) or hypot(*args, **kwargs))

    class TwoWeights(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.first, self.second = nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(5))

        def forward(self, x):
            return torch.hypot(x * self.first, x * self.second + 1)

    model = TwoWeights()
    if frozen:
        getattr(model, frozen).requires_grad_(False)
    reference, x = copy.deepcopy(model), torch.randn(3, 5)
    wrapped = ORTModule(model)
    wrapped(x).sum().backward()  # compiles: the export traces the forward
    for parameter in model.parameters():
        parameter.grad = None
    calls.clear()
    wrapped(x).sum().backward()
    assert len(calls) == 2  # the forward node, and one recomputation for all the gradients
    reference(x).sum().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert (ours.grad is None) == (theirs.grad is None)
        if theirs.grad is not None:
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-6)


# Recurrent layers with dropout between their layers, in training mode: torch's kernels draw the
# masks from torch's generator (the same masks as eager after the same torch.manual_seed), and the
# gradient node draws them again from the state the forward started from.
DROPOUT_CASES = {
    "lstm": lambda: Recurrent("LSTM", layers=3, dropout=0.5),
    "gru reading h_n": lambda: Recurrent("GRU", layers=2, dropout=0.5, reads_last_hidden=True),
    "rnn": lambda: Recurrent(layers=2, dropout=0.5, batch_first=False),
    "lstm bidirectional reading h_n and c_n": lambda: Recurrent("LSTM", layers=2, dropout=0.5, bidirectional=True,
                                                               reads_last_hidden=True),
}


@pytest.mark.parametrize("case", sorted(DROPOUT_CASES))
def test_orttrainer_trains_recurrent_dropout_between_layers_with_eagers_masks(case):
    model, batches, seeds = DROPOUT_CASES[case](), _batches((4, 6, 3), steps=3), [3, 4, 5]
    reference = copy.deepcopy(model)
    expected = _eager_losses(reference, batches, seeds)
    desc = {"inputs": [("x", ["batch", 6, 3]), ("target", ["batch"])], "outputs": [("loss", [], True),
                                                                                  ("y", ["batch", 2])]}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options={"utils": {"grad_norm_clip": False}})
    losses = []
    for seed, (x, target) in zip(seeds, batches):
        torch.manual_seed(seed)
        losses.append(trainer.train_step(x, target)[0].item())
    assert_losses_close(losses, expected)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.detach(), theirs, rtol=1e-5, atol=1e-6)
    x, target = batches[0]
    torch.manual_seed(0)
    masked = trainer.train_step(x, target)[1]
    torch.manual_seed(1)
    assert not torch.allclose(trainer.train_step(x, target)[1], masked)  # the masks are drawn, per seed
    reference.load_state_dict(model.state_dict())
    reference.eval()  # eval_step: no dropout
    torch.testing.assert_close(trainer.eval_step(x, target)[1], reference(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["lstm", "gru reading h_n"])
def test_ortmodule_trains_recurrent_dropout_between_layers_with_eagers_masks(case, monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model, batches, seeds = DROPOUT_CASES[case](), _batches((4, 6, 3), steps=3), [3, 4, 5]
    reference = copy.deepcopy(model)
    expected = _eager_losses(reference, batches, seeds)
    assert_losses_close(_eager_losses(ORTModule(model), batches, seeds), expected)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.detach(), theirs, rtol=1e-5, atol=1e-6)
    wrapped = ORTModule(model).eval()
    torch.testing.assert_close(wrapped(batches[0][0]), reference.eval()(batches[0][0]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_dropout_of_a_one_layer_recurrent_layer_draws_nothing_and_trains(kind):
    """torch drops out between layers only: with one layer `dropout` changes nothing (torch warns
    when the layer is made); the exporter refused it in training mode all the same."""
    with pytest.warns(UserWarning, match="dropout option adds dropout after all but last recurrent layer"):
        model = Recurrent(kind, dropout=0.5)
    batches = _batches((4, 6, 3), steps=3)
    expected = _eager_losses(copy.deepcopy(model), batches)
    trainer = ORTTrainer(model, desc_for((4, 6, 3)), optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options={"utils": {"grad_norm_clip": False}})
    assert_losses_close([trainer.train_step(x, target)[0].item() for x, target in batches], expected)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_recurrent_layer_with_dropout_is_not_recomputed(reentrant, monkeypatch):
    """A checkpointed segment's nodes are copied into the backward, but a torch node that draws is
    left to the forward (a copy would draw other masks: gradients 10% off, silently)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.inp, self.rnn, self.head = nn.Linear(3, 3), nn.LSTM(3, 5, 3, dropout=0.5, batch_first=True), \
                nn.Linear(5, 2)

        def forward(self, x):
            hidden = torch.utils.checkpoint.checkpoint(lambda h: self.rnn(h)[0].tanh(), self.inp(x),
                                                       use_reentrant=reentrant)
            return self.head(hidden[:, -1])

    model = Checkpointed()
    reference, wrapped = copy.deepcopy(model), ORTModule(model)
    for seed, (x, _) in enumerate(_batches((4, 6, 3), steps=2)):
        for module in (wrapped, reference):
            torch.manual_seed(seed)
            module(x).square().sum().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)


def test_recurrent_dropout_on_a_packed_sequence_is_refused_by_name():
    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(3, 5, 2, dropout=0.25)

        def forward(self, x):
            packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([6, 4, 3, 2]))
            return nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0])[0][-1, :, :2]

    trainer = ORTTrainer(Packed(), {"inputs": [("x", [6, 4, 3]), ("target", [4, 2])], "outputs": [("loss", [], True)]},
                         optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss)
    with pytest.raises(ExportError, match=r"nn\.LSTM with dropout=0\.25 between its layers cannot be trained in ONNX "
                                        r"Runtime on a PackedSequence: pass the padded batch itself \(the layer trains "
                                        r"with its dropout then\), or set dropout=0"):
        trainer.train_step(torch.randn(6, 4, 3), torch.randn(4, 2))


def test_export_onnx_of_a_trained_rnn_writes_onnx_rnn(tmp_path):
    make, shape = CASES["rnn bidirectional reading h_n"]
    model, (x, target) = make(), _batches(shape, steps=1)[0]
    trainer = ORTTrainer(model, desc_for(shape), optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
    trainer.train_step(x, target)
    trainer.export_onnx(tmp_path / "model.onnx")
    exported = onnx.load(tmp_path / "model.onnx")
    assert "RNN" in {node.op_type for node in exported.graph.node}
    assert not any(node.domain == DOMAIN for node in exported.graph.node)
    session = onnxruntime.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = model.eval()(x)
    np.testing.assert_allclose(session.run(None, {"x": x.numpy()})[0], expected.numpy(), rtol=1e-5, atol=1e-6)


def test_eval_step_and_export_onnx_of_a_model_with_torch_nodes(tmp_path):
    make, shape = CASES["einsum input first"]
    model, (x, target) = make(), _batches(shape, steps=1)[0]
    trainer = ORTTrainer(model, desc_for(shape), optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
    trainer.train_step(x, target)
    loss, y = trainer.eval_step(x, target)
    torch.testing.assert_close(y, model.eval()(x), rtol=1e-5, atol=1e-6)
    trainer.export_onnx(tmp_path / "model.onnx")  # for a plain ONNX Runtime: ONNX's Einsum, no torch node
    exported = onnx.load(tmp_path / "model.onnx")
    assert {node.op_type for node in exported.graph.node} >= {"Einsum"}
    assert not any(node.domain == DOMAIN for node in exported.graph.node)
    session = onnxruntime.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x.numpy()})[0], y.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ortrainer_trains_in_step_with_torch(case):
    make, shape = CASES[case]
    model, batches = make(), _batches(shape)
    expected = _eager_losses(copy.deepcopy(model), batches)
    trainer = ORTTrainer(model, desc_for(shape), optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options={"utils": {"grad_norm_clip": False}})
    assert_losses_close([trainer.train_step(x, target)[0].item() for x, target in batches], expected)


@pytest.mark.parametrize("case", ["lstm bidirectional two layers reading h_n and c_n", "gru bidirectional"])
def test_ortrainer_trains_a_recurrent_layer_over_a_dynamic_batch(case):
    """A dynamic batch exports the zero initial states as ConstantOfShape (h_0 and c_0 one tensor):
    with one gradient node per input, the builder defined that tensor's gradient twice and failed."""
    make, shape = CASES[case]
    model, batches = make(), _batches(shape)
    expected = _eager_losses(copy.deepcopy(model), batches)
    desc = {"inputs": [("x", ["batch", *shape[1:]]), ("target", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options={"utils": {"grad_norm_clip": False}})
    assert_losses_close([trainer.train_step(x, target).item() for x, target in batches], expected)


@pytest.mark.parametrize("case", ["bilinear x1.5", "conv_transpose2d", "einsum activations", "einsum input first",
                                  "adaptive_avg_pool2d", "function erfinv", "function atan", "function cumprod",
                                  "function detach", "function straight-through", "function no_grad", "function cummax",
                                  "function pow base and exponent", "function pow of a constant",
                                  "function prod of all", "function l2 norm of all",
                                  "function xlogy of a detached value", "function mode", "function exp2 sinc erfc",
                                  "function nansum nanmean", "function reflect padding", "function cdist of itself",
                                  "function trace diag", "function kron pdist", "function nearest-exact", "rnn tanh",
                                  "rnn bidirectional reading h_n", "lstm bidirectional two layers reading h_n and c_n"])
def test_ortmodule_trains_in_step_with_torch(case, monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # the graph, or an error
    make, shape = CASES[case]
    model, batches = make(), _batches(shape)
    expected = _eager_losses(copy.deepcopy(model), batches)
    assert_losses_close(_eager_losses(ORTModule(model), batches), expected)


def test_ortmodule_names_the_concatenation_its_builder_cannot_differentiate(monkeypatch):
    """ORTModule's builder optimizes inside (where ORTTrainer fixes the graph after ONNX Runtime's
    optimizer): two concatenations of one ones tensor fail there, by name; under the default fallback
    policy that call runs in PyTorch, with a warning, and trains as torch."""
    make, shape = CASES["function ones concatenated twice"]
    model, batches = make(), _batches(shape)
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    with pytest.raises(NotImplementedError, match=(
            r"ONNX Runtime's gradient builder defined the gradient of '/model/Constant\w*' twice: a tensor "
            r"that needs no gradient is concatenated \(torch.cat\) twice")):
        ORTModule(copy.deepcopy(model))(batches[0][0])
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    expected = _eager_losses(copy.deepcopy(model), batches)
    with pytest.warns(UserWarning, match="runs in PyTorch"):
        assert_losses_close(_eager_losses(ORTModule(model), batches), expected)


@pytest.mark.parametrize("case", ["einsum ellipsis", "adaptive_avg_pool2d"])
def test_new_batch_sizes_rederive_graphs_with_torch_nodes(case):
    """A dynamic batch dim: later shapes come from the re-derived export (its value_info is gone, the
    torch nodes' output shapes are stated again), proven against torch."""
    make, shape = CASES[case]
    model = make()
    batches = [_batches((size, *shape[1:]), steps=1)[0] for size in (4, 3, 5, 3)]
    expected = _eager_losses(copy.deepcopy(model), batches)
    desc = {"inputs": [("x", ["batch", *shape[1:]]), ("target", ["batch"])],
            "outputs": [("loss", [], True), ("y", ["batch", 2])]}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options={"utils": {"grad_norm_clip": False}})
    assert_losses_close([trainer.train_step(x, target)[0].item() for x, target in batches], expected)


class Sampled(nn.Module):
    """REINFORCE-style: classes drawn with torch.multinomial, the loss on their log-probabilities."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 5)

    def forward(self, x):
        log_probs = F.log_softmax(self.linear(x), dim=1)
        drawn = torch.multinomial(log_probs.exp(), 3, replacement=True)
        return -log_probs.gather(1, drawn).mean(), drawn


def test_multinomial_draws_from_torchs_generator():
    """The same draws as eager PyTorch after the same torch.manual_seed (ONNX's Multinomial would
    draw from ONNX Runtime's generator), so the losses agree step by step."""
    model, inputs = Sampled(), [torch.randn(6, 4, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    reference = copy.deepcopy(model)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(7)
    expected = []
    for x in inputs:
        sgd.zero_grad()
        loss, drawn = reference(x)
        loss.backward()
        sgd.step()
        expected.append((loss.item(), drawn))
    desc = {"inputs": [("x", [6, 4])], "outputs": [("loss", [], True), ("drawn", [6, 3], False)]}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), options={"utils": {"grad_norm_clip": False}})
    torch.manual_seed(7)
    for step, x in enumerate(inputs):
        loss, drawn = trainer.train_step(x)
        assert torch.equal(drawn, expected[step][1]), step
        np.testing.assert_allclose(loss.item(), expected[step][0], rtol=LOSS_RTOL)


def test_export_onnx_keeps_the_exporters_refusal_of_ops_onnx_lacks(tmp_path):
    make, shape = CASES["function sinh"]
    model, (x, target) = make(), _batches(shape, steps=1)[0]
    trainer = ORTTrainer(model, desc_for(shape), optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
    trainer.train_step(x, target)  # trains: a torch node
    with pytest.raises(Exception, match="aten::sinh"):  # an inference model for plain ONNX Runtime: no torch node
        trainer.export_onnx(tmp_path / "model.onnx")
    assert not (tmp_path / "model.onnx").exists()


@pytest.mark.parametrize("name", [b"sum", b"aten::sum"])
def test_onnx_runtime_s_own_reduce_sum_call_is_answered(name):
    """ONNX Runtime's CUDA ReduceSum (training build) calls the registered executor as
    `sum.dim_IntList` (`aten::sum` in some releases) with an omitted dtype (a null input); the first
    GPU run failed there."""
    x = torch.randn(3, 4, 5)
    capsules = [torch.utils.dlpack.to_dlpack(t) for t in (x, torch.tensor([0, 2]), torch.tensor([True]))]
    inputs = (ctypes.c_void_p * 4)(*[torch_ops._capsule_pointer(c, b"dltensor") for c in capsules], None)
    for capsule in capsules:
        torch_ops._capsule_rename(capsule, b"used_dltensor")  # ONNX Runtime's to free, as in a run
    outputs = (ctypes.c_void_p * 1)()
    torch_ops._execute(name, b"dim_IntList", 4, inputs, 1, outputs)
    assert torch_ops.take_errors() == []
    result = torch.utils.dlpack.from_dlpack(torch_ops._capsule_new(outputs[0], b"dltensor", None))
    assert torch.equal(result, x.sum(dim=(0, 2), keepdim=True))
