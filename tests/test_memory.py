"""Memory the trainer gives back: the CPU arena after a session's first run, the freed heap."""
import os

import numpy as np
import onnx
import onnxruntime
import pytest

from ort_trainer import ORTTrainer, optim
from ort_trainer._session import Placement

from . import models

MIB = 1 << 20


def _anon_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("RssAnon"))


def _large_intermediate_model(mib):
    """x [1] -> Expand to `mib` MiB of float32 -> ReduceSum: the arena holds the big tensor."""
    shape = onnx.helper.make_tensor("shape", onnx.TensorProto.INT64, [1], [mib * MIB // 4])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Expand", ["x", "shape"], ["big"]),
         onnx.helper.make_node("ReduceSum", ["big"], ["y"], keepdims=0)], "large",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [])], [shape])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=7)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc")
def test_release_cached_memory_hands_the_arena_back():
    placement = Placement("cpu", 1, False)
    session = onnxruntime.InferenceSession(_large_intermediate_model(96).SerializeToString(),
                                           placement.session_options(), providers=placement.providers)
    assert session.run(None, {"x": np.ones(1, np.float32)})[0] == 96 * MIB // 4
    held = _anon_mib()
    placement.release_cached_memory()
    assert held - _anon_mib() >= 80, (held, _anon_mib())


def test_each_session_releases_cached_memory_after_its_first_run_only(monkeypatch):
    trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=models.mlp_loss)
    released = []
    monkeypatch.setattr(trainer._placement, "release_cached_memory", lambda: released.append(True))
    for step in range(3):
        trainer.train_step(*models.mlp_batch(step))
    assert len(released) == 1
    for step in range(2):
        trainer.eval_step(*models.mlp_batch(step))
    assert len(released) == 2
    trainer.train_step(*models.mlp_batch(0, batch=5))  # a new input shape: a new session
    assert len(released) == 3
