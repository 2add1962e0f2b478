"""ort-trainer: ONNX Runtime's ORTTrainer for today's PyTorch.

    from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
"""
from ._runtime import require_training_build

require_training_build()

from . import amp, optim  # noqa: E402
from ._options import ORTTrainerOptions  # noqa: E402
from ._trainer import ORTTrainer, TrainStepInfo  # noqa: E402

__all__ = ["ORTTrainer", "ORTTrainerOptions", "TrainStepInfo", "amp", "optim"]
__version__ = "0.1.0"
