"""A compiled graph is reused only while what its trace read holds (`_guards`): attributes that steer
forward(), hooks, train/eval flags; a trace whose Python code read tensor values is refused
(ORTTrainer) or runs in PyTorch (ORTModule); requires_grad changed under ORTTrainer is refused."""
import copy

import pytest
import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel

from ort_trainer import ORTTrainer, optim
from ort_trainer.ortmodule import ORTModule

from . import models


class Steered(nn.Module):
    """The issue's model: a plain attribute picks the branch."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([10.0]))
        self.flag = True

    def forward(self, a):
        return self.w + a if self.flag else a * self.w


class Branchy(nn.Module):
    """Branches on a tensor value."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, x):
        y = self.linear(x)
        return y * 2 if y.sum() > 0 else -y


class Counting(nn.Module):
    """Writes an attribute in every forward (no trace can depend on it staying put)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


class ScaledByTensor(nn.Module):
    """A plain tensor attribute (neither parameter nor buffer): a constant of the trace."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.scale = torch.tensor(2.0)

    def forward(self, x):
        return self.linear(x) * self.scale


@pytest.fixture
def no_fallback(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


# ---------------------------------------------------------------- ORTModule

def test_an_attribute_that_steers_forward_compiles_again(no_fallback):
    wrapped, a = ORTModule(Steered()), torch.ones(2)
    assert wrapped(a).tolist() == [11.0, 11.0]
    wrapped.flag = False
    assert wrapped(a).tolist() == [10.0, 10.0]  # PyTorch's answer; the stale graph gave [11, 11]
    wrapped.flag = True
    assert wrapped(a).tolist() == [11.0, 11.0] and len(wrapped._graphs) == 2  # the first graph, reused


def test_hooks_added_and_removed_later_are_traced(no_fallback):
    wrapped, a = ORTModule(Steered()), torch.ones(2)
    wrapped(a)
    handle = wrapped.module.register_forward_hook(lambda module, inputs, output: output * 3)
    assert wrapped(a).tolist() == [33.0, 33.0]
    handle.remove()
    assert wrapped(a).tolist() == [11.0, 11.0]


def test_a_config_attribute_read_in_forward_compiles_again(no_fallback):
    """Hugging Face forwards read their config (return_dict, output_hidden_states, ...)."""
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    model = GPT2LMHeadModel(config).eval()
    wrapped, ids = ORTModule(copy.deepcopy(model)), torch.randint(0, 50, (2, 8))
    assert wrapped(input_ids=ids).hidden_states is None
    wrapped.config.output_hidden_states = True
    model.config.output_hidden_states = True
    hidden = wrapped(input_ids=ids).hidden_states
    assert len(hidden) == 2 and torch.allclose(hidden[-1], model(input_ids=ids).hidden_states[-1], atol=1e-5)


def test_a_tensor_attribute_changed_in_place_compiles_again(no_fallback):
    model = ScaledByTensor()
    wrapped, x = ORTModule(copy.deepcopy(model)), torch.randn(3, 2)
    wrapped(x)
    wrapped.scale.mul_(3)
    model.scale.mul_(3)
    assert torch.allclose(wrapped(x), model(x)) and len(wrapped._graphs) == 2


def test_an_attribute_forward_writes_does_not_compile_every_call(no_fallback):
    wrapped, x = ORTModule(Counting()), torch.randn(3, 2)
    for _ in range(3):
        wrapped(x)
    assert len(wrapped._graphs) == 1


def test_an_optimizer_step_on_weights_an_attribute_also_holds_does_not_compile_again(no_fallback):
    """nn.LSTM keeps its parameters in `_flat_weights` too: their in-place update by the optimizer
    compiled a new graph on every step (the weights are graph inputs, read on every call)."""
    torch.manual_seed(0)
    model = nn.LSTM(3, 4, bidirectional=True, batch_first=True)
    reference, x = copy.deepcopy(model), torch.randn(2, 5, 3)
    wrapped = ORTModule(model)
    ours, theirs = torch.optim.Adam(model.parameters(), lr=0.1), torch.optim.Adam(reference.parameters(), lr=0.1)
    for _ in range(3):
        for module, optimizer in ((wrapped, ours), (reference, theirs)):
            optimizer.zero_grad()
            module(x)[0].square().sum().backward()
            optimizer.step()
    assert len(wrapped._graphs) == 1
    for mine, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6)


