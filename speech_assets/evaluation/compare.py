"""The same CTC probe on several encoders and on the log-mel input itself, over several seeds.

``fbank`` (the probe on log-mel) and ``random`` (an untrained encoder) are the baselines; the verdict
is a paired bootstrap over held-out utterances of the CER difference. Reading ``results.parquet``
needs neither torch nor a model.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from speech_assets import utils
from speech_assets.layout import ProbeFiles

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

    from speech_assets.evaluation.encoders import Utterance
    from speech_assets.evaluation.probe_options import ProbeOptions
    from speech_assets.model.hubert import HubertPretrainModel

log = logging.getLogger(__name__)

FBANK = "fbank"
RANDOM = "random"
BASELINES = (FBANK, RANDOM)
OPTIONAL_COLUMNS = ("lr",)  # later additions: a results file without them still reads (as NaN)
# probe/utterances.parquet beside results.parquet: each held-out utterance's edit counts per model and seed
UTTERANCE_COLUMNS = ("model", "seed", "utt_id", "speaker_id", "char_errors", "chars", "word_errors", "words")
# the verdict is "indicative only" below this many held-out speakers ([probe] min_heldout_speakers's default)
MIN_HELDOUT_SPEAKERS = 3
MIN_HELDOUT_UTTERANCES = 20
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95
VERDICT_WORDS = {"better": "better than", "worse": "worse than", "no evidence": "no evidence against"}
# a probe stops once this many development evaluations in a row bring no improvement
PATIENCE = 2


@dataclass(frozen=True)
class ProbeModel:
    """A model under probe. ``normalise``: raw log-mel ``(T, 80)`` -> normalised, as the model was
    trained. ``encoder`` ``None``: the probe reads the normalised log-mel itself (``fbank``)."""

    name: str
    checkpoint_sha256: str
    normalisation: str
    normalise: Callable[[np.ndarray], np.ndarray]
    encoder: HubertPretrainModel | None = None


@dataclass(frozen=True)
class HeldoutErrors:
    """Per held-out utterance of one probe (``(U,)`` each): edit counts and the reference's lengths."""

    utt_ids: tuple[str, ...]
    speaker_ids: tuple[str, ...]
    char_errors: np.ndarray
    chars: np.ndarray
    word_errors: np.ndarray
    words: np.ndarray


@dataclass(frozen=True)
class ProbeResult:
    """One row of ``probe/results.parquet``: ``model``'s probe trained with ``seed``, scored on ``split``.
    The fields up to ``lr`` are its columns, in order (the first nine the original contract)."""

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
    lr: float = math.nan  # chosen on the development split when ProbeOptions.lrs has several
    seconds: float = 0.0  # feature extraction (shared by the seeds) + this seed's training + scoring; not stored
    errors: HeldoutErrors | None = None  # held-out rows: per utterance (probe/utterances.parquet)

    def row(self) -> dict[str, object]:
        return {column: getattr(self, column) for column in RESULT_COLUMNS}

    @classmethod
    def from_row(cls, row: dict[str, object]) -> ProbeResult:
        missing = [c for c in RESULT_COLUMNS if c not in row and c not in OPTIONAL_COLUMNS]
        if missing:
            raise ValueError(f"probe results lack the columns {missing}: rematerialize downstream_probe")
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})  # type: ignore[arg-type]


RESULT_COLUMNS = tuple(f.name for f in fields(ProbeResult))[:-2]  # not seconds, errors


def results_table(results: Sequence[ProbeResult]) -> pa.Table:
    import pyarrow as pa

    types = {"layer_weights": pa.list_(pa.float64()), "cer": pa.float64(), "wer": pa.float64(), "lr": pa.float64()}
    types |= dict.fromkeys(("utterances", "steps", "seed", "speakers"), pa.int64())
    schema = pa.schema([(column, types.get(column, pa.string())) for column in RESULT_COLUMNS])
    return pa.Table.from_pylist([r.row() for r in results], schema=schema)


def utterances_table(results: Sequence[ProbeResult]) -> pa.Table:
    import pyarrow as pa

    rows = [
        {"model": r.model, "seed": r.seed, **dict(zip(UTTERANCE_COLUMNS[2:], row, strict=True))}
        for r in results
        if r.errors is not None
        for row in zip(*astuple(r.errors), strict=True)
    ]
    types = {"model": pa.string(), "seed": pa.int64(), "utt_id": pa.string(), "speaker_id": pa.string()}
    return pa.Table.from_pylist(rows, schema=pa.schema([(c, types.get(c, pa.int64())) for c in UTTERANCE_COLUMNS]))


