"""Mixed precision on CUDA: real fp16 and bf16 products (the CPU emulates fp16 and refuses bf16),
against the PyTorch loop under `torch.autocast('cuda', dtype)` (+ GradScaler for fp16), and
ORTModule under autocast. Tolerances as tests/test_mixed_precision.py explains for fp16 (losses
1e-4 relative over 10 steps); bf16 rounds to 8 significant bits (2^-8 = 3.9e-3), so 1e-2.
TF32 off on both sides. Not yet run on a GPU (written for the first lent device, issue #26)."""
import copy
import os

import pytest
import torch

onnxruntime = pytest.importorskip("onnxruntime")
if "CUDAExecutionProvider" not in onnxruntime.get_available_providers() or not torch.cuda.is_available():
    pytest.skip("needs ONNX Runtime's CUDA build and a CUDA torch", allow_module_level=True)

from ort_trainer import ORTTrainer, ORTTrainerOptions, amp, optim  # noqa: E402
from ort_trainer.ortmodule import ORTModule  # noqa: E402

from .. import models  # noqa: E402

STEPS = 10
LOSS_RTOL = {"float16": 1e-4, "bfloat16": 1e-2}
NO_TF32 = {"CUDAExecutionProvider": {"use_tf32": 0}}
pytestmark = pytest.mark.usefixtures("torch_tf32_off")


def _batches():
    return [tuple(t.cuda() for t in models.transformer_batch(step)) for step in range(STEPS)]


def _autocast_losses(model, dtype, *, wrap=None):
    """The PyTorch loop (Adam, no clip) under autocast; `wrap`: ORTModule around the model."""
    model = copy.deepcopy(model)
    model = wrap(model) if wrap is not None else model
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == "float16")
    losses, dtypes = [], set()
    for src, label in _batches():
        adam.zero_grad()
        with torch.autocast("cuda", dtype=getattr(torch, dtype)):
            output = model(src)
            loss = models.transformer_loss(output, label)
        dtypes.add(output.dtype)
        scaler.scale(loss).backward()
        scaler.step(adam)
        scaler.update()
        losses.append(loss.item())
    return losses, dtypes


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ortrainer_trains_in_step_with_torch_autocast_on_cuda(dtype):
    model = models.transformer().cuda()
    expected, _ = _autocast_losses(model, dtype)
    trainer = ORTTrainer(copy.deepcopy(model), models.TRANSFORMER_DESC, optim.AdamConfig(lr=1e-3),
                         loss_fn=models.transformer_loss, options=ORTTrainerOptions({
                             "device": {"id": "cuda"}, "provider_options": NO_TF32, "utils": {"grad_norm_clip": False},
                             "mixed_precision": {"enabled": True, "dtype": dtype}}))
    for step, (src, label) in enumerate(_batches()):
        loss, _ = trainer.train_step(src, label)
        assert loss.item() == pytest.approx(expected[step], rel=LOSS_RTOL[dtype]), step
    assert trainer.train_step_info.optimization_step == STEPS


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ortmodule_under_autocast_trains_in_step_on_cuda(dtype, monkeypatch):
    monkeypatch.setitem(os.environ, "ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = models.transformer().cuda()
    expected, expected_dtypes = _autocast_losses(model, dtype)
    losses, dtypes = _autocast_losses(model, dtype, wrap=ORTModule)
    assert dtypes == expected_dtypes
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=LOSS_RTOL[dtype], atol=0)


def _overflow_history(device):
    """test_loss_scaling_fp16's overflow sequence (scale 2^24: skipped updates until the scale has
    backed off) with an LR schedule: per step (updates applied, finite, scale, last lr)."""
    scaler = amp.DynamicLossScaler(loss_scale=2.0 ** 24, up_scale_window=3)
    scheduler = optim.lr_scheduler.LinearWarmupLRScheduler(total_steps=30, warmup=0.2)
    trainer = ORTTrainer(models.mlp().to(device), models.MLP_DESC, optim.AdamConfig(lr=0.01), loss_fn=models.mlp_loss,
                         options=ORTTrainerOptions({"device": {"id": device}, "lr_scheduler": scheduler,
                                                    "mixed_precision": {"enabled": True, "loss_scaler": scaler}}))
    batch = [t.to(device) for t in models.mlp_batch(0)]
    history = []
    for _ in range(14):
        trainer.train_step(*batch)
        info = trainer.train_step_info
        history.append((info.optimization_step, info.all_finite, scaler.loss_scale, scheduler.get_last_lr()[0]))
    return history, trainer


@pytest.mark.filterwarnings("ignore:mixed_precision.dtype='float16' on device 'cpu'")
def test_overflows_are_skipped_on_the_device_as_on_the_cpu():
    """On CUDA the skip, the count and the scale are decided on the device (no host sync): the
    same updates applied, scales and lrs step by step as the CPU trainer's host-side rule."""
    cpu, _ = _overflow_history("cpu")
    cuda, trainer = _overflow_history("cuda")
    assert trainer._device_scaling is not None
    assert cuda == cpu
    assert cpu[0][:3] == (0, False, 2.0 ** 23) and cpu[-1][0] >= 3

