"""The CPU implementation of the flat-buffer optimizers: one functional step per algorithm.

torch's multi-threaded CPU kernels on zero-copy ``torch.from_numpy`` views of the flat NumPy
buffers, fused where torch has a fused kernel whose math is the original's
(``torch._fused_sgd_``; ``torch._fused_adamw_`` for Adam mode 0 with bias correction;
``torch._fused_adam_`` for Lamb's direction), in-place ops elsewhere, run block by block so that
the intermediates stay in cache (see ``_BLOCK``). The fused ops are private to torch: the tests
hold every step to its reference in ``_optimizers.reference``. Nothing is allocated per step but
block-sized scratch kept in the ``LayoutTable``; ``grads`` is never written.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .flat import FlatLayout, GroupSlice
from .hyper import AdamHyper
from .reference import clip_divisor_from_norm, trust_ratio

FAMILIES = ("sgd", "adam", "lamb")

# Every op of an update runs on one block of 2**18 elements (1 MiB per fp32 array) before moving
# on, so a block's arrays stay in cache and each buffer crosses the memory bus about once per
# step. Measured on 12M parameters, cold cache, Adam with a gradient divisor: 24 ms with
# whole-buffer ops, 9.5 ms in blocks (7.3 ms with no divisor).
_BLOCK = 1 << 18

# Below this bound on |w| + lr*ratio*|d|, no fp32 weight update can overflow (max 3.4e38).
_SAFE_MAGNITUDE = 1e38


def _block_ranges(group: GroupSlice):
    """(start, stop) of each block of the group, in flat-buffer elements."""
    return [(start, min(start + _BLOCK, group.stop)) for start in range(group.start, group.stop,
                                                                        _BLOCK)]


@dataclass(frozen=True)
class _LambBlock:
    """One block of a Lamb group and the pieces of the tensors (segments) it overlaps."""

    start: int  # in flat-buffer elements
    stop: int
    seg_lo: int  # the overlapped segments, [seg_lo, seg_hi), counted from the group's first one
    seg_hi: int
    piece_starts: np.ndarray  # where each overlapped segment starts in the block (first: 0)
    direction_pieces: list  # views of the direction buffer, one per overlapped segment


class LayoutTable:
    """A FlatLayout prepared for one family's steps: block-sized scratch buffers, the step t as
    the fused kernels read it, and for Lamb the direction buffer (N floats) and each block's
    segment pieces. Build once per optimizer; one step at a time per table."""

    def __init__(self, layout: FlatLayout, family: str):
        if family not in FAMILIES:
            raise ValueError(f"layout_table: family must be one of {sorted(FAMILIES)}, "
                             f"got {family!r}")
        self.layout = layout
        self.family = family
        self.block_buffers: list[torch.Tensor] = []
        self.step_tensor = torch.zeros((), dtype=torch.float32)
        if family == "lamb":
            self.direction = torch.empty(layout.size, dtype=torch.float32)
            self.lamb_blocks = [self._split_blocks(group) for group in layout.groups]

    def _split_blocks(self, group):
        offsets, blocks = self.layout.seg_offsets, []
        for start, stop in _block_ranges(group):
            seg_lo = int(np.searchsorted(offsets, start, side="right")) - 1
            seg_hi = int(np.searchsorted(offsets, stop, side="left"))
            piece_starts = np.maximum(offsets[seg_lo:seg_hi], start) - start
            piece_sizes = np.diff(piece_starts, append=stop - start).tolist()
            blocks.append(_LambBlock(start, stop, seg_lo - group.seg_start,
                                     seg_hi - group.seg_start, piece_starts,
                                     list(self.direction[start:stop].split(piece_sizes))))
        return blocks

    def block_buffer(self, index: int, size: int) -> torch.Tensor:
        """The first ``size`` elements of the index-th block-sized scratch buffer."""
        while len(self.block_buffers) <= index:
            self.block_buffers.append(torch.empty(_BLOCK, dtype=torch.float32))
        return self.block_buffers[index][:size]

    def unscaled(self, grads, grad_divisor):
        """grads / grad_divisor for one block, in block buffer 0 unless the divisor is 1.

        Not torch's fused ``grad_scale``: it writes the unscaled gradient back into grads.
        """
        if grad_divisor == 1.0:
            return grads
        return torch.div(grads, grad_divisor, out=self.block_buffer(0, grads.numel()))


def layout_table(layout: FlatLayout, family: str) -> LayoutTable:
    """The scratch and block plan of ``layout`` for ``family`` ('sgd', 'adam', 'lamb')."""
    return LayoutTable(layout, family)


def _views_by_block(table, arrays, grad_divisor, whole_group):
    """(hyper, params, unscaled grads, *state): torch views of one block at a time, group by
    group, for the elementwise algorithms.

    A lone fused kernel reads each buffer once anyway: a group for which ``whole_group(hyper)``
    says the step is one is taken in one piece (saves ~0.6 ms of per-call overhead on 12M
    parameters), unless grads need unscaling.
    """
    params, grads, *state = (torch.from_numpy(array) for array in arrays)
    for group in table.layout.groups:
        if grad_divisor == 1.0 and whole_group(group.hyper):
            ranges = [(group.start, group.stop)]
        else:
            ranges = _block_ranges(group)
        for start, stop in ranges:
            yield (group.hyper, params[start:stop], table.unscaled(grads[start:stop], grad_divisor),
                   *(tensor[start:stop] for tensor in state))


def _counted_on_the_host(where: str, counters: None, lr_table: None) -> None:
    """Refuses CUDA loss scaling's device counters: the steps take them on both devices (one
    contract), the CPU ones count their updates on the host."""
    given = [f"{name}={type(value).__module__}.{type(value).__name__}"
             for name, value in (("counters", counters), ("lr_table", lr_table)) if value is not None]
    if given:
        raise ValueError(f"{where}: counters and lr_table are the device arrays of loss scaling on CUDA; the CPU "
                         f"steps count updates on the host and take None, got {', '.join(given)}")


# ----------------------------------------------------------------------------------------------
# SGD
# ----------------------------------------------------------------------------------------------


def sgd_step(table: LayoutTable, params: np.ndarray, grads: np.ndarray, momentum: np.ndarray, *, lr: float,
             grad_divisor: float = 1.0, first_step: bool, counters: None = None, lr_table: None = None) -> None:
    """One SGD step in place (``sgd_reference``): torch's fused SGD kernel.

    ``momentum`` is neither read on the first step nor written by groups whose momentum is 0.
    ``counters`` and ``lr_table`` are CUDA's (``cuda_steps.sgd_step``): refused here.
    """
    _counted_on_the_host("sgd_step", counters, lr_table)
    for hyper, w, g, buf in _views_by_block(table, (params, grads, momentum), float(grad_divisor),
                                            whole_group=lambda hyper: True):
        coefficient = hyper.momentum
        torch._fused_sgd_(
            [w], [g], [buf] if coefficient else [],
            weight_decay=hyper.lambda_coef, momentum=coefficient, lr=lr,
            dampening=hyper.dampening, nesterov=bool(coefficient and hyper.nesterov),
            maximize=False, is_first_step=first_step)


# ----------------------------------------------------------------------------------------------
# Adam
# ----------------------------------------------------------------------------------------------


def _adam_is_fused(hyper: AdamHyper) -> bool:
    """Mode 0 with bias correction: torch's fused AdamW kernel computes the original's math
    (epsilon after the corrected sqrt(v), decay lr*lambda*w on the old weight)."""
    return hyper.weight_decay_mode == 0 and bool(hyper.do_bias_correction)


def adam_step(table: LayoutTable, params: np.ndarray, grads: np.ndarray, exp_avg: np.ndarray,
              exp_avg_sq: np.ndarray, *, step: int, lr: float, grad_divisor: float = 1.0, counters: None = None,
              lr_table: None = None) -> None:
    """One Adam step in place (``adam_reference``), t = ``step``: torch's fused AdamW kernel
    where its math is the original's, in-place torch ops for the other groups (``counters``,
    ``lr_table``: refused, as in ``sgd_step``)."""
    _counted_on_the_host("adam_step", counters, lr_table)
    table.step_tensor.fill_(step)
    for hyper, w, g, m, v in _views_by_block(table, (params, grads, exp_avg, exp_avg_sq),
                                             float(grad_divisor), whole_group=_adam_is_fused):
        if _adam_is_fused(hyper):
            torch._fused_adamw_(
                [w], [g], [m], [v], [], [table.step_tensor],
                lr=lr, beta1=hyper.alpha, beta2=hyper.beta,
                weight_decay=hyper.lambda_coef, eps=hyper.epsilon,
                amsgrad=False, maximize=False)
            continue
        alpha, beta = hyper.alpha, hyper.beta
        decay, eps = hyper.lambda_coef, hyper.epsilon
        c1, c2 = (1 - alpha**step, 1 - beta**step) if hyper.do_bias_correction else (1.0, 1.0)
        m.lerp_(g, 1 - alpha)  # alpha*m + (1-alpha)*g in one op
        v.mul_(beta).addcmul_(g, g, value=1 - beta)
        denom = torch.sqrt(v, out=table.block_buffer(1, w.numel()))
        if hyper.weight_decay_mode == 0:
            if c2 != 1.0:
                denom.mul_(1 / math.sqrt(c2))
            denom.add_(eps)  # sqrt(v/c2) + eps
            if decay:
                w.mul_(1 - lr * decay)  # decay of the old weight
            w.addcdiv_(m, denom, value=-lr / c1)
        else:
            denom.add_(eps)  # sqrt(v) + eps: epsilon is not bias-corrected in this mode
            w.addcdiv_(m, denom, value=-lr * math.sqrt(c2) / c1)
            if decay:
                w.mul_(1 - lr * decay)  # decay of the updated weight


# ----------------------------------------------------------------------------------------------
# Lamb
# ----------------------------------------------------------------------------------------------


def lamb_step(table: LayoutTable, params: np.ndarray, grads: np.ndarray, exp_avg: np.ndarray,
              exp_avg_sq: np.ndarray, *, step: int, lr: float, grad_divisor: float = 1.0,
              segment_sums: Callable[[np.ndarray, np.ndarray], None] | None = None, counters: None = None,
              lr_table: None = None) -> None:
    """One Lamb step in place (``lamb_reference``), t = ``step``, in two passes over each group's
    blocks.

    Pass 1: new moments and direction d (kept in the table's direction buffer), and each tensor's
    squared norms of w and d, summed per block (torch's threaded cascade sum where the block
    holds one tensor, else ``np.add.reduceat``: fp32, ~1e-8 and ~1e-7 relative; ``torch.norm``
    was off by up to 1e-2) and across blocks in float64. Then ``segment_sums``, if given. Pass 2:
    w -= lr * ratio * d. The original's non-finite rules are applied element by element only in
    the blocks, or groups, whose sums show that they are needed.

    With bias correction and epsilon > 0, a block whose w and g are finite takes d from torch's
    fused CPU Adam kernel run on d = 0 with lr = -1 (it updates m and v in place: one pass
    instead of eight ops). There d cannot be non-finite (the denominator is >= epsilon, m is a
    mix of finite values), so the moments may be written before d is known. Over 12M parameters:
    50 -> 24 ms per step with the single-tensor shortcuts of ``_piece_sumsq`` and pass 2.

    Args:
        segment_sums: ZeRO's hook, ``segment_sums(params_sumsq, direction_sumsq)``: completes, in
            place, the per-segment float64 sums of squares of this shard into those of the whole
            tensors (the trust ratio is per tensor).
        counters, lr_table: refused, as in ``sgd_step``.
    """
    _counted_on_the_host("lamb_step", counters, lr_table)
    flat = [torch.from_numpy(array) for array in (params, grads, exp_avg, exp_avg_sq)]
    grad_divisor = float(grad_divisor)
    table.step_tensor.fill_(step)
    num_segments = table.layout.seg_offsets.size - 1
    params_sumsq, direction_sumsq = np.zeros(num_segments), np.zeros(num_segments)
    groups = [(index, group, slice(group.seg_start, group.seg_stop))
              for index, group in enumerate(table.layout.groups)]
    for index, group, segments in groups:
        _lamb_direction_pass(table, index, group, flat, step, grad_divisor,
                             params_sumsq[segments], direction_sumsq[segments])
    if segment_sums is not None:
        segment_sums(params_sumsq, direction_sumsq)
    for index, group, segments in groups:
        _lamb_update_pass(table, index, group, flat[0], lr, params_sumsq[segments],
                          direction_sumsq[segments])


def _lamb_direction_pass(table, index, group, flat, step, grad_divisor, params_sumsq,
                         direction_sumsq):
    """New moments and direction d; adds each tensor's squared norms of w and d to the sums."""
    hyper = group.hyper
    alpha, beta = hyper.alpha, hyper.beta
    decay, eps = hyper.lambda_coef, hyper.epsilon
    params, grads, exp_avg, exp_avg_sq = flat
    fused = bool(hyper.do_bias_correction) and eps > 0

    for block in table.lamb_blocks[index]:
        w, m, v, d = (tensor[block.start:block.stop]
                      for tensor in (params, exp_avg, exp_avg_sq, table.direction))
        g = table.unscaled(grads[block.start:block.stop], grad_divisor)
        new_m, new_v, squares = (table.block_buffer(i, w.numel()) for i in (1, 2, 3))
        block_params_sumsq = _piece_sumsq(w, squares, block)
        params_sumsq[block.seg_lo:block.seg_hi] += block_params_sumsq
        if fused and np.all(np.isfinite(block_params_sumsq)) and math.isfinite(g.sum()):
            d.zero_()
            torch._fused_adam_([d], [g], [m], [v], [], [table.step_tensor], lr=-1.0, beta1=alpha,
                               beta2=beta, weight_decay=0.0, eps=eps, amsgrad=False,
                               maximize=False)
            if decay:
                d.add_(w, alpha=decay)
            direction_sumsq[block.seg_lo:block.seg_hi] += _piece_sumsq(d, squares, block)
            continue
        torch.lerp(m, g, 1 - alpha, out=new_m)
        torch.mul(v, beta, out=new_v).addcmul_(g, g, value=1 - beta)
        # d = lambda*w + (m/c1) / (sqrt(v/c2) + eps), as m / (c1/sqrt(c2)*sqrt(v) + c1*eps)
        denom = torch.sqrt(new_v, out=d)
        if hyper.do_bias_correction:
            c1, c2 = 1 - alpha**step, 1 - beta**step
            denom.mul_(c1 / math.sqrt(c2)).add_(c1 * eps)
        else:
            denom.add_(eps)
        torch.div(new_m, denom, out=d)
        if decay:
            d.add_(w, alpha=decay)

        block_direction_sumsq = _piece_sumsq(d, squares, block)
        if np.all(np.isfinite(block_direction_sumsq)):  # then every d is finite
            m.copy_(new_m)
            v.copy_(new_v)
        else:  # d = 0 and the moments unchanged where d is not finite
            finite = torch.isfinite(d)
            d.masked_fill_(~finite, 0)
            torch.where(finite, new_m, m, out=m)
            torch.where(finite, new_v, v, out=v)
            block_direction_sumsq = _piece_sumsq(d, squares, block)
        direction_sumsq[block.seg_lo:block.seg_hi] += block_direction_sumsq


def _lamb_update_pass(table, index, group, params, lr, params_sumsq, direction_sumsq):
    """w -= lr * ratio * d, the trust ratio from each tensor's norms."""
    hyper = group.hyper
    step_sizes = lr * trust_ratio(params_sumsq, direction_sumsq,
                                  hyper.ratio_min, hyper.ratio_max)
    largest_result = np.sqrt(params_sumsq) + np.abs(step_sizes) * np.sqrt(direction_sumsq)
    all_finite = bool(np.all(largest_result < _SAFE_MAGNITUDE))  # False for inf, nan
    for block in table.lamb_blocks[index]:
        w, d = params[block.start:block.stop], table.direction[block.start:block.stop]
        if all_finite and block.seg_hi - block.seg_lo == 1:  # one tensor: one fused op
            w.sub_(d, alpha=float(step_sizes[block.seg_lo]))
            continue
        torch._foreach_mul_(block.direction_pieces,
                            step_sizes[block.seg_lo:block.seg_hi].tolist())
        if all_finite:
            w.sub_(d)
        else:  # keep the old weight where the new one is not finite
            new_w = torch.sub(w, d, out=table.block_buffer(1, w.numel()))
            torch.where(torch.isfinite(new_w), new_w, w, out=w)


def _piece_sumsq(values, squares, block):
    """Sum of squares of each segment piece of a block (fp32; ~1e-7 relative or better)."""
    torch.mul(values, values, out=squares)
    if len(block.piece_starts) == 1:  # torch's cascade sum: threaded, ~1e-8
        return np.array([squares.sum().item()])
    return np.add.reduceat(squares.numpy(), block.piece_starts)  # pairwise


# ----------------------------------------------------------------------------------------------
# Gradient norm and clipping
# ----------------------------------------------------------------------------------------------

_NORM_BLOCK = 256


def sum_of_squares(grads) -> float:
    """sum(grads**2): fp32 partial sums over blocks of 256 elements (one einsum, no temporary),
    added up in float64.

    Measured on 12M elements: relative error of the norm 2e-9 (random) to 8e-7 (all equal) in
    2 ms; a fully float64 sum takes 8 ms, and np.dot in fp32 is off by 1e-4 to 1e-3.
    """
    grads = np.ravel(grads)
    body = grads.size - grads.size % _NORM_BLOCK
    blocks = grads[:body].reshape(-1, _NORM_BLOCK)
    tail = grads[body:].astype(np.float64)
    return float(np.einsum("ij,ij->i", blocks, blocks).sum(dtype=np.float64) + tail @ tail)


def global_grad_norm(grads) -> float:
    """||grads||_2, from ``sum_of_squares``."""
    return math.sqrt(sum_of_squares(grads))


def clip_divisor(grads, max_norm: float, loss_scale: float = 1.0) -> tuple[float, float]:
    """(S, N): N = ||grads||_2 and S = ``clip_divisor_from_norm(N, ...)``, Python floats."""
    norm = global_grad_norm(grads)
    return clip_divisor_from_norm(norm, max_norm, loss_scale), norm