def read_leaderboard(results_path: str | os.PathLike[str]) -> list[dict[str, object]]:
    import pyarrow.parquet as pq

    path = ProbeFiles.beside(results_path).leaderboard
    if not path.is_file():
        raise FileNotFoundError(f"no probe leaderboard at {path}: rematerialize downstream_probe")
    return pq.read_table(path).to_pylist()


def load_leaderboard(path: str | os.PathLike[str], min_speakers: int = MIN_HELDOUT_SPEAKERS) -> tuple[list, int]:
    """(the leaderboard of ``results.parquet`` at ``path``, the minimum of held-out speakers it was
    judged with: the run's own from ``leaderboard.parquet``, else ``min_speakers``)."""
    with contextlib.suppress(FileNotFoundError, IndexError, KeyError):
        min_speakers = int(read_leaderboard(path)[0]["min_heldout_speakers"])
    return leaderboard(read_results(path), min_speakers), min_speakers


@dataclass(frozen=True)
class BaselineVerdict:
    """Whether a model beats a baseline; ``text`` is both the check's description and the metadata value."""

    passed: bool
    text: str


def beats_baseline(row: Mapping[str, Any] | None, model: str, baseline: str) -> BaselineVerdict:
    """``model`` against ``baseline`` from its ``leaderboard.parquet`` row (None: no row): passes only
    when the paired interval says better and the verdict is not indicative."""
    if row is None:
        return BaselineVerdict(
            False, f"warn: no {model} row in the probe's leaderboard: rematerialize downstream_probe"
        )
    verdict = row.get(f"verdict_{baseline}")
    if verdict in VERDICT_WORDS:
        said = f"{VERDICT_WORDS[verdict]} {baseline}"
    else:
        said = f"not compared with {baseline} (no per-utterance scores)"
    if row.get(f"cer_change_{baseline}") is not None:
        said += (
            f", CER change {row[f'cer_change_{baseline}']:+.3f} "
            f"[{row[f'cer_change_{baseline}_low']:+.3f}, {row[f'cer_change_{baseline}_high']:+.3f}]"
        )
    why = indicative_reasons(int(row["speakers"]), int(row["utterances"]), int(row["min_heldout_speakers"]))
    if why:
        return BaselineVerdict(False, f"warn: indicative only ({why}): {said}")
    passed = verdict == "better"
    return BaselineVerdict(passed, f"{'pass' if passed else 'warn'}: {said}")


def read_results(path: str | os.PathLike[str]) -> list[ProbeResult]:
    """The rows of a ``results.parquet``, with the held-out rows' errors from ``utterances.parquet`` where it exists."""
    import pyarrow.parquet as pq

    results = [ProbeResult.from_row(row) for row in pq.read_table(path).to_pylist()]
    if not ProbeFiles.beside(path).utterances.is_file():
        return results
    found: dict[tuple[str, int], list[dict]] = {}
    for row in pq.read_table(ProbeFiles.beside(path).utterances).to_pylist():
        found.setdefault((row["model"], row["seed"]), []).append(row)

    def errors(rows: list[dict]) -> HeldoutErrors:
        counts = (np.array([r[c] for r in rows], dtype=np.int64) for c in UTTERANCE_COLUMNS[4:])
        return HeldoutErrors(tuple(r["utt_id"] for r in rows), tuple(r["speaker_id"] for r in rows), *counts)

    return [
        replace(r, errors=errors(found[(r.model, r.seed)]))
        if r.split == "heldout" and (r.model, r.seed) in found
        else r
        for r in results
    ]


def split_utterances(
    utterances: Sequence[Utterance], heldout: set[str], max_train: int, max_eval: int, seed: int = 0
) -> tuple[list[Utterance], list[Utterance]]:
    """(training, held-out) speakers' utterances, seeded subsamples of ``max_train`` / ``max_eval`` (0: all)."""
    from speech_assets.evaluation.probe import subsample

    train = [u for u in utterances if u.speaker_id not in heldout]
    test = [u for u in utterances if u.speaker_id in heldout]
    return (
        [train[i] for i in subsample(len(train), max_train, seed)],
        [test[i] for i in subsample(len(test), max_eval, seed)],
    )


