"""A character CTC probe on frozen features (the SUPERB convention): a softmax-weighted sum of the
encoder's layer-normalised layers, then a linear layer (or a BiLSTM and one) to the 29 CTC tokens.
Features are computed once and kept in memory, so probe steps cost only the probe.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from speech_assets.evaluation.probe_options import ProbeOptions
from speech_assets.evaluation.text import VOCAB_SIZE, decode_greedy, encode
from speech_assets.model.loss import IGNORE_INDEX
from speech_assets.train.objectives import ctc_loss


class CtcProbe(nn.Module):
    """``layers (B, N, L, D)``, ``lengths (B,)`` -> CTC log-probabilities ``(B, L, 29)``."""

    def __init__(self, num_layers: int, dim: int, probe: str = "linear", hidden: int = 128) -> None:
        super().__init__()
        self.layer_logits = nn.Parameter(torch.zeros(num_layers))
        self.lstm = nn.LSTM(dim, hidden, batch_first=True, bidirectional=True) if probe == "bilstm" else None
        self.output = nn.Linear(2 * hidden if self.lstm is not None else dim, VOCAB_SIZE)

    @property
    def layer_weights(self) -> list[float]:
        return torch.softmax(self.layer_logits.detach(), dim=0).tolist()

    def forward(self, layers: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.head(layer_norm(layers), lengths)

    def head(self, normed: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = torch.einsum("n,bnld->bld", torch.softmax(self.layer_logits, dim=0), normed)
        if self.lstm is not None:
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
            x, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=x.shape[1])
        return F.log_softmax(self.output(x), dim=-1)


def layer_norm(layers: torch.Tensor) -> torch.Tensor:
    """Per frame, no affine parameters: normalising each utterance once equals normalising every padded batch."""
    return F.layer_norm(layers, layers.shape[-1:])


def collate_layers(items: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, L_i, D)`` tensors -> zero-padded ``(B, N, L_max, D)`` and ``lengths (B,)``."""
    lengths = torch.tensor([t.shape[1] for t in items], dtype=torch.long)
    batch = nn.utils.rnn.pad_sequence([t.transpose(0, 1) for t in items], batch_first=True)  # (B, L_max, N, D)
    return batch.transpose(1, 2).float().contiguous(), lengths


def _schedule(step: int, steps: int) -> float:
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def padded(targets: Sequence[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(list(targets), batch_first=True, padding_value=IGNORE_INDEX)


@dataclass
class Trained:
    """A probe of :func:`train_probes` at the step it was kept, with its dev CER there (NaN without dev)."""

    lr: float
    step: int
    dev_cer: float
    probe: CtcProbe


def train_probes(
    features: Sequence[torch.Tensor],
    texts: Sequence[str],
    options: ProbeOptions,
    seed: int = 0,
    *,
    lrs: Sequence[float] = (),
    stop_at: int | None = None,
    dev: tuple[Sequence[torch.Tensor], Sequence[str]] | None = None,
    every: int = 0,
    patience: int = 0,
    normalised: bool = False,
) -> list[Trained]:
    """One probe per learning rate of ``lrs`` (empty: ``options.lr``) on the same batches, each as if
    trained alone with that lr (the CTC loss dominates a CPU step: batches are read and normalised
    once for all). With ``dev``, every ``every`` steps (0: ``steps // 8``) each probe
    is kept at its best dev CER (ties: the earlier) and stops after ``patience`` evaluations (0:
    never) without improvement. ``normalised``: ``features`` are already :func:`layer_norm` ed."""
    if not features:
        raise ValueError("no training utterances for the probe")
    lrs = tuple(lrs) or (options.lr,)
    targets = [torch.tensor(encode(text), dtype=torch.long) for text in texts]
    dev_features = [f if normalised else layer_norm(f) for f in dev[0]] if dev else []
    every = every or max(1, options.steps // 8)
    total = options.steps if stop_at is None else max(1, min(stop_at, options.steps))
    generator = torch.Generator().manual_seed(seed)
    probes, optimizers, schedulers = [], [], []
    for lr in lrs:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            probe = CtcProbe(features[0].shape[0], features[0].shape[2], options.probe, options.hidden)
        optimizer = torch.optim.AdamW(probe.parameters(), lr=lr, weight_decay=0.0)
        probes.append(probe.train())
        optimizers.append(optimizer)
        schedulers.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, options.steps)))
    kept = [Trained(lr, 0, math.nan, probe) for lr, probe in zip(lrs, probes, strict=True)]
    active, stale = set(range(len(lrs))), [0] * len(lrs)
    order: list[int] = []
    for step in range(1, total + 1):
        if len(order) < options.batch_size:
            order += torch.randperm(len(features), generator=generator).tolist()
        batch, order = order[: options.batch_size], order[options.batch_size :]
        layers, lengths = collate_layers([features[i] for i in batch])
        normed = layers if normalised else layer_norm(layers)
        chosen = padded([targets[i] for i in batch])
        running = sorted(active)
        loss = sum(ctc_loss(probes[p].head(normed, lengths), lengths, chosen) for p in running)
        for p in running:
            optimizers[p].zero_grad(set_to_none=True)
        loss.backward()
        for p in running:
            nn.utils.clip_grad_norm_(probes[p].parameters(), 5.0)
            optimizers[p].step()
            schedulers[p].step()
        if not (dev_features and (step % every == 0 or step == total)):
            continue
        for p in running:
            cer = score(dev[1], transcribe(probes[p], dev_features, normalised=True)).cer
            if math.isnan(kept[p].dev_cer) or cer < kept[p].dev_cer:
                kept[p], stale[p] = Trained(lrs[p], step, cer, copy.deepcopy(probes[p]).eval()), 0
            else:
                stale[p] += 1
                if patience and stale[p] >= patience:
                    active.discard(p)
            probes[p].train()
        if not active:
            break
    if not dev_features:
        kept = [Trained(lr, total, math.nan, probe) for lr, probe in zip(lrs, probes, strict=True)]
    for trained in kept:
        trained.probe.eval()
    return kept


