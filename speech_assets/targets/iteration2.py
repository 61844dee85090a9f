"""HuBERT iteration 2: one client's k-means targets in the feature space of a trained encoder.

Iteration 2 clusters the hidden states of one layer of the frozen iteration-1 encoder (the middle
one by default, as HuBERT's layer 6 of 12), each client only its own utterances. Features are
never all in memory: the fit sample and the labelling pass go one shard at a time. Labels come
out at the encoder's 50 Hz rate, the layout of iteration 1's ``labels.parquet``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speech_assets.features.cmvn import Normaliser, from_record
from speech_assets.features.shards import FeatureRecord
from speech_assets.model.batches import frozen_hidden_states
from speech_assets.model.encoders import load_encoder
from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.targets import kmeans
from speech_assets.targets.build import ClientTargetSet, build_client_targets
from speech_assets.targets.config import ITERATION2_KMEANS
from speech_assets.targets.publish import ClientShards, publish_client_targets


def default_layer(model: HubertPretrainModel) -> int:
    """HuBERT's choice scaled to depth: layer 6 of 12 for Base, the middle layer otherwise."""
    return max(1, len(model.encoder.layers) // 2)


class EncoderRefused(ValueError):
    """A checkpoint iteration 2 cannot cluster in (a layer outside it, or no recorded input normalisation)."""


@dataclass(frozen=True)
class Iteration2Encoder:
    """The frozen encoder whose ``layer`` (1-based) iteration 2 clusters, with its input normalisation."""

    model: HubertPretrainModel
    layer: int
    cmvn: Normaliser
    sha256: str
    checkpoint: str
    asset: str
    data_version: str

    def record(self) -> dict[str, Any]:
        return {
            "encoder_asset": self.asset,
            "checkpoint": self.checkpoint,
            "checkpoint_sha256": self.sha256,
            "checkpoint_data_version": self.data_version,
            "layer": self.layer,
        }


def load_iteration2_encoder(
    checkpoint: str, layer: int, *, asset: str, data_version: str, device: torch.device | None = None
) -> Iteration2Encoder:
    """The encoder of ``checkpoint`` on ``device`` (CUDA when there is one) at ``layer`` (0: :func:`default_layer`)."""
    encoder = load_encoder(checkpoint)
    model = encoder.model
    layer = layer or default_layer(model)
    if not 1 <= layer <= len(model.encoder.layers):
        raise EncoderRefused(f"[iteration2] layer {layer} is outside 1..{len(model.encoder.layers)}")
    if (cmvn := from_record(encoder.checkpoint.get("normalisation"))) is None:
        raise EncoderRefused(f"{checkpoint} records no input normalisation: re-materialise {asset}")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return Iteration2Encoder(model.to(device), layer, cmvn, encoder.sha256, checkpoint, asset, data_version)


def iteration2_targets(
    client: ClientShards,
    out_dir: Path,
    encoder: Iteration2Encoder,
    config: kmeans.KMeansConfig,
    *,
    settings: str,
    code_version: str,
    log: Callable[[str], None] = print,
    warn: Callable[[str], None] = print,
) -> dict:
    """Reuse or refit one client's targets in ``encoder``'s feature space; returns the published record."""

    def fit(previous: dict, intact: bool) -> tuple[ClientTargetSet, dict[str, Any]]:
        result = build_iter2_targets(
            client.client_id,
            client.files(client.speakers),
            encoder.cmvn,
            encoder.model,
            encoder.layer,
            out_dir,
            config,
            log=warn,
            label_only=client.files(client.heldout),
        )
        return result, {"label_rate_hz": 50, **encoder.record()}

    fit_inputs = [encoder.sha256, str(encoder.layer), settings, code_version]  # what decides a fit beside the shards
    return publish_client_targets(client, out_dir, fit_inputs, config.k, fit, log=log, what="iteration-2 targets")


def build_iter2_targets(
    client_id: str,
    shard_paths: list[Path],
    cmvn: Normaliser,
    model: HubertPretrainModel,
    layer: int,
    out_dir: Path,
    config: kmeans.KMeansConfig = ITERATION2_KMEANS,
    log: Callable[[str], None] = print,
    label_only: Collection[Path] = (),
) -> ClientTargetSet:
    """Fit one client's codebook on ``layer`` features of its own shards, then label all of them;
    ``label_only`` shards (the held-out speakers') are labelled but never fitted."""
    model.eval()

    def hidden_states(records: list[FeatureRecord]) -> list[np.ndarray]:
        feats = [cmvn.apply(record.logmel, "logmel") for record in records]  # apply() gives float32
        return [states.numpy() for states in frozen_hidden_states(model, feats, layer=layer)]

    return build_client_targets(
        client_id,
        shard_paths,
        None,
        out_dir,
        config,
        log,
        label_only,
        feature="logmel",
        featurise=hidden_states,
        model_rate=True,
    )
