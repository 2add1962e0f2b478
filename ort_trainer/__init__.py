"""ort-trainer: ONNX Runtime's ORTTrainer for today's PyTorch.

    from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
    from ort_trainer import ORTModule
"""
from ._install import require_training_build

require_training_build()

from . import amp, data, optim  # noqa: E402
from ._configuration.options import ORTTrainerOptions, PropagateCastOpsStrategy  # noqa: E402
from ._trainer.trainer import ORTTrainer, TrainStepInfo  # noqa: E402
from .ortmodule import ORTModule  # noqa: E402

__all__ = ["ORTModule", "ORTTrainer", "ORTTrainerOptions", "PropagateCastOpsStrategy", "TrainStepInfo", "amp", "data", "optim"]
__version__ = "0.1.0"
