"""The same CTC probe on several encoders and on the log-mel input itself, in one run.

:func:`compare_encoders` is what ``downstream_probe`` and ``bench/probe.py`` run: the utterances
of the training speakers train one probe per model, the held-out speakers' utterances score it
(greedy CER and WER, jiwer), and every model sees exactly the same utterances, probe options and
seed. ``fbank`` is the baseline every encoder has to beat: the probe on CMVN-normalised log-mel
at 100 Hz, one "layer" ``(1, T, 80)``. ``random`` is an untrained encoder of the pretrained one's
shape: what the architecture gives without pretraining.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from speech_assets.evaluation.encoders import Utterance, layer_features
from speech_assets.model.encoders import LoadedEncoder
from speech_assets.evaluation.probe import ProbeOptions, evaluate_probe, subsample, train_probe

log = logging.getLogger(__name__)

FBANK = "fbank"
RANDOM = "random"
# results.parquet columns, in order
RESULT_COLUMNS = ("model", "checkpoint_sha256", "probe", "layer_weights", "split", "cer", "wer", "utterances", "steps")


@dataclass(frozen=True)
class ProbeResult:
    """One row of ``probe/results.parquet``: ``model``'s probe scored on ``split``."""

    model: str
    checkpoint_sha256: str
    probe: str
    layer_weights: list[float]
    split: str
    cer: float
    wer: float
    utterances: int
    steps: int
    seconds: float  # feature extraction + probe training + scoring, for this model

    def row(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items() if k in RESULT_COLUMNS}


def split_utterances(
    utterances: Sequence[Utterance], heldout: set[str], max_train: int, max_eval: int, seed: int = 0
) -> tuple[list[Utterance], list[Utterance]]:
    """(training speakers' utterances, held-out speakers' utterances), each a seeded subsample of
    at most ``max_train`` / ``max_eval`` (0: all)."""
    train = [u for u in utterances if u.speaker_id not in heldout]
    test = [u for u in utterances if u.speaker_id in heldout]
    return (
        [train[i] for i in subsample(len(train), max_train, seed)],
        [test[i] for i in subsample(len(test), max_eval, seed)],
    )


def compare_encoders(
    train: Sequence[Utterance],
    test: Sequence[Utterance],
    encoders: Mapping[str, LoadedEncoder],
    options: ProbeOptions,
    on_model: Callable[[ProbeResult], None] | None = None,
) -> list[ProbeResult]:
    """Probe ``fbank`` and each of ``encoders`` (name -> encoder, in order): two rows per model,
    ``split`` ``train`` (the probe's own training utterances) and ``heldout``."""
    if not train or not test:
        raise ValueError(f"the probe needs utterances on both sides: {len(train)} training, {len(test)} held-out")
    texts_train, texts_test = [u.text for u in train], [u.text for u in test]
    models: list[tuple[str, str, Callable[[Sequence[Utterance]], list[torch.Tensor]]]] = [
        (FBANK, "", lambda utts: [torch.from_numpy(u.feats)[None] for u in utts])
    ]
    for name, encoder in encoders.items():
        models.append((name, encoder.sha256, lambda utts, m=encoder.model: layer_features(m, [u.feats for u in utts])))
    results: list[ProbeResult] = []
    for name, sha, features_of in models:
        started = time.perf_counter()
        train_features, test_features = features_of(train), features_of(test)
        probe = train_probe(train_features, texts_train, options)
        weights = [round(w, 4) for w in probe.layer_weights]
        scores = {
            split: evaluate_probe(probe, feats, texts)[0]
            for split, feats, texts in (("train", train_features, texts_train), ("heldout", test_features, texts_test))
        }
        seconds = time.perf_counter() - started
        for split, s in scores.items():
            result = ProbeResult(name, sha, options.probe, weights, split, s.cer, s.wer, s.utterances, options.steps, seconds)
            results.append(result)
        log.info("probe %s: held-out CER %.3f WER %.3f (%.0f s)", name, scores["heldout"].cer, scores["heldout"].wer, seconds)
        if on_model is not None:
            on_model(results[-1])
    return results


def markdown_table(results: Sequence[ProbeResult]) -> str:
    """Model against held-out CER/WER (and the probe's CER on its own training data)."""
    by_model: dict[str, dict[str, ProbeResult]] = {}
    for r in results:
        by_model.setdefault(r.model, {})[r.split] = r
    lines = [
        "| model | held-out CER | held-out WER | train CER | utterances (held-out) | top layer weight |",
        "|---|---|---|---|---|---|",
    ]
    for model, splits in sorted(by_model.items(), key=lambda item: item[1]["heldout"].cer):
        held, trained = splits["heldout"], splits.get("train")
        weights = held.layer_weights
        top = max(range(len(weights)), key=weights.__getitem__)
        lines.append(
            f"| {model} | {held.cer:.3f} | {held.wer:.3f} | {trained.cer if trained else float('nan'):.3f} | "
            f"{held.utterances} | layer {top}: {weights[top]:.2f} |"
        )
    return "\n".join(lines)
