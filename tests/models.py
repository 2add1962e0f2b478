"""Small models and an eager PyTorch reference loop shared by the trainer tests."""
import copy

import numpy as np
import torch
import torch.nn as nn

from examples.wikitext2.model import TransformerModel
from examples.wikitext2.train import DEFAULT_DATA

VOCAB = 50


def transformer(seed=0):
    torch.manual_seed(seed)
    return TransformerModel(VOCAB, 32, 2, 32, 2, dropout=0.0)


def transformer_loss(output, targets):
    return nn.functional.cross_entropy(output.view(-1, VOCAB), targets)


TRANSFORMER_DESC = {"inputs": [("src", ["bptt", "batch_size"]), ("label", ["bptt_x_batch_size"])],
                    "outputs": [("loss", [], True), ("output", ["bptt", "batch_size", VOCAB])]}


def transformer_batch(step, bptt=7, batch=4):
    generator = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (bptt + 1, batch), generator=generator)
    return data[:-1], data[1:].reshape(-1)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 5))

    def forward(self, x):
        return self.net(x)


def mlp(seed=0):
    torch.manual_seed(seed)
    return MLP()


def mlp_loss(output, target):
    return nn.functional.cross_entropy(output, target)


MLP_DESC = {"inputs": [("x", ["batch", 12]), ("target", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", 5])]}


class StraightThroughClamp(torch.autograd.Function):
    """Clamps forward, passes the gradient through unchanged: a backward that is not the
    derivative of the forward, so a graph differentiating the forward trains other weights."""

    @staticmethod
    def forward(ctx, x):
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx, grad):
        return grad


def mlp_batch(step, batch=8):
    generator = torch.Generator().manual_seed(2000 + step)
    return torch.randn(batch, 12, generator=generator), torch.randint(0, 5, (batch,), generator=generator)


class ConvBatchNorm(nn.Module):
    """Conv2d, BatchNorm2d (in training mode: batch statistics, running statistics updated), ReLU,
    Linear: a ResNet stem in small."""

    def __init__(self, momentum=0.1, affine=True):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(4, momentum=momentum, affine=affine)
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).flatten(1))


def conv_batch_norm(seed=0, **kwargs):
    torch.manual_seed(seed)
    return ConvBatchNorm(**kwargs)


CONV_BATCH_NORM_DESC = {"inputs": [("x", ["batch", 3, 8, 8]), ("target", ["batch"])],
                        "outputs": [("loss", [], True), ("logits", ["batch", 5])]}


def conv_batch_norm_batch(step, batch=8):
    generator = torch.Generator().manual_seed(4000 + step)
    return (torch.randn(batch, 3, 8, 8, generator=generator) * 2 + 1,
            torch.randint(0, 5, (batch,), generator=generator))


class RunningNorm(nn.Module):
    """A BatchNorm (whose running statistics both front ends update) and an InstanceNorm that keeps
    running statistics too (which no graph writes back)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.instance = nn.InstanceNorm1d(4, track_running_stats=True)

    def forward(self, x):
        return self.instance(self.norm(self.linear(x)).unsqueeze(-1).expand(-1, -1, 3))


class TwoTower(nn.Module):
    """Two inputs, two outputs, its own loss inside (loss_fn=None): a regression and a score."""

    def __init__(self):
        super().__init__()
        self.left = nn.Linear(6, 16)
        self.right = nn.Conv1d(1, 4, 3, padding=1)
        self.head = nn.Linear(16 + 4 * 6, 3)

    def forward(self, a, b):
        features = torch.cat([torch.tanh(self.left(a)), torch.relu(self.right(b.unsqueeze(1))).flatten(1)], 1)
        prediction = self.head(features)
        return prediction.pow(2).mean(), prediction


def two_tower(seed=0):
    torch.manual_seed(seed)
    return TwoTower()


TWO_TOWER_DESC = {"inputs": [("a", ["batch", 6]), ("b", ["batch", 6])],
                  "outputs": [("loss", [], True), ("prediction", ["batch", 3])]}


def two_tower_batch(step, batch=5):
    generator = torch.Generator().manual_seed(3000 + step)
    return torch.randn(batch, 6, generator=generator), torch.randn(batch, 6, generator=generator)


def lamb_step_float64(params, grads, state, step, lr, alpha=0.9, beta=0.999, lambda_coef=0.0, epsilon=1e-6,
                      ratio_min=-np.inf, ratio_max=np.inf, do_bias_correction=False):
    """Independent float64 transcription of the original ORT Lamb update, one tensor at a time."""
    for index, (w, g) in enumerate(zip(params, grads)):
        m, v = state.setdefault(index, (np.zeros_like(w), np.zeros_like(w)))
        m[...] = alpha * m + (1 - alpha) * g
        v[...] = beta * v + (1 - beta) * g * g
        c1 = 1 - alpha ** step if do_bias_correction else 1.0
        c2 = 1 - beta ** step if do_bias_correction else 1.0
        direction = lambda_coef * w + (m / c1) / (np.sqrt(v / c2) + epsilon)
        w_norm, d_norm = np.linalg.norm(w), np.linalg.norm(direction)
        ratio = 1.0 if w_norm == 0 or d_norm == 0 else np.clip(w_norm / d_norm, ratio_min, ratio_max)
        w -= lr * ratio * direction


def comparable(name, tensor):
    """Without the attention key bias (the middle third of nn.MultiheadAttention's in_proj_bias and
    GPT-2's c_attn bias, BERT's key bias whole): its true gradient is exactly zero (softmax ignores
    a shift shared by all keys), so Adam/Lamb turn rounding noise into lr-sized steps in any framework."""
    if name.endswith(("self_attn.in_proj_bias", "attn.c_attn.bias")):
        third = tensor.numel() // 3
        return torch.cat([tensor[:third], tensor[2 * third:]])
    if name.endswith("attention.self.key.bias"):
        return tensor[:0]
    return tensor


def torch_loop(model, loss_fn, batches, make_optimizer, max_norm=None, lamb=None):
    """Eager PyTorch: the losses per step and the final parameters (a deep copy is trained).

    lamb: kwargs for lamb_step_float64 (then make_optimizer is ignored).
    """
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None if lamb is not None else make_optimizer(params)
    lamb_state, params64 = {}, [p.detach().double().numpy().copy() for p in params]
    losses = []
    for step, batch in enumerate(batches, 1):
        for p in params:
            p.grad = None
        output = model(*batch[:-1]) if loss_fn else model(*batch)
        loss = loss_fn(output, batch[-1]) if loss_fn else output[0]
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        if lamb is None:
            optimizer.step()
        else:
            lamb_step_float64(params64, [p.grad.double().numpy() for p in params], lamb_state, step, **lamb)
            with torch.no_grad():
                for p, w in zip(params, params64):
                    p.copy_(torch.from_numpy(w))
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def shared_text_slice(tmp_path_factory, lines):
    """The first `lines` lines of the shared WikiText-2 text in a file of their own (the test is
    skipped where ../shared is missing)."""
    import pytest

    if not DEFAULT_DATA.is_file():
        pytest.skip("shared WikiText-2 text not available")
    path = tmp_path_factory.mktemp("wikitext") / "slice.txt"
    with open(DEFAULT_DATA, encoding="utf-8") as source:
        path.write_text("".join(next(source) for _ in range(lines)), encoding="utf-8")
    return path
