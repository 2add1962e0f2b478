"""Refusals carry their fallback category (`_configuration.refusals`) and ORTModule's fallback is
decided in one place (`ortmodule._fallback`); a catch of a failing graph names the errors it
expects, so a bug (KeyError, AttributeError, ...) surfaces with its traceback instead of turning
into a fallback to PyTorch, a trace again or a `False`."""
import copy
import re
import warnings

import pytest
import torch
from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

from ort_trainer import ORTTrainer, optim
from ort_trainer._compile import exports as trainer_exports
from ort_trainer._compile import inference
from ort_trainer._configuration.ortmodule_settings import FallbackPolicy
from ort_trainer._configuration.refusals import (DeviceRefused, OnnxModelRefused, TorchModelRefused, device_failure,
                                                  shown_name)
from ort_trainer._export.autograd_functions import AutogradFunctionRefused
from ort_trainer._export.binding import BindingError
from ort_trainer._export.guards import DataDependentTraceError
from ort_trainer._export.trace import ExportError
from ort_trainer._graph.missing_gradient import MissingGradientError
from ort_trainer._runtime.cuda_requirements import CudaUnavailable
from ort_trainer._runtime.trainer_sessions import CompiledGraph
from ort_trainer.ortmodule import ORTModule
from ort_trainer.ortmodule import _fallback, _wrapper

from . import models
from .test_ortmodule import Spectrum
from .test_trace_guards import Branchy

POLICY = FallbackPolicy


@pytest.mark.parametrize("error, category, shown", [
    (BindingError("b"), POLICY.FALLBACK_UNSUPPORTED_DATA, "BindingError"),
    (DataDependentTraceError(["here"]), POLICY.FALLBACK_UNSUPPORTED_TORCH_MODEL, "DataDependentTraceError"),
    (TorchModelRefused("t"), POLICY.FALLBACK_UNSUPPORTED_TORCH_MODEL, "NotImplementedError"),
    (DeviceRefused("d"), POLICY.FALLBACK_UNSUPPORTED_DEVICE, "NotImplementedError"),
    (CudaUnavailable("c"), POLICY.FALLBACK_UNSUPPORTED_DEVICE, "CudaUnavailable"),
    (ExportError("e"), POLICY.FALLBACK_UNSUPPORTED_ONNX_MODEL, "ExportError"),
    (OnnxModelRefused("o"), POLICY.FALLBACK_UNSUPPORTED_ONNX_MODEL, "NotImplementedError"),
    (MissingGradientError("Op", []), POLICY.FALLBACK_UNSUPPORTED_ONNX_MODEL, "MissingGradientError"),
    (AutogradFunctionRefused("a"), POLICY.FALLBACK_UNSUPPORTED_ONNX_MODEL, "AutogradFunctionRefused"),
    (ort_errors.Fail("f"), POLICY.FALLBACK_UNSUPPORTED_ONNX_MODEL, "Fail"),  # ONNX Runtime's own, untyped
    (RuntimeError("r"), POLICY.FALLBACK_UNSUPPORTED_ONNX_MODEL, "RuntimeError"),
    (NotImplementedError("n"), POLICY.FALLBACK_UNSUPPORTED_ONNX_MODEL, "NotImplementedError"),
])
def test_each_refusal_knows_its_category_and_keeps_the_name_messages_give_it(error, category, shown):
    assert isinstance(error, _fallback.REFUSED)
    assert _fallback.category(error) == category
    assert shown_name(error) == shown


@pytest.mark.parametrize("error", [KeyError("k"), AttributeError("a"), TypeError("t"), ValueError("v"),
                                   IndexError("i")])
def test_a_bug_while_compiling_propagates_whatever_the_policy(monkeypatch, error):
    """Before, any exception of the compile ran the model in PyTorch with a warning: our own bugs
    looked like an unsupported model."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_FORCE_TORCH_FORWARD")

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(_wrapper.ModuleGraph, "compiled", broken)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ORTModule")
        with pytest.raises(type(error)) as raised:
            ORTModule(models.mlp())(torch.randn(3, 12))
    assert raised.value is error


@pytest.mark.parametrize("error", [ort_errors.Fail("[ONNXRuntimeError] : 1 : FAIL : no kernel"),
                                   ort_errors.InvalidGraph("[ONNXRuntimeError] : 10 : INVALID_GRAPH : bad"),
                                   RuntimeError("ONNX Runtime's builder failed")])
def test_onnx_runtimes_errors_are_the_onnx_models_and_fall_back(monkeypatch, error):
    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(_wrapper.ModuleGraph, "compiled", failing)
    model = models.mlp()
    wrapped, x = ORTModule(copy.deepcopy(model)), torch.randn(3, 12)
    with pytest.warns(UserWarning, match=re.escape(
            f"MLP runs in PyTorch for this input signature (FALLBACK_UNSUPPORTED_ONNX_MODEL): {type(error).__name__}: "
            f"{error}. Set ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE to raise instead")) as caught:
        torch.testing.assert_close(wrapped(x), model(x))
    assert [w.filename for w in caught if "runs in PyTorch" in str(w.message)] == [__file__]  # the caller's line
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    with pytest.raises(type(error)) as raised:
        ORTModule(copy.deepcopy(model))(x)
    assert raised.value is error


def test_the_category_comes_from_the_refusal_not_from_where_it_was_caught(monkeypatch):
    """A trace that reads tensor values fails in the export, the step that compiles the ONNX model:
    its refusal still says it is the torch model's."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_TORCH_MODEL")
    x = torch.randn(4, 2)
    with pytest.warns(UserWarning, match=r"\(FALLBACK_UNSUPPORTED_TORCH_MODEL\): DataDependentTraceError"):
        ORTModule(Branchy())(x)
    with pytest.raises(ExportError, match="exporting the model to ONNX failed at operator aten::fft_rfft"):
        ORTModule(Spectrum())(torch.randn(8, 4))


