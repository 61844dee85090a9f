"""The identity of an encoder's weights (model/encoders.py)."""

import torch

from speech_assets.model.encoders import weights_sha256
from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.model.presets import get_preset


def _model(seed: int) -> HubertPretrainModel:
    torch.manual_seed(seed)
    return HubertPretrainModel(get_preset("tiny"), {"a": 8, "b": 12})


def test_weights_sha256_depends_on_values_only() -> None:
    state = _model(0).state_dict()
    digest = weights_sha256(state)
    reordered = dict(reversed(list(state.items())))
    assert weights_sha256(reordered) == digest
    assert weights_sha256({k: v.clone() for k, v in state.items()}) == digest
    assert weights_sha256(_model(1).state_dict()) != digest
    changed = dict(state)
    key = next(iter(changed))
    changed[key] = changed[key].clone()
    changed[key].view(-1)[0] += 1e-6
    assert weights_sha256(changed) != digest
