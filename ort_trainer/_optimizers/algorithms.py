"""Flat-buffer optimizers: SGD, Adam and Lamb over one contiguous fp32 parameter buffer.

Every trainable parameter lives in one flat buffer ``params``, its gradient at the same offset in
``grads`` (``_optimizers.flat.FlatLayout``). An optimizer validates its hyperparameters, holds the
algorithm's state (flat arrays in the same layout) and counts updates; the update itself is one
call to the functional step of the implementation its device names: ``_optimizers.cpu`` ('cpu',
NumPy buffers) or ``_optimizers.cuda_steps`` ('cuda', CuPy buffers). Both follow the same contract
(DESIGN.md, "Optimizers") and match the references of ``_optimizers.reference``.
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from . import cpu, cuda_steps
from .flat import FlatLayout
from .hyper import AdamHyper, Hyper, LambHyper, SGDHyper

#: A flat buffer: a NumPy array on the CPU, a CuPy array on CUDA (CuPy is optional: no type to name).
Array = Any
#: ZeRO's hook of Lamb's CPU step (``cpu.lamb_step``'s ``segment_sums``).
SegmentSums = Callable[[np.ndarray, np.ndarray], None]


def implementation_of(device: str, where: str) -> tuple[ModuleType, ModuleType]:
    """(module of functional steps, array module of its buffers) for ``device``."""
    if device == "cpu":
        return cpu, np
    if device == "cuda":
        return cuda_steps, cuda_steps.require_cupy()
    raise ValueError(f"{where}: device must be 'cpu' or 'cuda', got {device!r}")


def clip_divisor(grads: Array, max_norm: float, loss_scale: float = 1.0, device: str = "cpu",
                 buffers: cuda_steps.ClipBuffers | None = None) -> tuple[Any, Any]:
    """(S, N): the divisor that unscales and clips the gradients at once, and their global norm.

    ``_optimizers.reference.clip_divisor_from_norm`` on N = ||grads||_2. Python floats on the CPU;
    on CUDA 0-d device arrays (no host sync), S ready to pass to ``FlatOptimizer.step``, written
    into ``buffers`` (``_optimizers.cuda_steps.clip_buffers``) when given: the next call overwrites them.
    """
    implementation = implementation_of(device, "clip_divisor")[0]
    if device == "cpu" or buffers is None:
        return implementation.clip_divisor(grads, max_norm, loss_scale)
    return implementation.clip_divisor(grads, max_norm, loss_scale, out=buffers.out, partials=buffers.partials)


class FlatOptimizer:
    """Holds the flat state of one algorithm and applies its update.

    Args:
        layout: where tensors and param groups sit in the flat buffers; each group's ``hyper``
            is the algorithm's ``hyper_type`` (``typed_hypers``).
        device: 'cpu' or 'cuda' (the current CUDA device). The buffers given to ``step`` must be
            flat float32 arrays of the layout's size: NumPy on the CPU, CuPy on CUDA.
    """

    config_name: str  # the original's optimizer name, as in the configs
    family: str  # names the algorithm's layout table and step in each implementation
    state_names: tuple[str, ...]
    hyper_type: type[Hyper]

    def __init__(self, layout: FlatLayout, device: str = "cpu") -> None:
        implementation, xp = implementation_of(device, type(self).__name__)
        for index, group in enumerate(layout.groups):
            if not isinstance(group.hyper, self.hyper_type):
                raise TypeError(f"{self.config_name}: param group {index} has hyperparameters of type "
                                f"{type(group.hyper).__name__}, expected {self.hyper_type.__name__} (typed_hypers)")
            self._check_group(index, group.hyper)
        self.layout = layout
        self.device = device
        self.implementation = implementation
        self._xp = xp
        self.state = {name: xp.zeros(layout.size, dtype=xp.float32) for name in self.state_names}
        self._counters = None  # CUDA loss scaling: the device counters that count the updates
        self.step_count = 0
        self._table = implementation.layout_table(layout, self.family)

    def count_on_device(self, counters: Array) -> None:
        """Loss scaling on CUDA: from now on the updates are counted in ``counters``
        (``cuda_steps.device_counters``), where the kernels read t and the loss scaler's update counts
        the applied ones; reading ``step_count`` is then a host sync."""
        if self.device != "cuda":
            raise ValueError(f"{type(self).__name__}.count_on_device: the counters are device arrays; this optimizer "
                             f"runs on {self.device!r}")
        counters[0] = float(self.step_count)
        self._counters = counters

    @property
    def step_count(self) -> int:
        """The number of updates applied."""
        if self._counters is not None:
            return int(self._counters[0].get())
        return self._step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._step_count = int(value)
        if self._counters is not None:
            self._counters[0] = float(value)

    def _check_group(self, index: int, hyper: Any) -> None:
        """Rejects hyperparameter values the algorithm cannot run (``hyper`` is a ``hyper_type``)."""

    def step(self, params: Array, grads: Array, lr: float, grad_divisor: float | Array = 1.0,
             lr_table: Array | None = None) -> None:
        """In place: g = grads / grad_divisor, then the update. grads are not modified.

        ``grad_divisor`` is a number or, on CUDA, ``clip_divisor``'s S (read on the device; NaN
        skips the update). Counting on the device (``count_on_device``), the count is left to the
        loss scaler's update and ``lr_table`` (the lr of each update t at [t - 1], a device
        array) may replace ``lr``.
        """
        self._check_buffer("params", params)
        self._check_buffer("grads", grads)
        if self._counters is None:
            if lr_table is not None:
                raise ValueError(f"{type(self).__name__}.step: lr_table is indexed by the device update count: "
                                 "call count_on_device first")
            self._step(params, grads, lr=float(lr), grad_divisor=grad_divisor, lr_table=None)
            self._step_count += 1
        else:
            self._step(params, grads, lr=float(lr), grad_divisor=grad_divisor, lr_table=lr_table)

    def _step(self, params: Array, grads: Array, *, lr: float, grad_divisor: float | Array,
              lr_table: Array | None) -> None:
        """The implementation's step of this algorithm (the device counters, if any, are ``self._counters``)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """A snapshot: {'step_count': int, 'state': {name: copy of the flat array}}."""
        return {"step_count": self.step_count,
                "state": {name: array.copy() for name, array in self.state.items()}}

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restores a ``state_dict()``: validates everything first, so a bad one changes nothing."""
        prefix = f"{self.config_name}.load_state_dict"
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"step_count", "state"}:
            keys: object = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict)
            raise ValueError(f"{prefix}: expected keys ['state', 'step_count'], got {keys}")
        step_count = state_dict["step_count"]
        if (not isinstance(step_count, numbers.Integral) or isinstance(step_count, bool)
                or step_count < 0):
            raise ValueError(f"{prefix}: 'step_count' must be an int >= 0, got {step_count!r}")
        state = state_dict["state"]
        if not isinstance(state, Mapping) or set(state) != set(self.state_names):
            keys = sorted(state) if isinstance(state, Mapping) else type(state)
            raise ValueError(
                f"{prefix}: 'state' must have exactly the keys {sorted(self.state_names)}, "
                f"got {keys}")
        expected = f"float32 array of shape ({self.layout.size},)"
        for name in self.state_names:
            value = state[name]
            shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
            if shape != (self.layout.size,) or dtype != np.float32:
                got = f"{dtype} array of shape {shape}" if shape is not None else type(value)
                raise ValueError(f"{prefix}: state['{name}'] must be a {expected}, got {got}")
        for name in self.state_names:
            self._xp.copyto(self.state[name], self._xp.asarray(state[name]))
        self.step_count = int(step_count)

    def _check_buffer(self, name, array):
        if (not isinstance(array, self._xp.ndarray) or array.dtype != np.float32
                or array.shape != (self.layout.size,) or not array.flags.c_contiguous):
            description = (f"{type(array).__module__}.{type(array).__name__} {array.dtype} "
                           f"{array.shape}" if hasattr(array, "shape") else repr(type(array)))
            raise ValueError(
                f"{type(self).__name__}.step: {name} must be a contiguous "
                f"{self._xp.__name__}.float32 array of shape ({self.layout.size},), "
                f"got {description}")


class SGD(FlatOptimizer):
    """torch.optim.SGD (momentum, dampening, nesterov, L2 weight decay ``lambda_coef``).

    The original SGDOptimizer is the case momentum = lambda_coef = 0.
    """

    config_name = "SGDOptimizer"
    family = "sgd"
    state_names = ("momentum",)
    hyper_type = SGDHyper

    def _step(self, params, grads, *, lr, grad_divisor, lr_table):
        self.implementation.sgd_step(self._table, params, grads, self.state["momentum"], lr=lr,
                                      grad_divisor=grad_divisor, first_step=self._step_count == 0,
                                      counters=self._counters, lr_table=lr_table)


class Adam(FlatOptimizer):
    """The original AdamOptimizer (see ``_optimizers.reference.adam_reference``)."""

    config_name = "AdamOptimizer"
    family = "adam"
    state_names = ("exp_avg", "exp_avg_sq")
    hyper_type = AdamHyper

    def _check_group(self, index: int, hyper: AdamHyper) -> None:
        if hyper.weight_decay_mode not in (0, 1):
            raise ValueError(
                f"{self.config_name}: param group {index}: weight_decay_mode must be 0 or 1, "
                f"got {hyper.weight_decay_mode!r}")

    def _step(self, params, grads, *, lr, grad_divisor, lr_table):
        self.implementation.adam_step(self._table, params, grads, self.state["exp_avg"],
                                       self.state["exp_avg_sq"], step=self._step_count + 1, lr=lr,
                                       grad_divisor=grad_divisor, counters=self._counters, lr_table=lr_table)


class Lamb(FlatOptimizer):
    """The original LambOptimizer (see ``_optimizers.reference.lamb_reference``).

    Args (besides ``FlatOptimizer``'s):
        segment_sums: ZeRO's hook (CPU only; ``_optimizers.cpu.lamb_step``): completes this
            shard's per-tensor sums of squares into the whole tensors' before the trust ratios.
    """

    config_name = "LambOptimizer"
    family = "lamb"
    state_names = ("exp_avg", "exp_avg_sq")
    hyper_type = LambHyper

    def __init__(self, layout: FlatLayout, device: str = "cpu", *, segment_sums: SegmentSums | None = None) -> None:
        if segment_sums is not None and device == "cuda":
            raise ValueError(f"Lamb: segment_sums (ZeRO's per-tensor sums over the shards) runs on the CPU only, "
                             f"got device={device!r}")
        super().__init__(layout, device)
        self._segment_sums = segment_sums

    def _step(self, params, grads, *, lr, grad_divisor, lr_table):
        self.implementation.lamb_step(self._table, params, grads, self.state["exp_avg"],
                                       self.state["exp_avg_sq"], step=self._step_count + 1, lr=lr,
                                       grad_divisor=grad_divisor, segment_sums=self._segment_sums,
                                       counters=self._counters, lr_table=lr_table)


_ALGORITHMS = {cls.config_name: cls for cls in (SGD, Adam, Lamb)}


def _algorithm(config_name: str, where: str) -> type[FlatOptimizer]:
    if config_name not in _ALGORITHMS:
        raise ValueError(f"{where}: config_name must be one of {sorted(_ALGORITHMS)}, "
                         f"got {config_name!r}")
    return _ALGORITHMS[config_name]


def make_optimizer(config_name: str, layout: FlatLayout, device: str = "cpu") -> FlatOptimizer:
    """The flat optimizer for an optimizer config's ``name`` ('SGDOptimizer', ...) on ``device``."""
    return _algorithm(config_name, "make_optimizer")(layout, device)


def typed_hypers(config_name: str, hypers: Sequence[Mapping[str, Any]]) -> tuple[Hyper, ...]:
    """The hyperparameters of each param group (validated dicts of ORT's names, as a config resolves
    them) as the algorithm's ``hyper_type``, for ``FlatLayout``: built once, read by attribute."""
    hyper_type = _algorithm(config_name, "typed_hypers").hyper_type
    names = {field.name for field in dataclasses.fields(hyper_type)}
    for index, hyper in enumerate(hypers):
        missing, unexpected = sorted(names - hyper.keys()), sorted(hyper.keys() - names)
        if missing or unexpected:
            raise ValueError(
                f"{config_name}: param group {index} must have exactly the "
                f"hyperparameters {sorted(names)}; missing {missing}, "
                f"unexpected {unexpected}")
    return tuple(hyper_type(**hyper) for hyper in hypers)


def state_names(config_name: str) -> tuple[str, ...]:
    """The names of the flat state arrays of an optimizer config's algorithm (what a checkpoint's
    optimizer state holds per parameter)."""
    return _algorithm(config_name, "state_names").state_names
