"""Flat-buffer optimizers: SGD, Adam and Lamb over one contiguous fp32 parameter buffer.

Every trainable parameter lives in one flat buffer ``params``, its gradient at the same offset in
``grads`` (see ``FlatLayout``). An optimizer updates all of them in one pass per param group.

Three layers, each checked against the one above it:

* ``sgd_reference``, ``adam_reference``, ``lamb_reference``: the update rules of the original
  ORTTrainer written out plainly in NumPy (any float dtype, temporaries allowed). They document
  the math and are the oracle for everything else.
* The CPU fast path (``FlatOptimizer.step`` on NumPy buffers): torch's multi-threaded CPU kernels
  on zero-copy ``torch.from_numpy`` views, fused where torch has a fused kernel whose math is the
  original's (``torch._fused_sgd_``; ``torch._fused_adamw_`` for Adam mode 0 with bias
  correction), in-place ops elsewhere, run block by block so that the intermediates stay in
  cache (see ``_BLOCK``). Nothing is allocated per step but block-sized scratch; ``grads`` is
  never written.
* The CuPy path (``xp=cupy``): delegates to ``ort_trainer._kernels`` (imported lazily):

  - ``layout_table(layout: FlatLayout, family: str) -> table``: built once per optimizer;
    ``family`` is ``'sgd'``, ``'adam'`` or ``'lamb'``; ``table`` is opaque here (the group
    ranges, segment offsets and hyperparameters on the device).
  - ``sgd_step(table, params, grads, momentum, *, lr: float, grad_divisor, first_step: bool)``
  - ``adam_step(table, params, grads, exp_avg, exp_avg_sq, *, step: int, lr: float, grad_divisor)``
  - ``lamb_step(table, params, grads, exp_avg, exp_avg_sq, *, step: int, lr: float, grad_divisor)``
  - ``sum_of_squares(grads) -> 0-d cupy array`` (used by ``global_grad_norm``).
  - ``clip_divisor(grads, max_norm, loss_scale) -> (S, N)``, 0-d cupy arrays, same rule as
    ``clip_divisor`` here.

  Arrays are flat cupy float32 arrays of the layout's size; ``step`` is the 1-based update index
  t; ``grad_divisor`` is a Python float or a 0-d cupy array (from ``clip_divisor``, so that no
  host sync is needed). Each call updates ``params`` and the state in place, never ``grads``, and
  must match the reference of its algorithm.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

# ----------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSlice:
    """One param group: a contiguous range of the flat buffer, made of whole segments (tensors)."""

    start: int  # first element of the group in the flat buffer
    stop: int  # one past the last element
    seg_start: int  # index of the group's first segment (tensor)
    seg_stop: int  # one past its last segment
    hyper: Mapping[str, float | int | bool]  # the group's hyperparameters, read-only

    def __post_init__(self):
        object.__setattr__(self, "hyper", MappingProxyType(dict(self.hyper)))


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor and each param group sits in the flat buffers. Validated on creation."""

    seg_offsets: np.ndarray  # int64, shape (nseg + 1,), [0] == 0, [-1] == N, strictly increasing
    groups: tuple[GroupSlice, ...]  # contiguous, in order, covering [0, N)

    def __post_init__(self):
        offsets = np.array(self.seg_offsets, dtype=np.int64)  # a private copy, made read-only
        offsets.setflags(write=False)
        object.__setattr__(self, "seg_offsets", offsets)
        object.__setattr__(self, "groups", tuple(self.groups))
        if offsets.ndim != 1 or offsets.size < 2 or offsets[0] != 0:
            raise ValueError(
                f"FlatLayout.seg_offsets must be 1-D, start at 0 and hold at least one segment, "
                f"got {offsets!r}")
        if np.any(np.diff(offsets) <= 0):
            bad = int(np.argmax(np.diff(offsets) <= 0))
            raise ValueError(
                f"FlatLayout.seg_offsets must be strictly increasing (no empty tensor), "
                f"got {offsets[bad]} then {offsets[bad + 1]} at index {bad}")
        if not self.groups:
            raise ValueError("FlatLayout.groups must hold at least one group, got none")
        expected_seg_start = 0
        for index, group in enumerate(self.groups):
            if group.seg_start != expected_seg_start or group.seg_stop <= group.seg_start:
                raise ValueError(
                    f"FlatLayout.groups[{index}] must cover segments [{expected_seg_start}, k) "
                    f"with k > {expected_seg_start}, got [{group.seg_start}, {group.seg_stop})")
            if group.seg_stop >= offsets.size:
                raise ValueError(
                    f"FlatLayout.groups[{index}].seg_stop must be <= {offsets.size - 1} "
                    f"(the number of segments), got {group.seg_stop}")
            expected = (int(offsets[group.seg_start]), int(offsets[group.seg_stop]))
            if (group.start, group.stop) != expected:
                raise ValueError(
                    f"FlatLayout.groups[{index}] must span elements [{expected[0]}, {expected[1]}) "
                    f"(its segments), got [{group.start}, {group.stop})")
            expected_seg_start = group.seg_stop
        if expected_seg_start != offsets.size - 1:
            raise ValueError(
                f"FlatLayout.groups must cover all {offsets.size - 1} segments, "
                f"they stop at segment {expected_seg_start}")

    @classmethod
    def from_sizes(cls, sizes_per_group: Sequence[Sequence[int]],
                   hypers: Sequence[Mapping]) -> FlatLayout:
        """Lays tensors out in the order given: group after group, tensor after tensor.

        Args:
            sizes_per_group: for each param group, the element count of each of its tensors.
            hypers: for each param group, its hyperparameters.
        """
        if len(sizes_per_group) != len(hypers):
            raise ValueError(
                f"FlatLayout.from_sizes needs one hyperparameter dict per group: got "
                f"{len(sizes_per_group)} groups and {len(hypers)} dicts")
        for group_index, sizes in enumerate(sizes_per_group):
            if len(sizes) == 0:
                raise ValueError(f"sizes_per_group[{group_index}] must list at least one tensor, "
                                 f"got none")
            for tensor_index, size in enumerate(sizes):
                if not isinstance(size, numbers.Integral) or isinstance(size, bool) or size < 1:
                    raise ValueError(
                        f"sizes_per_group[{group_index}][{tensor_index}] must be an int >= 1, "
                        f"got {size!r}")
        all_sizes = [int(size) for sizes in sizes_per_group for size in sizes]
        offsets = np.concatenate([[0], np.cumsum(all_sizes, dtype=np.int64)])
        groups, seg_start = [], 0
        for sizes, hyper in zip(sizes_per_group, hypers):
            seg_stop = seg_start + len(sizes)
            groups.append(GroupSlice(int(offsets[seg_start]), int(offsets[seg_stop]),
                                     seg_start, seg_stop, hyper))
            seg_start = seg_stop
        return cls(offsets, tuple(groups))

    @property
    def size(self) -> int:
        """N, the number of elements of the flat buffers."""
        return int(self.seg_offsets[-1])

    def local_offsets(self, group: GroupSlice) -> np.ndarray:
        """The group's segment offsets relative to its start: [0, ..., group.stop - group.start]."""
        return self.seg_offsets[group.seg_start:group.seg_stop + 1] - group.start


