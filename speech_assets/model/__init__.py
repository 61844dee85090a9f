"""HuBERT-style masked-prediction model: presets, span masking, per-client heads, loss, export.

The torch-based names are loaded on first use, so that reading a preset (``presets`` has no torch
dependency) does not import torch: the Dagster code location imports presets for its config
schema and must stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

from speech_assets.model.presets import PRESETS, ModelPreset, get_preset

_LAZY = {
    "ClientLogits": "hubert",
    "EncoderOutput": "hubert",
    "HubertPretrainModel": "hubert",
    "PretrainOutput": "hubert",
    "count_parameters": "hubert",
    "output_lengths": "hubert",
    "padding_mask": "hubert",
    "IGNORE_INDEX": "loss",
    "LossOutput": "loss",
    "masked_prediction_loss": "loss",
    "summarize": "loss",
    "span_mask": "masking",
}

__all__ = ["PRESETS", "ModelPreset", "get_preset", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"speech_assets.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'speech_assets.model' has no attribute {name!r}")
