"""torch's kernels for layers the graphs hand to torch nodes (`IMPLEMENTATIONS` in `torch_ops`):
gradients ONNX Runtime lacks (interpolate, transposed convolution) or runs slower (layer norm),
einsum and adaptive pooling, and ONNX Runtime's own call of `sum` (its CUDA ReduceSum).

Each takes the node's input tensors and its params (JSON attributes) and returns its outputs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .product_kernels import convolution_args


def interpolate_grad(inputs, params):
    grad, x = inputs[0], inputs[1]
    mode = params["modes"].get(str(x.dim()))
    if mode is None:
        raise ValueError(f"no torch interpolate mode for a {x.dim()}-d input (modes by rank: {params['modes']})")
    scales = inputs[2].tolist()[2:] if len(inputs) > 2 and inputs[2].numel() else None
    source = torch.zeros(x.shape, dtype=grad.dtype, device=grad.device, requires_grad=True)
    with torch.enable_grad():
        resized = F.interpolate(source, size=None if scales else tuple(grad.shape[2:]), scale_factor=scales,
                                mode=mode, align_corners=params["align_corners"],
                                recompute_scale_factor=False if scales else None)
    if resized.shape != grad.shape:
        raise ValueError(f"interpolate of {tuple(x.shape)} gives {tuple(resized.shape)}, the gradient is "
                         f"{tuple(grad.shape)}")
    return list(torch.autograd.grad(resized, source, grad))


def conv_transpose_grad(inputs, params):
    grad, x, weight = inputs
    return list(torch.ops.aten.convolution_backward(grad, x, weight, [weight.shape[1] * params["groups"]],
                                                    *convolution_args(weight, params), [True, True, True]))


def einsum(inputs, params):
    return [torch.einsum(params["equation"], *inputs)]


def adaptive_avg_pool(inputs, params):
    return [_ADAPTIVE_AVG_POOLS[len(params["output_size"])](inputs[0], params["output_size"])]


_ADAPTIVE_AVG_POOLS = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}


def layer_norm_grad(inputs, params):
    """ONNX Runtime's LayerNormalizationGrad (dY, X, scale, saved mean, saved inverse std) as torch's
    backward of layer_norm: [dX, dscale, dbias]."""
    grad, x, scale, mean, inv_std = inputs
    found = torch.ops.aten.native_layer_norm_backward(grad, x, x.shape[params["axis"] % x.dim():], mean, inv_std,
                                                      scale, scale, [True, True, True])  # (bias: its shape is read)
    return list(found)


def onnx_runtime_reduce_sum(inputs, params):
    """ONNX Runtime's own CUDA ReduceSum (training build) hands its sums to the registered executor
    as `sum.dim_IntList` (`aten::sum` in some releases): the input, the axes and keepdims (host
    tensors), no dtype."""
    x, axes, keepdims = inputs[:3]
    return [torch.sum(x, dim=axes.tolist(), keepdim=bool(keepdims.item()))]
