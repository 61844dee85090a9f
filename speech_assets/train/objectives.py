"""Engine objectives: HuBERT's masked prediction (and its held-out evaluation) and CTC fine-tuning.

Inputs: log-mel ``feats (B, T, 80)`` at 100 Hz, ``lengths (B,)``, ``clients (B,)`` and ``targets
(B, L)`` at 50 Hz (``L = (T + 1) // 2``); spans are masked on the 50 Hz frames.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from speech_assets.model.hubert import HubertPretrainModel, output_lengths
from speech_assets.model.loss import IGNORE_INDEX, masked_prediction_loss, summarize
from speech_assets.model.masking import leak_free, pipeline_label_radius, span_mask
from speech_assets.train.data import (
    Batch,
    CorpusIndex,
    SpanMasking,
    UtteranceDataset,
    UtteranceRef,
    collate,
    eval_batches,
    mask_generator,
)
from speech_assets.train.engine import Distributed, all_reduce, autocast


class MaskedPrediction:
    """Cross-entropy of each sample's own head on masked frames (plus ``unmasked_weight`` times the
    unmasked ones); statistics ``(6,)``: :data:`speech_assets.model.loss.STAT_FIELDS`. Masks come from
    ``(seed, *key, step, rank, micro)``: drawn by the loader's workers when the batch carries one,
    else here."""

    def __init__(
        self,
        model: HubertPretrainModel,
        device: torch.device,
        *,
        seed: int,
        mask_prob: float,
        mask_length: int,
        unmasked_weight: float,
        rank: int = 0,
        key: tuple[int | str, ...] = (),
    ) -> None:
        self.model, self.device, self.rank, self.key = model, device, rank, key
        self.unmasked_weight = unmasked_weight
        self.masking = SpanMasking(seed, mask_prob, mask_length, rank, key)

    def __call__(self, model: nn.Module, batch: Batch, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        drawn_for = (self.masking, step, micro)
        if batch.mask is None or batch.masked_for != drawn_for:
            batch = replace(batch, mask=self.masking(batch.lengths, step, micro), masked_for=drawn_for)
        batch = batch.to(self.device)
        mask = batch.mask
        assert mask is not None
        output = model(batch.feats, batch.lengths, batch.clients, mask, padded=batch.padded)
        loss = masked_prediction_loss(output.logits, batch.targets, mask, self.unmasked_weight)
        return loss.loss, loss.stats

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        summary = summarize(totals)
        return {
            "loss": summary["masked_loss"] + self.unmasked_weight * summary["unmasked_loss"],
            "masked_loss": summary["masked_loss"],
            "masked_accuracy": summary["masked_accuracy"],
            "unmasked_accuracy": summary["unmasked_accuracy"],
        }

    @torch.no_grad()
    def evaluate(
        self, dataset: UtteranceDataset, majority: list[int], batch_seconds: float, job: Distributed, precision: str
    ) -> dict[str, Any]:
        """Masked prediction on held-out ``dataset`` (the training masks at fixed seeds), summed over ranks.

        Also ``majority_accuracy`` (always the client's most frequent training label), overall and per
        client, and both on two subsets of masked frames: ``leak_free_*`` (the measure to read: no
        visible frame within :func:`~speech_assets.model.masking.pipeline_label_radius` shares an
        audio sample with the MFCC frame label ``j`` was clustered from) and ``interior_*`` (both
        neighbours masked). With HuBERT's ``p = 0.08``, ``l = 10`` about 62 % of masked frames are
        leak-free, so no separate evaluation mask is needed.
        """
        self.model.eval()
        world, rank = job.world_size, job.rank
        batches = eval_batches(dataset.seconds, batch_seconds, world, rank)
        loader = DataLoader(dataset, batch_sampler=batches, collate_fn=collate, num_workers=0)
        totals = torch.zeros(6, dtype=torch.float64, device=job.device)
        radius = pipeline_label_radius(self.model.frontend)
        # per client: masked frames, correct predictions, majority-label hits; the same on interior
        # frames, then on leak-free frames
        per_client = torch.zeros(len(self.model.clients), 9, dtype=torch.float64, device=job.device)
        majority_labels = torch.tensor(majority, dtype=torch.long, device=job.device)
        for local_index, batch in enumerate(loader):
            mask = self.masking.draw(batch.lengths, "heldout", local_index * world + rank).to(job.device)
            batch = batch.to(job.device)
            with autocast(precision, job.device):
                output = self.model(batch.feats, batch.lengths, batch.clients, mask, padded=batch.padded)
                totals += masked_prediction_loss(output.logits, batch.targets, mask).stats
            inner = torch.zeros_like(mask)
            inner[:, 1:-1] = mask[:, :-2] & mask[:, 1:-1] & mask[:, 2:]
            free, targets = leak_free(mask, radius), batch.targets
            scored = mask & (targets != IGNORE_INDEX)
            correct = (output.logits.argmax(dim=-1) == targets) & scored
            hits = (targets == majority_labels[batch.clients][:, None]) & scored
            counts = [scored, correct, hits, scored & inner, correct & inner, hits & inner]
            counts += [scored & free, correct & free, hits & free]
            per_client.index_add_(0, batch.clients, torch.stack([c.sum(dim=1) for c in counts], dim=1).double())
        self.model.train()
        summary: dict[str, Any] = summarize(all_reduce(totals, job).cpu())
        summary["loss"] = summary["masked_loss"] + self.unmasked_weight * summary["unmasked_loss"]
        rows = all_reduce(per_client, job).cpu()
        column = [float(rows[:, i].sum()) for i in range(9)]
        summary["majority_accuracy"] = column[2] / column[0] if column[0] else 0.0
        summary |= frame_rates(column, float, first=1)
        summary["per_client"] = {
            name: frame_rates(row, int) for name, row in zip(self.model.clients, rows.tolist(), strict=True)
        }
        return summary


SUBSETS = ("masked_", "interior_", "leak_free_")  # the column triples of the held-out counts


def frame_rates(row: list[float], count: type, first: int = 0) -> dict[str, Any]:
    """Frames, masked and majority accuracy of each subset's column triple (frames, correct, majority hits)."""
    rates: dict[str, Any] = {}
    for index in range(first, len(SUBSETS)):
        subset = SUBSETS[index]
        frames, correct, hits = row[3 * index : 3 * index + 3]
        prefix = "" if index == 0 else subset
        rates[f"{subset}frames"] = count(frames)
        rates[f"{prefix}masked_accuracy"] = correct / frames if frames else None
        rates[f"{prefix}majority_accuracy"] = hits / frames if frames else None
    return rates


def majority_labels(index: CorpusIndex, train_refs: list[UtteranceRef]) -> list[int]:
    """Each client's most frequent label over its training utterances (index order of clients)."""
    counts: list[np.ndarray] = [np.zeros(1, np.int64) for _ in index.clients]
    for ref in train_refs:
        labels = index.labels[ref.client][ref.utt_id]
        found = np.bincount(labels[labels >= 0].astype(np.int64))
        if found.shape[0] > counts[ref.client].shape[0]:
            found, counts[ref.client] = counts[ref.client], found
        counts[ref.client][: found.shape[0]] += found
    return [int(c.argmax()) for c in counts]


def proximal_term(model: nn.Module, reference: dict[str, torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's ``mu / 2 * sum ||w - w_ref||^2`` over the parameters named in ``reference``."""
    total = torch.zeros((), device=next(model.parameters()).device)
    for name, parameter in model.named_parameters():
        if name in reference:
            total = total + (parameter - reference[name]).pow(2).sum()
    return 0.5 * mu * total


class Proximal:
    """An objective plus FedProx's proximal term (the client's half of Flower's ``FedProx``)."""

    def __init__(
        self, inner: MaskedPrediction, model: nn.Module, reference: dict[str, torch.Tensor], mu: float
    ) -> None:
        self.inner, self.model, self.mu = inner, model, mu
        self.masking = inner.masking
        device = next(model.parameters()).device
        self.reference = {name: tensor.detach().to(device) for name, tensor in reference.items()}

    def __call__(self, model: nn.Module, batch: Batch, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        loss, stats = self.inner(model, batch, step, micro)
        return loss + proximal_term(self.model, self.reference, self.mu), stats

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        return self.inner.metrics(totals)


CTC_BLANK = 0  # the CTC blank is token 0 of every vocabulary fine-tuned here


class CtcForward(nn.Module):
    """An encoder with a CTC head ``model.heads[0]``: ``feats (B, T, 80)``, ``lengths (B,)``, optional
    ``mask (B, L)`` and ``channels (B, 80)`` -> log-probabilities ``(B, L, V)`` float32 and ``lengths``.
    ``frozen="no_grad"`` trains only the head; ``"zero"`` gives the encoder an exact zero gradient
    instead (DDP needs a gradient for every parameter it wraps)."""

    def __init__(self, model: HubertPretrainModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        feats: torch.Tensor,
        lengths: torch.Tensor,
        mask: torch.Tensor | None = None,
        channels: torch.Tensor | None = None,
        frozen: str = "",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if channels is not None:
            feats = feats.masked_fill(channels[:, None, :], 0.0)
        if frozen == "no_grad":
            with torch.no_grad():
                encoded = self.model.encode(feats, lengths, mask)
            hidden = encoded.hidden.detach()
        else:
            encoded = self.model.encode(feats, lengths, mask)
            hidden = encoded.hidden.detach() + 0.0 * encoded.hidden if frozen == "zero" else encoded.hidden
        return F.log_softmax(self.model.heads[0](hidden).float(), dim=-1), encoded.lengths


def ctc_loss(log_probs: torch.Tensor, lengths: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over utterances of CTC per target token; ``targets (B, S)`` padded with ``IGNORE_INDEX``."""
    valid = targets != IGNORE_INDEX
    return F.ctc_loss(
        log_probs.transpose(0, 1),
        targets[valid],
        lengths,
        valid.sum(dim=1),
        blank=CTC_BLANK,
        reduction="mean",
        zero_infinity=True,
    )


@dataclass
class CtcTraining:
    """CTC fine-tuning: the encoder frozen for ``freeze_steps`` steps, span masks on frames and on
    the 80 input bands from ``(seed, step, rank, micro)``. Statistics ``(3,)``: micro-batches, summed
    loss, frozen micro-batches."""

    device: torch.device
    _: KW_ONLY
    seed: int
    freeze_steps: int
    mask_prob: float
    mask_length: int
    channel_prob: float
    channel_length: int
    rank: int = 0

    def masks(self, lengths: torch.Tensor, *parts: int | str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(B, L)`` frame and ``(B, 80)`` band masks (``None`` at probability 0), in this RNG order."""
        generator = mask_generator(self.seed, "ctc", *parts)
        mask = channels = None
        if self.mask_prob > 0:
            mask = span_mask(output_lengths(lengths), self.mask_prob, self.mask_length, generator)
        if self.channel_prob > 0:
            bands = torch.full_like(lengths, 80)
            channels = span_mask(bands, self.channel_prob, self.channel_length, generator, min_spans=0)
        return mask, channels

    def __call__(self, model: nn.Module, batch: Batch, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        mask, channels = self.masks(batch.lengths, step, self.rank, micro)
        frozen = step < self.freeze_steps
        batch = batch.to(self.device)
        log_probs, lengths = model(
            batch.feats,
            batch.lengths,
            None if mask is None else mask.to(self.device),
            None if channels is None else channels.to(self.device),
            ("zero" if isinstance(model, DistributedDataParallel) else "no_grad") if frozen else "",
        )
        loss = ctc_loss(log_probs, lengths, batch.targets)
        stats = torch.tensor([1.0, 0.0, float(frozen)], dtype=torch.float64, device=self.device)
        stats[1] = loss.detach().double()
        return loss, stats

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        count = float(totals[0].clamp(min=1))
        return {"loss": float(totals[1]) / count, "frozen": float(totals[2]) / count}
