"""Bad input to ORTTrainer: every message pinned, and a rejected call changes nothing."""
import contextlib
import re

import pytest
import torch
import torch.nn as nn

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim

from . import models


def mlp_trainer(**options):
    return ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(), loss_fn=models.mlp_loss,
                      options=ORTTrainerOptions(options))


def snapshot(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def assert_unchanged(trainer, before, steps):
    assert trainer._train_step_info.step == steps
    assert trainer._train_step_info.optimization_step == steps
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


@pytest.mark.parametrize("args, error, message", [
    ((nn.Linear(2, 2).state_dict(), models.MLP_DESC, optim.AdamConfig()), TypeError,
     "model must be a torch.nn.Module or an onnx.ModelProto, got OrderedDict"),
    ((models.mlp(), models.MLP_DESC, {"lr": 0.1}), TypeError,
     "optim_config must be an optim.SGDConfig, optim.AdamConfig or optim.LambConfig, got dict"),
])
def test_constructor_types(args, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        ORTTrainer(*args, loss_fn=models.mlp_loss)


def test_loss_fn_and_options_types():
    with pytest.raises(TypeError, match="^loss_fn must be callable or None, got int$"):
        ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(), loss_fn=3)
    with pytest.raises(TypeError, match="^options must be an ORTTrainerOptions or a dict, got list$"):
        ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(), loss_fn=models.mlp_loss, options=[])


def test_loss_must_come_first_with_loss_fn():
    desc = {"inputs": models.MLP_DESC["inputs"], "outputs": [("logits", ["batch", 5]), ("loss", [], True)]}
    with pytest.raises(ValueError, match=re.escape(
            "Invalid model_desc: with a loss_fn the loss must be the first output, got is_loss on output 1 ('loss')")):
        ORTTrainer(models.mlp(), desc, optim.AdamConfig(), loss_fn=models.mlp_loss)


def test_loss_fn_needs_a_label_input():
    desc = {"inputs": [("x", ["batch", 12])], "outputs": [("loss", [], True)]}
    with pytest.raises(ValueError, match=re.escape(
            "Invalid model_desc: with a loss_fn at least one input must be a label (an input forward() does not "
            "take), but forward() takes every one: forward(x) and model_desc inputs ['x']")):
        ORTTrainer(models.mlp(), desc, optim.AdamConfig(), loss_fn=models.mlp_loss)


def test_unknown_frozen_weight():
    with pytest.raises(ValueError, match=re.escape(
            "Invalid options: utils.frozen_weights names unknown parameters ['net.9.weight']; the model's "
            "parameters are ['net.0.weight', 'net.0.bias', 'net.1.weight', 'net.1.bias', 'net.3.weight', "
            "'net.3.bias']")):
        mlp_trainer(utils={"frozen_weights": ["net.9.weight"]})


class UnusedHead(nn.Module):
    """An MLP with a head its forward never calls (a model whose other task is off)."""

    def __init__(self):
        super().__init__()
        self.body = models.mlp()
        self.unused_head = nn.Linear(5, 2)

    def forward(self, x):
        return self.body(x)


def test_param_groups_may_name_frozen_and_unused_parameters_as_torch_optimizers_do():
    """Groups built from model.named_parameters() (the no-decay recipe) name every parameter."""
    model = UnusedHead()
    names = [name for name, _ in model.named_parameters()]
    biases = [name for name in names if name.endswith("bias")]
    config = optim.AdamConfig(lr=0.01, params=[{"params": biases, "lambda_coef": 0.0}], lambda_coef=0.01)
    trainer = ORTTrainer(model, models.MLP_DESC, config, loss_fn=models.mlp_loss,
                         options=ORTTrainerOptions({"utils": {"frozen_weights": ["body.net.0.bias"]}}))
    before = snapshot(trainer)
    unused = "parameters ['unused_head.bias', 'unused_head.weight'] are not used"
    with pytest.warns(UserWarning, match=re.escape(unused)):
        trainer.train_step(*models.mlp_batch(0))
    after = snapshot(trainer)
    untouched = {"body.net.0.bias", "unused_head.weight", "unused_head.bias"}
    assert all(torch.equal(after[name], before[name]) == (name in untouched) for name in names)


def test_param_group_naming_an_unknown_parameter():
    config = optim.AdamConfig(params=[{"params": ["net.0.weight", "nope"], "alpha": 0.8}])
    with pytest.raises(ValueError, match="nope"):
        ORTTrainer(models.mlp(), models.MLP_DESC, config, loss_fn=models.mlp_loss)


