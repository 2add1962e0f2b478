"""Step-by-step parity with eager PyTorch: same init, same data, dropout off, 20 steps."""
import pytest
import torch

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim

from . import models

STEPS = 20
CASES = {
    "transformer": (models.transformer, models.transformer_loss, models.TRANSFORMER_DESC, models.transformer_batch),
    "mlp": (models.mlp, models.mlp_loss, models.MLP_DESC, models.mlp_batch),
    "two_tower": (models.two_tower, None, models.TWO_TOWER_DESC, models.two_tower_batch),
}
OPTIMIZERS = {
    "sgd": (lambda: optim.SGDConfig(lr=0.05, momentum=0.9, lambda_coef=0.01, max_norm_clip=0.5),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01), None),
    "sgd_nesterov": (lambda: optim.SGDConfig(lr=0.05, momentum=0.8, nesterov=True, max_norm_clip=0.5),
                     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True), None),
    "adam": (lambda: optim.AdamConfig(lr=0.01, max_norm_clip=0.5),
             lambda p: torch.optim.Adam(p, lr=0.01, foreach=False), None),
    "adamw": (lambda: optim.AdamConfig(lr=0.01, lambda_coef=0.1, max_norm_clip=0.5),
              lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, foreach=False), None),
    "lamb": (lambda: optim.LambConfig(lr=0.01, lambda_coef=0.01, max_norm_clip=0.5), None,
             dict(lr=0.01, lambda_coef=0.01)),
}


def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def assert_parity(case, optimizer, clip):
    make_model, loss_fn, desc, make_batch = CASES[case]
    make_config, make_torch_optimizer, lamb = OPTIMIZERS[optimizer]
    config = make_config()
    batches = [make_batch(step) for step in range(STEPS)]
    expected_losses, expected_params = models.torch_loop(
        make_model(), loss_fn, batches, make_torch_optimizer, max_norm=0.5 if clip else None, lamb=lamb)

    trainer = ORTTrainer(make_model(), desc, config, loss_fn=loss_fn,
                         options=ORTTrainerOptions({"utils": {"grad_norm_clip": clip}}))
    for step, batch in enumerate(batches):
        loss = trainer.train_step(*batch)[0]
        assert abs(loss.item() - expected_losses[step]) <= 1e-4 * abs(expected_losses[step]), (step, loss)
    trained = dict(trainer.model.named_parameters())
    for name, expected in expected_params.items():
        assert _relative(models.comparable(name, trained[name].detach()), models.comparable(name, expected)) <= 1e-4, name


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
def test_mlp_parity(optimizer, clip):
    assert_parity("mlp", optimizer, clip)


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "lamb"])
def test_transformer_parity(optimizer):
    assert_parity("transformer", optimizer, clip=True)


@pytest.mark.parametrize("optimizer", ["adamw", "lamb", "sgd_nesterov"])
def test_two_inputs_two_outputs_parity(optimizer):
    assert_parity("two_tower", optimizer, clip=False)
