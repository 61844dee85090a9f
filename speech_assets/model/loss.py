"""Masked-prediction loss (pure functions over tensors, no training-loop state)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, unmasked_weight: float = 0.0
) -> LossOutput:
    """Mean cross-entropy of each row's head (``logits (B, L, K_max)``, ``-inf`` past its ``k``) against
    its targets over masked frames, plus ``unmasked_weight`` times that over unmasked ones (HuBERT: 0),
    and the summed statistics (which report the unmasked frames' loss even at weight 0)."""
    if targets.shape != mask.shape:
        raise ValueError(f"targets {tuple(targets.shape)} and mask {tuple(mask.shape)} differ in shape")
    # in the logits' dtype: under autocast cross_entropy runs in fp32 (an autocast fp32 op), sums in fp32
    ce = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none").float()
    valid = targets != IGNORE_INDEX
    correct = logits.argmax(dim=-1) == targets
    # masked sums, not boolean indexing: the selected frames' count is never read on the host
    masked, unmasked = valid & mask, valid & ~mask
    masked_sum, unmasked_sum = torch.where(masked, ce, 0.0).sum(), torch.where(unmasked, ce, 0.0).sum()
    counts = [(correct & masked).sum(), masked.sum(), (correct & unmasked).sum(), unmasked.sum()]
    sums = torch.stack([masked_sum.detach(), *counts[:2], unmasked_sum.detach(), *counts[2:]]).double()
    loss = masked_sum / sums[2].clamp(min=1).float()
    if unmasked_weight:
        loss = loss + unmasked_weight * unmasked_sum / sums[5].clamp(min=1).float()
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
