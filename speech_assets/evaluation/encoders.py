"""Encoders under evaluation and what probes read from them.

* :func:`load_utterances`: CMVN-normalised log-mel ``(T, 80)`` and the transcript of every kept
  utterance of some shards;
* :func:`load_encoder`: a training checkpoint's encoder (``torch.load(weights_only=True)``);
  :func:`random_encoder`: the same shape, randomly initialised;
* :func:`layer_features`: every layer's frozen output per utterance.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speech_assets.evaluation.text import normalise
from speech_assets.features.cmvn import Cmvn
from speech_assets.features.shards import iter_shard
from speech_assets.model.batches import batches_by_length, pad
from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.model.presets import ModelPreset
from speech_assets.train.checkpoint import load_checkpoint, weights_sha256


@dataclass
class Utterance:
    """One utterance: ``feats (T, 80)`` float32 log-mel at 100 Hz (CMVN applied), its normalised transcript."""

    utt_id: str
    speaker_id: str
    feats: np.ndarray
    text: str

    @property
    def seconds(self) -> float:
        return self.feats.shape[0] / 100.0


def load_utterances(shards: Sequence[str | os.PathLike[str]], cmvn: Cmvn, transcripts: Mapping[str, str]) -> list[Utterance]:
    """Every utterance of ``shards`` that has a non-empty transcript, in shard then ``utt_id`` order."""
    found = []
    for shard in shards:
        for record in iter_shard(shard, features=("logmel",)):
            text = normalise(transcripts.get(record.utt_id) or "")
            if text and record.logmel is not None:
                found.append(Utterance(record.utt_id, record.speaker_id, cmvn.apply(record.logmel, "logmel"), text))
    return found


@dataclass
class LoadedEncoder:
    """An encoder with the identity of its weights (``sha256``: :func:`weights_sha256` of the
    whole checkpoint's model state, as the training result records it)."""

    model: HubertPretrainModel
    sha256: str
    checkpoint: dict[str, Any]


def load_encoder(path: str | os.PathLike[str]) -> LoadedEncoder:
    """The model of a ``final.pt`` (training, distillation, or a federated run's global encoder,
    whose ``sha256`` is then that of the encoder alone, as the federated asset records it), in
    eval mode on CPU."""
    state = load_checkpoint(Path(path))
    if "encoder" in state and "preset" in state:  # a federated run's final.pt: the global encoder, no heads
        model = HubertPretrainModel(ModelPreset(**state["preset"]), {"none": 2})
        missing, unexpected = model.load_state_dict(state["encoder"], strict=False)
        if unexpected or any(not key.startswith("heads.") for key in missing):
            raise ValueError(f"{path}: the encoder does not fit its preset ({missing=}, {unexpected=})")
        return LoadedEncoder(model.eval(), weights_sha256(state["encoder"]), state)
    if "preset" not in state or "clients" not in state:
        raise ValueError(f"{path} is not a final checkpoint (no preset/clients): use <run>/final.pt")
    model = HubertPretrainModel(ModelPreset(**state["preset"]), dict(state["clients"]))
    model.load_state_dict(state["model"])
    sha = state.get("weights_sha256") or weights_sha256(state["model"])
    return LoadedEncoder(model.eval(), sha, state)


def random_encoder(preset: ModelPreset, seed: int = 0) -> LoadedEncoder:
    """A randomly initialised encoder of ``preset``'s shape (deterministic for ``seed``)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = HubertPretrainModel(preset, {"none": 2})
    return LoadedEncoder(model.eval(), weights_sha256(model.state_dict()), {})


@torch.no_grad()
def layer_features(model: HubertPretrainModel, feats: Sequence[np.ndarray], max_frames: int = 8000) -> list[torch.Tensor]:
    """Frozen hidden states of every utterance: ``(layers + 1, L_i, D)`` float32 each, ``L_i = (T_i + 1) // 2``
    (see :meth:`HubertPretrainModel.hidden_states` for what each layer is)."""
    model.eval()
    out: list[torch.Tensor | None] = [None] * len(feats)
    for batch in batches_by_length([f.shape[0] for f in feats], max_frames):
        padded, lengths = pad([feats[i] for i in batch])
        states, encoded = model.hidden_states(padded, lengths)
        stacked = torch.stack(states, dim=1)  # (B, layers + 1, L, D)
        for row, index in enumerate(batch):
            out[index] = stacked[row, :, : int(encoded.lengths[row])].clone()
    return [t for t in out if t is not None]
