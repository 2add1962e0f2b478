"""Mixed precision (fp16, `mixed_precision.enabled`) together with the trainer's other features:
gradient accumulation, clipping, frozen and tied weights, param groups, recomputation, new input
shapes, data parallel and ZeRO-1, export_onnx, save_as_onnx, an ONNX model as the model, and
state_dict round trips carrying the loss scaler.

Each feature is checked against eager PyTorch under `torch.autocast('cpu', torch.float16)` with a
`torch.amp.GradScaler` (its defaults, as the trainer's DynamicLossScaler: 2^16), same init and
data, dropout 0; where no eager reference exists, against the trainer itself (recompute: the same
fp16 trainer without it; resume: a straight run; export: torch's fp32 forward).

Tolerances (test_mixed_precision.py explains why the two fp16 runs differ by rounding noise):
losses within LOSS_RTOL = 1e-4 relative, weights within WEIGHT_RTOL = 1e-2 (max difference over max
magnitude, per tensor). Measured here, on batches of 64 rows (the MLP) so that one flipped fp16
rounding of a logit moves the mean loss little (with the tests' usual 8 rows the loss noise
reached 8e-5, too close to 1e-4):
  accumulation (SGD)   losses 2.2e-5, weights 7.3e-4
  clipping (SGD)       losses 3.9e-5, weights 7.6e-4
  frozen (SGD)         losses 2.5e-5, weights 7.9e-4 (frozen tensors: exactly unchanged)
  tied (SGD)           losses 1.3e-5, weights 3.5e-4
  param groups (AdamW) losses 2.2e-5, weights 8.4e-4
  new shapes (Adam)    losses 1.9e-5
  ONNX model (Adam)    losses 2.5e-5
  data parallel, ZeRO-1 (SGD, clipped) losses 2.0e-5, weights 8.9e-4 (one fp16 process on the
                       global batch: 6.8e-6, 1.2e-4)
so the loss tolerance is 2.6x (clipping) to 8x the measurement, the weight tolerance over 10x (it is the
bound test_mixed_precision.py set: torch fp32 vs autocast differ by up to 5e-3). What would break
each feature moves far more: clipping not applied 6e-4 (losses) / 2.8e-2 (weights), clipping the
still-scaled gradients (every step clipped) 1.8e-3 / 5.2e-2, frozen weights trained 3.2e-3 / 7e-2,
one of the tied weight's two gradients lost 2e-2 / 1e-1, param groups ignored 6.8e-3 / 6.8e-2,
gradients summed over the ranks instead of averaged 6e-2 (weights), accumulated gradients
averaged instead of summed: half the SGD update.

These tolerances cannot tell fp16 from fp32 (torch fp32 vs autocast differ as much), so each test
also checks that the feature's graph does compute in fp16: its logits are fp16 values (a Gemm's
output is rounded to fp16 with its bias; an fp32 graph's logits are not: 0% of them are), or,
where the last product is a MatMul plus a bias added in fp32, the training graph holds fp16 casts.
"""
import copy
import io
import os
import re
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn as nn

from ort_trainer import ORTTrainer, ORTTrainerOptions, amp, optim

from . import models
from .test_onnx_model import exported

pytestmark = pytest.mark.filterwarnings("ignore:mixed_precision.dtype='float16' on device 'cpu'")

LOSS_RTOL, WEIGHT_RTOL = 1e-4, 1e-2
BATCH = 64
STEPS = 12
CPU_WARNING = "mixed_precision.dtype='float16' on device 'cpu'"


# ---------------------------------------------------------------- helpers

def _fp16_trainer(model, desc, config, loss_fn=None, *, scaler=None, **options):
    """An fp16 trainer; clipping off unless `options['utils']` turns it on."""
    options = copy.deepcopy(options)
    options.setdefault("utils", {}).setdefault("grad_norm_clip", False)
    options["mixed_precision"] = {"enabled": True, **({"loss_scaler": scaler} if scaler is not None else {})}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", CPU_WARNING)
        return ORTTrainer(model, desc, config, loss_fn=loss_fn, options=ORTTrainerOptions(options))


