"""Masked-prediction loss (pure functions over tensors, no training-loop state)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speech_assets.model.hubert import ClientLogits

IGNORE_INDEX = -100
STAT_FIELDS = (
    "masked_loss_sum",
    "masked_correct",
    "masked_frames",
    "unmasked_loss_sum",
    "unmasked_correct",
    "unmasked_frames",
)


@dataclass
class LossOutput:
    """``loss``: scalar to back-propagate; ``stats``: ``(6,)`` float64 detached sums in
    :data:`STAT_FIELDS` order (additive across micro-batches and ranks)."""

    loss: torch.Tensor
    stats: torch.Tensor


def masked_prediction_loss(
    logits: Sequence[ClientLogits], targets: torch.Tensor, mask: torch.Tensor, unmasked_weight: float = 0.0
) -> LossOutput:
    """Mean cross-entropy of each client's head against its own targets over masked frames, plus
    ``unmasked_weight`` times that over unmasked ones (HuBERT: 0), and the summed statistics."""
    if targets.shape != mask.shape:
        raise ValueError(f"targets {tuple(targets.shape)} and mask {tuple(mask.shape)} differ in shape")
    sums = torch.zeros(len(STAT_FIELDS), dtype=torch.float64, device=targets.device)
    masked_total = targets.new_zeros((), dtype=torch.float32)
    unmasked_total = targets.new_zeros((), dtype=torch.float32)
    for group in logits:
        # masked sums, not boolean indexing: the selected frames' count is never read on the host
        client_targets = group.select(targets)
        valid = client_targets != IGNORE_INDEX
        client_mask = group.select(mask)
        ce = F.cross_entropy(
            group.logits.float().transpose(1, 2), client_targets, ignore_index=IGNORE_INDEX, reduction="none"
        )
        correct = group.logits.argmax(dim=-1) == client_targets
        masked, unmasked = valid & client_mask, valid & ~client_mask
        masked_sum = torch.where(masked, ce, 0.0).sum()
        unmasked_sum = torch.where(unmasked, ce, 0.0).sum()
        masked_total = masked_total + masked_sum
        unmasked_total = unmasked_total + unmasked_sum
        counts = [(correct & masked).sum(), masked.sum(), (correct & unmasked).sum(), unmasked.sum()]
        sums += torch.stack([masked_sum.detach(), *counts[:2], unmasked_sum.detach(), *counts[2:]]).double()
    loss = masked_total / sums[2].clamp(min=1).float()
    if unmasked_weight:
        loss = loss + unmasked_weight * unmasked_total / sums[5].clamp(min=1).float()
    return LossOutput(loss=loss, stats=sums)


def summarize(stats: torch.Tensor) -> dict[str, float]:
    """Turn summed :data:`STAT_FIELDS` into means: masked/unmasked loss and accuracy, frame counts."""
    values = dict(zip(STAT_FIELDS, stats.tolist(), strict=True))
    masked, unmasked = max(values["masked_frames"], 1.0), max(values["unmasked_frames"], 1.0)
    return {
        "masked_loss": values["masked_loss_sum"] / masked,
        "masked_accuracy": values["masked_correct"] / masked,
        "unmasked_loss": values["unmasked_loss_sum"] / unmasked,
        "unmasked_accuracy": values["unmasked_correct"] / unmasked,
        "masked_frames": values["masked_frames"],
        "unmasked_frames": values["unmasked_frames"],
    }
