"""Training: config, data, autoconfig, checkpoints, the engine and its users (HuBERT pretraining,
distillation), launch, tracking.

Entry points: ``python -m speech_assets.train --config CONFIG.json`` (see ``__main__``),
``python -m speech_assets.train.distill --config CONFIG.json``, :func:`speech_assets.train.trainer.train`,
:func:`speech_assets.train.launch.build_torchrun_command`.
"""

from speech_assets.train.config import ClientTargets, TrainConfig

__all__ = ["ClientTargets", "TrainConfig"]
