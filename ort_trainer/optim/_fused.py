"""``FusedAdam`` and ``FusedLamb``: ``torch.optim.Optimizer``s with apex's names, defaults and math,
run by the flat-buffer implementations the trainer uses (``_optimizers.cpu``, ``_optimizers.cuda_steps``).

Why flat: one call updates every parameter (one CUDA launch per phase, cache-sized blocks on the
CPU), and Lamb's per-tensor trust ratio comes from the segment table. PyTorch has no Lamb; apex's
needs a CUDA build. The parameters stay the user's tensors: their ``.data`` becomes a view of one
fp32 buffer, and the per-parameter state (``step``, ``exp_avg``, ``exp_avg_sq``) is made of views
of the flat state, so ``state_dict()`` has the layout of ``torch.optim.Adam``'s.

Gradients are copied into a private flat buffer each step (after ``zero_grad(set_to_none=True)``
backward allocates fresh ones, so a copy is needed anyway; private, it may take Adam's L2 term).
A parameter whose ``grad`` is None is skipped and its step count not advanced, as in torch.optim:
each call into the implementation covers a run of consecutive parameters that have a gradient
and share their step count and learning rate (one run, the whole buffer, in the usual case).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .._optimizers.hyper import AdamHyper, LambHyper
from ._fused_base import FusedOptimizer, check_bool, check_real

__all__ = ["FusedAdam", "FusedLamb"]


class FusedAdam(FusedOptimizer):
    """Adam over flat buffers, with the arguments and math of apex's ``FusedAdam``.

    ``adam_w_mode=True`` (default) is ``torch.optim.AdamW`` (decoupled decay); ``False`` is
    ``torch.optim.Adam`` (L2: ``g + weight_decay * w``, added to a private copy of the gradient).
    ``bias_correction=False`` drops ``1 - beta**t``. CPU: torch's fused CPU kernels over the flat
    buffer; CUDA: one kernel launch (CuPy). ``amsgrad=True`` is refused, as by apex. Differences
    from apex: fp32 parameters only; the step count is per parameter (``torch.optim.Adam``'s), not
    per group, which only matters for parameters that miss gradients.

    ``state_dict()`` loads into ``torch.optim.AdamW`` (``Adam`` with ``adam_w_mode=False``) and
    theirs into this: per parameter ``step``, ``exp_avg``, ``exp_avg_sq``; each group carries
    ``decoupled_weight_decay`` for torch.
    """

    _family = "adam"

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
        check_bool("FusedAdam", "adam_w_mode", adam_w_mode)
        check_bool("FusedAdam", "amsgrad", amsgrad)
        if amsgrad:
            raise ValueError("FusedAdam: amsgrad=True is not supported (nor is it by apex's "
                             "FusedAdam)")
        self.adam_w_mode = adam_w_mode
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults, set_grad_none)

    def _check_group(self, index, group):
        super()._check_group(index, group)
        decoupled = group.get("decoupled_weight_decay", self.adam_w_mode)
        if decoupled != self.adam_w_mode:
            raise ValueError(
                f"FusedAdam: param group {index}: decoupled_weight_decay={decoupled!r} (from "
                f"torch.optim.{'AdamW' if decoupled else 'Adam'}) needs "
                f"FusedAdam(adam_w_mode={decoupled!r}), this one has adam_w_mode={self.adam_w_mode!r}")

    def _flat_hyper(self, group):
        beta1, beta2 = group["betas"]
        return AdamHyper(alpha=float(beta1), beta=float(beta2), epsilon=float(group["eps"]),
                         lambda_coef=float(group["weight_decay"]) if self.adam_w_mode else 0.0,
                         do_bias_correction=group["bias_correction"], weight_decay_mode=0)

    def state_dict(self):
        """torch.optim's, each group with ``decoupled_weight_decay`` = ``adam_w_mode``: without it
        torch.optim.AdamW would load the groups as L2 Adam."""
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            group["decoupled_weight_decay"] = self.adam_w_mode
        return state_dict

    def _update(self, store, lo, hi, table, part, *, step, lr, context):
        grads, params = store.tensors["grads"], store.tensors["params"]
        if not self.adam_w_mode:  # L2: g += weight_decay * w, in the private gradient copy
            for group, a, b in store.group_spans(lo, hi):
                decay = float(self.param_groups[group]["weight_decay"])
                if decay:
                    span = slice(int(store.offsets[a]), int(store.offsets[b]))
                    grads[span].add_(params[span], alpha=decay)
        arrays = store.arrays
        store.implementation.adam_step(
            table, arrays["params"][part], arrays["grads"][part], arrays["exp_avg"][part],
            arrays["exp_avg_sq"][part], step=step, lr=lr)


class FusedLamb(FusedOptimizer):
    """LAMB over flat buffers, with the arguments and math of apex's ``FusedLAMB``.

    Gradients are divided by ``max(1, ||g|| / max_grad_norm)`` (global norm over every gradient);
    then Adam's direction plus ``weight_decay * w``, and the per-tensor trust ratio
    ``||w|| / ||d||`` (1 where either is 0), applied only to groups with ``weight_decay != 0``
    unless ``use_nvlamb``. ``grad_averaging`` scales the gradient's share of ``exp_avg`` by
    ``1 - beta1``. ``max_grad_norm`` may be ``math.inf`` (no clipping) and must be the same in
    every group (the norm is global).

    Differences from apex: fp32 parameters only; ``adam_w_mode=False`` and
    ``grad_averaging=False`` are refused (the flat implementations do not have them); the step
    count is per parameter, as in torch.optim, not per group; where the direction or the new
    weight is not finite, the moments or the weight keep their old values (ORT's LambOptimizer
    rules) instead of propagating NaN.
    """

    _family = "lamb"

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
                 set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False):
        for name, value in (("amsgrad", amsgrad), ("adam_w_mode", adam_w_mode),
                            ("use_nvlamb", use_nvlamb)):
            check_bool("FusedLamb", name, value)
        if amsgrad:
            raise ValueError("FusedLamb: amsgrad=True is not supported (nor is it by apex's "
                             "FusedLAMB)")
        if not adam_w_mode:
            raise ValueError("FusedLamb: adam_w_mode=False (L2 decay inside the moments) is not "
                             "supported: only decoupled weight decay, adam_w_mode=True")
        self.adam_w_mode = adam_w_mode
        self.use_nvlamb = use_nvlamb
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, set_grad_none)

    def _check_group(self, index, group):
        super()._check_group(index, group)
        where = f"FusedLamb: param group {index}"
        check_bool(where, "grad_averaging", group["grad_averaging"])
        if not group["grad_averaging"]:
            raise ValueError(f"{where}: grad_averaging=False is not supported: exp_avg always "
                             f"takes (1 - beta1) * g")
        check_real(where, "max_grad_norm", group["max_grad_norm"], 0.0, above=True)

    def _check_groups(self, groups):
        super()._check_groups(groups)
        norms = [group["max_grad_norm"] for group in groups]
        if len(set(norms)) > 1:
            raise ValueError(f"FusedLamb: every param group must have the same max_grad_norm (the "
                             f"gradient norm is global), got {norms}")

    def _flat_hyper(self, group):
        beta1, beta2 = group["betas"]
        decay = float(group["weight_decay"])
        ratio_min, ratio_max = (0.0, math.inf) if self.use_nvlamb or decay else (1.0, 1.0)
        return LambHyper(alpha=float(beta1), beta=float(beta2), epsilon=float(group["eps"]),
                         lambda_coef=decay, ratio_min=ratio_min, ratio_max=ratio_max,
                         do_bias_correction=group["bias_correction"])

    def _prepare(self, store, present):
        """The clip divisor: the norm counts the gradients of this step only."""
        if not present.all():
            torch._foreach_zero_([store.views["grads"][i] for i in np.flatnonzero(~present)])
        divisor, _ = store.implementation.clip_divisor(store.arrays["grads"],
                                                       float(self.param_groups[0]["max_grad_norm"]))
        return divisor

    def _update(self, store, lo, hi, table, part, *, step, lr, context):
        arrays = store.arrays
        store.implementation.lamb_step(
            table, arrays["params"][part], arrays["grads"][part], arrays["exp_avg"][part],
            arrays["exp_avg_sq"][part], step=step, lr=lr, grad_divisor=context)
