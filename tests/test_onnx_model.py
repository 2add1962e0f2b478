"""An onnx.ModelProto as the model (the loss inside the graph, as the original ORTTrainer's ONNX
samples did), and save_as_onnx: the ONNX path trains exactly as the torch path it was exported from."""
import copy
import io
import re
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

from ort_trainer import ORTTrainer, optim

from . import models

DESC = {"inputs": [("x", ["batch", 12]), ("target", ["batch"])],
        "outputs": [("loss", [], True), ("out", ["batch", 5])]}


class MLPWithLoss(torch.nn.Module):
    """The MLP with its loss in forward(): what gets exported as the ONNX model."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x, target):
        out = self.mlp(x)
        return torch.nn.functional.cross_entropy(out, target), out


def exported(module, keep_initializers_as_inputs=False):
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, models.mlp_batch(0), buffer, input_names=["x", "target"],
                          output_names=["loss", "out"], opset_version=14, dynamo=False,
                          dynamic_axes={"x": {0: "batch"}, "target": {0: "batch"}, "out": {0: "batch"}},
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          keep_initializers_as_inputs=keep_initializers_as_inputs)
    return onnx.load_from_string(buffer.getvalue())


def train(trainer, steps, first=0):
    return [trainer.train_step(*models.mlp_batch(step))[0].item() for step in range(first, first + steps)]


@pytest.fixture
def module():
    return MLPWithLoss(models.mlp())


@pytest.mark.parametrize("initializers_as_inputs", [False, True], ids=["ir4", "initializers-as-inputs"])
def test_an_onnx_model_trains_like_the_torch_model_it_was_exported_from(module, initializers_as_inputs):
    config = optim.AdamConfig(lr=1e-2, params=[{"params": ["mlp.net.3.weight"], "lambda_coef": 0.1}])
    from_onnx = ORTTrainer(exported(module, initializers_as_inputs), DESC, config)
    from_torch = ORTTrainer(copy.deepcopy(module), DESC, optim.AdamConfig(
        lr=1e-2, params=[{"params": ["mlp.net.3.weight"], "lambda_coef": 0.1}]))
    assert train(from_onnx, 6) == train(from_torch, 6)
    ours, theirs = from_onnx.state_dict(), from_torch.state_dict()
    assert list(ours["model"]) == list(theirs["model"]) == [name for name, _ in module.named_parameters()]
    for name, tensor in theirs["model"].items():
        assert torch.equal(ours["model"][name], tensor), name
    for state in theirs["optimizer"]["state"]:
        for name, tensor in theirs["optimizer"]["state"][state].items():
            assert torch.equal(ours["optimizer"]["state"][state][name], tensor), (state, name)
    eval_x, eval_target = models.mlp_batch(50, batch=3)  # another batch size: the graph's dims are symbolic
    torch.testing.assert_close(from_onnx.eval_step(eval_x, eval_target)[1],
                               from_torch.eval_step(eval_x, eval_target)[1], rtol=0, atol=0)


def test_frozen_weights_are_named_by_initializer(module):
    trainer = ORTTrainer(exported(module), DESC, optim.SGDConfig(lr=0.1),
                         options={"utils": {"frozen_weights": ["mlp.net.0.weight"]}})
    before = trainer.state_dict()["model"]
    train(trainer, 2)
    after = trainer.state_dict()["model"]
    assert torch.equal(after["mlp.net.0.weight"], before["mlp.net.0.weight"])
    assert not torch.equal(after["mlp.net.0.bias"], before["mlp.net.0.bias"])


def test_model_desc_names_must_be_graph_inputs_and_outputs(module):
    desc = {"inputs": [("x", ["batch", 12]), ("labels", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", 5])]}
    with pytest.raises(ValueError, match=re.escape(
            "Invalid model_desc: inputs ['labels'] and outputs ['logits'] are not in the ONNX graph; its inputs are "
            "['target', 'x'], its outputs ['loss', 'out']")):
        ORTTrainer(exported(module), desc, optim.SGDConfig())


def test_every_graph_input_must_be_described(module):
    desc = {"inputs": [("x", ["batch", 12])], "outputs": [("loss", [], True)]}
    with pytest.raises(ValueError, match=re.escape(
            "Invalid model_desc: the ONNX graph reads inputs ['target'] that model_desc does not describe")):
        ORTTrainer(exported(module), desc, optim.SGDConfig())


def test_the_loss_is_the_graphs(module):
    with pytest.raises(ValueError, match=re.escape(
            "loss_fn must be None when the model is an ONNX model: the loss is computed in the graph")):
        ORTTrainer(exported(module), DESC, optim.SGDConfig(), loss_fn=torch.nn.functional.cross_entropy)


def test_the_export_check_has_no_torch_model_to_compare_with(module):
    with pytest.raises(ValueError, match=re.escape(
            "Invalid options: debug.check_model_export=True compares the graph with the torch model, and an ONNX "
            "model has none; leave it False")):
        ORTTrainer(exported(module), DESC, optim.SGDConfig(), options={"debug": {"check_model_export": True}})


def test_models_of_other_types_are_refused():
    with pytest.raises(TypeError, match=re.escape(
            "model must be a torch.nn.Module or an onnx.ModelProto, got bytes")):
        ORTTrainer(b"model.onnx", DESC, optim.SGDConfig())


def test_input_dtypes_come_from_the_graph(module):
    trainer = ORTTrainer(exported(module), DESC, optim.SGDConfig())
    x, target = models.mlp_batch(0)
    with pytest.raises(TypeError, match=re.escape(
            "train_step(): input 'target' has dtype torch.int32, expected torch.int64 (from model_desc)")):
        trainer.train_step(x, target.int())


def test_export_onnx_points_to_save_as_onnx(module):
    trainer = ORTTrainer(exported(module), DESC, optim.SGDConfig())
    train(trainer, 1)
    with pytest.raises(TypeError, match=re.escape("save_as_onnx() writes it with the trained weights")):
        trainer.export_onnx("unused.onnx")


def _run(path, x, target):
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["loss"], {"x": x.numpy(), "target": target.numpy()})[0]


@pytest.mark.parametrize("kind", ["torch", "onnx"])
def test_save_as_onnx_writes_the_forward_and_loss_with_the_trained_weights(module, kind, tmp_path):
    trainer = ORTTrainer(exported(module) if kind == "onnx" else module, DESC, optim.AdamConfig(lr=1e-2))
    train(trainer, 3)
    trainer.save_as_onnx(tmp_path / "trained.onnx")
    saved = onnx.load(tmp_path / "trained.onnx")
    assert {i.name for i in saved.graph.initializer} >= set(trainer.state_dict()["model"])
    x, target = models.mlp_batch(9, batch=6)
    expected = trainer.eval_step(x, target)[0].item()
    np.testing.assert_allclose(_run(tmp_path / "trained.onnx", x, target), expected, rtol=1e-6)


def test_a_saved_training_model_resumes_as_an_onnx_model(module, tmp_path):
    """save_as_onnx + state_dict from a torch run continue, as an ONNX model, exactly as the run."""
    trainer = ORTTrainer(module, DESC, optim.AdamConfig(lr=1e-2))
    train(trainer, 3)
    trainer.save_as_onnx(tmp_path / "run.onnx")
    state = trainer.state_dict()
    resumed = ORTTrainer(onnx.load(tmp_path / "run.onnx"), DESC, optim.AdamConfig(lr=1e-2))
    resumed.load_state_dict(state)
    assert train(resumed, 3, first=3) == train(trainer, 3, first=3)


def test_save_as_onnx_needs_a_sample_batch_for_a_torch_model(module):
    with pytest.raises(RuntimeError, match=re.escape(
            "save_as_onnx() needs a sample batch: call train_step() or eval_step() once first")):
        ORTTrainer(module, DESC, optim.SGDConfig()).save_as_onnx("unused.onnx")
