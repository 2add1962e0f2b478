"""The placement's rules that need no GPU: the model moved to the trainer's device, and on CUDA
(torch's and CuPy's stream calls faked, recorded in order) the stream order kept when a step
raises and first values queued on the placement's stream."""
import contextlib
import types

import pytest
import torch

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
from ort_trainer._runtime import placement as _placement
from ort_trainer._runtime.placement import Placement
from ort_trainer._trainer.mixed_precision import mixed_precision

from . import models


def test_a_model_elsewhere_is_moved_to_the_device_with_its_buffers():
    model = models.conv_batch_norm()
    Placement("meta").take(model)  # any device other than the model's: the rule, without a GPU
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"meta"}


def test_the_trainer_moves_the_model_after_every_check(monkeypatch):
    """Moved once the arguments are accepted (a refused call leaves the model where it was)."""
    taken = []
    monkeypatch.setattr(Placement, "take", lambda self, model: taken.append(model))
    with pytest.raises(ValueError, match="frozen_weights"):
        ORTTrainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(), loss_fn=models.mlp_loss,
                   options={"utils": {"frozen_weights": ["nope"]}})
    assert taken == []
    model = models.mlp()
    ORTTrainer(model, models.MLP_DESC, optim.SGDConfig(), loss_fn=models.mlp_loss)
    assert taken == [model]


class _Recorder:
    """Fake torch.cuda streams and CuPy: what is entered, waited on and allocated, in order."""

    def __init__(self, monkeypatch):
        self.events, self.current = [], "caller"
        recorder = self

        class Stream:
            cuda_stream = 1234

            def __init__(self, name="placement"):
                self.name = name

            def wait_stream(self, other):
                recorder.events.append(f"{self.name} waits for {other.name}")

        @contextlib.contextmanager
        def entered(name):
            previous, recorder.current = recorder.current, name
            recorder.events.append(f"enter {name}")
            try:
                yield
            finally:
                recorder.events.append(f"exit {name}")
                recorder.current = previous

        def array(value, dtype):
            recorder.events.append(f"array on {recorder.current}")
            return value

        self.caller = Stream("caller")
        cuda = types.SimpleNamespace(Device=lambda index: entered(f"device {index}"),
                                     ExternalStream=lambda ptr, index: entered(f"cupy stream {ptr}"))
        self.xp = types.SimpleNamespace(cuda=cuda, array=array)
        monkeypatch.setattr(_placement, "require_cuda", lambda index: self.xp)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device: self.caller)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: entered(f"torch stream {stream.name}"))


def test_a_step_that_raises_still_orders_the_callers_stream_after_it(monkeypatch):
    recorder = _Recorder(monkeypatch)
    placement = Placement("cuda:0")
    with pytest.raises(KeyError, match="failed"):
        with placement.step():
            raise KeyError("failed")
    assert recorder.events[0] == "placement waits for caller"
    assert recorder.events[-1] == "caller waits for placement"


def test_the_loss_scale_is_copied_on_the_placements_stream(monkeypatch):
    """Its host-to-device copy is queued ahead of the steps that read it, not on another stream."""
    recorder = _Recorder(monkeypatch)
    placement = Placement("cuda:0")
    options = ORTTrainerOptions({"mixed_precision": {"enabled": True}}).mixed_precision
    with placement.allocating():
        mixed_precision(options, "cuda", placement.xp)
    assert "array on cupy stream 1234" in recorder.events
    assert "enter torch stream placement" in recorder.events
    # ordered after the caller's work (the model's tensors it copies) and before the caller's next
    assert recorder.events[0] == "placement waits for caller"
    assert recorder.events[-1] == "caller waits for placement"
