"""The same CTC probe on several encoders and on the log-mel input itself, over several seeds.

:func:`compare_encoders` is what ``downstream_probe`` and ``bench/probe.py`` run: the utterances
of the training speakers train the probes of each model, the held-out speakers' utterances score
them (greedy CER and WER, jiwer), and every model sees exactly the same utterances, probe options
and seeds. Each model reads the raw log-mel through its own normalisation (:class:`ProbeModel`:
the one it was trained with), and its features are extracted once and reused by every seed.

``fbank`` is the baseline every encoder has to beat: the probe on normalised log-mel at 100 Hz,
one "layer" ``(1, T, 80)``. ``random`` is an untrained encoder of the pretrained one's shape:
what the architecture gives without pretraining. :func:`summarise`, :func:`markdown_table`,
:func:`standing` and :func:`beats` say what the rows mean over seeds, and when they are too few
or too noisy to tell.

torch is imported only by :func:`compare_encoders` and :func:`probe_features`: reading and
summarising ``results.parquet`` (``speech-assets probe``) needs neither torch nor a model.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

    from speech_assets.evaluation.encoders import Utterance
    from speech_assets.evaluation.probe import CtcProbe, ProbeOptions
    from speech_assets.model.hubert import HubertPretrainModel

log = logging.getLogger(__name__)

FBANK = "fbank"
RANDOM = "random"
BASELINES = (FBANK, RANDOM)
# results.parquet columns, in order (the first nine are the original contract; later ones appended)
RESULT_COLUMNS = (
    "model", "checkpoint_sha256", "probe", "layer_weights", "split", "cer", "wer", "utterances", "steps",
    "seed", "normalisation", "speakers", "lr",
)  # fmt: skip
OPTIONAL_COLUMNS = ("lr",)  # later additions: a results file without them still reads (as NaN)
# :func:`standing` / :func:`beats` call a comparison "too small to tell" below this many held-out
# utterances, with fewer than 2 seeds on either side, or when |difference of mean CERs| is not
# larger than SPREAD_FACTOR * sqrt(std_a^2 + std_b^2) (sample stds over seeds).
MIN_HELDOUT_UTTERANCES = 20
MIN_SEEDS = 2
SPREAD_FACTOR = 2.0


@dataclass(frozen=True)
class ProbeModel:
    """A model under probe. ``normalise``: raw log-mel ``(T, 80)`` -> normalised ``(T, 80)``, the
    normalisation the model was trained with (``normalisation`` labels it: ``utterance``,
    ``global``, ...). ``encoder`` ``None``: the probe reads the normalised log-mel itself, one layer
    ``(1, T, 80)`` (``fbank``); else every layer of the frozen encoder, ``(layers + 1, L, D)``."""

    name: str
    checkpoint_sha256: str
    normalisation: str
    normalise: Callable[[np.ndarray], np.ndarray]
    encoder: HubertPretrainModel | None = None


@dataclass(frozen=True)
class ProbeResult:
    """One row of ``probe/results.parquet``: ``model``'s probe trained with ``seed``, scored on
    ``split`` (``utterances`` of ``speakers`` distinct speakers)."""

    model: str
    checkpoint_sha256: str
    probe: str
    layer_weights: list[float]
    split: str
    cer: float
    wer: float
    utterances: int
    steps: int
    seed: int
    normalisation: str
    speakers: int
    lr: float = float("nan")  # the probe's learning rate (chosen on the development split when ProbeOptions.lrs has several)
    seconds: float = 0.0  # feature extraction (shared by the seeds) + this seed's training + scoring; not stored

    def row(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items() if k in RESULT_COLUMNS}

    @classmethod
    def from_row(cls, row: dict[str, object]) -> ProbeResult:
        """A result from a ``results.parquet`` row (``seconds`` is not stored: 0)."""
        missing = [c for c in RESULT_COLUMNS if c not in row and c not in OPTIONAL_COLUMNS]
        if missing:
            raise ValueError(f"probe results lack the columns {missing}: rematerialize downstream_probe")
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})  # type: ignore[arg-type]


def results_table(results: Sequence[ProbeResult]) -> pa.Table:
    """``results`` as a table of :data:`RESULT_COLUMNS`, in that order."""
    import pyarrow as pa

    schema = pa.schema([
        ("model", pa.string()), ("checkpoint_sha256", pa.string()), ("probe", pa.string()),
        ("layer_weights", pa.list_(pa.float64())), ("split", pa.string()), ("cer", pa.float64()), ("wer", pa.float64()),
        ("utterances", pa.int64()), ("steps", pa.int64()), ("seed", pa.int64()), ("normalisation", pa.string()),
        ("speakers", pa.int64()), ("lr", pa.float64()),
    ])  # fmt: skip
    return pa.Table.from_pylist([r.row() for r in results], schema=schema)


def read_results(path: str | os.PathLike[str]) -> list[ProbeResult]:
    """The rows of a ``results.parquet``."""
    import pyarrow.parquet as pq

    return [ProbeResult.from_row(row) for row in pq.read_table(path).to_pylist()]


def split_utterances(
    utterances: Sequence[Utterance], heldout: set[str], max_train: int, max_eval: int, seed: int = 0
) -> tuple[list[Utterance], list[Utterance]]:
    """(training speakers' utterances, held-out speakers' utterances), each a seeded subsample of
    at most ``max_train`` / ``max_eval`` (0: all)."""
    from speech_assets.evaluation.probe import subsample

    train = [u for u in utterances if u.speaker_id not in heldout]
    test = [u for u in utterances if u.speaker_id in heldout]
    return (
        [train[i] for i in subsample(len(train), max_train, seed)],
        [test[i] for i in subsample(len(test), max_eval, seed)],
    )


def normalised(model: ProbeModel, feats: np.ndarray) -> np.ndarray:
    """``model.normalise`` of raw log-mel ``feats (T, 80)``: ``(T, 80)`` float32."""
    out = np.asarray(model.normalise(feats), dtype=np.float32)
    if out.shape != feats.shape:
        raise ValueError(f"{model.name}: normalise turned {feats.shape} into {out.shape}")
    return out


def probe_features(model: ProbeModel, utterances: Sequence[Utterance]) -> list[torch.Tensor]:
    """What ``model``'s probe reads per utterance: ``(1, T, 80)`` normalised log-mel for
    ``encoder`` ``None``, else the encoder's ``(layers + 1, (T + 1) // 2, D)`` on it."""
    import torch

    from speech_assets.evaluation.encoders import layer_features

    feats = [normalised(model, u.feats) for u in utterances]
    if model.encoder is None:
        return [torch.from_numpy(f)[None] for f in feats]
    return layer_features(model.encoder, feats)


