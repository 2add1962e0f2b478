"""Checkpoints: resume is bitwise equal to a straight run; bad files change nothing."""
import re

import pytest
import torch

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim

from . import models


def make_trainer(config=None, **options):
    scheduler = optim.LinearWarmupLRScheduler(total_steps=20, warmup=0.25)
    return ORTTrainer(models.transformer(), models.TRANSFORMER_DESC, config or optim.AdamConfig(lr=0.01),
                      loss_fn=models.transformer_loss,
                      options=ORTTrainerOptions({"lr_scheduler": scheduler, **options}))


def weights(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("config", [optim.AdamConfig(lr=0.01), optim.LambConfig(lr=0.01),
                                    optim.SGDConfig(lr=0.05, momentum=0.9)], ids=["adam", "lamb", "sgd"])
def test_resume_is_bitwise_equal_to_a_straight_run(tmp_path, config):
    batches = [models.transformer_batch(step) for step in range(20)]
    straight = make_trainer(config)
    straight_losses = [straight.train_step(*batch)[0] for batch in batches]

    first = make_trainer(config)
    for batch in batches[:10]:
        first.train_step(*batch)
    first.save_checkpoint(tmp_path / "ckpt.pt", user_dict={"epoch": 3})
    resumed = make_trainer(config)
    assert resumed.load_checkpoint(tmp_path / "ckpt.pt") == {"epoch": 3}  # before any step: deferred
    resumed_losses = [resumed.train_step(*batch)[0] for batch in batches[10:]]
    assert all(torch.equal(a, b) for a, b in zip(resumed_losses, straight_losses[10:]))
    final = weights(straight)
    assert all(torch.equal(p, final[name]) for name, p in weights(resumed).items())
    assert resumed.train_step_info.step == 20 and resumed.train_step_info.optimization_step == 20
    assert resumed._lr_scheduler.get_last_lr() == straight._lr_scheduler.get_last_lr()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["trainer_options"]
    assert saved["lr_scheduler"] == "LinearWarmupLRScheduler" and saved["utils"]["grad_norm_clip"] is True


def test_load_into_a_trainer_that_already_trained(tmp_path):
    saved = make_trainer()
    for step in range(3):
        saved.train_step(*models.transformer_batch(step))
    state = saved.state_dict()
    other = make_trainer()
    other.train_step(*models.transformer_batch(9))
    other.load_state_dict(state)
    assert all(torch.equal(p, state["model"][name]) for name, p in weights(other).items())
    assert torch.equal(other.train_step(*models.transformer_batch(3))[0], saved.train_step(*models.transformer_batch(3))[0])


def test_checkpoint_weights_load_into_the_plain_torch_model(tmp_path):
    trainer = make_trainer()
    trainer.train_step(*models.transformer_batch(0))
    trainer.save_checkpoint(tmp_path / "ckpt.pt")
    plain = models.transformer(seed=5)
    plain.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"])
    data, targets = models.transformer_batch(1)
    plain.eval()
    with torch.no_grad():
        assert torch.allclose(plain(data), trainer.eval_step(data, targets)[1], atol=1e-5)


def test_another_models_checkpoint_is_refused_by_key_and_changes_nothing(tmp_path):
    mlp = ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(), loss_fn=models.mlp_loss)
    mlp.train_step(*models.mlp_batch(0))
    mlp.save_checkpoint(tmp_path / "mlp.pt")
    trainer = make_trainer()
    trainer.train_step(*models.transformer_batch(0))
    before = weights(trainer)
    with pytest.raises(ValueError, match=re.escape("load_state_dict: state_dict['model']: missing keys [")) as error:
        trainer.load_checkpoint(tmp_path / "mlp.pt")
    assert "unexpected keys ['net.0.bias', 'net.0.weight'" in str(error.value)
    assert all(torch.equal(p, before[name]) for name, p in weights(trainer).items())
    assert trainer.train_step_info.step == 1


