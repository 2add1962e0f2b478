from ._config import AdamConfig, DecayMode, LambConfig, SGDConfig
from ._fused import FusedAdam, FusedLamb
from .fp16_optimizer import FP16_Optimizer
from .lr_scheduler import (ConstantWarmupLRScheduler, CosineWarmupLRScheduler, LinearWarmupLRScheduler,
                           PolyWarmupLRScheduler)

__all__ = ["SGDConfig", "AdamConfig", "LambConfig", "DecayMode", "ConstantWarmupLRScheduler",
           "CosineWarmupLRScheduler", "LinearWarmupLRScheduler", "PolyWarmupLRScheduler", "FusedAdam", "FusedLamb",
           "FP16_Optimizer"]
