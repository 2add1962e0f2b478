"""The original's module path, ``onnxruntime.training.amp.loss_scaler``: code written for it imports
``LossScaler`` and ``DynamicLossScaler`` from here unchanged."""
from ._loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["LossScaler", "DynamicLossScaler"]
