"""What `finetuned_asr` fine-tunes, on what, and what it reads back: the plan of its runs, without Dagster.

Each model first tries every peak lr of ``lr_grid`` at the smallest budget and first seed
(:attr:`FinetunePlan.tuning`); :func:`choose_lrs` keeps the lowest dev CER's for its final runs.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow.parquet as pq

from speech_assets.corpus.clients import ClientsTable
from speech_assets.evaluation import decoding
from speech_assets.evaluation.finetune import Candidate, ctc_feasible, finished_result, labelled_subset
from speech_assets.evaluation.finetune_results import SCRATCH
from speech_assets.evaluation.probe import subsample
from speech_assets.evaluation.protocol import probe_split
from speech_assets.evaluation.text import normalise
from speech_assets.features.shards import read_shard_table
from speech_assets.utils import markdown_table, sha256_strings

PRETRAINED = "pretrained"  # the encoder always there, whose architecture `scratch` re-initialises
Checkpoint = tuple[str, str]  # (``final.pt`` path, its asset's data version)
RunKey = tuple[str, float, int]  # (model, labelled minutes, seed)
LrKey = tuple[str, float]  # (model, peak lr) of a tuning run
DEV_SEED = 0xDE5  # the fixed seed that orders the training speakers to pick the dev speakers


class FinetuneRefused(ValueError):
    """The fine-tuning cannot be planned (an unknown encoder, nothing to label) or a run left no result."""


class FinetuneOptions(Protocol):
    """The ``[finetune]`` settings the plan reads."""

    encoders: list[str]
    labelled_minutes: list[float]
    seeds: list[int]
    decoders: list[str]
    max_frames: int
    max_eval_utterances: int
    lr: float
    lr_grid: list[float]
    dev_speakers: int
    max_dev_utterances: int


@dataclass(frozen=True)
class LabelledPool:
    """The utterances of one speaker split: labelling ``candidates``, scored held-out and dev texts
    (``{utt_id: text}``; dev speakers are training-side speakers never labelled), ``skipped``:
    transcribed utterances CTC cannot use, ``overlap_dropped``: training-side utterances whose
    sentence is a held-out one."""

    train_speakers: list[str]
    test_speakers: list[str]
    candidates: list[Candidate]
    heldout_texts: dict[str, str]
    transcripts: dict[str, str]
    skipped: int
    dev_speakers: list[str] = field(default_factory=list)
    dev_texts: dict[str, str] = field(default_factory=dict)
    overlap_dropped: int = 0

    @property
    def available_minutes(self) -> float:
        return sum(c.seconds for c in self.candidates) / 60

    @property
    def labelling_speakers(self) -> list[str]:
        return [s for s in self.train_speakers if s not in self.dev_speakers]


@dataclass(frozen=True)
class PlannedRun:
    """One fine-tuning run of ``model`` (an encoder's name or ``scratch``) from checkpoint ``encoder`` on
    ``labelled`` (``{"train"|"dev"|"heldout": {utt_id: text}}``); ``settings``: the ``[finetune]``
    updates that name it; ``versions``: its inputs' data versions."""

    model: str
    minutes: float
    seed: int
    encoder: str
    labelled: dict[str, dict[str, str]]
    labelled_text: str
    settings: dict[str, Any]
    versions: dict[str, str]
    lr: float

    @property
    def key(self) -> RunKey:
        return (self.model, self.minutes, self.seed)

    @property
    def lr_key(self) -> LrKey:
        return (self.model, self.lr)

    @property
    def init(self) -> str:
        return "scratch" if self.model == SCRATCH else "pretrained"

    @property
    def shard_speakers(self) -> list[str]:
        return sorted({k.split("/", 1)[1] for k in self.versions if k.startswith("vad_features/")})


@dataclass(frozen=True)
class FinetunePlan:
    """Every run of one materialization and what its report says. ``lrs``: the learning rates each
    model tries (``[lr]`` without a grid or a dev set)."""

    encoders: dict[str, Checkpoint]
    pool: LabelledPool
    decoders: list[str]
    missing_decoder: str | None
    budgets: list[float]
    seeds: list[int]
    base_versions: dict[str, str]
    encoder_assets: dict[str, str]
    lrs: list[float]

    @property
    def models(self) -> list[str]:
        return [*self.encoders, SCRATCH]

    @property
    def recogniser_key(self) -> RunKey:
        """The run exported as the recogniser: the first encoder, the largest budget, the first seed."""
        return (next(iter(self.encoders)), self.budgets[-1], self.seeds[0])

    @cached_property
    def tuning(self) -> list[PlannedRun]:
        """Every model x lr at the smallest budget and first seed (none when there is one lr to try)."""
        if len(self.lrs) < 2:
            return []
        # the final runs plan this budget and seed again, and warn
        return self.runs({model: self.lrs for model in self.models}, lambda _: None, first=True)

    def final_runs(self, chosen: Mapping[str, float], warn: Callable[[str], None]) -> list[PlannedRun]:
        return self.runs({model: [chosen[model]] for model in self.models}, warn)

    def runs(
        self, lrs: Mapping[str, Sequence[float]], warn: Callable[[str], None], first: bool = False
    ) -> list[PlannedRun]:
        """One run per budget, seed, model (the encoders, then ``scratch``) and lr of ``lrs[model]``
        (``first``: the smallest budget and first seed only); a budget and seed label the same subset
        for every model (all of it, with a warning, when there is less audio than asked)."""
        pool, encoders, assets = self.pool, self.encoders, self.encoder_assets
        runs = []
        for minutes in self.budgets[:1] if first else self.budgets:
            for seed in self.seeds[:1] if first else self.seeds:
                subset = labelled_subset(pool.candidates, pool.test_speakers, minutes, seed)
                labelled = {
                    "train": {u: pool.transcripts[u] for u in subset},
                    "dev": pool.dev_texts,
                    "heldout": pool.heldout_texts,
                }
                chosen = set(subset)
                seconds = sum(c.seconds for c in pool.candidates if c.utt_id in chosen)
                if seconds < minutes * 60:
                    warn(
                        f"{minutes:g} min asked, {seconds / 60:.1f} min of training speakers' audio available: "
                        f"using all of it"
                    )
                labelled_text = json.dumps(labelled, indent=1, sort_keys=True)
                versions = {**self.base_versions, "labelled": sha256_strings([labelled_text])}
                for model in self.models:
                    path, version = encoders[PRETRAINED] if model == SCRATCH else encoders[model]
                    inputs = {assets.get(model, assets[PRETRAINED]): version, **versions}
                    named = (model, minutes, seed, path, labelled, labelled_text)
                    runs += [
                        PlannedRun(*named, run_settings(model, minutes, seed, lr, self.decoders), inputs, lr)
                        for lr in lrs[model]
                    ]
        return runs

    def untuned(self) -> dict[str, float]:
        """Each model's lr when nothing is tuned (one lr to try)."""
        return {model: self.lrs[0] for model in self.models}


def choose_encoders(
    wanted: Sequence[str],
    known: Collection[str],
    pretrained: Checkpoint,
    checkpoint_of: Callable[[str], Checkpoint | None],
) -> dict[str, Checkpoint]:
    """The encoders of ``wanted`` that have a checkpoint, in order; only ``pretrained`` when none has."""
    found = {PRETRAINED: pretrained}
    for name in wanted:
        if name not in known:
            raise FinetuneRefused(f"[finetune] encoders: unknown {name!r}; known: {sorted(known)}")
        if name not in found and (checkpoint := checkpoint_of(name)) is not None:
            found[name] = checkpoint
    return {name: found[name] for name in wanted if name in found} or {PRETRAINED: pretrained}


def dev_speakers_of(speakers: Collection[str], wanted: int) -> list[str]:
    """``wanted`` of ``speakers`` (at most all but one, left to label) by a fixed-seed permutation of
    the sorted speakers, so the same whatever their order."""
    ordered = sorted(set(speakers))
    count = min(max(wanted, 0), len(ordered) - 1)
    if count <= 0:
        return []
    order = np.random.default_rng(DEV_SEED).permutation(len(ordered))
    return sorted(ordered[i] for i in order[:count].tolist())


def labelled_pool(
    options: FinetuneOptions,
    manifest_file: str | os.PathLike[str],
    shard_file: Callable[[str], Path],
    train_speakers: list[str],
    test_speakers: list[str],
) -> LabelledPool:
    """The transcribed utterances CTC can align, at most ``max_frames`` long: a seeded subsample of the
    test speakers' as the held-out set; of the training speakers' (minus those whose sentence a
    held-out speaker reads), ``dev_speakers`` speakers' as the dev set, the rest as candidates."""
    manifest = pq.read_table(manifest_file, columns=["utt_id", "transcript"]).to_pydict()
    texts = {u: normalise(t or "") for u, t in zip(manifest["utt_id"], manifest["transcript"], strict=True)}
    usable: dict[str, list[Candidate]] = {}  # speaker -> the transcribed utterances CTC can use
    skipped = 0
    # every held-out speaker's sentence, scored or not: none of them may be labelled, dev or LM text
    heldout_sentences: set[str] = set()
    for speaker in sorted(set(train_speakers) | set(test_speakers)):
        usable[speaker] = []
        shard = read_shard_table(shard_file(speaker), columns=["utt_id", "num_frames"]).to_pylist()
        for row in shard:
            text = texts.get(row["utt_id"], "")
            if not text:
                continue
            if speaker in test_speakers:
                heldout_sentences.add(text)
            if not (ctc_feasible(row["num_frames"], text) and row["num_frames"] <= options.max_frames):
                skipped += 1
                continue
            usable[speaker].append(Candidate(row["utt_id"], speaker, row["num_frames"] / 100.0))
    heldout = sorted(c.utt_id for s in test_speakers for c in usable[s])
    heldout = [heldout[i] for i in subsample(len(heldout), options.max_eval_utterances, seed=0)]
    training, dropped = {}, 0
    for speaker in sorted(set(train_speakers) - set(test_speakers)):
        kept = [c for c in usable[speaker] if texts[c.utt_id] not in heldout_sentences]
        dropped += len(usable[speaker]) - len(kept)
        training[speaker] = kept
    dev_of = dev_speakers_of([s for s, kept in training.items() if kept], options.dev_speakers)
    dev = sorted(c.utt_id for s in dev_of for c in training[s])
    dev_texts = {dev[i]: texts[dev[i]] for i in subsample(len(dev), options.max_dev_utterances, seed=0)}
    candidates = [c for s, kept in training.items() if s not in dev_of for c in kept]
    heldout_texts = {u: texts[u] for u in heldout}
    return LabelledPool(
        train_speakers, test_speakers, candidates, heldout_texts, texts, skipped, dev_of, dev_texts, dropped
    )


def run_settings(model: str, minutes: float, seed: int, lr: float, decoders: list[str]) -> dict[str, Any]:
    """The ``[finetune]`` updates that name one run (and its folder); scratch freezes nothing."""
    return {
        "labelled_minutes": [minutes],
        "seeds": [seed],
        "encoders": [model],
        "decoders": decoders,
        "parallel_runs": 0,  # how many runs train at once does not name a run
        "lr": lr,
        "lr_grid": [],  # nor does the grid its lr was tried from
        **({"freeze_steps": 0, "freeze_frontend": False} if model == SCRATCH else {}),
    }


def plan_finetune(
    options: FinetuneOptions,
    *,
    pretrained: Checkpoint,
    checkpoint_of: Callable[[str], Checkpoint | None],
    encoder_assets: Mapping[str, str],
    clients: Callable[[], ClientsTable],
    manifest_file: str | os.PathLike[str],
    shard_file: Callable[[str], Path],
    data_versions: Callable[[list[str]], dict[str, str]],
    log: Callable[[str], None],
    warn: Callable[[str], None],
) -> FinetunePlan:
    """Every run of ``options``; ``data_versions(speakers)``: the versions every run shares."""
    import torch

    encoders = choose_encoders(options.encoders, encoder_assets, pretrained, checkpoint_of)
    # the speakers each checkpoint records ({"train": [...], "heldout": [...]})
    recorded = {
        name: torch.load(path, map_location="cpu", weights_only=True).get("speakers")
        for name, (path, _) in encoders.items()
    }
    train_speakers, test_speakers = probe_split(clients(), recorded)
    pool = labelled_pool(options, manifest_file, shard_file, train_speakers, test_speakers)
    if not pool.candidates or not pool.heldout_texts:
        raise FinetuneRefused(
            f"nothing to fine-tune on: {len(pool.candidates)} labellable training utterances, "
            f"{len(pool.heldout_texts)} held-out"
        )
    log(
        f"{len(pool.candidates)} transcribed utterances ({pool.available_minutes:.1f} min) of "
        f"{len(pool.labelling_speakers)} training speakers to label from"
        f" ({pool.skipped} too long or too short for CTC), {len(pool.dev_texts)} dev utterances of "
        f"{len(pool.dev_speakers)} speakers, {len(pool.heldout_texts)} held-out utterances of "
        f"{len(test_speakers)} speakers; {pool.overlap_dropped} training-side utterances dropped: their "
        f"sentence is a held-out one"
    )
    lrs = sorted(set(float(lr) for lr in options.lr_grid)) or [float(options.lr)]
    if not pool.dev_texts:  # nothing to choose an lr on
        lrs = [float(options.lr)]
        if options.dev_speakers > 0:
            warn(
                f"no dev speaker: {len(pool.labelling_speakers)} training speaker(s) with usable utterances, one is "
                f"kept to label; each run trains its max_steps and keeps its last step, at lr {options.lr:g}"
            )
    beam = any(d != "greedy" for d in options.decoders)  # greedy always, beam when wanted and installed
    missing_decoder = decoding.unavailable() if beam else None
    if missing_decoder:
        warn(f"beam decoding skipped: {missing_decoder}; greedy only")
    decoders = ["greedy", "beam"] if beam and not missing_decoder else ["greedy"]
    base_versions = data_versions(sorted(set(train_speakers) | set(test_speakers)))
    budgets, seeds = sorted(set(float(m) for m in options.labelled_minutes)), list(options.seeds)
    return FinetunePlan(
        encoders, pool, decoders, missing_decoder, budgets, seeds, base_versions, dict(encoder_assets), lrs
    )


def _sort_key(lr: float, cer: float | None) -> tuple[bool, float, float]:
    finite = cer is not None and math.isfinite(cer)
    return (not finite, cer if finite else 0.0, lr)


def choose_lrs(tuned: Mapping[LrKey, Path]) -> tuple[dict[str, float], dict[str, dict[float, float | None]]]:
    """(per model the lr of lowest dev CER, ties to the smaller lr; per model each lr's dev CER)."""
    dev_cers: dict[str, dict[float, float | None]] = {}
    for (model, lr), run_dir in tuned.items():
        result = finished_result(run_dir)
        if result is None:
            raise FinetuneRefused(f"{model}, lr {lr:g} (choosing the lr): no result in {run_dir}")
        dev_cers.setdefault(model, {})[lr] = result.get("dev_cer")
    chosen = {model: min(cers, key=lambda lr: _sort_key(lr, cers[lr])) for model, cers in dev_cers.items()}
    return chosen, dev_cers


def lr_table(lrs: Sequence[float], chosen: Mapping[str, float], dev_cers: Mapping[str, Mapping[float, Any]]) -> str:
    """Markdown: per model the dev CER of each lr tried, the chosen one in bold."""
    if not dev_cers:
        return markdown_table(("model", "lr (no grid: not tuned)"), ((m, f"{lr:g}") for m, lr in chosen.items()))

    def cell(model: str, lr: float) -> str:
        cer = dev_cers[model].get(lr)
        text = "n/a" if cer is None or not math.isfinite(cer) else f"{cer:.3f}"
        return f"**{text}** (chosen)" if chosen.get(model) == lr else text

    table = markdown_table(
        ["model", *(f"lr {lr:g}" for lr in lrs)], ([model, *(cell(model, lr) for lr in lrs)] for model in dev_cers)
    )
    return f"dev CER (greedy) of each peak lr, smallest budget, first seed\n\n{table}"


def text_overlap(runs: Mapping[RunKey, Mapping[str, Any]]) -> int | None:
    """Labelled utterances whose sentence is a held-out one, over the runs (must be 0); None when unrecorded."""
    counts = [r["text_overlap"] for r in runs.values() if r.get("text_overlap") is not None]
    return sum(counts) if counts else None


def collect_results(planned: Mapping[RunKey, Path]) -> tuple[list[dict[str, Any]], dict[RunKey, dict[str, Any]]]:
    """(the rows of ``results.parquet``, one per run, decoder and split; every run's ``result.json`` by key)."""
    rows, runs = [], {}
    for (model, minutes, seed), run_dir in planned.items():
        result = finished_result(run_dir)
        if result is None:
            raise FinetuneRefused(f"{model}, {minutes:g} min, seed {seed}: no result in {run_dir}")
        runs[(model, minutes, seed)] = result
        heldout = (result.get("speakers") or {}).get("heldout")
        rows += [
            {
                "model": model,
                "labelled_minutes": minutes,
                "seed": seed,
                **score,
                "steps": result["step"],
                "labelled_seconds": result["labelled_seconds"],
                "checkpoint_sha256": result["checkpoint_sha256"],
                "dev_cer": result.get("dev_cer"),
                "lr": result.get("lr"),
                "heldout_speakers": len(heldout) if heldout is not None else None,
                "text_overlap": result.get("text_overlap"),
                "oov_rate": result.get("oov_rate"),
            }
            for score in result["scores"]
        ]
    return rows, runs