def compare_encoders(
    train: Sequence[Utterance],
    test: Sequence[Utterance],
    models: Sequence[ProbeModel],
    options: ProbeOptions,
    on_model: Callable[[ProbeResult], None] | None = None,
) -> list[ProbeResult]:
    """Probe each of ``models`` (in order) once per seed of ``options.seeds``: two rows per model
    and seed, ``split`` ``train`` (the probe's own training utterances) and ``heldout``. The seed
    sets the probe's initialisation and the order it reads the utterances in; the training and
    held-out utterances are the same for every seed. ``on_model`` gets each held-out row as it
    is scored."""
    from speech_assets.evaluation.probe import dev_split, evaluate_probe, train_probe

    if not train or not test:
        raise ValueError(f"the probe needs utterances on both sides: {len(train)} training, {len(test)} held-out")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be unique, got {names}")
    texts = {"train": [u.text for u in train], "heldout": [u.text for u in test]}
    speakers = {"train": len({u.speaker_id for u in train}), "heldout": len({u.speaker_id for u in test})}
    # several lrs: each model's lr and stopping step are chosen on training speakers only; too few
    # training utterances to split (fewer than 2): the first lr, all steps
    fit, dev = dev_split([u.speaker_id for u in train]) if len(options.lrs) > 1 and len(train) > 1 else ([], [])
    if len(options.lrs) > 1 and not dev:
        log.warning("probe: %d training utterance(s), too few for a development split: lr %g for every model", len(train), options.lrs[0])
    results: list[ProbeResult] = []
    for model in models:
        started = time.perf_counter()
        features = {"train": probe_features(model, train), "heldout": probe_features(model, test)}
        extraction = time.perf_counter() - started
        lr, steps = options.lrs[0] if options.lrs else options.lr, options.steps
        if dev:
            lr, steps = choose_probe(features["train"], texts["train"], fit, dev, options, model.name)
        chosen = replace(options, lr=lr)
        for seed in options.seeds:
            started = time.perf_counter()
            probe = train_probe(features["train"], texts["train"], chosen, seed=seed, stop_at=steps)
            weights = [round(w, 4) for w in probe.layer_weights]
            scores = {split: evaluate_probe(probe, features[split], texts[split])[0] for split in ("train", "heldout")}
            seconds = extraction + time.perf_counter() - started
            for split, s in scores.items():
                results.append(ProbeResult(
                    model.name, model.checkpoint_sha256, options.probe, weights, split, s.cer, s.wer, s.utterances,
                    steps, seed, model.normalisation, speakers[split], lr, seconds,
                ))  # fmt: skip
            log.info("probe %s seed %d lr %g, %d steps: held-out CER %.3f WER %.3f (%.0f s)", model.name, seed, lr, steps, scores["heldout"].cer, scores["heldout"].wer, seconds)
            if on_model is not None:
                on_model(results[-1])
    return results


