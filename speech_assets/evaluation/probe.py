"""A character CTC probe on frozen features (the SUPERB convention).

The encoder is frozen; the probe learns a softmax-weighted sum of its layers (each
layer-normalised without affine parameters), then a linear layer (``linear``) or a one-layer
BiLSTM and a linear layer (``bilstm``) to the 29 CTC tokens (:mod:`speech_assets.evaluation.text`),
trained with CTC on the training speakers. Greedy (best-path) decoding; CER and WER from jiwer.

Features are computed once per utterance and kept in memory (``(layers + 1, L, D)`` float32 per
utterance; 100 Hz log-mel is a single "layer" ``(1, T, 80)``), so probe steps cost only the probe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from speech_assets.evaluation.text import BLANK, VOCAB_SIZE, decode_greedy, encode

PROBES = ("linear", "bilstm")


@dataclass(frozen=True)
class ProbeOptions:
    """``steps`` AdamW steps of ``batch_size`` utterances at ``lr`` (linear warmup over the first
    10 %, then cosine decay); ``hidden``: BiLSTM width per direction; ``seeds``: one probe per seed
    (:func:`~speech_assets.evaluation.compare.compare_encoders`), each seed setting the probe's
    initialisation and the order it reads the utterances in); ``lrs``: learning rates to choose
    from, per model, on a development split of the training speakers, together with the stopping
    step (every ``steps // 4``; :func:`~speech_assets.evaluation.compare.compare_encoders`: SUPERB
    searches the learning rate per upstream model and tests its best development checkpoint);
    empty: ``lr`` for all and ``steps`` steps, one value: that value."""

    probe: str = "linear"
    steps: int = 400
    batch_size: int = 8
    lr: float = 2e-3
    hidden: int = 128
    seeds: tuple[int, ...] = (0, 1, 2)
    lrs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))  # settings give a list
        object.__setattr__(self, "lrs", tuple(float(lr) for lr in self.lrs))
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one, got {self.seeds}")
        if len(set(self.lrs)) != len(self.lrs) or any(lr <= 0 for lr in self.lrs):
            raise ValueError(f"lrs must be distinct and > 0, got {self.lrs}")
        if self.probe not in PROBES:
            raise ValueError(f"probe must be one of {PROBES}, got {self.probe!r}")
        if self.steps < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError("steps and batch_size must be >= 1 and lr > 0")


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
        normed = F.layer_norm(layers, layers.shape[-1:])
        x = torch.einsum("n,bnld->bld", torch.softmax(self.layer_logits, dim=0), normed)
        if self.lstm is not None:
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
            x, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=x.shape[1])
        return F.log_softmax(self.output(x), dim=-1)


def collate_layers(items: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, L_i, D)`` tensors -> zero-padded ``(B, N, L_max, D)`` and ``lengths (B,)``."""
    lengths = torch.tensor([t.shape[1] for t in items], dtype=torch.long)
    n, _, d = items[0].shape
    batch = torch.zeros(len(items), n, int(lengths.max()), d)
    for row, t in enumerate(items):
        batch[row, :, : t.shape[1]] = t
    return batch, lengths


def _schedule(step: int, steps: int) -> float:
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train_probe(
    features: Sequence[torch.Tensor], texts: Sequence[str], options: ProbeOptions, seed: int = 0, *,
    stop_at: int | None = None, every: int = 0, on_checkpoint: Callable[[int, CtcProbe], None] | None = None,
) -> CtcProbe:  # fmt: skip
    """Train a probe on ``features`` (``(N, L_i, D)`` each) with CTC against ``texts``.

    Deterministic for a given ``seed`` and thread count: ``seed`` initialises the probe, and
    utterances are drawn epoch by epoch in an order ``seed`` shuffles. The schedule always spans
    ``options.steps``; ``stop_at`` ends training earlier on that schedule (a stopping point chosen
    on development data). ``on_checkpoint(step, probe)`` sees the probe (in eval mode) every
    ``every`` steps and at the end.
    """
    if not features:
        raise ValueError("no training utterances for the probe")
    targets = [torch.tensor(encode(text), dtype=torch.long) for text in texts]
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        probe = CtcProbe(features[0].shape[0], features[0].shape[2], options.probe, options.hidden)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=options.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, options.steps))
    order: list[int] = []
    total = options.steps if stop_at is None else max(1, min(stop_at, options.steps))
    probe.train()
    for step in range(1, total + 1):
        if len(order) < options.batch_size:
            order += torch.randperm(len(features), generator=generator).tolist()
        batch, order = order[: options.batch_size], order[options.batch_size :]
        layers, lengths = collate_layers([features[i] for i in batch])
        log_probs = probe(layers, lengths)
        loss = F.ctc_loss(
            log_probs.transpose(0, 1),
            torch.cat([targets[i] for i in batch]),
            lengths,
            torch.tensor([len(targets[i]) for i in batch]),
            blank=BLANK,
            zero_infinity=True,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(probe.parameters(), 5.0)
        optimizer.step()
        scheduler.step()
        if on_checkpoint is not None and ((every and step % every == 0) or step == total):
            on_checkpoint(step, probe.eval())
            probe.train()
    return probe.eval()


@torch.no_grad()
def transcribe(probe: CtcProbe, features: Sequence[torch.Tensor], batch_size: int = 16) -> list[str]:
    """Greedy CTC transcripts of ``features``."""
    probe.eval()
    hypotheses: list[str] = []
    for start in range(0, len(features), batch_size):
        layers, lengths = collate_layers(features[start : start + batch_size])
        best = probe(layers, lengths).argmax(dim=-1)
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


def evaluate_probe(probe: CtcProbe, features: Sequence[torch.Tensor], texts: Sequence[str]) -> tuple[Scores, list[str]]:
    hypotheses = transcribe(probe, features)
    return score(texts, hypotheses), hypotheses


def dev_split(speakers: Sequence[str], fraction: float = 0.2) -> tuple[list[int], list[int]]:
    """(fit, dev) indices of utterances by ``speakers``: every speaker whose rank in sorted order
    falls on a ``fraction`` grid is a development speaker (at least one, and at least one left to
    fit on); with a single speaker, every fifth utterance is development instead. Deterministic."""
    names = sorted(set(speakers))
    if len(names) >= 2:
        count = min(len(names) - 1, max(1, round(len(names) * fraction)))
        step = len(names) / count
        dev_names = {names[int(i * step)] for i in range(count)}
        dev = [i for i, s in enumerate(speakers) if s in dev_names]
    else:
        dev = list(range(0, len(speakers), max(2, round(1 / fraction))))
    chosen = set(dev)
    return [i for i in range(len(speakers)) if i not in chosen], dev


def subsample(count: int, limit: int, seed: int = 0) -> list[int]:
    """At most ``limit`` of ``range(count)``, a seeded choice kept in order (``limit <= 0``: all)."""
    if limit <= 0 or count <= limit:
        return list(range(count))
    return sorted(np.random.default_rng(seed).choice(count, size=limit, replace=False).tolist())
