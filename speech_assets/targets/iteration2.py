"""HuBERT iteration 2: one client's k-means targets in the feature space of a trained encoder.

Iteration 1 clusters MFCC frames; iteration 2 clusters the hidden states of one layer of the
iteration-1 encoder (HuBERT: layer 6 of 12 for Base; here the middle layer by default). Each
client clusters only its own utterances (the federated rule of iteration 1 still holds); the
encoder is frozen, in eval mode, fp32 on CPU or bf16 autocast on CUDA.

Features are never all in memory: the fit sample (whole utterances, at most ``config.max_fit_frames``
50 Hz frames) is computed shard by shard, and the labelling pass computes, labels and drops one
shard's features at a time. Labels come out at the model's 50 Hz rate directly (the encoder's
output rate), ``len = (num_frames + 1) // 2``, the layout of iteration 1's ``labels.parquet``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import numpy as np
import torch

from speech_assets.features.cmvn import Normaliser
from speech_assets.features.shards import iter_shard
from speech_assets.model.batches import batches_by_length, pad
from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.targets import kmeans
from speech_assets.targets.build import ClientState, ClientTargetSet, fit_k, fit_sample, write_client_targets
from speech_assets.targets.config import ITERATION2_KMEANS
from speech_assets.targets.labels import UtteranceLabels


def default_layer(model: HubertPretrainModel) -> int:
    """HuBERT's choice scaled to depth: layer 6 of 12 for Base, the middle layer otherwise."""
    return max(1, len(model.encoder.layers) // 2)


@torch.no_grad()
def layer_frames(
    model: HubertPretrainModel, feats: Sequence[np.ndarray], layer: int, max_frames: int = 8000
) -> list[np.ndarray]:
    """``layer``'s hidden states ``(L_i, D)`` float32 (``L_i = (T_i + 1) // 2``) of log-mel ``(T_i, 80)`` inputs.

    Batches by length (padded size at most ``max_frames`` input frames); ``layer`` counts like
    :meth:`HubertPretrainModel.hidden_states` (0 = the Transformer's input).
    """
    device = next(model.parameters()).device
    out: list[np.ndarray | None] = [None] * len(feats)
    for batch in batches_by_length([f.shape[0] for f in feats], max_frames):
        padded, lengths = pad([feats[i] for i in batch])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            states, encoded = model.hidden_states(padded.to(device), lengths.to(device))
        hidden = states[layer].float().cpu()
        for row, index in enumerate(batch):
            out[index] = hidden[row, : int(encoded.lengths[row])].numpy().copy()
    return [x for x in out if x is not None]


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
    """Fit one client's codebook on ``layer`` features of its own shards, then label all of them.

    ``cmvn`` normalises the log-mel input exactly as the encoder was trained (its checkpoint's
    record). ``label_only`` shards (the held-out speakers') are labelled but never fitted. Writes
    ``codebook.npy`` ``(K, D)``, ``labels.parquet`` (50 Hz) and ``state.npz`` under ``out_dir``.
    """
    model.eval()
    fit_parts: list[np.ndarray] = []
    fit_paths = [path for path in shard_paths if path not in set(label_only)]
    for shard_number, utt_ids in sorted(
        fit_sample(client_id, fit_paths, config.max_fit_frames, config.seed, model_rate=True).items()
    ):
        feats = [
            cmvn.apply(r.logmel, "logmel")
            for r in iter_shard(fit_paths[shard_number], features=("logmel",), dtype=None)  # apply() gives float32
            if r.utt_id in utt_ids
        ]
        fit_parts += layer_frames(model, feats, layer)
    frames = np.concatenate(fit_parts, axis=0)
    del fit_parts
    k_used = fit_k(client_id, frames.shape[0], config, log)
    fit = kmeans.fit_kmeans(frames, k_used, config.seed, **config.fit_kwargs())
    del frames

    codebook = kmeans.CodebookIndex(fit.codebook)
    quality = kmeans.QualityAccumulator(k_used)
    items: list[UtteranceLabels] = []
    for path in shard_paths:
        records = list(iter_shard(path, features=("logmel",), dtype=None))
        hidden = layer_frames(model, [cmvn.apply(r.logmel, "logmel") for r in records], layer)
        labels_per_utt, sqdists = kmeans.label_utterances_with_sqdist(hidden, codebook)
        for record, labels, sqdist in zip(records, labels_per_utt, sqdists, strict=True):
            quality.add(labels, sqdist)
            items.append(UtteranceLabels(record.utt_id, record.speaker_id, labels))
    dim = fit.codebook.shape[1]
    # the state keeps the same fields as iteration 1's; the "CMVN" of encoder features is the identity
    state = ClientState(
        fit.codebook,
        np.zeros(dim, np.float32),
        np.ones(dim, np.float32),
        fit.frames_fit,
        fit.inertia_per_frame,
        quality,
    )
    return write_client_targets(client_id, config.k, out_dir, state, items, shard_paths)
