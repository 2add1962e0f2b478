"""Custom torch.autograd.Functions inside the graph, both front ends: the Function's own forward
runs in a torch node and its own backward in the gradient node, on the same ctx (saved tensors,
attributes, needs_input_grad, mark_non_differentiable, set_materialize_grads, constant arguments),
in step with eager PyTorch; what a graph cannot reproduce is refused by name."""
import copy
import re

import pytest
import torch
import torch.nn as nn

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
from ort_trainer._runtime import torch_ops
from ort_trainer.ortmodule import ORTModule

from . import models


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


class StraightThroughRound(torch.autograd.Function):
    """Rounds to 1/scale forward; backward scales the gradient by 1 + |x| (clamped): not the
    derivative of the forward (zero almost everywhere), so a graph differentiating the inlined
    forward trains nothing before it."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        ctx.save_for_backward(x)
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        return grad * (1 + x.abs().clamp(max=1)), None


class Rounded(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.second(StraightThroughRound.apply(torch.relu(self.first(x)), 4.0))


def _batch(step, rows=6):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 8, generator=generator), torch.randn(rows, 4, generator=generator)


def _mse(output, target):
    return ((output - target) ** 2).mean()


def _assert_trains_like_eager(model, steps=5, make_loss=_mse):
    """ORTModule(model) and a copy in eager PyTorch, AdamW, the same batches: losses and final
    weights equal (to float rounding)."""
    torch.manual_seed(0)
    eager, wrapped = copy.deepcopy(model), ORTModule(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (wrapped, eager)]
    for step in range(steps):
        x, target = _batch(step)
        losses = []
        for module, optimizer in zip((wrapped, eager), optimizers):
            optimizer.zero_grad()
            loss = make_loss(module(x), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-7), step
    for (name, ours), theirs in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch_ops._contexts  # every kept ctx was used by its backward and freed


def test_ortmodule_runs_the_functions_own_backward():
    _assert_trains_like_eager(Rounded())


def test_ortmodule_straight_through_clamp_gradient_is_its_backwards():
    linear = nn.Linear(4, 4)
    wrapped = ORTModule(nn.Sequential(linear, _Clamp()))
    (wrapped(torch.randn(8, 4) * 100) * 100).sum().backward()
    assert torch.equal(linear.bias.grad, torch.full((4,), 800.0))  # straight through; the clamp's would be ~0


class _Clamp(nn.Module):
    def forward(self, x):
        return models.StraightThroughClamp.apply(x)


class AddsInPlace(torch.autograd.Function):
    """Adds 3 * bias to its first argument in place (ctx.mark_dirty) and returns it."""

    @staticmethod
    def forward(ctx, x, bias):
        ctx.mark_dirty(x)
        return x.add_(3 * bias)

    @staticmethod
    def backward(ctx, grad):
        return grad, 3 * grad.sum(0)


class DirtiesAnArgument(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second, self.bias = nn.Linear(8, 16), nn.Linear(16, 4), nn.Parameter(torch.randn(16))

    def forward(self, x):
        hidden = self.first(x)  # needs a gradient: no leaf, so eager lets the Function modify it
        added = AddsInPlace.apply(hidden, self.bias)
        return self.second(added * hidden)  # hidden is the modified tensor


def test_ortmodule_function_modifying_an_argument_that_needs_a_gradient_in_place_trains_in_step():
    _assert_trains_like_eager(DirtiesAnArgument())


class OnInputsAlone(nn.Module):
    """A Function computed from the call's inputs alone: no parameter on its way."""

    def __init__(self, scaled):
        super().__init__()
        self.scaled = scaled

    def forward(self, x):
        return StraightThroughRound.apply(x * 3 if self.scaled else x, 4.0)


@pytest.mark.parametrize("scaled", [False, True])
def test_ortmodule_input_gradient_through_a_function_of_the_inputs_alone_is_its_backwards(scaled):
    x = torch.randn(6, 8)
    eager_x, ours_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, output = OnInputsAlone(scaled)(eager_x), ORTModule(OnInputsAlone(scaled))(ours_x)
    torch.testing.assert_close(output, expected)
    expected.pow(2).sum().backward()
    output.pow(2).sum().backward()
    torch.testing.assert_close(ours_x.grad, eager_x.grad)
    assert not torch_ops._contexts


