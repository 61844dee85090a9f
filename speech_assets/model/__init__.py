"""HuBERT-style masked-prediction model: presets, span masking, per-client heads, loss."""

from speech_assets.model.hubert import (
    ClientLogits,
    EncoderOutput,
    HubertPretrainModel,
    PretrainOutput,
    count_parameters,
    output_lengths,
    padding_mask,
)
from speech_assets.model.loss import IGNORE_INDEX, LossOutput, masked_prediction_loss, summarize
from speech_assets.model.masking import span_mask
from speech_assets.model.presets import PRESETS, ModelPreset, get_preset

__all__ = [
    "IGNORE_INDEX",
    "PRESETS",
    "ClientLogits",
    "EncoderOutput",
    "HubertPretrainModel",
    "LossOutput",
    "ModelPreset",
    "PretrainOutput",
    "count_parameters",
    "get_preset",
    "masked_prediction_loss",
    "output_lengths",
    "padding_mask",
    "span_mask",
    "summarize",
]
