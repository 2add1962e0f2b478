"""FP16_Optimizer (ort_trainer.optim, and the original's path optim.fp16_optimizer): the multi-tensor
norm and overflow check against NumPy's float64 math; an apex-shaped fp16 optimizer (written here:
apex is CUDA-only) steps as without the wrapper, overflow skips included; the wrapper is transparent;
what it cannot wrap is refused by name. DeepSpeed's optimizers: tests/test_deepspeed.py."""
import math
import re

import numpy as np
import pytest
import torch

from ort_trainer._optimizers.multi_tensor import has_inf_or_nan, norms, total_norm
from ort_trainer.optim import FP16_Optimizer

SHAPES = [(7, 5), (0,), (1,), (300,), (33, 17), (4, 3, 2)]


def tensors(dtype, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) * scale).to(dtype) for shape in SHAPES]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_norms_equal_numpy_float64(dtype):
    values = tensors(dtype, scale=300.0)  # fp16 squares of ~1000 overflow fp16: the sum is float64
    flat = np.concatenate([t.double().numpy().ravel() for t in values])
    assert total_norm(values).dtype == torch.float64
    assert total_norm(values).item() == pytest.approx(np.linalg.norm(flat), rel=1e-12)
    assert total_norm(values, math.inf).item() == np.abs(flat).max()
    expected = [np.linalg.norm(t.double().numpy()) for t in values if t.numel()]
    np.testing.assert_allclose(norms(values).numpy(), expected, rtol=1e-12)
    assert total_norm([]).item() == 0.0 and total_norm([torch.zeros(0)], math.inf).item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [None, math.inf, -math.inf, math.nan, "max"])
@pytest.mark.parametrize("where", [0, 2, 4])
def test_overflow_check_equals_numpy(dtype, bad, where):
    values = tensors(dtype)
    if bad == "max":  # finite: fp16's largest value, whose square is not
        values[where].view(-1)[-1] = torch.finfo(dtype).max
    elif bad is not None:
        values[where].view(-1)[-1] = bad
    expected = not all(np.isfinite(t.float().numpy()).all() for t in values)
    assert bool(has_inf_or_nan(values)) is expected
    assert has_inf_or_nan(values).shape == () and not has_inf_or_nan([])


# ------------------------------------------------------------------------------------------------
# apex.fp16_utils.FP16_Optimizer in small: fp16 model parameters, fp32 master copies stepped by an
# inner optimizer, a dynamic loss scaler that checks the fp16 gradients tensor by tensor
# ------------------------------------------------------------------------------------------------

class FakeDynamicLossScaler:
    checks = 0  # calls of the per-tensor check, over all instances

    def __init__(self, loss_scale=2.0 ** 8, scale_window=3):
        self.loss_scale, self.scale_window, self.stable = loss_scale, scale_window, 0

    def has_overflow(self, params):
        return self.has_overflow_serial(params)

    def has_overflow_serial(self, params):
        return any(p.grad is not None and self._has_inf_or_nan(p.grad) for p in params)

    @staticmethod
    def _has_inf_or_nan(x):
        FakeDynamicLossScaler.checks += 1
        total = float(x.float().sum())
        return total in (math.inf, -math.inf) or total != total

    def update_scale(self, overflow):
        if overflow:
            self.loss_scale, self.stable = self.loss_scale / 2, 0
        else:
            self.stable += 1
            if self.stable % self.scale_window == 0:
                self.loss_scale *= 2


