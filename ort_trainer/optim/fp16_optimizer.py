"""``FP16_Optimizer``: DeepSpeed's and apex's fp16 optimizers with our multi-tensor gradient norm
and overflow checks (the original's module path, ``onnxruntime.training.optim.fp16_optimizer``).

Those libraries check overflow and take the gradient norm tensor by tensor (an op, and on CUDA
often a host sync, per tensor); ``_optimizers.multi_tensor`` does each in one multi-tensor op per
device and dtype. The checks are replaced on the optimizer itself, so the library's own ``step``
(and DeepSpeed's engine, which holds the optimizer) run them; everything else is the optimizer's.
"""
import types

import torch

from .._optimizers.multi_tensor import has_inf_or_nan, norms, scale_, total_norm

__all__ = ["FP16_Optimizer"]

_SUPPORTED = ("DeepSpeed's fp16 and ZeRO optimizers (deepspeed.initialize's optimizer with fp16 enabled, or at "
              "zero_optimization.stage 1, 2 or 3) "
              "and apex-style fp16 optimizers (fp16_groups, fp32_from_fp16_groups, loss_scaler, clip_master_grads: "
              "apex.fp16_utils.FP16_Optimizer)")


def _grads(params):
    return [p.grad for p in params if p.grad is not None]


# ------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO: the method names are DeepSpeed's (a patched method pickles by its name)
# ------------------------------------------------------------------------------------------------

class _ZeroStage1And2:
    """DeepSpeedZeroOptimizer (stages 1 and 2): the overflow checks and the L2 gradient norm of
    each param group's partition (DeepSpeed's own filters, all-reduces and -1 for inf/NaN)."""

    def has_overflow_serial(self, params):
        return has_inf_or_nan(_grads(params)).reshape(1)

    def has_overflow_partitioned_grads_serial(self):
        grads = [g for i in range(len(self.bit16_groups)) for g in (self.averaged_gradients[i] or ())
                 if g is not None]
        return has_inf_or_nan(grads).reshape(1)

    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
        from deepspeed import comm as dist
        from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
        kept = [g.data for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params)
                if not getattr(p, "ds_pipe_replicated", False)
                and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)]
        squares = norms(kept).pow(2).sum().float().to(self.device)
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=squares, op=dist.ReduceOp.SUM)
        norm = squares.pow(0.5)
        mask_nan_or_inf_with_val_inplace(norm, device=self.device)
        return norm


class _ZeroStage3:
    """DeepSpeedZeroOptimizer_Stage3: the serial overflow checks (its gradient norm, tied to its
    partition groups, stays DeepSpeed's)."""

    def has_overflow_serial(self, params, is_grad_list=False):
        return bool(has_inf_or_nan(_grads(params)))

    def has_overflow_partitioned_grads_serial(self):
        grads = [g for i in range(len(self.fp16_groups)) for g in (self.averaged_gradients[i] or ())
                 if g is not None]
        return bool(has_inf_or_nan(grads))


class _CheckOverflow:
    """The CheckOverflow of DeepSpeed's fp16 optimizers without ZeRO (FP16_Optimizer,
    FP16_UnfusedOptimizer): `has_overflow(params)` calls this one (their norms are DeepSpeed's
    module functions, left as they are)."""

    def has_overflow_serial(self, params):
        return bool(has_inf_or_nan(_grads(params)))


# ------------------------------------------------------------------------------------------------
# apex-style: fp16 model parameters, fp32 master copies in an inner optimizer, a loss scaler
# ------------------------------------------------------------------------------------------------

class _ApexScaler:
    """apex's DynamicLossScaler: `has_overflow(params)` calls this one."""

    def has_overflow_serial(self, params):
        return bool(has_inf_or_nan(_grads(params)))


class _Apex:
    """apex's `clip_master_grads`: torch's clip_grad_norm_ over the fp32 master gradients (-1 after
    an overflow); the norm accumulated in float64, the coefficient torch's."""

    def clip_master_grads(self, max_norm, norm_type=2):
        if self.overflow:
            return -1
        grads = _grads(p for group in self.optimizer.param_groups for p in group["params"])
        norm = total_norm(grads, float(norm_type)).float()
        scale_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm


# ------------------------------------------------------------------------------------------------
# which optimizer is which
# ------------------------------------------------------------------------------------------------

