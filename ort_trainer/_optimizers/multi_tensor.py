"""Gradient norms and overflow checks over lists of tensors: the gradients of an fp16 optimizer
(DeepSpeed's, apex's) are many tensors, not one flat buffer. One multi-tensor op per (device,
dtype) replaces the per-tensor loops those libraries run (one op, and on CUDA often one host sync,
per tensor).

torch's ``_foreach_norm`` is the fused op on both devices (a multi-tensor-apply kernel on CUDA,
one call over the list on the CPU); our CuPy clip kernels (``_optimizers.cuda_steps``) read one flat
buffer, which these lists are not. The tests hold both functions to NumPy's float64 math.
"""
import math

import torch


def _groups(tensors):
    """The non-empty tensors by (device, dtype): the lists one ``_foreach`` call takes."""
    groups = {}
    for tensor in tensors:
        if tensor.numel():
            groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())


def norms(tensors, norm_type=2.0):
    """Each non-empty tensor's `norm_type`-norm, as one float64 tensor on the first tensor's device
    (empty when there is none). The 2-norm is accumulated in float64, as DeepSpeed's norms are;
    the inf-norm (max |x|) is exact in any dtype, and NaN where a tensor holds a NaN."""
    groups = _groups(tensors)
    if not groups:
        return torch.zeros(0, dtype=torch.float64)
    dtype = torch.float64 if norm_type != math.inf else None
    device = groups[0][0].device
    parts = [torch.stack(torch._foreach_norm(group, norm_type, dtype=dtype)).to(device, torch.float64)
             for group in groups]
    return torch.cat(parts)


def total_norm(tensors, norm_type=2.0):
    """The `norm_type`-norm of all tensors as one vector (a 0-d float64 tensor): inf or NaN where a
    value is not finite."""
    each = norms(tensors, norm_type)
    if norm_type == math.inf:
        return each.max() if each.numel() else torch.zeros((), dtype=torch.float64)
    return each.pow(norm_type).sum().pow(1.0 / norm_type)


def has_inf_or_nan(tensors):
    """Whether any value of `tensors` is inf or NaN (a 0-d bool tensor, no host sync): the max |x|
    of each tensor, which never overflows and propagates NaN."""
    return ~torch.isfinite(norms(tensors, math.inf)).all()


def scale_(tensors, factor):
    """Multiplies each tensor in place by the 0-d tensor `factor` (cast to its device and dtype)."""
    for group in _groups(tensors):
        torch._foreach_mul_(group, factor.to(group[0].device, group[0].dtype))