def test_optimizer_mismatch_is_refused(tmp_path):
    trainer = make_trainer()
    trainer.train_step(*models.transformer_batch(0))
    state = trainer.state_dict()
    with pytest.raises(ValueError, match=re.escape(
            "load_state_dict: the checkpoint's optimizer is 'AdamOptimizer', this trainer's is 'SGDOptimizer'")):
        make_trainer(optim.SGDConfig()).load_state_dict(state)


def test_truncated_file_is_refused_and_an_existing_file_survives_a_failed_write(tmp_path, monkeypatch):
    trainer = make_trainer()
    trainer.train_step(*models.transformer_batch(0))
    path = tmp_path / "ckpt.pt"
    trainer.save_checkpoint(path)
    original = path.read_bytes()
    (tmp_path / "cut.pt").write_bytes(original[: len(original) // 2])
    with pytest.raises(ValueError, match=re.escape(f"checkpoint '{tmp_path / 'cut.pt'}' is truncated or corrupt")):
        make_trainer().load_checkpoint(tmp_path / "cut.pt")

    def failing_save(obj, file, *args, **kwargs):
        file.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint(path)
    assert path.read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "cut.pt"]


def test_saving_mid_accumulation_is_refused(tmp_path):
    trainer = make_trainer(batch={"gradient_accumulation_steps": 2})
    trainer.train_step(*models.transformer_batch(0))
    with pytest.raises(RuntimeError, match=re.escape(
            "save_checkpoint() in the middle of a gradient-accumulation cycle (micro-step 1 of 2)")):
        trainer.save_checkpoint(tmp_path / "ckpt.pt")
    assert list(tmp_path.iterdir()) == []


def test_scheduler_presence_must_match(tmp_path):
    plain = ORTTrainer(models.transformer(), models.TRANSFORMER_DESC, optim.AdamConfig(lr=0.01),
                       loss_fn=models.transformer_loss)
    with pytest.raises(ValueError, match=re.escape(
            "load_state_dict: the checkpoint has no lr_scheduler state, and this trainer has lr_scheduler")):
        make_trainer().load_state_dict(plain.state_dict())


def _without_step_count(optimizer):
    del optimizer["step_count"]


@pytest.mark.parametrize("spoil,message", [
    (lambda optimizer: optimizer.update(step_count=-4),
     "load_state_dict: state_dict['optimizer']['step_count'] must be an int >= 0, got -4"),
    (lambda optimizer: optimizer.update(step_count="x"),
     "load_state_dict: state_dict['optimizer']['step_count'] must be an int >= 0, got 'x'"),
    (_without_step_count, "load_state_dict: state_dict['optimizer']: missing keys ['step_count']"),
], ids=["negative", "str", "missing"])
@pytest.mark.parametrize("trained", [True, False], ids=["after_a_step", "fresh"])
def test_a_bad_optimizer_section_is_refused_before_anything_changes(spoil, message, trained):
    source = make_trainer()
    source.train_step(*models.transformer_batch(0))
    state = source.state_dict()
    spoil(state["optimizer"])
    trainer = make_trainer()
    if trained:
        trainer.train_step(*models.transformer_batch(5))
    before, saved = weights(trainer), trainer.state_dict()
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer.load_state_dict(state)
    assert all(torch.equal(p, before[name]) for name, p in weights(trainer).items())
    assert trainer.train_step_info.step == int(trained)
    assert trainer.state_dict()["optimizer"]["step_count"] == saved["optimizer"]["step_count"]
    trainer.train_step(*models.transformer_batch(1))  # nothing pending: the next step runs


def test_resuming_inside_an_accumulation_cycle_is_refused():
    source = make_trainer()
    source.train_step(*models.transformer_batch(0))
    trainer = make_trainer(batch={"gradient_accumulation_steps": 2})
    with pytest.raises(ValueError, match=re.escape(
            "load_state_dict: train_step_info['step']=1 is micro-step 1 of a gradient-accumulation cycle for this "
            "trainer's batch.gradient_accumulation_steps=2")):
        trainer.load_state_dict(source.state_dict())
    assert trainer.train_step_info.step == 0
    source.train_step(*models.transformer_batch(1))
    trainer.load_state_dict(source.state_dict())  # step 2: the start of a cycle
    assert trainer.train_step_info.step == 2