_DEEPSPEED = {  # (module, class) of DeepSpeed's optimizers -> (kind, patches, the attribute they patch or None)
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"):
        ("DeepSpeed ZeRO stage 1/2", _ZeroStage1And2, None),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"): ("DeepSpeed ZeRO stage 3", _ZeroStage3, None),
    ("deepspeed.runtime.fp16.fused_optimizer", "FP16_Optimizer"):
        ("DeepSpeed fp16", _CheckOverflow, "overflow_checker"),
    ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer"):
        ("DeepSpeed fp16", _CheckOverflow, "overflow_checker"),
}
_APEX_ATTRIBUTES = ("fp16_groups", "fp32_from_fp16_groups", "optimizer", "overflow", "loss_scaler",
                    "clip_master_grads")


def _patches(optimizer):
    """(kind, [(object, method name, function)]) for `optimizer`, or None when it is none we know."""
    for cls in type(optimizer).__mro__:
        known = _DEEPSPEED.get((cls.__module__, cls.__name__))
        if known is not None:
            kind, patches, attribute = known
            target = optimizer if attribute is None else getattr(optimizer, attribute)
            names = [name for name in vars(patches) if not name.startswith("_")]
            return kind, [(target, name, vars(patches)[name]) for name in names]
    if all(hasattr(optimizer, name) for name in _APEX_ATTRIBUTES):
        patches = [(optimizer, "clip_master_grads", _Apex.clip_master_grads)]
        if hasattr(optimizer.loss_scaler, "has_overflow_serial"):  # a static scaler never overflows
            patches.append((optimizer.loss_scaler, "has_overflow_serial", _ApexScaler.has_overflow_serial))
        return "apex-style", patches
    return None


class FP16_Optimizer:  # noqa: N801 (the original's name)
    """Wraps DeepSpeed's fp16 or ZeRO optimizer (stages 1, 2, 3) or an apex-style fp16 optimizer,
    replacing its gradient-norm and overflow checks with one multi-tensor op each; otherwise transparent
    (`step`, `zero_grad`, `state_dict`, `load_state_dict`, `param_groups` and every other
    attribute are the optimizer's).

        model, optimizer, _, _ = deepspeed.initialize(model=ORTModule(model), optimizer=optimizer,
                                                      config=config)
        optimizer = FP16_Optimizer(optimizer)

    The checks are replaced on `optimizer` itself, so DeepSpeed's engine (`model.step()`) runs
    them too. Replaced: DeepSpeed ZeRO 1/2 `has_overflow_serial`,
    `has_overflow_partitioned_grads_serial` and the L2 `get_grad_norm_direct`; ZeRO 3 the two
    overflow checks; fp16 without ZeRO its overflow checker's `has_overflow_serial`; apex-style
    `clip_master_grads` and the dynamic loss scaler's `has_overflow_serial`. Any other optimizer:
    TypeError naming its type and what is supported.
    `wrapped` is the optimizer, `kind` what it was taken for ('DeepSpeed ZeRO stage 1/2', ...).
    """

    def __init__(self, optimizer):
        if isinstance(optimizer, FP16_Optimizer):
            raise TypeError("FP16_Optimizer: optimizer is already an FP16_Optimizer; wrap the optimizer once")
        kind = type(optimizer)
        if kind.__module__.split(".")[0] == "megatron":
            raise TypeError(f"FP16_Optimizer: cannot wrap a {kind.__module__}.{kind.__qualname__}: Megatron-LM clips "
                            "the gradients over its model-parallel group, which FP16_Optimizer's norm does not; "
                            f"supported: {_SUPPORTED}")
        found = _patches(optimizer)
        if found is None:
            missing = [name for name in _APEX_ATTRIBUTES if not hasattr(optimizer, name)]
            raise TypeError(f"FP16_Optimizer: cannot wrap a {kind.__module__}.{kind.__qualname__} (an apex-style "
                            f"optimizer would have {missing}); supported: {_SUPPORTED}")
        kind, patches = found
        for target, name, function in patches:
            setattr(target, name, types.MethodType(function, target))
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "kind", kind)

    @property
    def wrapped(self):
        """The optimizer whose checks were replaced."""
        return self._optimizer

    def __getattr__(self, name):
        if name == "_optimizer":  # not set yet (a failed __init__, unpickling)
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def __setattr__(self, name, value):
        setattr(self._optimizer, name, value)

    def step(self, *args, **kwargs):
        return self._optimizer.step(*args, **kwargs)

    def zero_grad(self, *args, **kwargs):
        return self._optimizer.zero_grad(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self._optimizer.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._optimizer.load_state_dict(*args, **kwargs)

    def __repr__(self):
        return f"FP16_Optimizer({self._optimizer!r})"

