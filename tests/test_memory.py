"""Memory the trainer gives back or reuses: the CPU arena after a session's first run, the freed
heap, the memory of outputs the caller has dropped."""
import os

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

from ort_trainer import ORTTrainer, optim
from ort_trainer._configuration.runtime_settings import RuntimeSettings
from ort_trainer._runtime import memory as _memory
from ort_trainer._runtime.placement import Placement
from ort_trainer._runtime.sessions import Sessions

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
    sessions = Sessions(Placement("cpu"), RuntimeSettings(threads=1))
    session = onnxruntime.InferenceSession(_large_intermediate_model(96).SerializeToString(),
                                           sessions.session_options(), providers=sessions.providers)
    assert session.run(None, {"x": np.ones(1, np.float32)})[0] == 96 * MIB // 4
    held = _anon_mib()
    sessions.memory.release_cached_memory()
    assert held - _anon_mib() >= 80, (held, _anon_mib())


def test_each_session_releases_cached_memory_around_its_first_run_only(monkeypatch):
    trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=models.mlp_loss)
    released = []
    monkeypatch.setattr(trainer._sessions.memory, "release_cached_memory", lambda: released.append(True))
    for step in range(3):
        trainer.train_step(*models.mlp_batch(step))
    assert len(released) == 2
    for step in range(2):
        trainer.eval_step(*models.mlp_batch(step))
    assert len(released) == 4
    trainer.train_step(*models.mlp_batch(0, batch=5))  # a new input shape: a training session, and the
    assert len(released) == 8                          # eval session that proves the re-derived graph


@pytest.fixture
def pooled_trainer(monkeypatch):
    """An MLP trainer whose [rows, 5] logits are pooled, not its loss (threshold lowered)."""
    monkeypatch.setattr(_memory, "POOLED_OUTPUT_BYTES", 16)
    return ORTTrainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=models.mlp_loss)


def test_an_output_the_caller_dropped_is_reused(pooled_trainer):
    _, logits = pooled_trainer.train_step(*models.mlp_batch(0))
    address = logits.data_ptr()
    del logits
    _, logits = pooled_trainer.train_step(*models.mlp_batch(1))
    assert logits.data_ptr() == address
    _, evaluated = pooled_trainer.eval_step(*models.mlp_batch(2))
    assert evaluated.data_ptr() != address


def test_an_output_or_a_view_the_caller_holds_is_never_overwritten(pooled_trainer):
    _, held = pooled_trainer.train_step(*models.mlp_batch(0))
    held_values = held.clone()
    _, base = pooled_trainer.train_step(*models.mlp_batch(1))
    view, kept_values = base[2:], base[2:].clone()
    _, exported = pooled_trainer.train_step(*models.mlp_batch(2))
    as_numpy, exported_values = exported.numpy(), exported.numpy().copy()
    del base, exported
    outputs = [pooled_trainer.eval_step(*models.mlp_batch(step))[1] for step in range(4)]
    outputs += [pooled_trainer.train_step(*models.mlp_batch(step))[1] for step in range(4)]
    addresses = {t.data_ptr() for t in outputs}
    assert len(addresses) == len(outputs) and held.data_ptr() not in addresses
    assert not {view.data_ptr() - 2 * 5 * 4} & addresses
    assert torch.equal(held, held_values) and torch.equal(view, kept_values)
    assert as_numpy.ctypes.data not in addresses and (as_numpy == exported_values).all()


def test_the_pool_keeps_one_free_output_of_each_of_the_last_two_sizes(pooled_trainer):
    outputs = {rows: pooled_trainer.eval_step(*models.mlp_batch(0, batch=rows))[1] for rows in (8, 3, 2)}
    another = pooled_trainer.eval_step(*models.mlp_batch(1))[1]
    del outputs[8], another  # two of one size: one kept
    del outputs[3], outputs[2]  # a third size: the oldest goes
    free = pooled_trainer._sessions.memory.free_outputs
    assert list(free) == [3 * 5 * 4, 2 * 5 * 4]
    address = free[2 * 5 * 4].ctypes.data
    assert pooled_trainer.eval_step(*models.mlp_batch(0, batch=2))[1].data_ptr() == address
