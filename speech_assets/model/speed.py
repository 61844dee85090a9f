"""The cost of an encoder: a training replica's memory and FLOPs (analytic), and forward speed
measured against other encoders in one process."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from speech_assets.features.shards import FRAME_RATE_HZ
from speech_assets.model.batches import cut_batches, pad
from speech_assets.model.hubert import HubertPretrainModel, count_parameters
from speech_assets.model.presets import get_preset


@dataclass(frozen=True)
class ModelProfile:
    """Memory of one training replica: fp32 weights, gradients and AdamW's two moments; activations
    kept for backward per second of audio."""

    preset: str
    parameters: int
    weight_bytes: int
    grad_bytes: int
    adam_bytes: int
    activation_bytes_per_second_fp32: float
    activation_bytes_per_second_16bit: float
    train_flops_per_second: float

    @property
    def state_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.adam_bytes


def profile_model(preset: str, num_clients: int, ks: int | Sequence[int], mean_seconds: float = 10.0) -> ModelProfile:
    """Exact parameter count (built on the meta device) and analytic memory/FLOPs; ``mean_seconds``
    sets the sequence length of the attention FLOPs."""
    sizes = [int(ks)] * num_clients if isinstance(ks, int) else [int(k) for k in ks]
    if len(sizes) != num_clients:
        raise ValueError(f"{len(sizes)} codebook sizes for {num_clients} clients")
    spec = get_preset(preset)
    with torch.device("meta"):
        parameters = count_parameters(HubertPretrainModel(spec, {f"c{i}": k for i, k in enumerate(sizes)}))
    frames_per_second = FRAME_RATE_HZ / 2
    return ModelProfile(
        preset=preset,
        parameters=parameters,
        weight_bytes=4 * parameters,
        grad_bytes=4 * parameters,
        adam_bytes=8 * parameters,
        activation_bytes_per_second_fp32=spec.activation_bytes_per_frame(4) * frames_per_second,
        activation_bytes_per_second_16bit=spec.activation_bytes_per_frame(2) * frames_per_second,
        train_flops_per_second=spec.train_flops_per_frame(mean_seconds * frames_per_second, sizes) * frames_per_second,
    )


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