# ----------------------------------------------------------------------------------------------
# Gradient norm and clipping
# ----------------------------------------------------------------------------------------------

_NORM_BLOCK = 256


def _is_cupy(xp) -> bool:
    return getattr(xp, "__name__", None) == "cupy"


def _array_module(array):
    """numpy, or cupy for a cupy array (cupy is imported only then)."""
    if type(array).__module__.startswith("cupy"):
        import cupy
        return cupy
    return np


def global_grad_norm(grads):
    """||grads||_2. A Python float for NumPy; a 0-d device array for CuPy (no host sync).

    On NumPy: fp32 partial sums over blocks of 256 elements (one einsum, no temporary), added up
    in float64. Measured on 12M elements: relative error 2e-9 (random) to 8e-7 (all equal) in
    2 ms; a fully float64 sum takes 8 ms, and np.dot in fp32 is off by 1e-4 to 1e-3.
    """
    if _array_module(grads) is not np:
        from . import _kernels
        return _array_module(grads).sqrt(_kernels.sum_of_squares(grads))
    grads = np.ravel(grads)
    body = grads.size - grads.size % _NORM_BLOCK
    blocks = grads[:body].reshape(-1, _NORM_BLOCK)
    tail = grads[body:].astype(np.float64)
    sum_of_squares = np.einsum("ij,ij->i", blocks, blocks).sum(dtype=np.float64) + tail @ tail
    return math.sqrt(sum_of_squares)


