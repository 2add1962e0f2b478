"""The hyperparameters of one param group, typed per algorithm (the original ORTTrainer's names):
what the functional steps, the CUDA tables and the NumPy references read, by attribute."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SGDHyper:
    """torch.optim.SGD's: weight decay ``lambda_coef`` as L2 (g += lambda*w)."""

    momentum: float
    nesterov: bool
    lambda_coef: float
    dampening: float


@dataclass(frozen=True)
class AdamHyper:
    """The original AdamOptimizer's (``_optimizers.reference.adam_reference``)."""

    alpha: float
    beta: float
    lambda_coef: float
    epsilon: float
    do_bias_correction: bool
    weight_decay_mode: int  # 0 or 1


@dataclass(frozen=True)
class LambHyper:
    """The original LambOptimizer's (``_optimizers.reference.lamb_reference``)."""

    alpha: float
    beta: float
    lambda_coef: float
    epsilon: float
    ratio_min: float
    ratio_max: float
    do_bias_correction: bool


Hyper = SGDHyper | AdamHyper | LambHyper

#: The hyperparameters of each kernel family ('sgd', 'adam', 'lamb').
HYPER_TYPES: dict[str, type[Hyper]] = {
    "sgd": SGDHyper, "adam": AdamHyper, "lamb": LambHyper}
