"""Models as users write them: inputs bound to forward() by name, outputs picked by name, None
inputs, and the modules' train/eval flags honoured. Each model trains in step with eager PyTorch."""
import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim

STEPS = 10
NO_CLIP = {"utils": {"grad_norm_clip": False}}


def _trainer(model, desc, loss_fn=None, **options):
    return ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn=loss_fn,
                      options=ORTTrainerOptions({**NO_CLIP, **options}))


def _batch(step, rows=6):
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randn(rows, 4, generator=generator), torch.randn(rows, 3, generator=generator)


def _assert_trains_like_torch(model, desc, torch_step, ort_step, loss_fn=None, steps=STEPS):
    """Same init, same batches: the ORTTrainer loss equals eager torch's at every step (SGD), and
    so do the weights and buffers (BatchNorm running statistics) at the end."""
    reference = copy.deepcopy(model)
    trainer = _trainer(model, desc, loss_fn)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        ours = ort_step(trainer, step)
        sgd.zero_grad()
        theirs = torch_step(reference, step)
        theirs.backward()
        sgd.step()
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-7), f"step {step}"
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6, msg=name)
    for (name, ours), theirs in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7, msg=name)
    return trainer


def _mse(output, target):
    return nn.functional.mse_loss(output, target)


LOSS_ONLY = [("loss", [], True)]


# ---------------------------------------------------------------- inputs by name and by position
def test_sequential_takes_the_first_input_by_position_and_the_rest_are_labels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch", 3])], "outputs": LOSS_ONLY + [("out", ["batch", 3])]}
    _assert_trains_like_torch(
        model, desc, lambda m, s: _mse(m(_batch(s)[0]), _batch(s)[1]),
        lambda t, s: t.train_step(*_batch(s))[0], loss_fn=_mse)


class SwappedOrder(nn.Module):
    """forward(a, b) where a and b play different roles: passing them in the wrong order shows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.scale = nn.Linear(4, 3)
        self.shift = nn.Linear(3, 3)

    def forward(self, a, b):
        return self.scale(a) * 10 + self.shift(b)


def test_inputs_listed_in_another_order_than_forward_are_bound_by_name():
    desc = {"inputs": [("b", ["batch", 3]), ("a", ["batch", 4])], "outputs": [("loss", [], True)]}

    class WithLoss(SwappedOrder):
        def forward(self, a, b):
            return super().forward(a, b).square().mean()

    model = WithLoss()
    _assert_trains_like_torch(
        model, desc, lambda m, s: m(*_batch(s)),
        lambda t, s: t.train_step(b=_batch(s)[1], a=_batch(s)[0]))
    a, b = _batch(99)
    with torch.no_grad():
        expected = model(a, b)
    assert _trainer(model, desc).eval_step(b=b, a=a).item() == pytest.approx(expected.item(), rel=1e-5)
    assert _trainer(model, desc).eval_step(b, a).item() == pytest.approx(expected.item(), rel=1e-5)


class KeywordDefaults(nn.Module):
    """forward(y=None, x=None): only x is described; y must keep its default."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.linear = nn.Linear(4, 3)

    def forward(self, y=None, x=None):
        out = self.linear(x)
        return out if y is None else out + y


def test_keyword_inputs_with_defaults_are_passed_by_name():
    desc = {"inputs": [("x", ["batch", 4]), ("target", ["batch", 3])], "outputs": LOSS_ONLY}
    _assert_trains_like_torch(
        KeywordDefaults(), desc, lambda m, s: _mse(m(x=_batch(s)[0]), _batch(s)[1]),
        lambda t, s: t.train_step(*_batch(s)), loss_fn=_mse)


class KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.linear = nn.Linear(4, 3)

    def forward(self, x, *, gate):
        return self.linear(x) * torch.sigmoid(gate)


def test_keyword_only_parameters_are_bound():
    desc = {"inputs": [("gate", ["batch", 3]), ("x", ["batch", 4]), ("target", ["batch", 3])], "outputs": LOSS_ONLY}

    def gate(step):
        return torch.full((6, 3), 0.1 * step)
    _assert_trains_like_torch(
        KeywordOnly(), desc, lambda m, s: _mse(m(_batch(s)[0], gate=gate(s)), _batch(s)[1]),
        lambda t, s: t.train_step(gate(s), *_batch(s)), loss_fn=_mse)


class OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.linear = nn.Linear(4, 3)

    def forward(self, x, mask=None):
        out = self.linear(x)
        return out if mask is None else out * mask


def test_none_for_an_optional_input_means_not_passed_and_is_its_own_graph():
    desc = {"inputs": [("x", ["batch", 4]), ("mask", ["batch", 3]), ("target", ["batch", 3])], "outputs": LOSS_ONLY}
    mask = torch.tensor([[1.0, 0.0, 1.0]]).expand(6, 3)

    def torch_step(m, step):
        x, y = _batch(step)
        return _mse(m(x, mask if step % 2 else None), y)

    def ort_step(t, step):
        x, y = _batch(step)
        return t.train_step(x, mask if step % 2 else None, y)

    trainer = _assert_trains_like_torch(OptionalMask(), desc, torch_step, ort_step, loss_fn=_mse)
    assert len(trainer._graphs) == 2


# ---------------------------------------------------------------- binding errors
class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, mask):
        return self.linear(x) * mask


@pytest.mark.parametrize("names, loss_fn, message", [
    (["x", "target"], _mse, "Invalid model_desc: forward() parameters ['mask'] have no default and no model_desc "
                            "input of that name: forward(x, mask) and model_desc inputs ['x', 'target']. Name the "
                            "inputs after forward()'s parameters"),
    (["x", "mask", "extra"], None, "Invalid model_desc: inputs ['extra'] are not parameters of forward() and there "
                                   "is no loss_fn to take them as labels: forward(x, mask) and model_desc inputs "
                                   "['x', 'mask', 'extra']. Rename them after forward()'s parameters, or pass a "
                                   "loss_fn"),
])
def test_inputs_forward_cannot_take_are_refused_with_its_signature(names, loss_fn, message):
    desc = {"inputs": [(name, ["batch", 4]) for name in names], "outputs": LOSS_ONLY}
    with pytest.raises(ValueError, match=re.escape(message)):
        ORTTrainer(TwoInputs(), desc, optim.SGDConfig(), loss_fn=loss_fn)


def test_unnamed_inputs_with_optional_positional_parameters_are_ambiguous():
    desc = {"inputs": [("src", ["batch", 4]), ("label", ["batch", 3])], "outputs": LOSS_ONLY}
    with pytest.raises(ValueError, match=re.escape(
            "Invalid model_desc: cannot tell which inputs go to forward() and which are labels for loss_fn: no "
            "model_desc input is named after a forward() parameter, and forward() has optional positional "
            "parameters: forward(x, mask=None) and model_desc inputs ['src', 'label']. Name the inputs after "
            "forward()'s parameters")):
        ORTTrainer(OptionalMask(), desc, optim.SGDConfig(), loss_fn=_mse)


def test_too_many_positional_inputs_without_a_loss_fn():
    model = nn.Sequential(nn.Linear(4, 3))
    desc = {"inputs": [("a", ["batch", 4]), ("b", ["batch", 4])], "outputs": LOSS_ONLY}
    with pytest.raises(ValueError, match=re.escape(
            "Invalid model_desc: forward() takes 1 to 1 positional inputs, but model_desc has 2 and no loss_fn to "
            "take the rest as labels: forward(input) and model_desc inputs ['a', 'b']")):
        ORTTrainer(model, desc, optim.SGDConfig())


@pytest.mark.parametrize("values, message", [
    ((None, None, "y"), "train_step(): input 'x' is None, but forward(x, mask=None) has no default for 'x'; pass a "
                        "tensor"),
    (("x", None, None), "train_step(): input 'target' is None, but it is a label for loss_fn; pass a tensor"),
])
def test_none_where_an_input_is_required_is_refused_and_changes_nothing(values, message):
    desc = {"inputs": [("x", ["batch", 4]), ("mask", ["batch", 3]), ("target", ["batch", 3])], "outputs": LOSS_ONLY}
    model = OptionalMask()
    before = copy.deepcopy(model.state_dict())
    trainer = _trainer(model, desc, _mse)
    x, y = _batch(0)
    args = [{"x": x, "y": y, None: None}[value] for value in values]
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer.train_step(*args)
    assert trainer.train_step_info.step == 0
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name])


