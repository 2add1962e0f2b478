"""Gradient accumulation: gradients summed over N train_step calls, one update every N."""
import copy

import pytest
import torch

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim

from . import models


def torch_accumulation_loop(model, batches, accumulation, lr):
    model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    losses = []
    for index, (x, y) in enumerate(batches):
        loss = models.mlp_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        if index % accumulation == accumulation - 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    return losses, dict(model.named_parameters())


@pytest.mark.parametrize("accumulation", [1, 3])
def test_accumulation_matches_pytorch(accumulation):
    batches = [models.mlp_batch(step) for step in range(4 * accumulation)]
    expected_losses, expected_params = torch_accumulation_loop(models.mlp(), batches, accumulation, 0.01)
    trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(lr=0.01, max_norm_clip=0.5),
                         loss_fn=models.mlp_loss,
                         options=ORTTrainerOptions({"batch": {"gradient_accumulation_steps": accumulation}}))
    for step, batch in enumerate(batches):
        loss = trainer.train_step(*batch)[0].item()
        assert abs(loss - expected_losses[step]) <= 1e-5 * abs(expected_losses[step]), step
        assert trainer._train_step_info.step == step + 1
        assert trainer._train_step_info.optimization_step == (step + 1) // accumulation
    for name, p in trainer.model.named_parameters():
        expected = expected_params[name].detach()
        assert ((p.detach() - expected).abs().max() / expected.abs().max()).item() <= 1e-5, name


def test_weights_only_move_at_the_accumulation_boundary():
    trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=models.mlp_loss,
                         options=ORTTrainerOptions({"batch": {"gradient_accumulation_steps": 2}}))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_step(*models.mlp_batch(0))
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    trainer.train_step(*models.mlp_batch(1))
    assert not any(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