def clip_divisor(grads, max_norm: float, loss_scale: float = 1.0):
    """The divisor S that unscales and clips the gradients at once, as the original's graph did.

    S = loss_scale; N = ||grads||_2; if N > S * max_norm: S = N / max_norm (no epsilon, unlike
    torch.nn.utils.clip_grad_norm_, which divides by N + 1e-6). The optimizer then uses grads / S.

    Returns:
        (S, N): Python floats for NumPy; 0-d device arrays for CuPy (no host sync).
    """
    if not max_norm > 0:
        raise ValueError(f"clip_divisor: max_norm must be > 0, got {max_norm!r}")
    if _array_module(grads) is not np:
        from . import _kernels
        return _kernels.clip_divisor(grads, max_norm, loss_scale)
    norm = global_grad_norm(grads)
    divisor = norm / max_norm if norm > loss_scale * max_norm else float(loss_scale)
    return divisor, norm


# ----------------------------------------------------------------------------------------------
# References: one param group, in place, plain NumPy (the dtype of the arrays given)
# ----------------------------------------------------------------------------------------------


def sgd_reference(params, grads, momentum_buf, step: int, lr: float, hyper: Mapping,
                  grad_divisor: float = 1.0) -> None:
    """torch.optim.SGD's update; ``step`` is the 1-based update index (the buffer starts at g)."""
    g = grads / grad_divisor
    if hyper["lambda_coef"]:
        g = g + hyper["lambda_coef"] * params
    momentum = hyper["momentum"]
    if momentum:
        if step == 1:
            momentum_buf[...] = g
        else:
            momentum_buf[...] = momentum * momentum_buf + (1 - hyper["dampening"]) * g
        g = g + momentum * momentum_buf if hyper["nesterov"] else momentum_buf
    params -= lr * g


def adam_reference(params, grads, exp_avg, exp_avg_sq, step: int, lr: float, hyper: Mapping,
                   grad_divisor: float = 1.0) -> None:
    """The original AdamOptimizer; ``step`` is t, starting at 1.

    weight_decay_mode 0 ("PyTorch AdamW"): torch.optim.Adam for lambda 0, torch.optim.AdamW with
    weight_decay=lambda otherwise. weight_decay_mode 1 ("HuggingFace"): epsilon is added to the
    uncorrected sqrt(v), and the decay applies to the already-updated weight.
    """
    alpha, beta = hyper["alpha"], hyper["beta"]
    decay, eps = hyper["lambda_coef"], hyper["epsilon"]
    g = grads / grad_divisor
    exp_avg[...] = alpha * exp_avg + (1 - alpha) * g
    exp_avg_sq[...] = beta * exp_avg_sq + (1 - beta) * g * g
    if hyper["do_bias_correction"]:
        c1, c2 = 1 - alpha**step, 1 - beta**step
    else:
        c1 = c2 = 1.0
    if hyper["weight_decay_mode"] == 0:
        params -= lr * ((exp_avg / c1) / (np.sqrt(exp_avg_sq / c2) + eps) + decay * params)
    else:
        step_size = lr * math.sqrt(c2) / c1
        params -= step_size * exp_avg / (np.sqrt(exp_avg_sq) + eps)
        params -= lr * decay * params