def probe_features(model: ProbeModel, utterances: Sequence[Utterance]) -> list[torch.Tensor]:
    """Per utterance, ``(1, T, 80)`` normalised log-mel, or the encoder's ``(layers + 1, (T + 1) // 2, D)``."""
    import torch

    from speech_assets.model.batches import frozen_hidden_states

    feats = []
    for u in utterances:
        feats.append(np.asarray(model.normalise(u.feats), dtype=np.float32))
        if feats[-1].shape != u.feats.shape:
            raise ValueError(f"{model.name}: normalise turned {u.feats.shape} into {feats[-1].shape}")
    if model.encoder is None:
        return [torch.from_numpy(f)[None] for f in feats]
    return frozen_hidden_states(model.encoder, feats)


def compare_encoders(
    train: Sequence[Utterance],
    test: Sequence[Utterance],
    models: Sequence[ProbeModel],
    options: ProbeOptions,
    on_model: Callable[[ProbeResult], None] | None = None,
) -> list[ProbeResult]:
    """Probe each model once per seed: a ``train`` and a ``heldout`` row per model and seed (``on_model``
    gets each held-out row as it is scored). A development part of the training speakers chooses, per
    model, the lr (the first seed's probes) and the stopping step (:data:`PATIENCE` evaluations without
    improvement), which the other seeds reuse; the held-out speakers take no part in any choice."""
    from speech_assets.evaluation.probe import dev_split, layer_norm, score, train_probes, transcribe, utterance_errors

    if not train or not test:
        raise ValueError(f"the probe needs utterances on both sides: {len(train)} training, {len(test)} held-out")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be unique, got {names}")
    fit, dev = dev_split([u.speaker_id for u in train]) if len(train) > 1 else (list(range(len(train))), [])
    if len(options.lrs) > 1 and not dev:
        log.warning(
            "probe: %d training utterance(s), too few for a development split: lr %g for every model",
            len(train),
            options.lrs[0],
        )
    lrs = (options.lrs[:1] if not dev else options.lrs) or (options.lr,)
    texts = {
        "train": [train[i].text for i in fit],
        "dev": [train[i].text for i in dev],
        "heldout": [u.text for u in test],
    }
    speakers = {"train": len({train[i].speaker_id for i in fit}), "heldout": len({u.speaker_id for u in test})}
    results: list[ProbeResult] = []
    for model in models:
        started = time.perf_counter()
        train_features = [layer_norm(f) for f in probe_features(model, train)]
        features = {
            "train": [train_features[i] for i in fit],
            "dev": [train_features[i] for i in dev],
            "heldout": [layer_norm(f) for f in probe_features(model, test)],
        }
        del train_features
        extraction = time.perf_counter() - started

        def trained(seed: int, lrs: Sequence[float], stop_at: int | None = None, search: bool = False) -> list:
            return train_probes(
                features["train"],
                texts["train"],
                options,
                seed,
                lrs=lrs,
                stop_at=stop_at,
                normalised=True,
                dev=(features["dev"], texts["dev"]) if search and dev else None,
                patience=PATIENCE,
            )

        for seed in options.seeds:
            started = time.perf_counter()
            if seed == options.seeds[0]:
                first = trained(seed, lrs, search=True)
                chosen = min(first, key=lambda t: (round(t.dev_cer, 6) if dev else 0.0, t.lr, t.step))
                if dev:
                    tried = {f"{t.lr:g}@{t.step}": round(t.dev_cer, 4) for t in first}
                    log.info(
                        f"probe {model.name}: development CER by lr {tried} -> lr {chosen.lr:g}, {chosen.step} steps"
                    )
                probe = chosen
            else:
                (probe,) = trained(seed, (chosen.lr,), stop_at=chosen.step)
            weights = [round(w, 4) for w in probe.probe.layer_weights]
            scores = {}
            for split in ("train", "heldout"):
                hypotheses = transcribe(probe.probe, features[split], normalised=True)
                scores[split] = score(texts[split], hypotheses)
            counts = utterance_errors(texts["heldout"], hypotheses)
            held = HeldoutErrors(tuple(u.utt_id for u in test), tuple(u.speaker_id for u in test), *counts)
            seconds = extraction + time.perf_counter() - started
            head = (model.name, model.checkpoint_sha256, options.probe, weights)
            for split, s in scores.items():
                found = (s.cer, s.wer, s.utterances, probe.step, seed, model.normalisation, speakers[split], probe.lr)
                results.append(ProbeResult(*head, split, *found, seconds, held if split == "heldout" else None))
            log.info(
                f"probe {model.name} seed {seed} lr {probe.lr:g}, {probe.step} steps: held-out CER "
                f"{scores['heldout'].cer:.3f} WER {scores['heldout'].wer:.3f} ({seconds:.0f} s)"
            )
            if on_model is not None:
                on_model(results[-1])
    return results


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
    model: str
    normalisation: str
    seeds: tuple[int, ...]
    cer: Spread
    wer: Spread
    utterances: int  # the fewest any seed was scored on (all the same in a run)
    speakers: int
    layer_weights: list[float]  # mean over seeds


