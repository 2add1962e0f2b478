"""The trainer's mixed precision (`mixed_precision`): the graphs' compute type, the loss scaler,
and its scale as a graph input."""
import warnings
from dataclasses import dataclass

import numpy as np

from .._graph.autocast import slower_than_fp32, unsupported
from ..amp import DynamicLossScaler


@dataclass(frozen=True)
class MixedPrecision:
    """compute_dtype: 'float16', 'bfloat16' or None (fp32); scaler: the loss scaler or None;
    scale: its scale as a 0-d array on the graphs' device (NumPy or CuPy), bound to the training
    graph once and updated in place, or None."""

    compute_dtype: str = None
    scaler: object = None
    scale: object = None


def mixed_precision(options, device_type, xp):
    """The MixedPrecision of `options.mixed_precision` on `device_type` ('cpu', 'cuda').

    fp16 gets a DynamicLossScaler unless given one (its gradients underflow without); bf16 has
    fp32's range and scales only with a given scaler.

    Raises:
        ValueError: loss_scaler or dtype set while enabled is False.
        NotImplementedError: the device cannot compute in that dtype (bf16 on the CPU).
    """
    if not options.enabled:
        for field, default in (("loss_scaler", None), ("dtype", "float16")):
            if getattr(options, field) != default:
                raise ValueError(f"Invalid options: mixed_precision.{field} is set, but mixed_precision.enabled is "
                                 "False (mixed precision is off)")
        return MixedPrecision()
    reason = unsupported(device_type, options.dtype)
    if reason is not None:
        raise NotImplementedError(f"mixed_precision.dtype={options.dtype!r} on device {device_type!r}: {reason}")
    slower = slower_than_fp32(device_type, options.dtype)
    if slower is not None:
        warnings.warn(f"mixed_precision.dtype={options.dtype!r} on device {device_type!r}: {slower}")
    scaler = options.loss_scaler
    if scaler is None and options.dtype == "float16":
        scaler = DynamicLossScaler()
    scale = None if scaler is None else xp.array(scaler.loss_scale, dtype=np.float32)
    return MixedPrecision(options.dtype, scaler, scale)
