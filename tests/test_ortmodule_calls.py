"""ORTModule takes calls as the model does: forward()'s own signature, tensors inside list, tuple and
dict arguments, helper methods whose self(...) runs the graph, outputs changed in place before
backward() refused as PyTorch refuses them, and a fresh dropout mask on every training call."""
import collections
import copy
import inspect
import json
import pickle

import pytest
import torch
import torch.nn as nn

from ort_trainer import ORTTrainer, optim
from ort_trainer.ortmodule import ORTModule


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


class WithHelpers(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x, scale: float = 1.0):
        return self.linear(x) * scale

    def train_step(self, x, target):
        return nn.functional.mse_loss(self(x), target)

    def describe(self):
        return super().__repr__()  # zero-argument super(): stays bound to the model


def test_forward_shows_the_models_signature_and_keeps_it_through_pickle():
    wrapped = ORTModule(WithHelpers())
    assert str(inspect.signature(wrapped.forward)) == "(x, scale: float = 1.0)"
    restored = pickle.loads(pickle.dumps(wrapped))  # what torch.save(wrapped) does
    assert str(inspect.signature(restored.forward)) == "(x, scale: float = 1.0)"
    assert restored(torch.ones(1, 4)).shape == (1, 2)


def test_a_helper_that_calls_self_runs_the_graph():
    torch.manual_seed(0)
    model = WithHelpers()
    wrapped = ORTModule(copy.deepcopy(model))
    x, target = torch.randn(3, 4), torch.randn(3, 2)
    loss = wrapped.train_step(x, target)
    assert len(wrapped._graphs) == 1  # the graph ran (plain PyTorch compiles nothing)
    loss.backward()
    model.train_step(x, target).backward()
    assert torch.allclose(wrapped.linear.weight.grad, model.linear.weight.grad, atol=1e-6)
    assert wrapped.describe().startswith("WithHelpers(")


def test_an_output_changed_in_place_before_backward_is_refused_as_pytorch_does():
    model = nn.Sequential(nn.Linear(8, 4), nn.Softmax(1))  # Softmax's gradient reads its output
    wrapped = ORTModule(copy.deepcopy(model))
    x, w = torch.randn(3, 8), torch.randn(3, 4)
    eager = model(x)
    eager.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (eager * w).sum().backward()
    ours = wrapped(x)
    ours.add_(1)
    with pytest.raises(RuntimeError, match=r"one of the variables needed for gradient computation has been modified "
                                           r"by an inplace operation: \[torch.FloatTensor \[3, 4\]\], which is "
                                           r"output 0 of _GraphFunction"):
        (ours * w).sum().backward()


def test_an_output_the_backward_does_not_read_may_change_in_place():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)  # its gradient reads the input, not the output: PyTorch allows it
    wrapped = ORTModule(copy.deepcopy(model))
    x, w = torch.randn(3, 8), torch.randn(3, 4)
    for module in (model, wrapped):
        output = module(x)
        output.mul_(2)
        (output * w).sum().backward()
    assert torch.allclose(wrapped.weight.grad, model.weight.grad, atol=1e-6)


Pair = collections.namedtuple("Pair", "first second")


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, pair, batch, scale=1.0):
        first, second = pair
        out = self.a(first) * batch["weights"][0] + self.b(second) * scale + batch["shift"]
        return {"out": out, "tag": batch["tag"]}


@pytest.mark.parametrize("container", [list, tuple, lambda items: Pair(*items)], ids=["list", "tuple", "namedtuple"])
def test_tensors_inside_list_tuple_and_dict_arguments_are_inputs(container):
    torch.manual_seed(0)
    model = Structured()
    wrapped = ORTModule(copy.deepcopy(model))
    first, second = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4)
    weights = [torch.randn(2, 3)]
    for shift in (2.0, 3.0):  # a number inside a dict is a constant of the call: a graph each
        batch = {"weights": weights, "shift": shift, "tag": "t"}
        expected = model(container([first, second]), batch)
        ours = wrapped(container([first, second]), batch)
        assert ours["tag"] == "t" and torch.allclose(ours["out"], expected["out"], atol=1e-6)
        theirs = torch.autograd.grad(expected["out"].sum(), [first, model.a.weight])
        mine = torch.autograd.grad(ours["out"].sum(), [first, wrapped.a.weight])
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(mine, theirs))
    assert len(wrapped._graphs) == 2


def _masks(run, steps=4):
    torch.manual_seed(0)
    return [(run() != 0) for _ in range(steps)]


def test_every_training_call_draws_a_fresh_dropout_mask_reproducibly():
    """In a forward + backward loop step 1 reused step 0's mask: ONNX Runtime's generator follows
    torch.manual_seed, and its seeds 0 and 1 give its CPU Dropout the same stream."""
    wrapped = ORTModule(nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5)))
    x = torch.ones(2, 4)

    def step():
        output = wrapped(x)
        output.sum().backward()
        return output.detach()

    masks = _masks(step)
    assert all(not torch.equal(masks[i], masks[j]) for i in range(4) for j in range(i))
    assert all(torch.equal(a, b) for a, b in zip(masks, _masks(step)))  # torch.manual_seed reproduces them


def test_every_train_step_draws_a_fresh_dropout_mask_reproducibly():
    class Dropped(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 64)
            self.dropout = nn.Dropout(0.5)

        def forward(self, x):
            return self.dropout(self.linear(x))

    desc = {"inputs": [("x", [2, 4]), ("weights", [2, 64])], "outputs": [("loss", [], True), ("out", [2, 64])]}
    trainer = ORTTrainer(Dropped(), desc, optim.SGDConfig(lr=1e-9),
                         loss_fn=lambda output, weights: (output * weights).sum())
    x, weights = torch.ones(2, 4), torch.ones(2, 64)
    masks = _masks(lambda: trainer.train_step(x, weights)[1])
    assert all(not torch.equal(masks[i], masks[j]) for i in range(4) for j in range(i))
    assert all(torch.equal(a, b) for a, b in zip(masks, _masks(lambda: trainer.train_step(x, weights)[1])))


def test_library_methods_act_on_the_model_itself(tmp_path):
    """save_pretrained (transformers') writes the model's class, not the wrapper's; the name tools
    read (`_get_name`, Trainer's label smoothing for causal LMs) is the model's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    wrapped = ORTModule(GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)))
    wrapped.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert wrapped._get_name() == "GPT2LMHeadModel" and isinstance(wrapped, ORTModule)