def lamb_reference(params, grads, exp_avg, exp_avg_sq, step: int, lr: float, hyper: Mapping,
                   grad_divisor: float = 1.0, *, seg_offsets) -> None:
    """The original LambOptimizer; ``step`` is t, starting at 1.

    ``seg_offsets`` are the group's tensor boundaries relative to the group's start
    (``FlatLayout.local_offsets``): the trust ratio is per tensor. Non-finite values follow the
    original kernels: where the direction d is not finite, d = 0 and the moments keep their old
    values; where the new weight is not finite, the weight keeps its old value.
    """
    alpha, beta = hyper["alpha"], hyper["beta"]
    decay, eps = hyper["lambda_coef"], hyper["epsilon"]
    if hyper["do_bias_correction"]:
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
        ratio = _trust_ratio(np.add.reduceat(np.square(params, dtype=np.float64), starts),
                             np.add.reduceat(np.square(direction, dtype=np.float64), starts),
                             hyper["ratio_min"], hyper["ratio_max"])
        new_params = params - (lr * np.repeat(ratio, sizes)).astype(params.dtype) * direction
        params[...] = np.where(np.isfinite(new_params), new_params, params)


def _trust_ratio(params_sumsq, direction_sumsq, ratio_min, ratio_max):
    """Per tensor: clamp(||w|| / ||d||, ratio_min, ratio_max), and 1 where either norm is 0.

    Takes squared norms. Clamps as the original did (max(ratio_min, min(ratio_max, x))), so
    ratio_min wins if the bounds cross.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.sqrt(np.asarray(params_sumsq, np.float64) / direction_sumsq)
    ratio = np.maximum(ratio_min, np.minimum(ratio_max, ratio))
    return np.where((params_sumsq == 0) | (direction_sumsq == 0), 1.0, ratio)


# ----------------------------------------------------------------------------------------------
# Optimizers over the flat buffers
# ----------------------------------------------------------------------------------------------

# The CPU path works block by block: every op of an update runs on one block of 2**18 elements
# (1 MiB per fp32 array) before moving on, so a block's arrays stay in cache and each buffer
# crosses the memory bus about once per step. Measured on 12M parameters, cold cache, Adam with a
# gradient divisor: 24 ms with whole-buffer ops, 9.5 ms in blocks (7.3 ms with no divisor).
_BLOCK = 1 << 18


def _block_ranges(group: GroupSlice):
    """(start, stop) of each block of the group, in flat-buffer elements."""
    return [(start, min(start + _BLOCK, group.stop)) for start in range(group.start, group.stop,
                                                                        _BLOCK)]


class FlatOptimizer:
    """Holds the flat state of one algorithm and applies its update group by group.

    Args:
        layout: where tensors and param groups sit in the flat buffers; each group's ``hyper``
            must hold exactly the algorithm's ``hyper_names``.
        xp: ``numpy`` (CPU fast path) or ``cupy`` (``_kernels``). The buffers given to ``step``
            must be flat float32 arrays of that module, of the layout's size.
    """

    config_name: str  # the original's optimizer name, as in the configs
    family: str  # the kernel family in _kernels
    state_names: tuple[str, ...]
    hyper_names: frozenset[str]

    def __init__(self, layout: FlatLayout, xp=np):
        if xp is not np and not _is_cupy(xp):
            raise ValueError(f"{type(self).__name__}: xp must be numpy or cupy, got {xp!r}")
        for index, group in enumerate(layout.groups):
            missing = sorted(self.hyper_names - group.hyper.keys())
            unexpected = sorted(group.hyper.keys() - self.hyper_names)
            if missing or unexpected:
                raise ValueError(
                    f"{self.config_name}: param group {index} must have exactly the "
                    f"hyperparameters {sorted(self.hyper_names)}; missing {missing}, "
                    f"unexpected {unexpected}")
        self.layout = layout
        self._xp = xp
        self.state = {name: xp.zeros(layout.size, dtype=xp.float32) for name in self.state_names}
        self.step_count = 0
        self._block_buffers: list[torch.Tensor] = []
        self._device_table = None
        if _is_cupy(xp):
            from . import _kernels
            self._device_table = _kernels.layout_table(layout, self.family)

    def step(self, params, grads, lr: float, grad_divisor=1.0) -> None:
        """In place: g = grads / grad_divisor, then the update. grads are not modified."""
        self._check_buffer("params", params)
        self._check_buffer("grads", grads)
        if self._device_table is not None:
            self._device_step(params, grads, float(lr), grad_divisor)
        else:
            flat = [torch.from_numpy(array) for array in (params, grads, *self.state.values())]
            self._cpu_step(flat, float(lr), float(grad_divisor))
        self.step_count += 1

    def _cpu_step(self, flat, lr, grad_divisor):
        for index, group in enumerate(self.layout.groups):
            self._cpu_group_step(index, group, flat, lr, grad_divisor)

    def state_dict(self) -> dict:
        """A snapshot: {'step_count': int, 'state': {name: copy of the flat array}}."""
        return {"step_count": self.step_count,
                "state": {name: array.copy() for name, array in self.state.items()}}

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restores a ``state_dict()``: validates everything first, so a bad one changes nothing."""
        prefix = f"{self.config_name}.load_state_dict"
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"step_count", "state"}:
            keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict)
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

    def _block_buffer(self, index: int, size: int) -> torch.Tensor:
        """The first ``size`` elements of the index-th block-sized scratch buffer."""
        while len(self._block_buffers) <= index:
            self._block_buffers.append(torch.empty(_BLOCK, dtype=torch.float32))
        return self._block_buffers[index][:size]

    def _unscaled(self, grads, grad_divisor):
        """grads / grad_divisor for one block, in block buffer 0 unless the divisor is 1.

        Not torch's fused ``grad_scale``: it writes the unscaled gradient back into grads.
        """
        if grad_divisor == 1.0:
            return grads
        return torch.div(grads, grad_divisor, out=self._block_buffer(0, grads.numel()))

    def _cpu_group_step(self, index, group, flat, lr, grad_divisor):
        """Elementwise algorithms: ``_cpu_block_step`` on torch views of each block.

        A lone fused kernel reads each buffer once anyway: it gets the whole group in one call
        (saves ~0.6 ms of per-call overhead on 12M parameters), unless grads need unscaling.
        """
        if grad_divisor == 1.0 and self._is_one_fused_kernel(group.hyper):
            ranges = [(group.start, group.stop)]
        else:
            ranges = _block_ranges(group)
        for start, stop in ranges:
            params, grads, *state = (tensor[start:stop] for tensor in flat)
            self._cpu_block_step(group.hyper, params, self._unscaled(grads, grad_divisor), *state,
                                 lr=lr)

    def _is_one_fused_kernel(self, hyper) -> bool:
        """Whether ``_cpu_block_step`` is one fused torch kernel for these hyperparameters."""
        return False

    def _cpu_block_step(self, hyper, params, grads, *state, lr):
        raise NotImplementedError

    def _device_step(self, params, grads, lr, grad_divisor):
        raise NotImplementedError