class Recording(torch.autograd.Function):
    """Records what its backward sees of the ctx: needs_input_grad, the constants, the attributes,
    which output gradients came (None after set_materialize_grads(False)); two outputs, the second
    marked non-differentiable."""

    calls = []

    @staticmethod
    def forward(ctx, x, weight, tag, factor, options):
        Recording.calls.append("forward")
        ctx.set_materialize_grads(False)
        ctx.tag, ctx.options = tag, options
        ctx.save_for_backward(x, weight)
        scaled = x * weight * factor
        mask = (x > 0).to(x.dtype)
        ctx.mark_non_differentiable(mask)
        return scaled, mask, x.sum(-1)

    @staticmethod
    def backward(ctx, grad_scaled, grad_mask, grad_sum):
        x, weight = ctx.saved_tensors
        Recording.calls.append(("backward", tuple(ctx.needs_input_grad), ctx.tag, ctx.options["k"],
                                grad_mask is None, grad_sum is None))
        grad_x = grad_scaled * weight * 3.0 if ctx.needs_input_grad[0] else None
        grad_weight = (grad_scaled * x).sum(0) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None, None, None


class RecordingModel(nn.Module):
    def __init__(self, input_needs_grad):
        super().__init__()
        self.first, self.weight = nn.Linear(8, 8), nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.input_needs_grad = input_needs_grad

    def forward(self, x):
        hidden = self.first(x) if self.input_needs_grad else x
        scaled, mask, _ = Recording.apply(hidden, self.weight, "tag", 3.0, {"k": 7})
        return scaled * mask + scaled


@pytest.mark.parametrize("input_needs_grad", [True, False])
def test_ortmodule_carries_the_ctx_from_forward_to_backward(input_needs_grad):
    model = RecordingModel(input_needs_grad)
    eager, wrapped = copy.deepcopy(model), ORTModule(model)
    x = torch.randn(6, 8)
    wrapped(x)  # the compile: the probe and the trace run the forward too
    seen = []
    for module in (eager, wrapped):
        Recording.calls.clear()
        module(x).pow(2).sum().backward()
        seen.append(list(Recording.calls))
    # then each call: forward once, backward once (the ctx is carried, not recomputed), seeing what eager's sees
    assert seen[1] == seen[0] == ["forward", ("backward", (input_needs_grad, True, False, False, False), "tag", 7,
                                              True, True)]
    for (name, ours), theirs in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)


class Normalize(torch.autograd.Function):
    """An output the ctx saves (the graph gets a copy: ONNX Runtime may reuse its own memory)."""

    @staticmethod
    def forward(ctx, x):
        result = x / x.norm(dim=-1, keepdim=True)
        ctx.save_for_backward(result, x.norm(dim=-1, keepdim=True))
        return result

    @staticmethod
    def backward(ctx, grad):
        result, norm = ctx.saved_tensors
        return (grad - result * (grad * result).sum(-1, keepdim=True)) / norm


class Normalized(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.second(torch.relu(Normalize.apply(self.first(x))) * 2)


def test_ortmodule_function_saving_its_output_trains_in_step():
    _assert_trains_like_eager(Normalized())


class MaskedScale(torch.autograd.Function):
    """Takes a bool mask (ONNX Runtime hands bool tensors over as uint8)."""

    @staticmethod
    def forward(ctx, x, mask):
        ctx.save_for_backward(mask)
        return x.masked_fill(~mask, 0.0) * 2

    @staticmethod
    def backward(ctx, grad):
        mask, = ctx.saved_tensors
        return grad.masked_fill(~mask, 0.0) * 3, None


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        hidden = self.first(x)
        return self.second(MaskedScale.apply(hidden, hidden > 0))


def test_ortmodule_function_with_a_bool_input_trains_in_step():
    _assert_trains_like_eager(Masked())


def _trainer(model, **utils):
    desc = {"inputs": [("x", ["rows", 8]), ("target", ["rows", 4])],
            "outputs": [("loss", [], True), ("output", ["rows", 4])]}
    return ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn=_mse,
                      options=ORTTrainerOptions({"utils": {"grad_norm_clip": False, **utils}}))


@pytest.mark.parametrize("make_model", [Rounded, Normalized])
def test_ortrainer_trains_through_functions_in_step_with_eager_at_every_shape(make_model):
    torch.manual_seed(0)
    model = make_model()
    eager = copy.deepcopy(model)
    trainer, optimizer = _trainer(model), torch.optim.SGD(eager.parameters(), lr=0.1)
    for step, rows in enumerate([6, 6, 5, 7]):  # new shapes: the graph re-derived from the first export
        x, target = _batch(step, rows)
        loss, output = trainer.train_step(x, target)
        optimizer.zero_grad()
        expected = _mse(eager(x), target)
        expected.backward()
        optimizer.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5), step
        assert output.shape == (rows, 4)
    torch.testing.assert_close(trainer.eval_step(x, target)[0], _mse(eager(x), target))
    assert not torch_ops._contexts


