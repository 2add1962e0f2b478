"""FusedAdam / FusedLamb on CUDA (the CuPy kernels through DLPack views of torch's buffers): parity
with torch.optim.AdamW(fused=True) on the same GPU and with apex's math (tests/test_fused_optimizers),
missing gradients, state dicts, streams, and the one-device rule."""
import math

import numpy as np
import pytest
import torch

cupy = pytest.importorskip("cupy")

from ort_trainer.optim import FusedAdam, FusedLamb  # noqa: E402
from tests.test_fused_optimizers import (DEFAULT_HYPER, SHAPES, ApexMath, assert_close,  # noqa: E402
                                         assert_same_state, make_params, set_grads)

pytestmark = pytest.mark.gpu

STEPS = 100


@pytest.fixture(autouse=True)
def _needs_torch_cuda():
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} has no CUDA")


def cuda_params(seed=0):
    return [torch.nn.Parameter(p.detach().cuda()) for p in make_params(seed)]


def set_cuda_grads(param_lists, step, generator):
    """tests.test_fused_optimizers.set_grads on CPU tensors, then moved to each list's device."""
    cpu = [[torch.nn.Parameter(torch.empty(shape)) for shape in SHAPES]]
    set_grads(cpu, step, generator)
    for params in param_lists:
        for p, q in zip(params, cpu[0]):
            p.grad = None if q.grad is None else q.grad.to(p.device)


def test_fused_adam_matches_torch_fused_adamw_on_the_gpu():
    """Two groups, a scheduler, gradients missing on some steps; run on a side stream, so that the
    kernels must follow torch's current stream."""
    ours_params, torch_params = cuda_params(), cuda_params()
    groups = lambda params: [{"params": params[:2]},  # noqa: E731
                             {"params": params[2:], "lr": 3e-3, "betas": (0.8, 0.99),
                              "weight_decay": 0.1}]
    ours = FusedAdam(groups(ours_params), weight_decay=0.01)
    theirs = torch.optim.AdamW(groups(torch_params), lr=1e-3, weight_decay=0.01, fused=True)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 1 / (1 + s), lambda s: 0.97 ** s])
                  for o in (ours, theirs)]
    generator = torch.Generator().manual_seed(1)
    stream = torch.cuda.Stream()
    for step in range(STEPS):
        set_cuda_grads([ours_params, torch_params], step, generator)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ours.step()
            theirs.step()
        torch.cuda.current_stream().wait_stream(stream)
        for scheduler in schedulers:
            scheduler.step()
    torch.cuda.synchronize()
    assert_close(ours_params, torch_params)
    assert_same_state(ours, theirs)


@pytest.mark.parametrize("use_nvlamb", [False, True])
@pytest.mark.parametrize("max_grad_norm", [0.5, math.inf])
def test_fused_lamb_matches_apex_math_on_the_gpu(use_nvlamb, max_grad_norm):
    params = cuda_params()
    groups = [([0, 1], dict(weight_decay=0.0)),
              ([2, 3], dict(lr=2e-3, bias_correction=False, eps=1e-5)),
              ([4, 5], dict(betas=(0.8, 0.99), weight_decay=0.1))]
    reference = ApexMath([p.cpu() for p in params],
                         [(indices, {**DEFAULT_HYPER[FusedLamb], **hyper}) for indices, hyper in groups],
                         lamb=True, max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb)
    optimizer = FusedLamb([{"params": [params[i] for i in indices], **hyper} for indices, hyper in groups],
                          max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb)
    generator = torch.Generator().manual_seed(7)
    for step in range(STEPS):
        set_cuda_grads([params], step, generator)
        reference.step([None if p.grad is None else p.grad.cpu() for p in params])
        optimizer.step()
    torch.cuda.synchronize()
    assert_close(params, [np.asarray(p) for p in reference.params], rtol=2e-5)


def test_state_dict_moves_between_cpu_and_gpu_and_torch():
    """FusedAdam on CUDA -> torch fused AdamW on CUDA -> FusedAdam on the CPU, all in step."""
    gpu_params = cuda_params()
    gpu = FusedAdam(gpu_params, weight_decay=0.01)
    generator = torch.Generator().manual_seed(2)
    for step in range(10):
        set_cuda_grads([gpu_params], step, generator)
        gpu.step()
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in gpu_params]
    theirs = torch.optim.AdamW(torch_params, fused=True)
    theirs.load_state_dict(gpu.state_dict())
    cpu_params = [torch.nn.Parameter(p.detach().cpu()) for p in gpu_params]
    cpu = FusedAdam(cpu_params)
    cpu.load_state_dict(gpu.state_dict())
    for step in range(10, 20):
        set_cuda_grads([gpu_params, torch_params, cpu_params], step, generator)
        for optimizer in (gpu, theirs, cpu):
            optimizer.step()
    torch.cuda.synchronize()
    assert_close(gpu_params, torch_params)
    assert_close(cpu_params, torch_params)
    assert_same_state(gpu, theirs)
    assert_same_state(cpu, theirs)


def test_parameters_on_two_devices_are_refused():
    with pytest.raises(ValueError, match=r"FusedAdam: param group 1, parameter 0 is on cuda:0, the "
                                         r"others on cpu: all parameters must be on one device"):
        FusedAdam([{"params": [torch.nn.Parameter(torch.ones(2))]},
                   {"params": [torch.nn.Parameter(torch.ones(2, device="cuda:0"))]}])