def test_a_dynamic_axis_probe_is_false_where_onnx_runtime_fails_and_a_bug_propagates(monkeypatch):
    x = torch.randn(2, 3)

    def fails(error):
        def session_outputs(*args):
            raise error
        return session_outputs

    monkeypatch.setattr(inference, "_session_outputs", fails(ort_errors.RuntimeException("Reshape: bad shape")))
    assert inference._runs_like_torch(b"", ["x"], [x], [x]) is False
    monkeypatch.setattr(inference, "_session_outputs", fails(AttributeError("a bug")))
    with pytest.raises(AttributeError, match="a bug"):
        inference._runs_like_torch(b"", ["x"], [x], [x])


@pytest.fixture
def traces(monkeypatch):
    """How many times ORTTrainer traced the model."""
    count = {"traces": 0}
    original = trainer_exports.export_training_model

    def counted(*args):
        count["traces"] += 1
        return original(*args)

    monkeypatch.setattr(trainer_exports, "export_training_model", counted)
    return count


def _eval_run_fails(monkeypatch, error):
    """The proof's eval-graph run (`quiet=True`) raises `error`; the steps' runs are as they are."""
    original = CompiledGraph.run

    def run(self, inputs, *, training, grads=None, quiet=False):
        if quiet:
            raise error
        return original(self, inputs, training=training, grads=grads, quiet=quiet)

    monkeypatch.setattr(CompiledGraph, "run", run)


def _mlp_trainer(**debug):
    return ORTTrainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=models.mlp_loss,
                      options={"debug": debug})


def test_a_rederived_graph_onnx_runtime_rejects_is_traced_again_and_a_bug_propagates(monkeypatch, traces):
    trainer = _mlp_trainer()
    trainer.train_step(*models.mlp_batch(0, batch=8))
    assert traces["traces"] == 1
    _eval_run_fails(monkeypatch, ort_errors.RuntimeException("Reshape: the input tensor cannot be reshaped"))
    trainer.train_step(*models.mlp_batch(1, batch=5))  # re-derived, fails its proof: traced at this shape
    assert traces["traces"] == 2
    trainer = _mlp_trainer()
    trainer.train_step(*models.mlp_batch(0, batch=8))
    _eval_run_fails(monkeypatch, KeyError("a bug"))
    with pytest.raises(KeyError, match="a bug"):
        trainer.train_step(*models.mlp_batch(1, batch=5))
    assert traces["traces"] == 3  # the bug was not taken for a shape the export baked in


DEVICE_FAILURES = [
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    ort_errors.Fail("[ONNXRuntimeError] : 1 : FAIL : CUDA failure 2: out of memory ; GPU=0"),
    ort_errors.RuntimeException("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory for "
                                "requested buffer of size 4194304"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
]


@pytest.mark.parametrize("error", DEVICE_FAILURES, ids=lambda error: type(error).__name__)
def test_the_device_failing_in_a_proof_propagates_and_nothing_is_traced_again(monkeypatch, traces, error):
    """Out of memory or a CUDA error says nothing about the graph: the proof re-raises it rather
    than trace again (which would hide it or fail the same way)."""
    trainer = _mlp_trainer()
    trainer.train_step(*models.mlp_batch(0, batch=8))
    _eval_run_fails(monkeypatch, error)
    with pytest.raises(type(error)) as raised:
        trainer.train_step(*models.mlp_batch(1, batch=5))  # re-derived: its proof's eval run fails
    assert raised.value is error and traces["traces"] == 1


def test_the_device_failing_in_the_proofs_torch_forward_propagates(monkeypatch, traces):
    trainer = _mlp_trainer()
    trainer.train_step(*models.mlp_batch(0, batch=8))
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def forward(*args):
        raise error

    monkeypatch.setattr(trainer_exports, "TracedStep", lambda *args: forward)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        trainer.train_step(*models.mlp_batch(1, batch=5))
    assert raised.value is error and traces["traces"] == 1


def test_the_device_failing_in_export_onnxs_proof_propagates(monkeypatch):
    error = RuntimeError("CUDA error: out of memory")

    def fails(*args):
        raise error

    monkeypatch.setattr(inference, "_session_outputs", fails)
    with pytest.raises(RuntimeError) as raised:
        inference._runs_like_torch(b"", [], [], [])
    assert raised.value is error


def test_device_failures_are_told_from_graphs_onnx_runtime_cannot_run():
    assert all(device_failure(error) for error in [*DEVICE_FAILURES, MemoryError()])
    assert not any(device_failure(error) for error in [
        ort_errors.RuntimeException("Reshape: the input tensor cannot be reshaped"),
        ort_errors.InvalidArgument("Out of range value in index tensor"), RuntimeError("Cast: unsupported type")])


def test_check_model_export_keeps_onnx_runtimes_error_chained(monkeypatch):
    error = ort_errors.RuntimeException("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Reshape failed\nmore")
    _eval_run_fails(monkeypatch, error)
    trainer = _mlp_trainer(check_model_export=True)
    with pytest.raises(RuntimeError, match=re.escape(
            "debug.check_model_export: the exported graph fails: RuntimeException: [ONNXRuntimeError] : 6 : "
            "RUNTIME_EXCEPTION : Reshape failed")) as raised:
        trainer.train_step(*models.mlp_batch(0))
    assert isinstance(raised.value.__cause__, trainer_exports.GraphDiffers)
    assert raised.value.__cause__.__cause__ is error