def summarise(results: Sequence[ProbeResult], split: str = "heldout") -> dict[str, ModelSummary]:
    """Per model (in the order of ``results``): CER and WER over its seeds on ``split``."""
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
            model,
            ",".join(sorted({r.normalisation for r in found})),
            seeds,
            Spread.of([r.cer for r in found]),
            Spread.of([r.wer for r in found]),
            min(r.utterances for r in found),
            min(r.speakers for r in found),
            weights,
        )
    return summaries


def markdown_table(results: Sequence[ProbeResult]) -> str:
    """Held-out CER/WER (mean ± sample std over seeds) and train CER per model, best held-out CER first."""
    held, trained = summarise(results, "heldout"), summarise(results, "train")
    rows = []
    for model, s in sorted(held.items(), key=lambda item: item[1].cer.mean):
        top = max(range(len(s.layer_weights)), key=s.layer_weights.__getitem__) if s.layer_weights else None
        lrs = sorted({r.lr for r in results if r.model == model and r.split == "heldout" and not math.isnan(r.lr)})
        rows.append(
            (model, s.normalisation, ", ".join(f"{lr:g}" for lr in lrs) or "n/a", len(s.seeds), s.cer, s.wer)
            + (trained[model].cer if model in trained else "n/a", s.utterances, s.speakers)
            + (f"layer {top}: {s.layer_weights[top]:.2f}" if top is not None else "n/a",)
        )
    header = ("model", "normalisation", "probe lr", "seeds", "held-out CER", "held-out WER", "train CER")
    return utils.markdown_table((*header, "utterances (held-out)", "speakers (held-out)", "top layer weight"), rows)