def test_a_branch_on_tensor_values_runs_in_pytorch_with_a_warning():
    model = Branchy()
    wrapped, x = ORTModule(copy.deepcopy(model)), torch.randn(4, 2)
    with pytest.warns(UserWarning, match=r"Branchy runs in PyTorch for this input signature "
                                         r"\(FALLBACK_UNSUPPORTED_TORCH_MODEL\): DataDependentTraceError: the model's "
                                         r"forward turns tensor values into Python values \(.*test_trace_guards.py:"
                                         r"\d+: return y \* 2 if y.sum\(\) > 0 else -y\)"):
        wrapped(x)
    for sample in (x, -x):  # both branches, as PyTorch takes them
        assert torch.equal(wrapped(sample), model(sample))


def test_a_branch_on_tensor_values_raises_without_fallback(no_fallback):
    with pytest.raises(NotImplementedError, match=r"turns tensor values into Python values .*Write that part with "
                                                  r"tensor operations \(torch.where instead of an if on a tensor\)"):
        ORTModule(Branchy())(torch.randn(4, 2))


def test_branches_on_sizes_are_not_data_dependent(no_fallback):
    class BySize(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x):
            return self.linear(x) * (2 if x.size(0) > 3 else 3)

    model = BySize()
    wrapped = ORTModule(copy.deepcopy(model))
    for rows in (2, 5):  # a graph per shape, each with its own branch
        x = torch.randn(rows, 2)
        assert torch.allclose(wrapped(x), model(x))


def test_a_transformer_encoder_honours_every_mask_it_is_given(no_fallback):
    """nn.TransformerEncoder checks whether a mask is causal by its values (a faster kernel); a
    graph traced on a causal mask must still read the next, non-causal one."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
    model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    wrapped, x = ORTModule(copy.deepcopy(model)), torch.randn(5, 3, 8)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    assert torch.allclose(wrapped(x, mask=causal), model(x, mask=causal), atol=1e-5)
    other = torch.zeros(5, 5)
    other[:, 0] = float("-inf")
    other[0, 0] = 0.0
    assert torch.allclose(wrapped(x, mask=other), model(x, mask=other), atol=1e-5)


# ---------------------------------------------------------------- ORTTrainer

DESC = {"inputs": [("x", ["n", 2]), ("y", ["n", 1])], "outputs": [("loss", [], True)]}


def _mse(output, target):
    return ((output - target) ** 2).mean()


class SteeredLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 1)
        self.shift = 1.0

    def forward(self, x):
        return self.linear(x) + self.shift


def test_trainer_compiles_again_when_an_attribute_changes_and_trains_like_torch():
    torch.manual_seed(0)
    model = SteeredLinear()
    eager = copy.deepcopy(model)
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.1), loss_fn=_mse,
                         options={"utils": {"grad_norm_clip": False}})
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(6):
        if step == 3:
            model.shift = eager.shift = -2.0
        x, y = torch.randn(4, 2), torch.randn(4, 1)
        loss = trainer.train_step(x, y)
        optimizer.zero_grad()
        expected = _mse(eager(x), y)
        expected.backward()
        optimizer.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
        assert trainer.eval_step(x, y).item() == pytest.approx(_mse(eager(x), y).item(), rel=1e-6)


def test_trainer_refuses_a_branch_on_tensor_values_and_changes_nothing():
    model = Branchy()
    before = copy.deepcopy(model.state_dict())
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.1), loss_fn=_mse)
    with pytest.raises(NotImplementedError, match=r"the model's forward turns tensor values into Python values "
                                                  r"\(.*test_trace_guards.py:\d+: return y \* 2 if y.sum\(\) > 0 "
                                                  r"else -y\): a traced graph keeps what the sample gave"):
        trainer.train_step(torch.randn(4, 2), torch.randn(4, 1))
    assert trainer.train_step_info.step == 0
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_trainer_refuses_requires_grad_changed_after_construction():
    model = models.mlp()
    trainer = ORTTrainer(model, models.MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=models.mlp_loss)
    x, y = models.mlp_batch(0)
    trainer.train_step(x, y)
    first = next(iter(dict(model.named_parameters())))
    model.get_parameter(first).requires_grad_(False)
    with pytest.raises(ValueError, match=rf"requires_grad of parameters \['{first}'\] changed since the trainer was "
                                         r"created: the parameters it trains are fixed then"):
        trainer.train_step(x, y)
    assert trainer.train_step_info.step == 1

