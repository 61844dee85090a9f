"""Variable-length inputs batched for a model: length-bucketed batches and zero padding (the
frozen-encoder passes of iteration-2 targets, evaluation and export)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def batches_by_length(lengths: Sequence[int], max_frames: int) -> list[list[int]]:
    """Indices grouped into batches of similar length whose padded size stays within ``max_frames``."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for index in order:
        if batches and (len(batches[-1]) + 1) * lengths[index] <= max_frames:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def pad(feats: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T_max, F)`` zero-padded float32 batch and ``lengths (B,)`` of ``(T_i, F)`` arrays."""
    lengths = torch.tensor([f.shape[0] for f in feats], dtype=torch.long)
    batch = torch.zeros(len(feats), int(lengths.max()), feats[0].shape[1])
    for row, f in enumerate(feats):
        batch[row, : f.shape[0]] = torch.from_numpy(np.ascontiguousarray(f))
    return batch, lengths