def _autocast_run(model, loss_fn, batches, make_optimizer, *, accumulation=1, max_norm=None):
    """Eager PyTorch under autocast with a GradScaler on a deep copy of `model`: the loss of every
    micro-step, the trained parameters and (max_norm) the unscaled gradient norm of every update.

    Gradients accumulate over `accumulation` micro-steps (each `scaler.scale(loss).backward()`),
    then one update: `scaler.unscale_` (before clipping, as GradScaler requires), clip, step, update.
    The scale changes only in `update()`, once per optimizer step, so within an accumulation cycle
    every micro-step carries the same scale, as in the trainer (it updates its scaler per update).
    `loss_fn` None: the model returns (loss, ...)."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu")
    losses, norms = [], []
    for index, batch in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(*batch[:-1]), batch[-1]) if loss_fn is not None else model(*batch)[0]
        scaler.scale(loss).backward()
        losses.append(loss.item())
        if index % accumulation == accumulation - 1:
            if max_norm is not None:
                scaler.unscale_(optimizer)
                norms.append(torch.nn.utils.clip_grad_norm_(params, max_norm).item())
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}, norms


def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _assert_losses_close(ours, theirs, rtol=LOSS_RTOL):
    assert len(ours) == len(theirs)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= rtol * abs(b), (step, a, b)


def _assert_weights_close(trainer, expected, rtol=WEIGHT_RTOL):
    trained = dict(trainer.model.named_parameters())
    assert set(trained) == set(expected)
    for name, tensor in expected.items():
        assert _relative(trained[name].detach(), tensor) <= rtol, (name, _relative(trained[name].detach(), tensor))


def _is_fp16(tensor):
    """Every value representable in fp16 (what a graph output rounded to fp16 is)."""
    return torch.equal(tensor, tensor.half().float())


def _weights(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def _mlp_batches(steps=STEPS, first=0):
    return [models.mlp_batch(step, batch=BATCH) for step in range(first, first + steps)]


def _train(trainer, batches):
    """(losses, logits of every step)."""
    outputs = [trainer.train_step(*batch) for batch in batches]
    return [output[0].item() for output in outputs], [output[1] for output in outputs]


def _sgd(lr):
    return lambda model: torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)


def _fp16_casts(graph):
    return sum(1 for node in graph.graph.node if node.op_type == "Cast"
               and onnx.helper.get_attribute_value(node.attribute[0]) == onnx.TensorProto.FLOAT16)


# ---------------------------------------------------------------- gradient accumulation

def test_gradient_accumulation_matches_autocast_with_grad_scaler():
    """2 micro-steps per update: the trainer sums the scaled gradients and unscales once, as
    GradScaler does when `step()`/`update()` run every second micro-step. SGD, so that the update
    is the summed gradient itself (averaged instead of summed, it would be half)."""
    batches = _mlp_batches()
    expected_losses, expected, _ = _autocast_run(models.mlp(), models.mlp_loss, batches, _sgd(0.1), accumulation=2)
    trainer = _fp16_trainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(lr=0.1),
                            models.mlp_loss, batch={"gradient_accumulation_steps": 2})
    before = _weights(trainer)
    loss, logits = trainer.train_step(*batches[0])
    assert all(torch.equal(p, before[name]) for name, p in _weights(trainer).items())  # mid-cycle: no update
    losses, outputs = _train(trainer, batches[1:])
    _assert_losses_close([loss.item(), *losses], expected_losses)
    _assert_weights_close(trainer, expected)
    assert all(_is_fp16(output) for output in [logits, *outputs])
    info = trainer.train_step_info
    assert info.step == STEPS and info.optimization_step == STEPS // 2 and info.all_finite
    scaler = trainer.state_dict()["loss_scaler"]
    assert scaler["loss_scale"] == 2.0 ** 16 and scaler["stable_steps"] == STEPS // 2  # updated per update


# ---------------------------------------------------------------- gradient clipping

def test_gradient_clipping_clips_the_unscaled_gradients_as_grad_scaler():
    """grad_norm_clip with max_norm_clip 0.55 against `scaler.unscale_` + `clip_grad_norm_`: the
    norm compared with max_norm is the unscaled one (the scaled gradients' is 2^16 times larger, and
    would clip every step). 0.55 lies inside the unclipped norms (0.43-0.61), so some updates are
    clipped and some are not: both a missing clip and an always-on clip show. SGD (the update is
    the clipped gradient itself)."""
    max_norm = 0.55
    batches = _mlp_batches()
    expected_losses, expected, norms = _autocast_run(models.mlp(), models.mlp_loss, batches, _sgd(0.1),
                                                     max_norm=max_norm)
    clipped = [norm > max_norm for norm in norms]
    assert any(clipped) and not all(clipped), norms
    trainer = _fp16_trainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(lr=0.1, max_norm_clip=max_norm),
                            models.mlp_loss, utils={"grad_norm_clip": True})
    losses, logits = _train(trainer, batches)
    _assert_losses_close(losses, expected_losses)
    _assert_weights_close(trainer, expected)
    assert all(_is_fp16(output) for output in logits)
    assert trainer.train_step_info.optimization_step == STEPS and trainer.train_step_info.all_finite


# ---------------------------------------------------------------- frozen weights

def test_frozen_weights_stay_put_and_the_rest_trains_as_autocast():
    """utils.frozen_weights = the first Linear: its weights are bitwise unchanged (they still enter
    the product in fp16) and the others train as torch with requires_grad=False on them."""
    frozen = ["net.0.weight", "net.0.bias"]
    reference = models.mlp()
    for name, p in reference.named_parameters():
        p.requires_grad_(name not in frozen)
    batches = _mlp_batches()
    expected_losses, expected, _ = _autocast_run(reference, models.mlp_loss, batches, _sgd(0.1))
    trainer = _fp16_trainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(lr=0.1), models.mlp_loss,
                            utils={"grad_norm_clip": False, "frozen_weights": frozen})
    before = _weights(trainer)
    losses, logits = _train(trainer, batches)
    after = _weights(trainer)
    for name in before:
        assert torch.equal(after[name], before[name]) == (name in frozen), name
    _assert_losses_close(losses, expected_losses)
    _assert_weights_close(trainer, expected)
    assert all(_is_fp16(output) for output in logits)


# ---------------------------------------------------------------- tied weights

TIED_VOCAB, TIED_WIDTH = 40, 16


class TiedLanguageModel(nn.Module):
    """An embedding tied to the output projection (as GPT-2's): one tensor, two gradients (the
    lookup's, in fp32; the projection's, an fp16 product's), summed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embedding = nn.Embedding(TIED_VOCAB, TIED_WIDTH)
        with torch.no_grad():
            self.embedding.weight.mul_(0.3)  # logits of order 1: fp16 rounds them finely
        self.hidden = nn.Linear(TIED_WIDTH, TIED_WIDTH)
        self.output = nn.Linear(TIED_WIDTH, TIED_VOCAB, bias=False)
        self.output.weight = self.embedding.weight

    def forward(self, tokens):
        return self.output(torch.tanh(self.hidden(self.embedding(tokens))))


def _tied_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, TIED_VOCAB), labels.reshape(-1))