def paired_bootstrap(
    errors_a: Sequence[float],
    errors_b: Sequence[float],
    lengths: Sequence[float],
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(difference, low, high): ``sum(a - b) / sum(lengths)`` over paired utterances (a difference of
    corpus error rates, negative where ``a`` errs less) and its percentile interval over bootstrap
    resamples of the utterances, the pairs kept together."""
    a, b, n = (np.asarray(x, dtype=np.float64) for x in (errors_a, errors_b, lengths))
    if not (a.shape == b.shape == n.shape) or a.ndim != 1 or not len(a):
        raise ValueError(f"paired_bootstrap needs equal, non-empty (U,) arrays, got {a.shape}, {b.shape}, {n.shape}")
    if n.sum() <= 0:
        raise ValueError("the references have no length")
    diff, rng, found = a - b, np.random.default_rng(seed), []
    chunk = max(1, 4_000_000 // len(a))  # bounds the (chunk, U) index array
    for start in range(0, resamples, chunk):
        picks = rng.integers(0, len(a), size=(min(chunk, resamples - start), len(a)))
        found.append(diff[picks].sum(axis=1) / np.maximum(n[picks].sum(axis=1), 1e-12))
    low, high = np.quantile(np.concatenate(found), [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(diff.sum() / n.sum()), float(low), float(high)


@dataclass(frozen=True)
class Paired:
    """A model's CER minus a baseline's on the same held-out utterances, with its bootstrap interval."""

    baseline: str
    difference: float
    low: float
    high: float

    @property
    def verdict(self) -> str:
        return "better" if self.high < 0 else "worse" if self.low > 0 else "no evidence"

    def __str__(self) -> str:
        return f"{self.difference:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def mean_errors(results: Sequence[ProbeResult], model: str) -> tuple[tuple[str, ...], np.ndarray, np.ndarray] | None:
    """(utterance ids, seed-averaged character errors, reference characters); None without per-utterance errors."""
    rows = [r for r in results if r.model == model and r.split == "heldout"]
    if not rows or any(r.errors is None for r in rows):
        return None
    ids = rows[0].errors.utt_ids  # type: ignore[union-attr]
    if any(r.errors.utt_ids != ids for r in rows):  # type: ignore[union-attr]
        raise ValueError(f"{model}: its seeds were scored on different held-out utterances")
    return ids, np.mean([r.errors.char_errors for r in rows], axis=0), rows[0].errors.chars  # type: ignore[union-attr]


def paired(results: Sequence[ProbeResult], model: str, baseline: str) -> Paired | None:
    """``model`` against ``baseline``; None where either lacks per-utterance errors."""
    a, b = mean_errors(results, model), mean_errors(results, baseline)
    if a is None or b is None:
        return None
    if a[0] != b[0]:
        raise ValueError(f"{model} and {baseline} were scored on different held-out utterances")
    return Paired(baseline, *paired_bootstrap(a[1], b[1], a[2]))


@dataclass(frozen=True)
class Standing(ModelSummary):
    """One model's line of the leaderboard; ``indicative``: why its verdict is only indicative (None: it is not)."""

    against: dict[str, Paired | None]
    indicative: str | None

    @property
    def baseline(self) -> bool:
        return self.model in BASELINES

    @property
    def verdict(self) -> str:
        """``baseline``, or e.g. ``better than random; no evidence against fbank (indicative only: ...)``."""
        if self.baseline:
            return "baseline"
        if not self.against:
            return "no baseline (fbank, random) to compare with"
        if any(p is None for p in self.against.values()):
            return "no per-utterance scores to compare: rematerialize downstream_probe"
        grouped: dict[str, list[str]] = {}
        for name, p in self.against.items():
            grouped.setdefault(p.verdict, []).append(name)  # type: ignore[union-attr]
        said = "; ".join(f"{words} {' and '.join(grouped[v])}" for v, words in VERDICT_WORDS.items() if v in grouped)
        return said + (f" (indicative only: {self.indicative})" if self.indicative else "")

    @property
    def short_verdict(self) -> str:
        """The verdict in a word or two for a table cell, ``*`` where it is only indicative."""
        if self.baseline:
            return "baseline"
        found = {p.verdict for p in self.against.values() if p is not None}
        if not self.against or any(p is None for p in self.against.values()):
            word = "n/a"
        elif len(found) == 1:
            word = found.pop()
        elif found == {"better", "no evidence"}:
            word = "better than " + ", ".join(b for b, p in self.against.items() if p and p.verdict == "better")
        else:
            word = "mixed"
        return word + ("*" if self.indicative and word != "n/a" else "")


def indicative_reasons(speakers: int, utterances: int | None, min_speakers: int) -> str | None:
    """Why a verdict is only indicative (None: it is not); ``utterances`` None: not counted."""
    reasons = []
    if speakers < min_speakers:
        reasons.append(f"{speakers} held-out speaker{'s' if speakers != 1 else ''}, fewer than {min_speakers}")
    if utterances is not None and utterances < MIN_HELDOUT_UTTERANCES:
        reasons.append(f"{utterances} held-out utterances, fewer than {MIN_HELDOUT_UTTERANCES}")
    return "; ".join(reasons) or None


def leaderboard(results: Sequence[ProbeResult], min_speakers: int = MIN_HELDOUT_SPEAKERS) -> list[Standing]:
    """Every model's held-out standing, best mean CER first, compared with each baseline present."""
    held = summarise(results, "heldout")
    board = []
    for name, s in held.items():
        against = {b: paired(results, name, b) for b in BASELINES if b in held and b != name}
        reasons = indicative_reasons(s.speakers, s.utterances, min_speakers)
        board.append(Standing(**vars(s), against=against, indicative=reasons))
    return sorted(board, key=lambda s: s.cer.mean)


LEADERBOARD_COLUMNS = (
    ("encoder", "string", "the model under probe (fbank: log-mel input; random: an untrained encoder)"),
    ("normalisation", "string", "how the model reads the log-mel (the normalisation it was trained with)"),
    ("CER", "string", "held-out character error rate, mean ± sample std over probe seeds"),
    ("WER", "string", "held-out word error rate, mean ± sample std over probe seeds"),
    ("vs fbank", "string", "CER change against fbank on the same utterances [95 % bootstrap interval]"),
    ("vs random", "string", "CER change against random on the same utterances [95 % bootstrap interval]"),
    (
        "verdict",
        "string",
        "better / worse where the interval excludes 0 (against each baseline), else no evidence; * indicative only",
    ),
    ("seeds", "int", "probe seeds"),
    ("utterances", "int", "held-out utterances"),
    ("speakers", "int", "held-out speakers"),
)


NBSP = "\u00a0"  # joins "0.679 ± 0.030" so that a narrow cell never wraps it


def leaderboard_rows(board: Sequence[Standing]) -> list[dict[str, str | int]]:
    """:data:`LEADERBOARD_COLUMNS` per model for people to read (why a verdict is indicative: :func:`reading_note`)."""

    def change(s: Standing, baseline: str) -> str:
        if baseline == s.model or baseline not in s.against:
            return "—"
        found = s.against[baseline]
        return "n/a" if found is None else str(found).replace(" ", NBSP)

    return [
        {
            "encoder": s.model,
            "normalisation": s.normalisation,
            "CER": str(s.cer).replace(" ", NBSP),
            "WER": str(s.wer).replace(" ", NBSP),
            "vs fbank": change(s, FBANK),
            "vs random": change(s, RANDOM),
            "verdict": s.short_verdict,
            "seeds": len(s.seeds),
            "utterances": s.utterances,
            "speakers": s.speakers,
        }
        for s in board
    ]


def leaderboard_markdown(board: Sequence[Standing]) -> str:
    """The leaderboard as a markdown table (what ``speech-assets probe`` prints), plain spaces for a terminal."""
    names = [c for c, _, _ in LEADERBOARD_COLUMNS]
    return utils.markdown_table(
        names, ([str(row[c]).replace(NBSP, " ") for c in names] for row in leaderboard_rows(board))
    )


def leaderboard_table(board: Sequence[Standing], min_speakers: int) -> pa.Table:
    """The leaderboard in numbers (``probe/leaderboard.parquet``)."""
    import pyarrow as pa

    rows = []
    for s in board:
        row: dict[str, object] = {
            "model": s.model,
            "normalisation": s.normalisation,
            "seeds": len(s.seeds),
            "cer": s.cer.mean,
            "cer_std": s.cer.std,
            "wer": s.wer.mean,
            "wer_std": s.wer.std,
            "utterances": s.utterances,
            "speakers": s.speakers,
        }
        for b in BASELINES:
            p = s.against.get(b)
            values = (p.difference, p.low, p.high, p.verdict) if p else (None,) * 4
            row |= dict(zip((f"cer_change_{b}", f"cer_change_{b}_low", f"cer_change_{b}_high", f"verdict_{b}"), values))
        rows.append(
            row | {"verdict": s.verdict, "indicative": s.indicative is not None, "min_heldout_speakers": min_speakers}
        )
    return pa.Table.from_pylist(rows)


def reading_note(board: Sequence[Standing], min_speakers: int) -> str:
    note = (
        "Verdict: each encoder's character errors on every held-out utterance (mean over its probe seeds) are paired "
        "with fbank's and random's on the same utterance; a 95 % bootstrap interval over utterances of the CER "
        "change says better or worse where it excludes 0, otherwise no evidence."
    )
    shown = next((s for s in board if s.indicative), None)
    if shown is not None:
        note += (
            f" Indicative only here (* beside a verdict): {shown.indicative}. A verdict about speakers in general "
            f"needs at least {min_speakers} held-out speakers (min_heldout_speakers, [probe] in pipeline.toml) and "
            f"{MIN_HELDOUT_UTTERANCES} utterances; `make demo` holds out one speaker, so there this is expected."
        )
    return note


def standing(results: Sequence[ProbeResult], min_speakers: int = MIN_HELDOUT_SPEAKERS) -> list[str]:
    """One line per encoder (not the baselines): held-out CER, change against each baseline, verdict."""
    lines = []
    for s in leaderboard(results, min_speakers):
        if s.baseline:
            continue
        parts = "".join(f", {b} {p}" for b, p in s.against.items() if p is not None)
        seeds = f"{len(s.seeds)} seed{'s' if len(s.seeds) != 1 else ''}"
        lines.append(
            f"{s.model}: held-out CER {s.cer} over {seeds}{parts} (CER change [95 % interval], paired over utterances) "
            f"on {s.utterances} utterances of {s.speakers} held-out speaker{'s' if s.speakers != 1 else ''}: "
            f"{s.verdict}"
        )
    return lines
