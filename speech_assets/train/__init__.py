"""Training: config, data, autoconfig, checkpoints, the engine and its users (HuBERT pretraining,
distillation), launch, tracking. Entry points: ``python -m speech_assets.train`` and ``.train.distill``."""

from speech_assets.train.config import ClientTargets, TrainConfig

__all__ = ["ClientTargets", "TrainConfig"]
