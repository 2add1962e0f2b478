"""Loss scaling under real fp16 graphs (`mixed_precision.enabled`), not only the scaler's rule:
fp16 flushes gradients below its smallest subnormal (6e-8) to zero and turns those above its largest
value (65504) into inf, so the scale is what lets small gradients train, and the dynamic rule
(halve and skip on overflow, double after a window of finite updates) is what keeps it in range.
The scaler's rule on its own is in test_loss_scaler.py; here it runs inside the trainer, plus the
original ORTTrainer's own DynamicLossScaler sequence test, ported.
"""
import numpy as np
import pytest
import torch

from ort_trainer import ORTTrainer, ORTTrainerOptions, TrainStepInfo, amp, optim

from . import models

pytestmark = pytest.mark.filterwarnings("ignore:mixed_precision.dtype='float16' on device 'cpu'")

# The MLP's loss times 1e-6: the logits' gradients (softmax - one_hot) / batch shrink to <= 1.25e-7,
# around fp16's smallest subnormal. lr = 0.1 / TINY makes the update as large as lr 0.1 on the plain
# loss; with lr 1.0 the updates (~1e-7) would sit at the weights' fp32 resolution and even the fp32
# trainer would leave 21% of the entries unchanged (measured), hiding the fp16 flush.
TINY = 1e-6


def _tiny_loss(output, target):
    return models.mlp_loss(output, target) * TINY


def _trainer(optim_config, loss_fn=models.mlp_loss, scaler=None, clip=True):
    options = {"utils": {"grad_norm_clip": clip}}
    if scaler is not None:
        options["mixed_precision"] = {"enabled": True, "loss_scaler": scaler}
    return ORTTrainer(models.mlp(), models.MLP_DESC, optim_config, loss_fn=loss_fn,
                      options=ORTTrainerOptions(options))