class FakeApexFP16Optimizer(torch.optim.Optimizer):
    """apex's FP16_Optimizer's attributes and calls: update_master_grads (overflow check, fp16
    gradients unscaled into the masters), clip_master_grads, step (skipped after an overflow)."""

    def __init__(self, fp16_params, lr=0.1):  # noqa: super().__init__ not called, as apex's wrapper
        self.fp16_groups = [list(fp16_params)]
        self.fp32_from_fp16_groups = [[p.detach().float().requires_grad_() for p in self.fp16_groups[0]]]
        self.optimizer = torch.optim.SGD(self.fp32_from_fp16_groups[0], lr=lr, momentum=0.9)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state
        self.loss_scaler = FakeDynamicLossScaler()
        self.overflow = False

    def update_master_grads(self):
        self.overflow = self.loss_scaler.has_overflow([p for group in self.fp16_groups for p in group])
        if not self.overflow:
            for model, master in zip(self.fp16_groups[0], self.fp32_from_fp16_groups[0]):
                master.grad = model.grad.float() / self.loss_scaler.loss_scale

    def clip_master_grads(self, max_norm, norm_type=2):
        if self.overflow:
            return -1
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def step(self, closure=None):
        self.loss_scaler.update_scale(self.overflow)
        if self.overflow:
            return
        self.optimizer.step()
        with torch.no_grad():
            for model, master in zip(self.fp16_groups[0], self.fp32_from_fp16_groups[0]):
                model.copy_(master)

    def zero_grad(self, set_to_none=True):
        for p in (*self.fp16_groups[0], *self.fp32_from_fp16_groups[0]):
            p.grad = None

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "loss_scale": self.loss_scaler.loss_scale,
                "fp32_from_fp16": [p.detach().clone() for p in self.fp32_from_fp16_groups[0]]}

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.loss_scaler.loss_scale = state_dict["loss_scale"]
        with torch.no_grad():
            for master, saved in zip(self.fp32_from_fp16_groups[0], state_dict["fp32_from_fp16"]):
                master.copy_(saved)


def fp16_params(seed=0):
    return [torch.nn.Parameter(t) for t in tensors(torch.float16, seed)]


BAD_STEPS = {3: math.inf, 5: math.nan, 6: -math.inf}  # step -> the value one gradient holds


def run(optimizer, params, steps=10, max_norm=0.5):
    """update_master_grads, clip_master_grads, step on the same scaled fp16 gradients each run;
    returns the norms clip_master_grads returned (-1 after an overflow) and the loss scales."""
    generator = torch.Generator().manual_seed(7)
    returned, scales = [], []
    for step in range(steps):
        optimizer.zero_grad()
        for index, p in enumerate(params):
            p.grad = (torch.randn(p.shape, generator=generator) * 40.0 * (index + 1)).half()
        if step in BAD_STEPS:
            params[4].grad.view(-1)[5] = BAD_STEPS[step]
        optimizer.update_master_grads()
        returned.append(float(optimizer.clip_master_grads(max_norm)))
        optimizer.step()
        scales.append(optimizer.loss_scaler.loss_scale)
    return returned, scales