TIED_DESC = {"inputs": [("tokens", ["batch", "seq"]), ("labels", ["batch", "seq"])],
             "outputs": [("loss", [], True), ("logits", ["batch", "seq", TIED_VOCAB])]}


def _tied_batch(step):
    generator = torch.Generator().manual_seed(600 + step)
    tokens = torch.randint(0, TIED_VOCAB, (16, 16), generator=generator)
    return tokens, (tokens * 7 + 3) % TIED_VOCAB  # learnable: the loss falls from 3.7 to 3.3


def test_tied_embedding_and_output_projection_train_as_autocast():
    batches = [_tied_batch(step) for step in range(STEPS)]
    expected_losses, expected, _ = _autocast_run(TiedLanguageModel(), _tied_loss, batches, _sgd(0.5))
    assert set(expected) == {"embedding.weight", "hidden.weight", "hidden.bias"}  # named once, as in torch
    trainer = _fp16_trainer(TiedLanguageModel(), TIED_DESC, optim.SGDConfig(lr=0.5), _tied_loss)
    losses, logits = _train(trainer, batches)
    _assert_losses_close(losses, expected_losses)
    _assert_weights_close(trainer, expected)
    assert trainer.model.output.weight is trainer.model.embedding.weight  # still one tensor
    assert [name for name in trainer._weights.flat.names if "embedding" in name or "output" in name] == [
        "model.embedding.weight"]  # one slot in the flat buffer, one update
    assert all(_is_fp16(output) for output in logits)  # the projection (no bias) is an fp16 MatMul