@pytest.mark.parametrize("call, error, message", [
    (lambda t, x, y: t.train_step(x), TypeError, "train_step() expects 2 inputs ['x', 'target'], got 1"),
    (lambda t, x, y: t.train_step(x, y, y), TypeError, "train_step() expects 2 inputs ['x', 'target'], got 3"),
    (lambda t, x, y: t.train_step(x, label=y), TypeError,
     "train_step() got unexpected keyword inputs ['label']; model_desc inputs are ['x', 'target']"),
    (lambda t, x, y: t.train_step(x, y, x=x), TypeError, "train_step() got inputs ['x'] both by position and by keyword"),
    (lambda t, x, y: t.train_step(x.double(), y), TypeError,
     "train_step(): input 'x' has dtype torch.float64, expected torch.float32 (from the first batch)"),
    (lambda t, x, y: t.train_step(x[:, :6], y), ValueError,
     "train_step(): input 'x' has shape [8, 6], but axis 1 must be 12 (model_desc ['batch', 12])"),
    (lambda t, x, y: t.train_step(x, y[:4]), ValueError,
     "train_step(): dim 'batch' is 8 in input 'x' but 4 in input 'target' (axis 0)"),
    (lambda t, x, y: t.train_step(x.unsqueeze(0), y), ValueError,
     "train_step(): input 'x' has shape [1, 8, 12], expected rank 2 ['batch', 12]"),
    (lambda t, x, y: t.train_step(x.tolist(), y), TypeError,
     "train_step(): input 'x' must be a torch.Tensor or numpy.ndarray, got list"),
    (lambda t, x, y: t.eval_step(x), TypeError, "eval_step() expects 2 inputs ['x', 'target'], got 1"),
    (lambda t, x, y: t.train_step(x[:0], y[:0]), ValueError,
     "train_step(): input 'x' has shape [0, 12]: an empty batch (a dimension of size 0) has no memory ONNX Runtime "
     "can bind; skip empty batches"),
])
def test_bad_step_inputs_change_nothing(call, error, message):
    trainer = mlp_trainer()
    x, y = models.mlp_batch(0)
    trainer.train_step(x, y)
    before = snapshot(trainer)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        call(trainer, x, y)
    assert_unchanged(trainer, before, steps=1)


def test_inputs_by_keyword_and_as_one_list():
    trainer = mlp_trainer()
    x, y = models.mlp_batch(0)
    first = trainer.eval_step(target=y, x=x)[0]
    assert torch.equal(trainer.eval_step([x, y])[0], first)


def test_declared_dtype_is_checked_on_the_first_batch():
    desc = {"inputs": [("x", ["batch", 12], "float64"), ("target", ["batch"])],
            "outputs": models.MLP_DESC["outputs"]}
    trainer = ORTTrainer(models.mlp(), desc, optim.AdamConfig(), loss_fn=models.mlp_loss)
    before = snapshot(trainer)
    with pytest.raises(TypeError, match=re.escape(
            "train_step(): input 'x' has dtype torch.float32, expected torch.float64 (from model_desc)")):
        trainer.train_step(*models.mlp_batch(0))
    assert_unchanged(trainer, before, steps=0)


