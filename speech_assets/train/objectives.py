"""Engine objectives: HuBERT's masked prediction (and its held-out evaluation) and the CTC loss."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.model.loss import IGNORE_INDEX, masked_prediction_loss, summarize
from speech_assets.model.masking import leak_free, pipeline_label_radius
from speech_assets.train.data import (
    Batch,
    CorpusIndex,
    SpanMasking,
    UtteranceDataset,
    UtteranceRef,
    collate,
    eval_batches,
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
        self,
        dataset: UtteranceDataset,
        majority: list[int],
        batch_seconds: float,
        job: Distributed,
        precision: str,
        model: HubertPretrainModel | None = None,
    ) -> dict[str, Any]:
        """Masked prediction on held-out ``dataset`` (the training masks at fixed seeds), summed over ranks.

        Also ``majority_accuracy`` (always the client's most frequent training label), overall and per
        client, and both on two subsets of masked frames: ``leak_free_*`` (the measure to read: no
        visible frame within :func:`~speech_assets.model.masking.pipeline_label_radius` shares an
        audio sample with the MFCC frame label ``j`` was clustered from) and ``interior_*`` (both
        neighbours masked). With HuBERT's ``p = 0.08``, ``l = 10`` about 62 % of masked frames are
        leak-free, so no separate evaluation mask is needed. ``model``: a snapshot of the weights to
        score instead of the live model (which then stays in training mode).
        """
        live = model is None
        model = self.model if model is None else model
        model.eval()
        world, rank = job.world_size, job.rank
        batches = eval_batches(dataset.seconds, batch_seconds, world, rank)
        loader = DataLoader(dataset, batch_sampler=batches, collate_fn=collate, num_workers=0)
        totals = torch.zeros(6, dtype=torch.float64, device=job.device)
        radius = pipeline_label_radius(model.frontend)
        # per client: masked frames, correct predictions, majority-label hits; the same on interior
        # frames, then on leak-free frames
        per_client = torch.zeros(len(model.clients), 9, dtype=torch.float64, device=job.device)
        majority_labels = torch.tensor(majority, dtype=torch.long, device=job.device)
        for local_index, batch in enumerate(loader):
            mask = self.masking.draw(batch.lengths, "heldout", local_index * world + rank).to(job.device)
            batch = batch.to(job.device)
            with autocast(precision, job.device):
                output = model(batch.feats, batch.lengths, batch.clients, mask, padded=batch.padded)
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
        if live:
            model.train()
        summary: dict[str, Any] = summarize(all_reduce(totals, job).cpu())
        summary["loss"] = summary["masked_loss"] + self.unmasked_weight * summary["unmasked_loss"]
        rows = all_reduce(per_client, job).cpu()
        column = [float(rows[:, i].sum()) for i in range(9)]
        summary["majority_accuracy"] = column[2] / column[0] if column[0] else 0.0
        summary |= frame_rates(column, float, first=1)
        summary["per_client"] = {
            name: frame_rates(row, int) for name, row in zip(model.clients, rows.tolist(), strict=True)
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
    labels: list[list[np.ndarray]] = [[np.zeros(0, np.int64)] for _ in index.clients]
    for ref in train_refs:
        found = index.labels[ref.client][ref.utt_id]
        labels[ref.client].append(found[found >= 0].astype(np.int64))
    return [int(np.bincount(np.concatenate(parts), minlength=1).argmax()) for parts in labels]


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


def ctc_loss(
    log_probs: torch.Tensor,
    lengths: torch.Tensor,
    targets: torch.Tensor,
    host_lengths: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Mean over utterances of CTC per target token; ``targets (B, S)`` padded with ``IGNORE_INDEX``
    (passed padded: the kernel reads each row up to its length). ``host_lengths``: ``(input,
    target)`` lengths on the host, where the kernel reads them; without them it copies ``lengths``
    and the target counts off the device."""
    counts = (targets != IGNORE_INDEX).sum(dim=1)
    inputs, tokens = host_lengths or (lengths, counts)
    per_utterance = F.ctc_loss(
        log_probs.transpose(0, 1), targets, inputs, tokens, blank=CTC_BLANK, reduction="none", zero_infinity=True
    )
    return (per_utterance / counts.clamp(min=1)).mean()  # reduction="mean" without its host-built tensor