# ---------------------------------------------------------------- param groups

def test_param_groups_train_as_torch_adamw_groups():
    """AdamConfig with a default group (weight decay 0.1) and a group for the last Linear (alpha
    0.8, no decay) against torch.optim.AdamW with the same two groups. (lr cannot be set per group:
    it is global in the original API, and refused there.)"""
    config = optim.AdamConfig(lr=0.01, lambda_coef=0.1, params=[
        {"params": ["net.3.weight", "net.3.bias"], "alpha": 0.8, "lambda_coef": 0.0}])

    def adamw_groups(model):
        last = [p for name, p in model.named_parameters() if name.startswith("net.3.")]
        rest = [p for name, p in model.named_parameters() if not name.startswith("net.3.")]
        return torch.optim.AdamW([{"params": rest}, {"params": last, "betas": (0.8, 0.999), "weight_decay": 0.0}],
                                 lr=0.01, weight_decay=0.1)

    batches = _mlp_batches()
    expected_losses, expected, _ = _autocast_run(models.mlp(), models.mlp_loss, batches, adamw_groups)
    trainer = _fp16_trainer(models.mlp(), models.MLP_DESC, config, models.mlp_loss)
    losses, logits = _train(trainer, batches)
    _assert_losses_close(losses, expected_losses)
    _assert_weights_close(trainer, expected)
    assert all(_is_fp16(output) for output in logits)


# ---------------------------------------------------------------- recomputation

class _Attention(nn.Module):
    """Attention weights dropped out (a Dropout after a Softmax), applied to the input; residual."""

    def __init__(self, width):
        super().__init__()
        self.query = nn.Linear(width, width)

    def forward(self, x):
        weights = torch.softmax(self.query(x) @ x.transpose(-1, -2), -1)
        return x + nn.functional.dropout(weights, 0.1, self.training) @ x


