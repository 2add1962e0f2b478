"""The seed `001_...` API (`ort_trainer.pytorch`): `trainer = ort.trainer(model, criterion, optimizer, ...)`
and `loss, y_pred = trainer.step(x, y)`, in step with the eager loop it replaces; bad input refused
by name, a refused step changing nothing."""
import copy
import re

import pytest
import torch

import ort_trainer.pytorch as ort
from ort_trainer.ortmodule import DebugOptions, ORTModule

N, D_IN, H, D_OUT = 64, 100, 50, 10


class Net(torch.nn.Module):
    """The seed's model: Net(D_in, H, D_out), a two-layer network."""

    def __init__(self, d_in, h, d_out):
        super().__init__()
        self.linear1 = torch.nn.Linear(d_in, h)
        self.linear2 = torch.nn.Linear(h, d_out)

    def forward(self, x):
        return self.linear2(self.linear1(x).clamp(min=0))


def _net():
    torch.manual_seed(0)
    return Net(D_IN, H, D_OUT)


def _batches(steps):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(N, D_IN, generator=generator), torch.randn(N, D_OUT, generator=generator))
            for _ in range(steps)]


@pytest.mark.parametrize("make_optimizer, max_grad_norm", [
    (lambda parameters: torch.optim.SGD(parameters, lr=1e-4), None),  # the seed's
    (lambda parameters: torch.optim.Adam(parameters, lr=1e-3), None),
    (lambda parameters: torch.optim.SGD(parameters, lr=0.05, momentum=0.9), 0.1),
], ids=["seed SGD", "Adam", "SGD momentum clipped"])
def test_the_seeds_loop_runs_in_step_with_the_eager_loop(monkeypatch, make_optimizer, max_grad_norm):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # ONNX Runtime's graph, or an error
    model, criterion = _net(), torch.nn.MSELoss()
    reference = copy.deepcopy(model)
    trainer = ort.trainer(model, criterion, make_optimizer(model.parameters()), max_grad_norm=max_grad_norm)
    assert isinstance(trainer.model, ORTModule)
    optimizer, norms = make_optimizer(reference.parameters()), []
    for x, y in _batches(4):
        loss, y_pred = trainer.step(x, y)
        expected_pred = reference(x)
        expected = criterion(expected_pred, y)
        optimizer.zero_grad()
        expected.backward()
        if max_grad_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm).item())
        optimizer.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
        torch.testing.assert_close(y_pred, expected_pred.detach(), rtol=1e-5, atol=1e-6)
        assert not loss.requires_grad and not y_pred.requires_grad
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)
    assert all(norm > max_grad_norm for norm in norms)  # the clipping acted


def test_an_ortmodule_is_used_as_it_is():
    wrapped = ORTModule(_net())
    trainer = ort.trainer(wrapped, torch.nn.MSELoss(), torch.optim.SGD(wrapped.parameters(), lr=1e-4))
    assert trainer.model is wrapped


def test_bad_arguments_are_refused_by_name():
    model, criterion = _net(), torch.nn.MSELoss()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-4)
    with pytest.raises(TypeError, match=r"^ort\.trainer: model must be a torch\.nn\.Module, got function$"):
        ort.trainer(_net, criterion, sgd)
    with pytest.raises(TypeError, match=re.escape("ort.trainer: criterion must be callable as criterion(y_pred, y) "
                                                  "(a loss such as torch.nn.MSELoss()), got str")):
        ort.trainer(model, "mse", sgd)
    with pytest.raises(TypeError, match=re.escape("ort.trainer: optimizer must be a torch.optim.Optimizer (such as "
                                                  "torch.optim.SGD(model.parameters(), lr=1e-4)), got dict")):
        ort.trainer(model, criterion, {"lr": 1e-4})
    with pytest.raises(ValueError, match=re.escape("ort.trainer: optimizer holds 4 parameter(s) that are not the "
                                                   "model's (an optimizer made for another model, or a copy of it): "
                                                   "make it from model.parameters()")):
        ort.trainer(model, criterion, torch.optim.SGD(copy.deepcopy(model).parameters(), lr=1e-4))
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match=re.escape(f"ort.trainer: max_grad_norm must be a positive finite "
                                                       f"number or None, got {bad!r}")):
            ort.trainer(model, criterion, sgd, max_grad_norm=bad)
    with pytest.raises(TypeError, match=r"^ort\.trainer: debug_options must be a DebugOptions or None, got dict$"):
        ort.trainer(model, criterion, sgd, debug_options={"save_onnx": True})
    with pytest.raises(TypeError, match=r"got an unexpected keyword argument 'lr_scheduler'"):
        ort.trainer(model, criterion, sgd, lr_scheduler=None)
    ort.trainer(model, criterion, sgd, debug_options=DebugOptions())


@pytest.mark.parametrize("criterion, got", [
    (torch.nn.MSELoss(reduction="none"), "a tensor of shape (64, 10)"),
    (lambda y_pred, y: torch.nn.functional.mse_loss(y_pred, y).item(), "a float"),
    (lambda y_pred, y: torch.nn.functional.mse_loss(y_pred.detach(), y), "a tensor of shape () without a gradient"),
])
def test_a_criterion_that_returns_no_loss_is_refused_and_changes_nothing(criterion, got):
    model = _net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = ort.trainer(model, criterion, sgd)
    before = copy.deepcopy(model.state_dict())
    x, y = _batches(1)[0]
    with pytest.raises(ValueError, match=re.escape("ort.trainer: criterion(y_pred, y) must return the loss as a "
                                                   f"one-element tensor computed from y_pred, got {got}")):
        trainer.step(x, y)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(parameter.grad is None for parameter in model.parameters())