def choose_probe(
    features: Sequence[torch.Tensor], texts: Sequence[str], fit: Sequence[int], dev: Sequence[int], options: ProbeOptions, name: str
) -> tuple[float, int]:
    """(learning rate, steps): of ``options.lrs`` and the stopping points every ``options.steps // 4``
    steps, the probe (first seed) trained on the ``fit`` utterances with the lowest CER on the
    ``dev`` utterances (training speakers the fit never saw; the held-out test speakers take no
    part); ties go to the smaller learning rate, then to fewer steps."""
    from speech_assets.evaluation.probe import evaluate_probe, train_probe

    dev_features, dev_texts = [features[i] for i in dev], [texts[i] for i in dev]
    dev_cer: dict[tuple[float, int], float] = {}
    for lr in sorted(options.lrs):
        def score(step: int, probe: CtcProbe, lr: float = lr) -> None:
            dev_cer[(lr, step)] = evaluate_probe(probe, dev_features, dev_texts)[0].cer

        train_probe([features[i] for i in fit], [texts[i] for i in fit], replace(options, lr=lr), seed=options.seeds[0],
                    every=max(1, options.steps // 4), on_checkpoint=score)  # fmt: skip
    best = min(dev_cer, key=lambda key: (round(dev_cer[key], 6), key))
    log.info(
        "probe %s: development CER by (lr, steps) %s -> lr %g, %d steps",
        name, {f"{lr:g}@{step}": round(c, 4) for (lr, step), c in dev_cer.items()}, *best,
    )  # fmt: skip
    return best


@dataclass(frozen=True)
class Spread:
    """Mean, sample standard deviation (NaN for one value), min and max of ``n`` values."""

    mean: float
    std: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no values")
        std = statistics.stdev(values) if len(values) > 1 else math.nan
        return cls(statistics.fmean(values), std, min(values), max(values), len(values))

    def __str__(self) -> str:
        return f"{self.mean:.3f}" if self.n < 2 else f"{self.mean:.3f} ± {self.std:.3f}"


@dataclass(frozen=True)
class ModelSummary:
    """One model's rows of one split over its seeds."""

    model: str
    normalisation: str
    seeds: tuple[int, ...]
    cer: Spread
    wer: Spread
    utterances: int  # the fewest any seed was scored on (all the same in a run)
    speakers: int
    layer_weights: list[float]  # mean over seeds


def summarise(results: Sequence[ProbeResult], split: str = "heldout") -> dict[str, ModelSummary]:
    """Per model (in the order of ``results``): mean and spread of CER and WER over its seeds on ``split``."""
    rows: dict[str, list[ProbeResult]] = {}
    for r in results:
        if r.split == split:
            rows.setdefault(r.model, []).append(r)
    summaries = {}
    for model, found in rows.items():
        seeds = tuple(r.seed for r in found)
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"{model}: seeds {seeds} repeat on split {split!r}")
        weights = np.mean([r.layer_weights for r in found], axis=0).tolist() if found[0].layer_weights else []
        summaries[model] = ModelSummary(
            model, ",".join(sorted({r.normalisation for r in found})), seeds,
            Spread.of([r.cer for r in found]), Spread.of([r.wer for r in found]),
            min(r.utterances for r in found), min(r.speakers for r in found), weights,
        )  # fmt: skip
    return summaries


def markdown_table(results: Sequence[ProbeResult]) -> str:
    """Model against held-out CER/WER (mean ± sample std over seeds) and the probe's CER on its own
    training data, best held-out CER first."""
    held, trained = summarise(results, "heldout"), summarise(results, "train")
    lines = [
        "| model | normalisation | probe lr | seeds | held-out CER | held-out WER | train CER | utterances (held-out) | speakers (held-out) | top layer weight |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, s in sorted(held.items(), key=lambda item: item[1].cer.mean):
        top = max(range(len(s.layer_weights)), key=s.layer_weights.__getitem__) if s.layer_weights else None
        train_cer = str(trained[model].cer) if model in trained else "n/a"
        lrs = sorted({r.lr for r in results if r.model == model and r.split == "heldout" and not math.isnan(r.lr)})
        lines.append(
            f"| {model} | {s.normalisation} | {', '.join(f'{lr:g}' for lr in lrs) or 'n/a'} | {len(s.seeds)} | {s.cer} | {s.wer} | {train_cer} | {s.utterances} | {s.speakers} | "
            + (f"layer {top}: {s.layer_weights[top]:.2f} |" if top is not None else "n/a |")
        )
    return "\n".join(lines)


def too_small_to_tell(a: ModelSummary, b: ModelSummary) -> str | None:
    """Why the held-out CERs of ``a`` and ``b`` cannot be told apart, or ``None`` when they can."""
    utterances = min(a.utterances, b.utterances)
    if utterances < MIN_HELDOUT_UTTERANCES:
        return f"{utterances} held-out utterances < {MIN_HELDOUT_UTTERANCES}"
    for s in (a, b):
        if s.cer.n < MIN_SEEDS:
            return f"{s.model} has {s.cer.n} seed, no spread to compare with"
    diff, spread = abs(a.cer.mean - b.cer.mean), SPREAD_FACTOR * math.hypot(a.cer.std, b.cer.std)
    if not diff > spread:
        return f"|difference| {diff:.3f} <= {SPREAD_FACTOR:g} x combined std {spread / SPREAD_FACTOR:.3f}"
    return None


def beats(results: Sequence[ProbeResult], model: str, baseline: str) -> bool | None:
    """Whether ``model``'s mean held-out CER is lower than ``baseline``'s; ``None`` when the rows are
    too few or too noisy to tell (:func:`too_small_to_tell`). KeyError when either has no rows."""
    held = summarise(results, "heldout")
    a, b = held[model], held[baseline]
    if too_small_to_tell(a, b) is not None:
        return None
    return a.cer.mean < b.cer.mean


def ratio(cer: float, baseline: float) -> str:
    """``cer`` relative to ``baseline``'s, as ``0.85x``."""
    return f"{cer / baseline:.2f}x" if baseline > 0 else "n/a x"


def standing(results: Sequence[ProbeResult]) -> list[str]:
    """One line per encoder (every model but the baselines ``fbank`` and ``random``): its held-out
    CER over seeds, against each baseline present (ratio of mean CERs), on how many held-out
    utterances and speakers, and the verdict: ``beats``, ``loses to``, or ``too small to tell``
    with the reason, for each comparison. The counts are those the rows record."""
    held = summarise(results, "heldout")
    baselines = [held[b] for b in BASELINES if b in held]
    lines = []
    for name, s in held.items():
        if name in BASELINES:
            continue
        seeds = f"{len(s.seeds)} seed{'s' if len(s.seeds) != 1 else ''}"
        parts = [f"{ratio(s.cer.mean, b.cer.mean)} {b.model} ({b.cer})" for b in baselines]
        head = f"{name}: held-out CER {s.cer} over {seeds}" + "".join(f", {p}" for p in parts)
        head += f" on {s.utterances} utterances of {s.speakers} held-out speaker{'s' if s.speakers != 1 else ''}"
        if not baselines:
            lines.append(f"{head}: no baseline (fbank, random) to compare with")
            continue
        verdicts: dict[str, list[str]] = {"beats": [], "loses to": []}
        unclear = []
        for b in baselines:
            reason = too_small_to_tell(s, b)
            if reason is not None:
                unclear.append(f"too small to tell against {b.model} ({reason})")
            else:
                verdicts["beats" if s.cer.mean < b.cer.mean else "loses to"].append(b.model)
        said = []
        for verb, against in verdicts.items():
            if against:
                said.append(f"{verb} {'both' if len(against) == 2 else against[0]}")
        lines.append(f"{head}: {'; '.join(said + unclear)}")
    return lines
