from ._config import AdamConfig, DecayMode, LambConfig, SGDConfig

__all__ = ["SGDConfig", "AdamConfig", "LambConfig", "DecayMode"]