class SGD(FlatOptimizer):
    """torch.optim.SGD (momentum, dampening, nesterov, L2 weight decay ``lambda_coef``).

    The original SGDOptimizer is the case momentum = lambda_coef = 0. The CPU path is torch's
    fused SGD kernel.
    """

    config_name = "SGDOptimizer"
    family = "sgd"
    state_names = ("momentum",)
    hyper_names = frozenset({"momentum", "nesterov", "lambda_coef", "dampening"})

    def _is_one_fused_kernel(self, hyper) -> bool:
        return True

    def _cpu_block_step(self, hyper, params, grads, momentum_buf, *, lr):
        momentum = hyper["momentum"]
        torch._fused_sgd_(
            [params], [grads], [momentum_buf] if momentum else [],
            weight_decay=hyper["lambda_coef"], momentum=momentum, lr=lr,
            dampening=hyper["dampening"], nesterov=bool(momentum and hyper["nesterov"]),
            maximize=False, is_first_step=self.step_count == 0)

    def _device_step(self, params, grads, lr, grad_divisor):
        from . import _kernels
        _kernels.sgd_step(self._device_table, params, grads, self.state["momentum"], lr=lr,
                          grad_divisor=grad_divisor, first_step=self.step_count == 0)


class Adam(FlatOptimizer):
    """The original AdamOptimizer (see ``adam_reference``).

    Mode 0 with bias correction (the default) runs torch's fused CPU AdamW kernel, whose math is
    the original's (epsilon after the corrected sqrt(v), decay lr*lambda*w on the old weight).
    Other groups run in-place torch ops.
    """

    config_name = "AdamOptimizer"
    family = "adam"
    state_names = ("exp_avg", "exp_avg_sq")
    hyper_names = frozenset({"alpha", "beta", "lambda_coef", "epsilon", "do_bias_correction",
                             "weight_decay_mode"})

    def __init__(self, layout: FlatLayout, xp=np):
        super().__init__(layout, xp)
        for index, group in enumerate(layout.groups):
            if group.hyper["weight_decay_mode"] not in (0, 1):
                raise ValueError(
                    f"{self.config_name}: param group {index}: weight_decay_mode must be 0 or 1, "
                    f"got {group.hyper['weight_decay_mode']!r}")
        self._step_tensor = torch.zeros((), dtype=torch.float32)  # t, as the fused kernel reads it

    def _is_one_fused_kernel(self, hyper) -> bool:
        return hyper["weight_decay_mode"] == 0 and bool(hyper["do_bias_correction"])

    def _cpu_block_step(self, hyper, params, grads, exp_avg, exp_avg_sq, *, lr):
        t = self.step_count + 1
        if self._is_one_fused_kernel(hyper):
            self._step_tensor.fill_(t)
            torch._fused_adamw_(
                [params], [grads], [exp_avg], [exp_avg_sq], [], [self._step_tensor],
                lr=lr, beta1=hyper["alpha"], beta2=hyper["beta"],
                weight_decay=hyper["lambda_coef"], eps=hyper["epsilon"],
                amsgrad=False, maximize=False)
            return
        alpha, beta = hyper["alpha"], hyper["beta"]
        decay, eps = hyper["lambda_coef"], hyper["epsilon"]
        c1, c2 = (1 - alpha**t, 1 - beta**t) if hyper["do_bias_correction"] else (1.0, 1.0)
        exp_avg.lerp_(grads, 1 - alpha)  # alpha*m + (1-alpha)*g in one op
        exp_avg_sq.mul_(beta).addcmul_(grads, grads, value=1 - beta)
        denom = torch.sqrt(exp_avg_sq, out=self._block_buffer(1, params.numel()))
        if hyper["weight_decay_mode"] == 0:
            if c2 != 1.0:
                denom.mul_(1 / math.sqrt(c2))
            denom.add_(eps)  # sqrt(v/c2) + eps
            if decay:
                params.mul_(1 - lr * decay)  # decay of the old weight
            params.addcdiv_(exp_avg, denom, value=-lr / c1)
        else:
            denom.add_(eps)  # sqrt(v) + eps: epsilon is not bias-corrected in this mode
            params.addcdiv_(exp_avg, denom, value=-lr * math.sqrt(c2) / c1)
            if decay:
                params.mul_(1 - lr * decay)  # decay of the updated weight

    def _device_step(self, params, grads, lr, grad_divisor):
        from . import _kernels
        _kernels.adam_step(self._device_table, params, grads, self.state["exp_avg"],
                           self.state["exp_avg_sq"], step=self.step_count + 1, lr=lr,
                           grad_divisor=grad_divisor)