def test_none_for_a_positional_input_is_refused():
    desc = {"inputs": [("a", ["batch", 4]), ("b", ["batch", 3])], "outputs": LOSS_ONLY}
    trainer = _trainer(nn.Sequential(nn.Linear(4, 3)), desc, _mse)
    with pytest.raises(ValueError, match=re.escape(
            "eval_step(): input 'a' is None, but it is passed to forward() by position; pass a tensor")):
        trainer.eval_step(None, _batch(0)[1])


# ---------------------------------------------------------------- outputs
class DictOutputs(nn.Module):
    """Returns more than model_desc declares, in another order, plus a non-tensor entry."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.linear = nn.Linear(4, 3)

    def forward(self, x, target=None):
        logits = self.linear(x)
        out = {"hidden": logits * 2, "cache": [("not", "a tensor")], "logits": logits}
        if target is not None:
            out["loss"] = _mse(logits, target)
        return out


def test_dict_outputs_are_picked_by_name_and_undeclared_ones_are_not_computed():
    desc = {"inputs": [("x", ["batch", 4]), ("target", ["batch", 3])],
            "outputs": [("logits", ["batch", 3]), ("loss", [], True)]}
    model = DictOutputs()
    trainer = _assert_trains_like_torch(model, desc, lambda m, s: m(*_batch(s))["loss"],
                                        lambda t, s: t.train_step(*_batch(s))[1])
    x, y = _batch(50)
    logits, loss = trainer.eval_step(x, y)
    torch.testing.assert_close(logits, model.linear(x).detach())
    graph = next(iter(trainer._graphs._graphs.values()))
    assert graph._output_names == ("logits", "loss")


def test_only_the_loss_declared_with_a_loss_fn_trains_and_returns_the_loss():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 3))
    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch", 3])], "outputs": LOSS_ONLY}
    trainer = _assert_trains_like_torch(model, desc, lambda m, s: _mse(m(_batch(s)[0]), _batch(s)[1]),
                                        lambda t, s: t.train_step(*_batch(s)), loss_fn=_mse)
    assert trainer.eval_step(*_batch(0)).shape == ()


def test_tuple_outputs_fill_declared_outputs_in_order():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(7)
            self.linear = nn.Linear(4, 3)

        def forward(self, x):
            out = self.linear(x)
            return out, out.sum(1)

    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch", 3])],
            "outputs": LOSS_ONLY + [("first", ["batch", 3]), ("second", ["batch"])]}
    model = Pair()
    trainer = _trainer(model, desc, lambda output, y: _mse(output[0], y))
    loss, first, second = trainer.eval_step(*_batch(0))
    torch.testing.assert_close(second, model.linear(_batch(0)[0]).sum(1).detach())


@pytest.mark.parametrize("outputs, message", [
    ([("loss", [], True), ("scores", ["batch", 3])],
     "model_desc outputs ['scores'] are not among the model's outputs ['hidden', 'cache', 'logits', 'loss'] (dict)"),
    ([("loss", [], True), ("cache", ["batch", 3])], "model output 'cache' is a list, not a tensor"),
])
def test_declared_outputs_the_model_does_not_produce_are_named(outputs, message):
    desc = {"inputs": [("x", ["batch", 4]), ("target", ["batch", 3])], "outputs": outputs}
    trainer = _trainer(DictOutputs(), desc)
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer.train_step(*_batch(0))
    assert trainer.train_step_info.step == 0


def test_more_declared_outputs_than_tensors_returned():
    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch", 3])],
            "outputs": LOSS_ONLY + [("out", ["batch", 3]), ("extra", ["batch"])]}
    trainer = _trainer(nn.Sequential(nn.Linear(4, 3)), desc, _mse)
    with pytest.raises(ValueError, match=re.escape(
            "model_desc outputs ['extra'] are not produced: the model returned 1 tensor(s) (Tensor) for model_desc "
            "outputs ['out', 'extra']")):
        trainer.train_step(*_batch(0))


def test_use_cache_is_turned_off_unless_model_desc_names_it():
    seen = []

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x, use_cache=True):
            seen.append(use_cache)
            return self.linear(x)

    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch", 3])], "outputs": LOSS_ONLY}
    _trainer(Cached(), desc, _mse).train_step(*_batch(0))
    assert seen and not any(seen)


# ---------------------------------------------------------------- train/eval flags are the user's
class FrozenBackbone(nn.Module):
    """A backbone with dropout and BatchNorm, frozen by the user with .eval(), under a trained head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(8)
        self.backbone = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.backbone(x))


