"""An encoder's weights: their identity (``weights_sha256``), a training checkpoint's encoder
(``load_encoder``: training, distillation or a federated run's global encoder, loaded with
``torch.load(weights_only=True)``) and a random one of the same shape (``random_encoder``)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.model.presets import ModelPreset


def weights_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over tensors in sorted key order (name, dtype, shape, raw bytes), independent of
    pickling, file layout and device."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        tensor = state_dict[key].detach().to("cpu").contiguous()
        header = f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode()
        digest.update(len(header).to_bytes(8, "little"))
        digest.update(header)
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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
    state = torch.load(Path(path), map_location="cpu", weights_only=True)
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