class _FeedForward(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + nn.functional.dropout(self.fc2(nn.functional.gelu(self.fc1(x))), 0.2, self.training)


class _Layer(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.attention, self.feed_forward = _Attention(width), _FeedForward(width, hidden)

    def forward(self, x):
        return self.feed_forward(self.attention(x))


class _Stack(nn.Module):
    """3 layers in an nn.Sequential (the stack transformer_layer_recompute finds), with dropout."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.project = nn.Linear(16, 16)
        self.blocks = nn.Sequential(*[_Layer(16, 64) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.blocks(self.project(x))).mean(1)


_STACK_DESC = {"inputs": [("x", ["batch", 10, 16]), ("y", ["batch"])], "outputs": [("loss", [], True)]}


def _train_stack(graph_transformer, directory):
    """Losses and parameters after 3 fp16 Adam steps, and the saved training graph; ONNX Runtime's
    seed set first, so that every trainer draws the same dropout masks."""
    onnxruntime.set_seed(11)
    path = directory / "training.onnx"
    trainer = _fp16_trainer(_Stack(), _STACK_DESC, optim.AdamConfig(lr=0.01), nn.functional.cross_entropy,
                            graph_transformer=graph_transformer,
                            debug={"graph_save_paths": {"model_with_training_graph_path": str(path)}})
    losses = []
    for step in range(3):
        generator = torch.Generator().manual_seed(4000 + step)
        losses.append(trainer.train_step(torch.randn(8, 10, 16, generator=generator),
                                         torch.randint(0, 4, (8,), generator=generator)))
    return losses, [p.detach().clone() for p in trainer.model.parameters()], onnx.load(path)


@pytest.fixture(scope="module")
def stack_without_recompute(tmp_path_factory):
    return _train_stack({}, tmp_path_factory.mktemp("without_recompute"))


RECOMPUTE_OPTIONS = {
    "gelu": {"gelu_recompute": True},
    "attention_dropout": {"attn_dropout_recompute": True},
    "layers": {"transformer_layer_recompute": True},
    "first_layer": {"transformer_layer_recompute": True, "number_recompute_layers": 1},
}


def _copies(graph):
    return [node for node in graph.graph.node if node.name.endswith("_recompute")]


@pytest.mark.parametrize("option", sorted(RECOMPUTE_OPTIONS))
def test_recompute_trains_exactly_as_without_under_fp16(option, stack_without_recompute, tmp_path):
    """Same losses and weights as the fp16 trainer without recomputation, bit for bit (measured: 0
    difference, dropout on: a recomputed Dropout applies the forward's mask again; the tolerance
    of an eager reference is not needed where the same graph computes the same values twice).
    Both graphs compute in fp16 (the fp32 trainer's weights differ from these by 0.28)."""
    losses, parameters, graph = _train_stack(RECOMPUTE_OPTIONS[option], tmp_path)
    expected_losses, expected_parameters, expected_graph = stack_without_recompute
    assert all(torch.equal(a, b) for a, b in zip(losses, expected_losses)), (losses, expected_losses)
    assert all(torch.equal(a, b) for a, b in zip(parameters, expected_parameters))
    assert _fp16_casts(graph) >= _fp16_casts(expected_graph) > 0


@pytest.mark.parametrize("option, op_types, layers", [
    # the backward reads the fp16 casts of a Gelu's (Dropout's) output: they are recomputed with it
    ("gelu", {"Gelu", "Cast"}, None),
    ("attention_dropout", {"DropoutGrad", "Cast"}, None),
    ("layers", None, {0, 1}),  # every layer but the last
    ("first_layer", None, {0}),
])
def test_recompute_copies_exist_under_fp16(option, op_types, layers, tmp_path):
    """The option does recompute under fp16: copies are in the training graph and the backward
    reads them (the fp32 trainer: 3 Gelu copies, 3 DropoutGrad copies, layers {0, 1}); a
    recomputed layer recomputes its fp16 casts too."""
    _, _, graph = _train_stack(RECOMPUTE_OPTIONS[option], tmp_path)
    copies = _copies(graph)
    assert copies, "no recompute copies in the training graph"
    read = {name for node in graph.graph.node for name in node.input}
    assert any(output in read for node in copies for output in node.output)
    if op_types is not None:
        assert {node.op_type for node in copies} == op_types
    else:
        copied_layers = {int(re.search(r"/blocks\.(\d+)/", output).group(1)) for node in copies
                         for output in node.output if "/blocks." in output}
        assert copied_layers == layers
        assert "Cast" in {node.op_type for node in copies}


# ---------------------------------------------------------------- a new input shape

def test_new_sequence_lengths_after_the_first_step_train_as_autocast(tmp_path):
    """The seed transformer on sequence lengths 7, 5, 7, 3, ...: one graph per length (its
    attention bakes the length in), each fp16, one loss scaler; losses as autocast's (Adam;
    measured 1.9e-5). The decoder's bias is added in fp32 after its fp16 MatMul, so the logits are
    not fp16 values here: the saved training graph of each new length shows its fp16 casts."""
    lengths = [7, 5, 7, 3, 5, 7, 7, 5, 3, 7, 5, 7]
    batches = [models.transformer_batch(step, bptt=length) for step, length in enumerate(lengths)]
    expected_losses, _, _ = _autocast_run(models.transformer(), models.transformer_loss, batches,
                                          lambda model: torch.optim.Adam(model.parameters(), lr=1e-3))
    path = tmp_path / "training.onnx"
    trainer = _fp16_trainer(models.transformer(), models.TRANSFORMER_DESC, optim.AdamConfig(lr=1e-3),
                            models.transformer_loss,
                            debug={"graph_save_paths": {"model_with_training_graph_path": str(path)}})
    losses = []
    for step, batch in enumerate(batches):
        losses.append(trainer.train_step(*batch)[0].item())
        if lengths[step] not in lengths[:step]:  # a new length: a graph built, and saved
            graph = onnx.load(path)
            path.unlink()
            source = next(i for i in graph.graph.input if i.name == "src")
            assert source.type.tensor_type.shape.dim[0].dim_value == lengths[step]
            assert _fp16_casts(graph) > 0
        assert not path.exists()  # a length seen before: no graph built
    assert len(trainer._graphs) == 3
    assert trainer.train_step_info.optimization_step == len(batches)
    _assert_losses_close(losses, expected_losses)


# ---------------------------------------------------------------- export_onnx, save_as_onnx

def test_export_onnx_writes_an_fp32_inference_model(tmp_path):
    """After fp16 training the exported inference model is fp32 throughout (initializers, input,
    output, no fp16 cast) and matches torch's fp32 eval forward within 1e-5 (measured 2.4e-7; the
    trainer's own fp16 eval graph differs from it by 5.6e-4, so an export computing in fp16 fails)."""
    trainer = _fp16_trainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(lr=0.01), models.mlp_loss)
    _, logits = _train(trainer, _mlp_batches(6))
    assert _is_fp16(logits[-1])
    path = tmp_path / "mlp.onnx"
    trainer.export_onnx(path)
    graph = onnx.load(path).graph
    float32 = onnx.TensorProto.FLOAT
    assert graph.initializer and all(init.data_type == float32 for init in graph.initializer)
    assert [(i.name, i.type.tensor_type.elem_type) for i in graph.input] == [("x", float32)]
    assert [(o.name, o.type.tensor_type.elem_type) for o in graph.output] == [("logits", float32)]
    assert _fp16_casts(onnx.load(path)) == 0
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    trainer.model.eval()
    for rows in (16, 5):
        x = torch.randn(rows, 12, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            expected = trainer.model(x).numpy()
        np.testing.assert_allclose(session.run(None, {"x": x.numpy()})[0], expected, rtol=0, atol=1e-5)


class MLPWithLoss(nn.Module):
    """The MLP with its loss in forward() (loss_fn None): what save_as_onnx and an ONNX model hold."""

    def __init__(self):
        super().__init__()
        self.mlp = models.mlp()

    def forward(self, x, target):
        out = self.mlp(x)
        return nn.functional.cross_entropy(out, target), out


ONNX_DESC = {"inputs": [("x", ["batch", 12]), ("target", ["batch"])],
             "outputs": [("loss", [], True), ("out", ["batch", 5])]}


def test_save_as_onnx_writes_the_fp32_forward_and_loss_and_resumes_as_an_onnx_model(tmp_path):
    """The saved model is fp32 (no fp16 cast), its loss is torch's fp32 loss of the trained model
    within 1e-6 (measured 7.5e-8; the trainer's fp16 eval loss is 1e-5 away), and it resumes, as
    an ONNX model under fp16 with the state_dict, exactly as the run it was saved from."""
    trainer = _fp16_trainer(MLPWithLoss(), ONNX_DESC, optim.AdamConfig(lr=0.01))
    _train(trainer, _mlp_batches(6))
    path = tmp_path / "trained.onnx"
    trainer.save_as_onnx(path)
    saved = onnx.load(path)
    assert all(init.data_type == onnx.TensorProto.FLOAT for init in saved.graph.initializer)
    assert {init.name for init in saved.graph.initializer} >= set(trainer.state_dict()["model"])
    assert _fp16_casts(saved) == 0
    x, target = models.mlp_batch(50, batch=BATCH)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    loss = session.run(["loss"], {"x": x.numpy(), "target": target.numpy()})[0]
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(x, target)[0].item()
    trainer.model.train()
    np.testing.assert_allclose(loss, expected, rtol=1e-6)

    resumed = _fp16_trainer(onnx.load(path), ONNX_DESC, optim.AdamConfig(lr=0.01))
    resumed.load_state_dict(trainer.state_dict())
    more = _mlp_batches(4, first=6)
    assert _train(resumed, more)[0] == _train(trainer, more)[0]


def test_an_onnx_model_trains_in_fp16():
    """An onnx.ModelProto as the model: mixed precision applies to its graph too (the logits are
    fp16 values; an fp32 trainer's: none of them), it trains bit for bit as the torch model it was
    exported from, and as autocast within the loss tolerance (measured 2.5e-5)."""
    module = MLPWithLoss()
    batches = _mlp_batches()
    expected_losses, _, _ = _autocast_run(module, None, batches,
                                          lambda model: torch.optim.Adam(model.parameters(), lr=0.01))
    from_onnx = _fp16_trainer(exported(module), ONNX_DESC, optim.AdamConfig(lr=0.01))
    from_torch = _fp16_trainer(copy.deepcopy(module), ONNX_DESC, optim.AdamConfig(lr=0.01))
    losses, logits = _train(from_onnx, batches)
    torch_losses, torch_logits = _train(from_torch, batches)
    assert all(_is_fp16(output) for output in logits)
    assert losses == torch_losses and all(torch.equal(a, b) for a, b in zip(logits, torch_logits))
    _assert_losses_close(losses, expected_losses)
    for name, tensor in from_torch.state_dict()["model"].items():
        assert torch.equal(from_onnx.state_dict()["model"][name], tensor), name


# ---------------------------------------------------------------- checkpoints with the loss scaler

def _scaled_trainer():
    """An initial scale of 2^24 overflows fp16 (scaled gradients beyond fp16's 65504): the
    first 5 updates are skipped, halving the scale to 2^19; with a window of 3 finite updates it
    doubles again and overflows again (steps 6 and 12 skipped, measured)."""
    return _fp16_trainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(lr=0.01), models.mlp_loss,
                         scaler=amp.DynamicLossScaler(loss_scale=2.0 ** 24, up_scale_window=3))


def _finite_run(trainer, batches):
    losses, finite = [], []
    for batch in batches:
        losses.append(trainer.train_step(*batch)[0])
        finite.append(trainer.train_step_info.all_finite)
    return losses, finite


def test_state_dict_round_trip_carries_the_loss_scaler_and_resumes_as_a_straight_run():
    """Resumed after 9 steps: scale and stable-step count restored (into the graph's scale input
    too), then the same losses, skipped updates, weights and scaler as a straight run, bit for bit.
    A scale not restored (back to 2^24) would skip the resumed updates: other losses."""
    batches, resume_at = _mlp_batches(14), 9
    straight = _scaled_trainer()
    straight_losses, straight_finite = _finite_run(straight, batches)
    assert not all(straight_finite[:resume_at]) and not all(straight_finite[resume_at:]), straight_finite

    first = _scaled_trainer()
    _finite_run(first, batches[:resume_at])
    state = first.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)  # plain values: loads with weights_only
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    scaler = state["loss_scaler"]
    assert scaler["type"] == "DynamicLossScaler" and scaler["up_scale_window"] == 3
    assert scaler["loss_scale"] < 2.0 ** 24 and scaler["stable_steps"] > 0  # not the initial values

    resumed = _scaled_trainer()
    resumed.load_state_dict(state)  # before any step
    assert resumed.state_dict()["loss_scaler"] == scaler
    assert float(resumed._loss_scale) == scaler["loss_scale"]  # the graphs' scale input
    losses, finite = _finite_run(resumed, batches[resume_at:])
    assert all(torch.equal(a, b) for a, b in zip(losses, straight_losses[resume_at:]))
    assert finite == straight_finite[resume_at:]
    final = _weights(straight)
    assert all(torch.equal(p, final[name]) for name, p in _weights(resumed).items())
    assert resumed.state_dict()["loss_scaler"] == straight.state_dict()["loss_scaler"]
    assert resumed.train_step_info.optimization_step == straight.train_step_info.optimization_step


# ---------------------------------------------------------------- data parallel and ZeRO stage 1

WORLD_SIZE = 2
DP_STEPS, DP_POISON_STEP = 8, 3
DP_LR, DP_MAX_NORM = 0.1, 0.55


def _dp_batch(step):
    """The global batch; at DP_POISON_STEP an inf in a row of rank 1's half: every rank must skip."""
    x, target = models.mlp_batch(step, batch=BATCH)
    if step == DP_POISON_STEP:
        x[BATCH - 1, 0] = float("inf")
    return x, target


def _dp_trainer(zero_stage=None):
    """SGD, clipped at 0.55: between the unclipped norms (0.44-0.61), so that some updates are
    clipped and some not, and a gradient off by a factor (summed over the ranks instead of averaged,
    or left scaled) shows in the unclipped ones."""
    options = {"utils": {"grad_norm_clip": True}}
    if zero_stage is not None:
        options["distributed"] = {"deepspeed_zero_optimization": {"stage": zero_stage}}
    return _fp16_trainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(lr=DP_LR, max_norm_clip=DP_MAX_NORM),
                         models.mlp_loss, **options)