def test_a_submodule_in_eval_mode_trains_with_its_dropout_off_and_keeps_its_flags():
    model = FrozenBackbone()
    with torch.no_grad():
        model.backbone[1].running_mean.uniform_(-0.5, 0.5)
        model.backbone[1].running_var.uniform_(0.5, 2.0)
    model.backbone.eval()
    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch", 3])], "outputs": LOSS_ONLY}
    trainer = _assert_trains_like_torch(model, desc, lambda m, s: _mse(m(_batch(s)[0]), _batch(s)[1]),
                                        lambda t, s: t.train_step(*_batch(s)), loss_fn=_mse)
    assert model.training and model.head.training
    assert not any(module.training for module in model.backbone.modules())
    trainer.eval_step(*_batch(0))
    assert model.training and not model.backbone.training


def test_batchnorm_in_training_mode_trains_on_batch_statistics_and_updates_its_running_ones():
    model = FrozenBackbone()
    model.backbone[2].eval()  # dropout off (its masks are not torch's); the BatchNorm trains
    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch", 3])], "outputs": LOSS_ONLY}
    trainer = _assert_trains_like_torch(model, desc, lambda m, s: _mse(m(_batch(s)[0]), _batch(s)[1]),
                                        lambda t, s: t.train_step(*_batch(s)), loss_fn=_mse)
    assert model.backbone[1].num_batches_tracked.item() == STEPS
    assert model.training and model.backbone[1].training and not model.backbone[2].training


def test_batchnorm_without_running_statistics_trains():
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.Linear(8, 3))
    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch", 3])], "outputs": LOSS_ONLY}
    _assert_trains_like_torch(model, desc, lambda m, s: _mse(m(_batch(s)[0]), _batch(s)[1]),
                              lambda t, s: t.train_step(*_batch(s)), loss_fn=_mse)


def test_flags_changed_after_the_first_step_compile_again():
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.9), nn.Linear(8, 3))
    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch", 3])], "outputs": LOSS_ONLY}
    reference = copy.deepcopy(model)
    trainer = _trainer(model, desc, _mse)
    trainer.train_step(*_batch(0))  # dropout on: a different update than torch's below
    model.eval()
    reference.load_state_dict(model.state_dict())
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference.eval()
    with pytest.warns(UserWarning, match=re.escape("train_step: the model is in eval mode (Sequential.training "
                                                   "is False), so it trains as torch would in eval mode")):
        for step in range(1, 4):
            ours = trainer.train_step(*_batch(step))
            sgd.zero_grad()
            theirs = _mse(reference(_batch(step)[0]), _batch(step)[1])
            theirs.backward()
            sgd.step()
            assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    assert len(trainer._graphs) == 1 and not model.training


def test_checks_and_exports_leave_every_flag_as_it_was(tmp_path):
    model = FrozenBackbone()
    model.backbone.eval()
    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch", 3])], "outputs": LOSS_ONLY + [("out", ["batch", 3])]}
    trainer = _trainer(model, desc, _mse, debug={"check_model_export": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.train_step(*_batch(0))
    trainer.export_onnx(tmp_path / "model.onnx")
    assert [module.training for module in model.modules()] == [True, False, False, False, False, False, True]


def test_a_convolutional_batchnorm_in_eval_mode_trains_on_its_running_statistics():
    torch.manual_seed(11)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    model[1].eval()
    desc = {"inputs": [("x", ["batch", 2, 6, 6]), ("y", ["batch", 3])], "outputs": LOSS_ONLY}

    def batch(step):
        generator = torch.Generator().manual_seed(700 + step)
        return torch.randn(5, 2, 6, 6, generator=generator), torch.randn(5, 3, generator=generator)
    _assert_trains_like_torch(model, desc, lambda m, s: _mse(m(batch(s)[0]), batch(s)[1]),
                              lambda t, s: t.train_step(*batch(s)), loss_fn=_mse)
