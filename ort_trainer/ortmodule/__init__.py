"""ORTModule for today's PyTorch: `model = ORTModule(model)`, and the rest of the loop stays.

    from ort_trainer.ortmodule import ORTModule, DebugOptions, LogLevel
"""
from .._configuration.ortmodule_settings import DebugOptions, LogLevel
from ._wrapper import ORTModule

__all__ = ["ORTModule", "DebugOptions", "LogLevel"]
