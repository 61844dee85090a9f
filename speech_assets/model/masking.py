"""HuBERT span masking: random span starts, fixed-length spans, overlaps allowed.

With start probability ``p`` and span length ``l`` each frame of a long sequence is masked with
probability close to ``1 - (1 - p) ** l`` (about 0.57 for HuBERT's ``p = 0.08``, ``l = 10``).
"""

from __future__ import annotations

import torch


def span_mask(
    lengths: torch.Tensor,
    mask_prob: float,
    mask_length: int,
    generator: torch.Generator,
    min_spans: int = 1,
) -> torch.Tensor:
    """Sample a span mask for a padded batch.

    Args:
        lengths: ``(B,)`` valid lengths (50 Hz frames) of each sequence.
        mask_prob: probability that a frame starts a span (HuBERT: 0.08); each sequence gets
            ``floor(mask_prob * L + u)``, ``u ~ U[0, 1)``, distinct starts (at least ``min_spans``).
        mask_length: span length in frames (HuBERT: 10), shortened to ``L`` for shorter sequences.
        generator: CPU generator, so that masks are reproducible independently of the global RNG.
        min_spans: lower bound on the number of spans per non-empty sequence.

    Returns:
        ``(B, max(lengths))`` bool on CPU, ``True`` where the frame is masked; never ``True`` on
        padding (positions ``>= lengths[b]``).
    """
    if not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"mask_prob must be in [0, 1], got {mask_prob}")
    if mask_length < 1:
        raise ValueError(f"mask_length must be >= 1, got {mask_length}")
    lengths_list = [int(n) for n in lengths.tolist()]
    mask = torch.zeros(len(lengths_list), max(lengths_list, default=0), dtype=torch.bool)
    for row, length in enumerate(lengths_list):
        if length == 0:
            continue
        span = min(mask_length, length)
        candidates = length - span + 1
        draw = float(torch.rand((), generator=generator))
        num_spans = min(max(int(mask_prob * length + draw), min_spans), candidates)
        if num_spans == 0:
            continue
        starts = torch.randperm(candidates, generator=generator)[:num_spans]
        mask[row, (starts[:, None] + torch.arange(span)).reshape(-1)] = True
    return mask
