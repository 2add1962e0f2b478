"""export_onnx: an inference model that plain onnxruntime runs, matching torch within 1e-5."""
import io
import re

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

from ort_trainer import ORTTrainer, optim

from . import models


def trained(make_model, desc, loss_fn, make_batch, steps=3):
    trainer = ORTTrainer(make_model(), desc, optim.AdamConfig(lr=0.01), loss_fn=loss_fn)
    for step in range(steps):
        trainer.train_step(*make_batch(step))
    return trainer


def run_onnx(path, feeds):
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {name: tensor.numpy() for name, tensor in feeds.items()})


def test_mlp_export_has_dynamic_batch_and_matches_torch(tmp_path):
    trainer = trained(models.mlp, models.MLP_DESC, models.mlp_loss, models.mlp_batch)
    path = tmp_path / "mlp.onnx"
    trainer.export_onnx(path)
    graph = onnx.load(str(path)).graph
    assert [i.name for i in graph.input] == ["x"]
    assert [o.name for o in graph.output] == ["logits"]
    assert {node.op_type for node in graph.node}.isdisjoint({"Dropout", "SoftmaxCrossEntropyLoss"})
    trainer.model.eval()
    for batch in (8, 3):
        x = torch.randn(batch, 12)
        with torch.no_grad():
            expected = trainer.model(x).numpy()
        np.testing.assert_allclose(run_onnx(path, {"x": x})[0], expected, rtol=0, atol=1e-5)


def test_transformer_export_fixes_the_baked_sequence_length_and_warns(tmp_path):
    trainer = trained(models.transformer, models.TRANSFORMER_DESC, models.transformer_loss, models.transformer_batch)
    path = tmp_path / "transformer.onnx"
    with pytest.warns(UserWarning, match=re.escape("export_onnx: dims ['bptt'] are fixed to the sample batch's sizes")):
        trainer.export_onnx(path)
    dims = [d.dim_value or d.dim_param for d in onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim]
    assert dims == [7, "batch_size"]
    trainer.model.eval()
    for batch in (4, 2):
        src = torch.randint(0, models.VOCAB, (7, batch))
        with torch.no_grad():
            expected = trainer.model(src).numpy()
        np.testing.assert_allclose(run_onnx(path, {"src": src})[0], expected, rtol=0, atol=1e-5)


def test_model_without_loss_fn_exports_all_its_outputs(tmp_path):
    trainer = trained(models.two_tower, models.TWO_TOWER_DESC, None, models.two_tower_batch)
    trainer.export_onnx(tmp_path / "two.onnx")
    a, b = models.two_tower_batch(9)
    trainer.model.eval()
    with torch.no_grad():
        loss, prediction = trainer.model(a, b)
    ours = run_onnx(tmp_path / "two.onnx", {"a": a, "b": b})
    np.testing.assert_allclose(ours[1], prediction.numpy(), atol=1e-5)
    np.testing.assert_allclose(ours[0], loss.numpy(), atol=1e-5)


def test_export_before_any_step_is_refused(tmp_path):
    trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(), loss_fn=models.mlp_loss)
    with pytest.raises(RuntimeError, match=re.escape(
            "export_onnx() needs a sample batch: call train_step() or eval_step() once first")):
        trainer.export_onnx(tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_export_of_a_model_desc_declaring_only_the_loss_is_refused(tmp_path):
    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(torch.nn.Linear(4, 3), desc, optim.SGDConfig(lr=0.1),
                         loss_fn=torch.nn.functional.cross_entropy)
    trainer.train_step(torch.randn(5, 4), torch.randint(0, 3, (5,)))
    with pytest.raises(ValueError, match=re.escape(
            "model_desc['outputs'] declares only the loss 'loss': declare the model's outputs after it (e.g. "
            "('output', ['batch', 10])) in a new trainer, or write the model with its loss by save_as_onnx()")):
        trainer.export_onnx(tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []
    trainer.save_as_onnx(tmp_path / "with_loss.onnx")  # the alternative the message names works


class PaddedElu(torch.nn.Module):
    """Ops our training exports write differently from torch: reflect padding (a torch node) and Elu
    (decomposed)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 2, 3)

    def forward(self, x):
        return torch.nn.functional.elu(self.conv(torch.nn.functional.pad(x, (1, 1), mode="reflect")))


def users_training_export(model, x):
    """The user's own torch.onnx.export of `model` in training mode: its op types."""
    buffer = io.BytesIO()
    torch.onnx.export(model, (x,), buffer, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False)
    return {node.op_type for node in onnx.load_from_string(buffer.getvalue()).graph.node}


def test_our_symbolics_leave_a_users_own_export_as_torch_writes_it():
    """Our symbolics are registered for our exports only: after training, a user's own training
    export still gets torch's ops (ours write torch nodes a plain ONNX Runtime cannot run), and a
    symbolic the user registered for an op we also export is theirs again."""
    x = torch.randn(4, 2, 6)
    expected = users_training_export(PaddedElu(), x)
    assert {"Pad", "Elu"} <= expected and "ATen" not in expected
    torch.onnx.register_custom_op_symbolic("aten::elu", users_elu, 9)
    try:
        desc = {"inputs": [("x", ["batch", 2, 6]), ("y", ["batch", 2, 6])], "outputs": [("loss", [], True)]}
        trainer = ORTTrainer(PaddedElu(), desc, optim.SGDConfig(lr=0.1), loss_fn=torch.nn.functional.mse_loss)
        trainer.train_step(x, torch.randn(4, 2, 6))
        assert users_training_export(PaddedElu(), x) == expected - {"Elu"} | {"Relu"}
    finally:
        torch.onnx.unregister_custom_op_symbolic("aten::elu", 9)
    assert users_training_export(PaddedElu(), x) == expected


def users_elu(g, x, alpha, scale, input_scale):
    return g.op("Relu", x)
