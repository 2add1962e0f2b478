"""The trainer's loss scaling (`mixed_precision`): the scaler, and its scale as a graph input."""
import warnings

import numpy as np

from ..amp import DynamicLossScaler


def loss_scaling(mixed_precision, xp):
    """(scaler, scale feed) under `mixed_precision.enabled`, else (None, None).

    The scale is a 0-d array (on the graphs' device, `xp`: NumPy or CuPy) bound to the training
    graph once and updated in place.
    """
    if not mixed_precision.enabled:
        if mixed_precision.loss_scaler is not None:
            raise ValueError("Invalid options: mixed_precision.loss_scaler is set, but mixed_precision.enabled "
                             "is False (loss scaling is part of mixed precision)")
        return None, None
    scaler = mixed_precision.loss_scaler or DynamicLossScaler()
    warnings.warn("mixed_precision.enabled: the graphs compute in fp32 (fp16 compute is not implemented yet); "
                  "dynamic loss scaling and skipping updates with non-finite gradients are active")
    return scaler, xp.array(scaler.loss_scale, dtype=np.float32)
