"""Loss scaling for mixed-precision (fp16) training."""
from .loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["LossScaler", "DynamicLossScaler"]