@dataclass(frozen=True)
class _LambBlock:
    """One block of a Lamb group and the pieces of the tensors (segments) it overlaps."""

    start: int  # in flat-buffer elements
    stop: int
    seg_lo: int  # the overlapped segments, [seg_lo, seg_hi), counted from the group's first one
    seg_hi: int
    piece_starts: np.ndarray  # where each overlapped segment starts in the block (first: 0)
    direction_pieces: list  # views of the direction buffer, one per overlapped segment


class Lamb(FlatOptimizer):
    """The original LambOptimizer (see ``lamb_reference``).

    CPU path, two passes over a group's blocks. Pass 1: new moments and direction d (kept in one
    flat scratch buffer of N floats), and each tensor's squared norms of w and d, summed per block
    (torch's threaded cascade sum where the block holds one tensor, else ``np.add.reduceat``:
    fp32, ~1e-8 and ~1e-7 relative; ``torch.norm`` was off by up to 1e-2) and across blocks in
    float64. Pass 2: w -= lr * ratio * d. The original's non-finite
    rules are applied element by element only in the blocks, or groups, whose sums show that they
    are needed.

    With bias correction and epsilon > 0, a block whose w and g are finite takes d from torch's
    fused CPU Adam kernel run on d = 0 with lr = -1 (it updates m and v in place: one pass
    instead of eight ops). There d cannot be non-finite (the denominator is >= epsilon, m is a
    mix of finite values), so the moments may be written before d is known. Over 12M parameters:
    50 -> 24 ms per step with the single-tensor shortcuts of ``_piece_sumsq`` and pass 2.
    """

    config_name = "LambOptimizer"
    family = "lamb"
    state_names = ("exp_avg", "exp_avg_sq")
    hyper_names = frozenset({"alpha", "beta", "lambda_coef", "epsilon", "ratio_min", "ratio_max",
                             "do_bias_correction"})

    # Below this bound on |w| + lr*ratio*|d|, no fp32 weight update can overflow (max 3.4e38).
    _SAFE_MAGNITUDE = 1e38

    def __init__(self, layout: FlatLayout, xp=np):
        super().__init__(layout, xp)
        if self._device_table is None:
            self._direction = torch.empty(layout.size, dtype=torch.float32)
            self._blocks = [self._split_blocks(group) for group in layout.groups]
            self._step_tensor = torch.zeros((), dtype=torch.float32)  # t, for the fused kernel

    def _split_blocks(self, group):
        offsets, blocks = self.layout.seg_offsets, []
        for start, stop in _block_ranges(group):
            seg_lo = int(np.searchsorted(offsets, start, side="right")) - 1
            seg_hi = int(np.searchsorted(offsets, stop, side="left"))
            piece_starts = np.maximum(offsets[seg_lo:seg_hi], start) - start
            piece_sizes = np.diff(piece_starts, append=stop - start).tolist()
            blocks.append(_LambBlock(start, stop, seg_lo - group.seg_start,
                                     seg_hi - group.seg_start, piece_starts,
                                     list(self._direction[start:stop].split(piece_sizes))))
        return blocks

    # ZeRO (CPU path): segment_sums(params_sumsq, direction_sumsq) completes, in place, the
    # per-segment float64 sums of squares of this shard into those of the whole tensors.
    segment_sums = None

    def _cpu_step(self, flat, lr, grad_divisor):
        """Pass 1 for every group, then ``segment_sums``, then pass 2 for every group."""
        num_segments = self.layout.seg_offsets.size - 1
        params_sumsq, direction_sumsq = np.zeros(num_segments), np.zeros(num_segments)
        groups = [(index, group, slice(group.seg_start, group.seg_stop))
                  for index, group in enumerate(self.layout.groups)]
        for index, group, segments in groups:
            self._cpu_direction_pass(index, group, flat, grad_divisor, params_sumsq[segments],
                                     direction_sumsq[segments])
        if self.segment_sums is not None:
            self.segment_sums(params_sumsq, direction_sumsq)
        for index, group, segments in groups:
            self._cpu_update_pass(index, group, flat[0], lr, params_sumsq[segments],
                                  direction_sumsq[segments])

    def _cpu_direction_pass(self, index, group, flat, grad_divisor, params_sumsq, direction_sumsq):
        """New moments and direction d; adds each tensor's squared norms of w and d to the sums."""
        hyper, t = group.hyper, self.step_count + 1
        alpha, beta = hyper["alpha"], hyper["beta"]
        decay, eps = hyper["lambda_coef"], hyper["epsilon"]
        params, grads, exp_avg, exp_avg_sq = flat
        fused = bool(hyper["do_bias_correction"]) and eps > 0
        self._step_tensor.fill_(t)

        for block in self._blocks[index]:
            w, m, v, d = (tensor[block.start:block.stop]
                          for tensor in (params, exp_avg, exp_avg_sq, self._direction))
            g = self._unscaled(grads[block.start:block.stop], grad_divisor)
            new_m, new_v, squares = (self._block_buffer(i, w.numel()) for i in (1, 2, 3))
            block_params_sumsq = self._piece_sumsq(w, squares, block)
            params_sumsq[block.seg_lo:block.seg_hi] += block_params_sumsq
            if fused and np.all(np.isfinite(block_params_sumsq)) and math.isfinite(g.sum()):
                d.zero_()
                torch._fused_adam_([d], [g], [m], [v], [], [self._step_tensor], lr=-1.0, beta1=alpha,
                                   beta2=beta, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False)
                if decay:
                    d.add_(w, alpha=decay)
                direction_sumsq[block.seg_lo:block.seg_hi] += self._piece_sumsq(d, squares, block)
                continue
            torch.lerp(m, g, 1 - alpha, out=new_m)
            torch.mul(v, beta, out=new_v).addcmul_(g, g, value=1 - beta)
            # d = lambda*w + (m/c1) / (sqrt(v/c2) + eps), as m / (c1/sqrt(c2)*sqrt(v) + c1*eps)
            denom = torch.sqrt(new_v, out=d)
            if hyper["do_bias_correction"]:
                c1, c2 = 1 - alpha**t, 1 - beta**t
                denom.mul_(c1 / math.sqrt(c2)).add_(c1 * eps)
            else:
                denom.add_(eps)
            torch.div(new_m, denom, out=d)
            if decay:
                d.add_(w, alpha=decay)

            block_direction_sumsq = self._piece_sumsq(d, squares, block)
            if np.all(np.isfinite(block_direction_sumsq)):  # then every d is finite
                m.copy_(new_m)
                v.copy_(new_v)
            else:  # d = 0 and the moments unchanged where d is not finite
                finite = torch.isfinite(d)
                d.masked_fill_(~finite, 0)
                torch.where(finite, new_m, m, out=m)
                torch.where(finite, new_v, v, out=v)
                block_direction_sumsq = self._piece_sumsq(d, squares, block)
            direction_sumsq[block.seg_lo:block.seg_hi] += block_direction_sumsq

    def _cpu_update_pass(self, index, group, params, lr, params_sumsq, direction_sumsq):
        """w -= lr * ratio * d, the trust ratio from each tensor's norms."""
        hyper = group.hyper
        step_sizes = lr * _trust_ratio(params_sumsq, direction_sumsq,
                                       hyper["ratio_min"], hyper["ratio_max"])
        largest_result = np.sqrt(params_sumsq) + np.abs(step_sizes) * np.sqrt(direction_sumsq)
        all_finite = bool(np.all(largest_result < self._SAFE_MAGNITUDE))  # False for inf, nan
        for block in self._blocks[index]:
            w, d = params[block.start:block.stop], self._direction[block.start:block.stop]
            if all_finite and block.seg_hi - block.seg_lo == 1:  # one tensor: one fused op
                w.sub_(d, alpha=float(step_sizes[block.seg_lo]))
                continue
            torch._foreach_mul_(block.direction_pieces,
                                step_sizes[block.seg_lo:block.seg_hi].tolist())
            if all_finite:
                w.sub_(d)
            else:  # keep the old weight where the new one is not finite
                new_w = torch.sub(w, d, out=self._block_buffer(1, w.numel()))
                torch.where(torch.isfinite(new_w), new_w, w, out=w)

    @staticmethod
    def _piece_sumsq(values, squares, block):
        """Sum of squares of each segment piece of a block (fp32; ~1e-7 relative or better)."""
        torch.mul(values, values, out=squares)
        if len(block.piece_starts) == 1:  # torch's cascade sum: threaded, ~1e-8
            return np.array([squares.sum().item()])
        return np.add.reduceat(squares.numpy(), block.piece_starts)  # pairwise

    def _device_step(self, params, grads, lr, grad_divisor):
        from . import _kernels
        _kernels.lamb_step(self._device_table, params, grads, self.state["exp_avg"],
                           self.state["exp_avg_sq"], step=self.step_count + 1, lr=lr,
                           grad_divisor=grad_divisor)


_OPTIMIZERS = {cls.config_name: cls for cls in (SGD, Adam, Lamb)}


def make_optimizer(config_name: str, layout: FlatLayout, xp=np) -> FlatOptimizer:
    """The flat optimizer for an optimizer config's ``name`` ('SGDOptimizer', ...)."""
    if config_name not in _OPTIMIZERS:
        raise ValueError(f"make_optimizer: config_name must be one of {sorted(_OPTIMIZERS)}, "
                         f"got {config_name!r}")
    return _OPTIMIZERS[config_name](layout, xp)
