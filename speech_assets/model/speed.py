"""Forward speed of encoders, measured against each other in one process."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from speech_assets.model.batches import cut_batches, pad
from speech_assets.model.hubert import HubertPretrainModel


@torch.no_grad()
def forward_speed(
    encoders: Mapping[str, HubertPretrainModel],
    feats: Sequence[np.ndarray],
    repeats: int = 3,
    threads: int = 1,
    max_frames: int = 4000,
) -> dict[str, float]:
    """Seconds of audio encoded per second by each encoder on the CPU. The encoders take turns on
    the same batches and each one's best round counts, so ratios between encoders are what to read."""
    lengths = np.array([f.shape[0] for f in feats])
    batches = [pad([feats[i] for i in batch]) for batch in cut_batches(np.arange(len(feats)), lengths, max_frames)]
    audio = sum(f.shape[0] for f in feats) / 100.0
    best = {name: float("inf") for name in encoders}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for model in encoders.values():
            model.eval().encode(*batches[0])  # warm-up: first calls allocate
        for _ in range(repeats):
            for name, model in encoders.items():
                started = time.perf_counter()
                for batch, lengths in batches:
                    model.encode(batch, lengths)
                best[name] = min(best[name], time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return {name: audio / seconds for name, seconds in best.items()}