class CapturesWeights(torch.autograd.Function):
    """A backward that computes the gradients of weights the Function reads without taking them
    as arguments, into their .grad (as reentrant checkpointing does)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            torch.autograd.backward(ctx.layer(x), grad)
        return x.grad, None


class Captured(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return CapturesWeights.apply(self.first(x), self.second)


def test_ortmodule_function_whose_backward_sets_weight_grads_trains_as_eager():
    _assert_trains_like_eager(Captured())


def test_ortrainer_refuses_a_backward_that_sets_weight_grads_itself_before_any_update():
    trainer = _trainer(Captured())
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with pytest.raises(NotImplementedError, match=re.escape(
            "a custom autograd.Function's backward set the .grad of parameters ['second.weight', 'second.bias'] "
            "itself: ORTTrainer updates the gradients its graph computes, and would not train them. Pass those "
            "parameters to the Function's apply as arguments (its backward returning their gradients), or train "
            "the model with ORTModule and a torch optimizer")), \
            pytest.warns(UserWarning, match=r"parameters \['second.bias', 'second.weight'\] are not used by the "
                                            r"model's forward/loss"):  # the graph does not read them
        trainer.train_step(*_batch(0))
    assert trainer.train_step_info.step == 0
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name


class TensorInList(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, extras):
        return x * extras[0]

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReturnsANumber(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, 3

    @staticmethod
    def backward(ctx, grad, _):
        return grad * 2


class Refused(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.linear, self.kind = nn.Linear(8, 4), kind

    def forward(self, x):
        hidden = self.linear(x)
        if self.kind == "list":
            return TensorInList.apply(hidden, [hidden.detach() + 1])
        output, count = ReturnsANumber.apply(hidden)
        return output * count


_REFUSALS = {
    "list": "custom autograd.Function tests.test_autograd_functions.TensorInList gets a tensor inside a list, tuple "
            "or dict argument: a graph would keep that tensor's values of this call as a constant. Pass each "
            "tensor as an argument of TensorInList.apply itself",
    "number": "custom autograd.Function tests.test_autograd_functions.ReturnsANumber returns a non-tensor value at "
              "output 1: a graph would keep the value of the traced call for every call. Return tensors only (a "
              "number as a 0-d tensor), or compute that value outside the Function",
}


@pytest.mark.parametrize("kind", sorted(_REFUSALS))
def test_what_a_graph_cannot_reproduce_is_refused_by_name_in_both_front_ends(kind):
    with pytest.raises(NotImplementedError, match=re.escape(_REFUSALS[kind])):
        ORTModule(Refused(kind))(torch.randn(6, 8)).sum().backward()
    desc = {"inputs": [("x", ["rows", 8]), ("target", ["rows", 4])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(Refused(kind), desc, optim.SGDConfig(), loss_fn=_mse)
    with pytest.raises(NotImplementedError, match=re.escape(_REFUSALS[kind])):
        trainer.train_step(*_batch(0))
    assert trainer.train_step_info.step == 0


def test_contexts_of_calls_without_backward_are_freed():
    wrapped = ORTModule(Rounded())
    x = torch.randn(6, 8)
    output = wrapped(x)  # a training call whose backward never comes
    assert torch_ops._contexts  # kept for the backward
    del output
    assert not torch_ops._contexts
    with torch.no_grad():
        wrapped(x)
    wrapped.eval()
    wrapped(x)
    assert not torch_ops._contexts


def test_disable_custom_autograd_support_runs_such_models_in_pytorch(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_TORCH_MODEL")
    monkeypatch.setenv("ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT", "1")
    wrapped = ORTModule(Rounded())
    with pytest.warns(UserWarning, match=re.escape(
            "(FALLBACK_UNSUPPORTED_TORCH_MODEL): NotImplementedError: the model's outputs are computed through "
            "custom torch.autograd.Functions ['tests.test_autograd_functions.StraightThroughRound']: the exported "
            "graph would differentiate their inlined forward instead of running their backward "
            "(ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT=1: they run in PyTorch under the default fallback policy)")):
        wrapped(torch.randn(6, 8))