def _weights(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def _one_sgd_update(scale):
    """{name: weight change} after one SGD step on the tiny loss; scale None: an fp32 trainer."""
    scaler = None if scale is None else amp.DynamicLossScaler(loss_scale=scale, automatic_update=False)
    trainer = _trainer(optim.SGDConfig(lr=0.1 / TINY), _tiny_loss, scaler, clip=False)
    before = _weights(trainer)
    trainer.train_step(*models.mlp_batch(0))
    assert trainer.train_step_info.all_finite and trainer.train_step_info.optimization_step == 1
    return {name: p - before[name] for name, p in _weights(trainer).items()}


def _changed_fraction(update):
    return torch.cat([(delta != 0).flatten() for delta in update.values()]).float().mean().item()


def test_a_scale_keeps_tiny_gradients_from_underflowing_in_fp16():
    """Measured (645 weight entries): fp32 changes 100%; fp16 at scale 1 changes 18% (the rest of the
    gradients flush to zero); fp16 at scale 2^16 changes 100% and is within 5.2e-4 of fp32's update
    (per tensor, max difference over max magnitude; at scale 1: 0.28 to 1.0). Tolerance 5e-3: each
    fp16 rounding errs by up to 2^-11 = 4.9e-4 relative and a gradient passes through a few (the
    logits' gradient, a product's input gradient, the weight gradient): about 10 roundings' worth."""
    fp32, unscaled, scaled = _one_sgd_update(None), _one_sgd_update(1.0), _one_sgd_update(2.0 ** 16)
    assert _changed_fraction(fp32) == 1.0
    assert _changed_fraction(unscaled) <= 0.4, _changed_fraction(unscaled)
    assert _changed_fraction(scaled) >= 0.99, _changed_fraction(scaled)
    for name, expected in fp32.items():
        error = ((scaled[name] - expected).abs().max() / expected.abs().max()).item()
        assert error <= 5e-3, (name, error)


def test_overflowing_scale_skips_updates_and_backs_off_until_training_proceeds():
    """Scale 2^24 (the maximum) on the plain loss: every fp16 gradient overflows (logits' gradients
    ~0.1 times 1.7e7 > 65504). Measured: skipped at 2^24 down to 2^17, trains at 2^16 (largest scaled
    gradient 37632); the assertion allows a factor 2 either way."""
    scaler = amp.DynamicLossScaler(loss_scale=2.0 ** 24)
    trainer = _trainer(optim.AdamConfig(lr=0.01), scaler=scaler)
    initial = _weights(trainer)
    info, scale, skipped = trainer.train_step_info, scaler.loss_scale, 0
    batch = models.mlp_batch(0)
    while True:
        trainer.train_step(*batch)
        if info.all_finite:
            break
        skipped += 1
        assert info.step == skipped and info.optimization_step == 0
        assert scaler.loss_scale == scale / 2 and float(trainer._loss_scale) == scale / 2
        scale /= 2
        assert not np.isfinite(trainer._weights.flat.grads).all()
        assert all(torch.equal(p, initial[name]) for name, p in _weights(trainer).items())
        optimizer = trainer._weights.optimizer
        assert optimizer.step_count == 0 and not any(array.any() for array in optimizer.state.values())
        assert skipped < 24, "the scale never backed off far enough"
    assert skipped >= 1 and 2.0 ** 15 <= scale <= 2.0 ** 17, (skipped, scale)
    assert scaler.loss_scale == scale  # a finite update keeps it (window 2000)
    assert info.step == skipped + 1 and info.optimization_step == 1 and trainer._weights.optimizer.step_count == 1
    assert all(array.any() for array in trainer._weights.optimizer.state.values())
    assert all(not torch.equal(p, initial[name]) for name, p in _weights(trainer).items())
    losses = [trainer.train_step(*batch)[0].item() for _ in range(5)]
    assert info.all_finite and info.optimization_step == 6 and losses == sorted(losses, reverse=True), losses


def test_scale_doubles_after_a_window_of_finite_fp16_updates():
    """Window 3 from 2^10: the graph's scale is 2^10 for updates 1-3, 2^11 for 4-6, 2^12 for 7.
    lr 1e-30 leaves every weight where it is (an update ~1e-31 is far below fp32's resolution
    of the weights; the zero LayerNorm bias moves to ~1e-31, which no activation can see), so each
    step's (scaled, fp16-rounded) gradients are the first step's times the scale ratio: exactly,
    as a power of two commutes with fp16 and fp32 rounding away from subnormals (measured: all 645
    entries exact)."""
    scaler = amp.DynamicLossScaler(loss_scale=2.0 ** 10, up_scale_window=3)
    trainer = _trainer(optim.SGDConfig(lr=1e-30), scaler=scaler)
    batch, first = models.mlp_batch(0), None
    used = [2.0 ** 10] * 3 + [2.0 ** 11] * 3 + [2.0 ** 12]
    after = used[1:] + [2.0 ** 12]
    for step, (scale, next_scale) in enumerate(zip(used, after), 1):
        trainer.train_step(*batch)
        grads = trainer._weights.flat.grads.copy()
        first = grads if first is None else first
        assert trainer.train_step_info.all_finite and trainer.train_step_info.optimization_step == step
        assert scaler.loss_scale == next_scale and float(trainer._loss_scale) == next_scale, step
        assert np.array_equal(grads, first * (scale / 2.0 ** 10)), step
        assert np.count_nonzero(grads) == grads.size  # none flushed, so the ratio is exact
    assert scaler.state_dict()["stable_steps"] == 1


def test_original_dynamic_loss_scaler_sequence():
    """onnxruntime's orttraining_test_orttrainer_frontend.py::testDynamicLossScaler, ported (its
    private `_stable_steps_count` is `state_dict()['stable_steps']` here; scales are powers of two,
    so compared exactly instead of with rtol 1e-7). Its companion testDynamicLossScalerCustomValues
    built loss_scale=3 with min_loss_scale=5, which this scaler refuses (see test_loss_scaler.py)."""
    default_scaler = amp.DynamicLossScaler()
    train_step_info = TrainStepInfo(optim.LambConfig())

    def stable_steps():
        return default_scaler.state_dict()["stable_steps"]

    assert default_scaler.loss_scale == float(1 << 16) and default_scaler.up_scale_window == 2000
    assert default_scaler.min_loss_scale == 1.0 and default_scaler.max_loss_scale == float(1 << 24)
    # 9 * 2000 finite updates: doubles at each 2000th until max_loss_scale, then stays
    loss_scale = float(1 << 16)
    for cycles in range(1, 10):
        for i in range(1, 2000):
            assert default_scaler.update(train_step_info) == loss_scale and stable_steps() == i, (cycles, i)
        new_loss_scale = default_scaler.update(train_step_info)
        if cycles <= 8:
            loss_scale *= 2
        assert new_loss_scale == loss_scale and stable_steps() == 0, cycles
    assert new_loss_scale == float(1 << 16) * 2 ** 8
    for count in range(1, 2050):
        assert default_scaler.update(train_step_info) == loss_scale and stable_steps() == count % 2000, count
    # 24 non-finite updates halve it down to 1.0 (min_loss_scale), where it stays
    train_step_info.all_finite = False
    for count in range(1, 25):
        loss_scale /= 2
        assert default_scaler.update(train_step_info) == loss_scale and stable_steps() == 0, count
    assert loss_scale == 1.0
    for count in range(1, 5):
        assert default_scaler.update(train_step_info) == 1.0 and stable_steps() == 0, count
