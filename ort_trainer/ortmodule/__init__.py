"""ORTModule for today's PyTorch: `model = ORTModule(model)`, and the rest of the loop stays.

    from ort_trainer.ortmodule import ORTModule, DebugOptions, LogLevel
"""
from .._ortmodule import ORTModule
from .._ortmodule_options import DebugOptions, LogLevel

__all__ = ["ORTModule", "DebugOptions", "LogLevel"]