def test_apex_style_steps_equal_the_unwrapped_optimizer():
    """10 steps, three with a non-finite gradient: the same skips, loss scales and returned
    norms (to 1e-6: ours is accumulated in float64, torch's clip_grad_norm_ in fp32), masters
    within 1e-6 and fp16 weights equal; the per-tensor check no longer runs."""
    plain_params, wrapped_params = fp16_params(), fp16_params()
    plain = FakeApexFP16Optimizer(plain_params)
    wrapped = FP16_Optimizer(FakeApexFP16Optimizer(wrapped_params))
    FakeDynamicLossScaler.checks = 0
    expected_norms, expected_scales = run(plain, plain_params)
    assert FakeDynamicLossScaler.checks > 0
    FakeDynamicLossScaler.checks = 0
    norms_, scales = run(wrapped, wrapped_params)
    assert FakeDynamicLossScaler.checks == 0

    assert scales == expected_scales and [n == -1 for n in norms_] == [step in BAD_STEPS for step in range(10)]
    np.testing.assert_allclose(norms_, expected_norms, rtol=1e-6)
    assert min(n for n in expected_norms if n != -1) > 0.5  # clipping acted
    for ours, theirs in zip(wrapped.fp32_from_fp16_groups[0], plain.fp32_from_fp16_groups[0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    for ours, theirs in zip(wrapped_params, plain_params):
        assert torch.equal(ours, theirs)


def test_the_wrapper_is_transparent():
    params = fp16_params()
    inner = FakeApexFP16Optimizer(params)
    wrapped = FP16_Optimizer(inner)
    assert wrapped.wrapped is inner and wrapped.kind == "apex-style"
    assert wrapped.param_groups is inner.param_groups and wrapped.optimizer is inner.optimizer
    wrapped.overflow = True  # attributes are set on the optimizer
    assert inner.overflow is True and wrapped.clip_master_grads(1.0) == -1
    wrapped.overflow = False
    run(wrapped, params, steps=2)
    saved = wrapped.state_dict()
    torch.testing.assert_close(saved, inner.state_dict())
    run(wrapped, params, steps=2)
    wrapped.load_state_dict(saved)
    torch.testing.assert_close(inner.state_dict(), saved)
    wrapped.zero_grad()
    assert all(p.grad is None for p in params)
    assert repr(wrapped) == f"FP16_Optimizer({inner!r})"


def test_a_static_loss_scaler_keeps_its_check():
    """A static scaler's has_overflow is False by design (apex's LossScaler): left as it is."""
    class StaticLossScaler:
        loss_scale = 1.0

        def has_overflow(self, params):
            return False

    inner = FakeApexFP16Optimizer(fp16_params())
    inner.loss_scaler = StaticLossScaler()
    FP16_Optimizer(inner)
    assert "has_overflow_serial" not in vars(inner.loss_scaler) and "clip_master_grads" in vars(inner)


def test_original_module_path():
    """`from onnxruntime.training.optim.fp16_optimizer import FP16_Optimizer` ported as it is."""
    from ort_trainer.optim.fp16_optimizer import FP16_Optimizer as original_path

    assert original_path is FP16_Optimizer


SUPPORTED = ("supported: DeepSpeed's fp16 and ZeRO optimizers (deepspeed.initialize's optimizer with fp16 enabled, "
             "or at zero_optimization.stage 1, 2 or 3) and apex-style fp16 optimizers (fp16_groups, "
             "fp32_from_fp16_groups, loss_scaler, clip_master_grads: apex.fp16_utils.FP16_Optimizer)")


def test_an_optimizer_it_cannot_wrap_is_refused_by_type():
    sgd = torch.optim.SGD(fp16_params(), lr=0.1)
    message = ("FP16_Optimizer: cannot wrap a torch.optim.sgd.SGD (an apex-style optimizer would have "
               "['fp16_groups', 'fp32_from_fp16_groups', 'optimizer', 'overflow', 'loss_scaler', "
               f"'clip_master_grads']); {SUPPORTED}")
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        FP16_Optimizer(sgd)
    inner = FakeApexFP16Optimizer(fp16_params())
    del inner.overflow
    with pytest.raises(TypeError, match=re.escape("would have ['overflow']); supported:")):
        FP16_Optimizer(inner)


def test_megatron_is_refused():
    """Megatron-LM's FP16_Optimizer has apex's attributes but clips over its model-parallel group."""
    megatron = type("FP16_Optimizer", (FakeApexFP16Optimizer,), {"__module__": "megatron.fp16.fp16"})
    message = ("FP16_Optimizer: cannot wrap a megatron.fp16.fp16.FP16_Optimizer: Megatron-LM clips the gradients "
               f"over its model-parallel group, which FP16_Optimizer's norm does not; {SUPPORTED}")
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        FP16_Optimizer(megatron(fp16_params()))


def test_wrapping_twice_is_refused():
    wrapped = FP16_Optimizer(FakeApexFP16Optimizer(fp16_params()))
    with pytest.raises(TypeError, match=r"^FP16_Optimizer: optimizer is already an FP16_Optimizer; wrap the "
                                        r"optimizer once$"):
        FP16_Optimizer(wrapped)