@torch.no_grad()
def transcribe(
    probe: CtcProbe, features: Sequence[torch.Tensor], batch_size: int = 16, normalised: bool = False
) -> list[str]:
    probe.eval()
    hypotheses: list[str] = []
    for start in range(0, len(features), batch_size):
        layers, lengths = collate_layers(features[start : start + batch_size])
        best = (probe.head(layers, lengths) if normalised else probe(layers, lengths)).argmax(dim=-1)
        hypotheses += [decode_greedy(best[row, : int(n)].tolist()) for row, n in enumerate(lengths)]
    return hypotheses


@dataclass(frozen=True)
class Scores:
    """Corpus-level ``cer`` and ``wer`` (edit operations over reference characters/words)."""

    cer: float
    wer: float
    utterances: int


def score(references: Sequence[str], hypotheses: Sequence[str]) -> Scores:
    import jiwer

    if not references:
        return Scores(float("nan"), float("nan"), 0)
    refs, hyps = list(references), list(hypotheses)
    return Scores(float(jiwer.cer(refs, hyps)), float(jiwer.wer(refs, hyps)), len(refs))


def utterance_errors(references: Sequence[str], hypotheses: Sequence[str]) -> tuple[np.ndarray, ...]:
    """Per utterance ``(U,)`` int64: (char errors, chars, word errors, words), summing to :func:`score`'s rates."""
    from rapidfuzz.distance import Levenshtein

    pairs = list(zip(references, hypotheses, strict=True))
    return (
        np.array([Levenshtein.distance(r, h) for r, h in pairs], dtype=np.int64),
        np.array([len(r) for r, _ in pairs], dtype=np.int64),
        np.array([Levenshtein.distance(r.split(), h.split()) for r, h in pairs], dtype=np.int64),
        np.array([len(r.split()) for r, _ in pairs], dtype=np.int64),
    )


def dev_split(speakers: Sequence[str]) -> tuple[list[int], list[int]]:
    """(fit, dev) indices: speakers on a grid of a fifth of the sorted names are dev (at least one,
    one left to fit); with a single speaker, every fifth utterance."""
    names = sorted(set(speakers))
    if len(names) >= 2:
        count = min(len(names) - 1, max(1, round(len(names) / 5)))
        step = len(names) / count
        dev_names = {names[int(i * step)] for i in range(count)}
        dev = [i for i, s in enumerate(speakers) if s in dev_names]
    else:
        dev = list(range(0, len(speakers), 5))
    chosen = set(dev)
    return [i for i in range(len(speakers)) if i not in chosen], dev


def subsample(count: int, limit: int, seed: int = 0) -> list[int]:
    """At most ``limit`` of ``range(count)``, a seeded choice kept in order (``limit <= 0``: all)."""
    if limit <= 0 or count <= limit:
        return list(range(count))
    return sorted(np.random.default_rng(seed).choice(count, size=limit, replace=False).tolist())