def _dp_rank_run(rank, directory):
    """On every rank (python -m tests.test_mixed_precision_features DIR, torchrun's environment):
    data parallel and ZeRO stage 1, each rank on its half of every global batch."""
    results = {}
    half = BATCH // WORLD_SIZE
    for zero_stage in (0, 1):
        trainer = _dp_trainer(zero_stage)
        losses, finite, logits = [], [], []
        for step in range(DP_STEPS):
            x, target = _dp_batch(step)
            loss, out = trainer.train_step(x[rank * half:(rank + 1) * half], target[rank * half:(rank + 1) * half])
            losses.append(loss.item())
            finite.append(trainer.train_step_info.all_finite)
            logits.append(out)
        results[zero_stage] = {"losses": losses, "finite": finite,
                               "fp16": all(_is_fp16(out) for step, out in enumerate(logits) if step != DP_POISON_STEP),
                               "weights": _weights(trainer), "loss_scaler": trainer.state_dict()["loss_scaler"]}
    torch.save(results, Path(directory) / f"rank{rank}.pt")


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def data_parallel_runs(tmp_path_factory):
    """The ranks' results: this file run as a module on WORLD_SIZE processes (gloo), once."""
    directory = tmp_path_factory.mktemp("data_parallel")
    port, processes = _free_port(), []
    for rank in range(WORLD_SIZE):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "tests.test_mixed_precision_features", str(directory)],
            cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True))
    deadline = time.monotonic() + 120
    failures = []
    for rank, process in enumerate(processes):
        try:
            _, stderr = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
        if process.returncode != 0:
            failures.append(f"rank {rank} exited with {process.returncode}:\n{stderr[-3000:]}")
    assert not failures, "\n".join(failures)
    return [torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def one_process_on_the_global_batch():
    """(losses, all_finite per step, trainer) of one fp16 process on the global batches."""
    trainer = _dp_trainer()
    losses, finite = _finite_run(trainer, [_dp_batch(step) for step in range(DP_STEPS)])
    return [loss.item() for loss in losses], finite, trainer


@pytest.mark.parametrize("zero_stage", [0, 1], ids=["data_parallel", "zero1"])
def test_data_parallel_and_zero1_train_as_one_process_in_fp16(data_parallel_runs, one_process_on_the_global_batch,
                                                               zero_stage):
    """2 gloo ranks, each on half of a global batch of 64 rows, SGD with clipping (the norm: of the
    averaged, unscaled gradients, over every shard under ZeRO); a non-finite gradient on rank 1
    only (step 3) skips the update on both ranks and halves both scales. The ranks agree bit for
    bit; against one fp16 process on the global batch (the same skips and scaler state) and
    against autocast + GradScaler on it: mean loss per step within LOSS_RTOL, weights within
    WEIGHT_RTOL (measured: one process 6.8e-6 and 1.2e-4, autocast 2.0e-5 and 8.9e-4; ZeRO-1
    equal to data parallel here)."""
    ranks = [rank_results[zero_stage] for rank_results in data_parallel_runs]
    single_losses, single_finite, single = one_process_on_the_global_batch
    expected_finite = [step != DP_POISON_STEP for step in range(DP_STEPS)]
    assert single_finite == expected_finite
    for rank in ranks:
        assert rank["finite"] == expected_finite and rank["fp16"]
        assert rank["loss_scaler"] == single.state_dict()["loss_scaler"]
        assert rank["loss_scaler"]["loss_scale"] == 2.0 ** 15  # halved once
        for name, tensor in ranks[0]["weights"].items():
            assert torch.equal(rank["weights"][name], tensor), name
    finite_steps = [step for step in range(DP_STEPS) if expected_finite[step]]
    mean_losses = np.mean([rank["losses"] for rank in ranks], axis=0)[finite_steps].tolist()
    _assert_losses_close(mean_losses, [single_losses[step] for step in finite_steps])
    _assert_weights_close(single, {name: tensor for name, tensor in ranks[0]["weights"].items()})

    batches = [_dp_batch(step) for step in range(DP_STEPS)]
    expected_losses, expected, norms = _autocast_run(models.mlp(), models.mlp_loss, batches, _sgd(DP_LR),
                                                     max_norm=DP_MAX_NORM)
    clipped = [norms[step] > DP_MAX_NORM for step in finite_steps]
    assert any(clipped) and not all(clipped), norms
    _assert_losses_close(mean_losses, [expected_losses[step] for step in finite_steps])
    for name, tensor in expected.items():
        assert _relative(ranks[0]["weights"][name], tensor) <= WEIGHT_RTOL, name


def _rank_main(directory):
    import torch.distributed as dist

    warnings.filterwarnings("ignore", CPU_WARNING)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    _dp_rank_run(dist.get_rank(), directory)
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1])
