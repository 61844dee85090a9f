"""Variable-length inputs batched for a model: length-bucketed batches, zero padding and the
frozen-encoder passes of iteration-2 targets, evaluation and export."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from speech_assets.model.hubert import HubertPretrainModel


def cut_batches(indices: Sequence[int] | np.ndarray, seconds: np.ndarray, batch_seconds: float) -> list[list[int]]:
    """Sort ``indices`` by length (``seconds``, or frames with a frame limit) and cut them greedily into
    batches whose padded size stays within ``batch_seconds`` (a longer one is a batch alone)."""
    ordered = np.asarray(indices, dtype=np.int64)
    ordered = ordered[np.argsort(seconds[ordered], kind="stable")]
    batches: list[list[int]] = []
    current: list[int] = []
    for index in ordered.tolist():
        if current and (len(current) + 1) * seconds[index] > batch_seconds:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def pad(feats: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T_max, F)`` zero-padded float32 batch and ``lengths (B,)`` of ``(T_i, F)`` arrays."""
    rows = [torch.from_numpy(np.ascontiguousarray(f, dtype=np.float32)) for f in feats]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), torch.tensor([len(f) for f in feats])


@torch.no_grad()
def frozen_hidden_states(
    model: HubertPretrainModel, feats: Sequence[np.ndarray], max_frames: int = 8000, layer: int | None = None
) -> list[torch.Tensor]:
    """Per log-mel input ``(T_i, 80)``, every layer's frozen output ``(layers + 1, L_i, D)`` or only
    ``layer``'s ``(L_i, D)`` float32 on the CPU (0: the Transformer's input), batched by length on
    the model's device (bf16 autocast on CUDA)."""
    model.eval()
    device = next(model.parameters()).device
    out: list[torch.Tensor | None] = [None] * len(feats)
    for batch in cut_batches(np.arange(len(feats)), np.array([f.shape[0] for f in feats]), max_frames):
        padded, lengths = pad([feats[i] for i in batch])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            states, encoded = model.hidden_states(padded.to(device), lengths.to(device))
        hidden = torch.stack(states, dim=1) if layer is None else states[layer].float().cpu()  # (B, [layers,] L, D)
        for row, index in enumerate(batch):
            out[index] = hidden[row, ..., : int(encoded.lengths[row]), :].clone()
    return [t for t in out if t is not None]