class Unexportable(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return torch.linalg.svd(self.linear(x))[0].sum()


def test_export_failure_names_the_operator():
    desc = {"inputs": [("x", [4, 4])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(Unexportable(), desc, optim.SGDConfig())
    before = snapshot(trainer)
    with pytest.raises(RuntimeError, match=re.escape(
            "exporting the model to ONNX failed at operator aten::linalg_svd: UnsupportedOperatorError: "
            "Exporting the operator 'aten::linalg_svd' to ONNX opset version 14 is not supported")):
        trainer.train_step(torch.randn(4, 4))
    assert_unchanged(trainer, before, steps=0)


def test_models_that_update_other_buffers_than_batchnorm_statistics_are_refused_by_name():
    trainer = ORTTrainer(models.RunningNorm(), {"inputs": [("x", ["n", 4]), ("target", ["n", 4, 3])],
                                                "outputs": [("loss", [], True)]},
                         optim.SGDConfig(), loss_fn=nn.functional.mse_loss)
    before = {name: b.clone() for name, b in trainer.model.named_buffers()}
    with pytest.raises(NotImplementedError, match=re.escape(
            "the model updates buffers ['instance.running_mean', 'instance.running_var'] in training mode; the "
            "trainer writes back BatchNorm running statistics only")):
        trainer.train_step(torch.randn(8, 4), torch.randn(8, 4, 3))
    for name, b in trainer.model.named_buffers():  # the BatchNorm's too: a rejected call changes nothing
        assert torch.equal(b, before[name]), name


def test_cuda_without_a_gpu_build_is_a_clear_error_not_a_cpu_fallback():
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this ONNX Runtime has a CUDA provider")
    with pytest.raises(RuntimeError, match=re.escape(
            "device.id asks for CUDA, but the installed ONNX Runtime 1.19.2 has no CUDAExecutionProvider "
            "(a CPU build?): pip install -e '.[gpu]' in the ort-trainer checkout")):
        mlp_trainer(device={"id": "cuda:0"})


class TrainingOnlyScale(nn.Module):
    """Exports differently from its eval-mode forward: what check_model_export exists to catch."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return (y * 2 if self.training else y).pow(2).mean()


def test_check_model_export_reports_a_graph_that_differs_from_torch():
    desc = {"inputs": [("x", ["n", 4])], "outputs": [("loss", [], True)]}
    checked = ORTTrainer(TrainingOnlyScale(), desc, optim.SGDConfig(),
                         options=ORTTrainerOptions({"debug": {"check_model_export": True}}))
    before = snapshot(checked)
    with pytest.raises(RuntimeError, match=re.escape(
            "debug.check_model_export: output 'loss' of the exported graph differs from the torch model by up to")):
        checked.train_step(torch.randn(3, 4))
    assert_unchanged(checked, before, steps=0)
    fine = mlp_trainer(debug={"check_model_export": True, "deterministic_compute": True})
    fine.train_step(*models.mlp_batch(0))
    assert fine.train_step_info.step == 1


def test_opset_version_option_is_used(monkeypatch):
    from ort_trainer._compile import exports as _export

    exported = []
    original = _export.export_training_model

    def spy(*args):
        exported.append(original(*args))
        return exported[-1]

    monkeypatch.setattr(_export, "export_training_model", spy)
    trainer = mlp_trainer(_internal_use={"onnx_opset_version": 15})
    trainer.train_step(*models.mlp_batch(0))
    assert [o.version for o in exported[0].opset_import if o.domain in ("", "ai.onnx")] == [15]


@pytest.mark.parametrize("logits_shape, message", [
    (["batch", 7], "model_desc output 'logits' is declared ['batch', 7] (here [8, 7]), but the model produces "
                   "shape [8, 5]"),
    (["rows", 5, 1], "model_desc output 'logits' is declared ['rows', 5, 1], but the model produces shape [8, 5]"),
    (["batch", "classes"], None),
])
def test_declared_output_shape_must_match_the_model(logits_shape, message):
    desc = {"inputs": models.MLP_DESC["inputs"], "outputs": [("loss", [], True), ("logits", logits_shape)]}
    trainer = ORTTrainer(models.mlp(), desc, optim.AdamConfig(), loss_fn=models.mlp_loss)
    if message is None:  # a name only outputs use binds freely
        assert trainer.train_step(*models.mlp_batch(0))[1].shape == (8, 5)
        return
    before = snapshot(trainer)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        trainer.train_step(*models.mlp_batch(0))
    assert_unchanged(trainer, before, steps=0)


def test_non_float32_parameters_are_refused_by_name():
    model = models.mlp()
    model.net[3].double()
    with pytest.raises(TypeError, match=re.escape(
            "ORTTrainer trains float32 parameters (one flat fp32 buffer); got {'net.3.weight': torch.float64, "
            "'net.3.bias': torch.float64}: call model.float(), or freeze them (utils.frozen_weights)")):
        ORTTrainer(model, models.MLP_DESC, optim.AdamConfig(), loss_fn=models.mlp_loss)



class OptionalBranch(nn.Module):
    """A projection read only when the optional input `extra` is given."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.extra_proj = nn.Linear(12, 5), nn.Linear(3, 5)

    def forward(self, x, extra=None):
        out = self.body(x)
        return out if extra is None else out + self.extra_proj(extra)


OPTIONAL_DESC = {"inputs": [("x", ["batch", 12]), ("extra", ["batch", 3]), ("target", ["batch"])],
                 "outputs": [("loss", [], True), ("logits", ["batch", 5])]}


@pytest.mark.parametrize("first_extra,message", [
    (False, "with these inputs (all given) the model uses parameters ['extra_proj.weight', 'extra_proj.bias'] that "
            "the first compiled call did not, so they have no place in the trainer's flat buffers"),
    (True, "with these inputs (None: ['extra']) the model leaves the trained parameters ['extra_proj.weight', "
           "'extra_proj.bias'] unused, and each update would still move them (momentum, weight decay) where torch's "
           "optimizer skips them"),
], ids=["used_later", "unused_later"])
def test_parameters_that_depend_on_optional_inputs_are_refused_by_name(first_extra, message):
    trainer = ORTTrainer(OptionalBranch(), OPTIONAL_DESC, optim.AdamConfig(), loss_fn=models.mlp_loss)
    x, y = models.mlp_batch(0)
    extra = torch.randn(8, 3)
    with pytest.warns(UserWarning) if not first_extra else contextlib.nullcontext():
        trainer.train_step(x, extra if first_extra else None, y)
    before = snapshot(trainer)
    for method in ("train_step", "eval_step"):
        with pytest.raises(ValueError, match=re.escape(message + ": the parameters a model uses must not depend on "
                                                       "which optional inputs are given")):
            getattr(trainer, method)(x, None if first_extra else extra, y)
    assert_unchanged(trainer, before, steps=1)


def test_frozen_parameters_may_depend_on_optional_inputs():
    model = OptionalBranch()
    trainer = ORTTrainer(model, OPTIONAL_DESC, optim.AdamConfig(), loss_fn=models.mlp_loss,
                         options=ORTTrainerOptions({"utils": {"frozen_weights": ["extra_proj.weight",
                                                                                 "extra_proj.bias"]}}))
    x, y = models.mlp_batch(0)
    extra = torch.randn(8, 3)
    trainer.train_step(x, None, y)
    loss, logits = trainer.eval_step(x, extra, y)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(logits, model(x, extra), atol=1e-6)
    model.train()
    trainer.train_step(x, extra, y)
