"""LR schedulers, loss scaling with skipped updates, frozen weights."""
import math
import re

import numpy as np
import pytest
import torch

from ort_trainer import ORTTrainer, ORTTrainerOptions, amp, optim

from . import models


def test_scheduler_sets_the_lr_of_every_update():
    scheduler = optim.CosineWarmupLRScheduler(total_steps=12, warmup=0.25)
    trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=models.mlp_loss,
                         options=ORTTrainerOptions({"lr_scheduler": scheduler, "utils": {"grad_norm_clip": False}}))
    reference = models.mlp()
    for step in range(12):
        x, y = models.mlp_batch(step)
        trainer.train_step(x, y)
        lr = scheduler.lr_at(0.1, step + 1)
        assert scheduler.get_last_lr() == [lr]
        if step == 0:
            assert lr == pytest.approx(0.1 / 3)  # warmup 0.25*12 = 3 updates; the original used lr 0 here
        reference.zero_grad()
        models.mlp_loss(reference(x), y).backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= lr * p.grad
    for name, p in trainer.model.named_parameters():
        assert torch.allclose(p, dict(reference.named_parameters())[name], rtol=1e-5, atol=1e-6), name


def mixed_precision_trainer(scaler):
    return ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(lr=0.01), loss_fn=models.mlp_loss,
                      options=ORTTrainerOptions({"mixed_precision": {"enabled": True, "loss_scaler": scaler}}))


@pytest.mark.filterwarnings("ignore:mixed_precision.dtype='float16' on device 'cpu'")
def test_loss_scaling_matches_unscaled_training():
    """Two power-of-two scales round the fp16 gradients alike (a binary scale only shifts the
    exponent, away from underflow and overflow): unscaled, the two runs train alike."""
    scaled = mixed_precision_trainer(amp.DynamicLossScaler(loss_scale=1024.0))
    less = mixed_precision_trainer(amp.DynamicLossScaler(loss_scale=16.0))
    for step in range(5):
        batch = models.mlp_batch(step)
        assert torch.allclose(scaled.train_step(*batch)[0], less.train_step(*batch)[0], rtol=1e-6)
        assert scaled.train_step_info.all_finite
    for (name, p), q in zip(scaled.model.named_parameters(), less.model.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name


@pytest.mark.filterwarnings("ignore:mixed_precision.dtype='float16' on device 'cpu'")
@pytest.mark.parametrize("poison", [math.inf, math.nan])
def test_non_finite_gradients_skip_the_update_and_back_off_the_scale(poison):
    scaler = amp.DynamicLossScaler(loss_scale=2.0 ** 10, up_scale_window=3)
    trainer = mixed_precision_trainer(scaler)
    trainer.train_step(*models.mlp_batch(0))
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    optimizer_state = {k: v.copy() for k, v in trainer._weights.optimizer.state.items()}
    x, y = models.mlp_batch(1)
    x[0, 0] = poison  # a non-finite input gives non-finite gradients
    trainer.train_step(x, y)
    assert not trainer.train_step_info.all_finite
    assert trainer.train_step_info.step == 2 and trainer.train_step_info.optimization_step == 1
    assert scaler.loss_scale == 2.0 ** 9 and float(trainer._loss_scale) == 2.0 ** 9
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, weights[name]), name
    for name, array in trainer._weights.optimizer.state.items():
        assert np.array_equal(array, optimizer_state[name]), name
    assert trainer._weights.optimizer.step_count == 1
    for step in range(2, 5):
        trainer.train_step(*models.mlp_batch(step))
        assert trainer.train_step_info.all_finite
    assert scaler.loss_scale == 2.0 ** 10  # up-scaled after a window of 3 finite steps


def test_loss_scaler_without_mixed_precision_is_refused():
    with pytest.raises(ValueError, match=re.escape(
            "Invalid options: mixed_precision.loss_scaler is set, but mixed_precision.enabled is False")):
        ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(), loss_fn=models.mlp_loss,
                   options=ORTTrainerOptions({"mixed_precision": {"loss_scaler": amp.DynamicLossScaler()}}))


def test_frozen_weights_get_no_gradient_and_stay_put():
    trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(lr=0.01), loss_fn=models.mlp_loss,
                         options=ORTTrainerOptions({"utils": {"frozen_weights": ["net.0.weight", "net.0.bias"]}}))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    for step in range(3):
        trainer.train_step(*models.mlp_batch(step))
    assert "model.net.0.weight" not in trainer._weights.flat.names
    session = trainer._graphs.get(next(iter(trainer._graphs._graphs)))._session(True)[0]
    gradient_outputs = {o.name for o in session.get_outputs() if o.name.endswith("_grad")}
    assert gradient_outputs == {f"model.{n}_grad" for n in ("net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias")}
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]) == name.startswith("net.0."), name


def test_fetches_limit_the_outputs_and_training_is_unchanged():
    full = ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(lr=0.01), loss_fn=models.mlp_loss)
    lean = ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(lr=0.01), loss_fn=models.mlp_loss)
    lean.train_step_info.fetches = ["loss"]
    for step in range(4):
        batch = models.mlp_batch(step)
        loss = lean.train_step(*batch)
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0
        assert torch.equal(loss, full.train_step(*batch)[0])
    assert lean.train_step_info.optimization_step == 4  # the original froze it under fetches
    graph = next(iter(lean._graphs._graphs.values()))
    session = graph._session(True)[0]
    assert [o.name for o in session.get_outputs() if not o.name.endswith("_grad")] == ["loss"]
    for p, q in zip(lean.model.parameters(), full.model.parameters()):
        assert torch.equal(p, q)
    lean.train_step_info.fetches = ["logits", "loss"]
    logits, loss = lean.eval_step(*models.mlp_batch(9))
    assert logits.shape == (8, 5) and loss.dim() == 0


def test_unknown_fetch_is_refused_and_changes_nothing():
    trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(lr=0.01), loss_fn=models.mlp_loss)
    trainer.train_step(*models.mlp_batch(0))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_step_info.fetches = ["loss", "probs"]
    with pytest.raises(ValueError, match=re.escape(
            "train_step(): train_step_info.fetches names unknown outputs ['probs']; model_desc outputs are "
            "['loss', 'logits']")):
        trainer.train_step(*models.mlp_batch(1))
    assert trainer.train_step_info.step == 1
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
