"""The math of the original ORTTrainer's optimizers, written out plainly.

The update rules (``sgd_reference``, ``adam_reference``, ``lamb_reference``) work in NumPy on one
param group at a time, in place, in the dtype of the arrays given (float64 for an oracle),
temporaries allowed: they document the math and are the oracle of the fast implementations
(``_optimizers.cpu``, the CUDA kernels of ``_optimizers.cuda_steps``), which must match them. The clip rule
(``clip_divisor_from_norm``) is a function of one number: everything on the host uses it as is.
"""
from __future__ import annotations

import math
import numpy as np

from .hyper import AdamHyper, LambHyper, SGDHyper


def sgd_reference(params: np.ndarray, grads: np.ndarray, momentum_buf: np.ndarray, *, step: int, lr: float,
                  hyper: SGDHyper, grad_divisor: float = 1.0) -> None:
    """torch.optim.SGD's update; ``step`` is the 1-based update index (the buffer starts at g)."""
    g = grads / grad_divisor
    if hyper.lambda_coef:
        g = g + hyper.lambda_coef * params
    momentum = hyper.momentum
    if momentum:
        if step == 1:
            momentum_buf[...] = g
        else:
            momentum_buf[...] = momentum * momentum_buf + (1 - hyper.dampening) * g
        g = g + momentum * momentum_buf if hyper.nesterov else momentum_buf
    params -= lr * g


def adam_reference(params: np.ndarray, grads: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray, *,
                   step: int, lr: float, hyper: AdamHyper, grad_divisor: float = 1.0) -> None:
    """The original AdamOptimizer; ``step`` is t, starting at 1.

    weight_decay_mode 0 ("PyTorch AdamW"): torch.optim.Adam for lambda 0, torch.optim.AdamW with
    weight_decay=lambda otherwise. weight_decay_mode 1 ("HuggingFace"): epsilon is added to the
    uncorrected sqrt(v), and the decay applies to the already-updated weight.
    """
    alpha, beta = hyper.alpha, hyper.beta
    decay, eps = hyper.lambda_coef, hyper.epsilon
    g = grads / grad_divisor
    exp_avg[...] = alpha * exp_avg + (1 - alpha) * g
    exp_avg_sq[...] = beta * exp_avg_sq + (1 - beta) * g * g
    if hyper.do_bias_correction:
        c1, c2 = 1 - alpha**step, 1 - beta**step
    else:
        c1 = c2 = 1.0
    if hyper.weight_decay_mode == 0:
        params -= lr * ((exp_avg / c1) / (np.sqrt(exp_avg_sq / c2) + eps) + decay * params)
    else:
        step_size = lr * math.sqrt(c2) / c1
        params -= step_size * exp_avg / (np.sqrt(exp_avg_sq) + eps)
        params -= lr * decay * params


def lamb_reference(params: np.ndarray, grads: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray, *,
                   step: int, lr: float, hyper: LambHyper, grad_divisor: float = 1.0,
                   seg_offsets: np.ndarray) -> None:
    """The original LambOptimizer; ``step`` is t, starting at 1.

    ``seg_offsets`` are the group's tensor boundaries relative to the group's start
    (``FlatLayout.local_offsets``): the trust ratio is per tensor. Non-finite values follow the
    original kernels: where the direction d is not finite, d = 0 and the moments keep their old
    values; where the new weight is not finite, the weight keeps its old value.
    """
    alpha, beta = hyper.alpha, hyper.beta
    decay, eps = hyper.lambda_coef, hyper.epsilon
    if hyper.do_bias_correction:
        c1, c2 = 1 - alpha**step, 1 - beta**step
    else:
        c1 = c2 = 1.0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        g = grads / grad_divisor
        new_exp_avg = alpha * exp_avg + (1 - alpha) * g
        new_exp_avg_sq = beta * exp_avg_sq + (1 - beta) * g * g
        direction = decay * params + (new_exp_avg / c1) / (np.sqrt(new_exp_avg_sq / c2) + eps)
        finite = np.isfinite(direction)
        direction[~finite] = 0
        exp_avg[...] = np.where(finite, new_exp_avg, exp_avg)
        exp_avg_sq[...] = np.where(finite, new_exp_avg_sq, exp_avg_sq)

        starts, sizes = seg_offsets[:-1], np.diff(seg_offsets)
        ratio = trust_ratio(np.add.reduceat(np.square(params, dtype=np.float64), starts),
                             np.add.reduceat(np.square(direction, dtype=np.float64), starts),
                             hyper.ratio_min, hyper.ratio_max)
        new_params = params - (lr * np.repeat(ratio, sizes)).astype(params.dtype) * direction
        params[...] = np.where(np.isfinite(new_params), new_params, params)


def trust_ratio(params_sumsq, direction_sumsq, ratio_min, ratio_max):
    """Per tensor: clamp(||w|| / ||d||, ratio_min, ratio_max), and 1 where either norm is 0.

    Takes squared norms. Clamps as the original did (max(ratio_min, min(ratio_max, x))), so
    ratio_min wins if the bounds cross.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.sqrt(np.asarray(params_sumsq, np.float64) / direction_sumsq)
    ratio = np.maximum(ratio_min, np.minimum(ratio_max, ratio))
    return np.where((params_sumsq == 0) | (direction_sumsq == 0), 1.0, ratio)


def clip_divisor_from_norm(norm: float, max_norm: float, loss_scale: float = 1.0) -> float:
    """The divisor S that unscales and clips the gradients at once, as the original's graph did.

    S = loss_scale; N = ``norm``, the global norm of the (loss-scaled) gradients; if
    N > S * max_norm: S = N / max_norm (no epsilon, unlike torch.nn.utils.clip_grad_norm_, which
    divides by N + 1e-6). The optimizer then uses grads / S. kernels/clip.cu applies the same rule
    on the device.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_divisor: max_norm must be > 0, got {max_norm!r}")
    return norm / max_norm if norm > loss_scale * max_norm else float(loss_scale)
