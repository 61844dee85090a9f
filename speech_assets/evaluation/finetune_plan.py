"""What `finetuned_asr` fine-tunes, on what, and what it reads back: the plan of its runs, without Dagster.

:func:`plan_finetune` picks the encoders (:func:`choose_encoders`), splits the speakers as the probe
does (:func:`~speech_assets.evaluation.protocol.probe_split`), gathers the utterances CTC can learn
from (:func:`labelled_pool`), picks the decoders (:func:`choose_decoders`) and plans one run per
(model, labelled budget, seed) (:func:`plan_runs`); :func:`collect_results` reads every planned
run's result into the rows of ``results.parquet``. The asset resolves what only Dagster knows
(checkpoints, data versions), names and writes each run's folder, and trains the runs
(:mod:`speech_assets.evaluation.finetune` is the worker); a refusal here is a
:class:`FinetuneRefused` with the message the asset fails with.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pyarrow.parquet as pq

from speech_assets.corpus.clients import ClientsTable
from speech_assets.evaluation import decoding
from speech_assets.evaluation.finetune import Candidate, ctc_feasible, finished_result, labelled_subset
from speech_assets.evaluation.finetune_results import SCRATCH
from speech_assets.evaluation.probe import subsample
from speech_assets.evaluation.protocol import probe_split
from speech_assets.evaluation.text import normalise
from speech_assets.features.shards import read_shard_table
from speech_assets.utils import sha256_strings

PRETRAINED = "pretrained"  # the encoder always there, whose architecture `scratch` re-initialises
Checkpoint = tuple[str, str]  # (``final.pt`` path, its asset's data version)
RunKey = tuple[str, float, int]  # (model, labelled minutes, seed)


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


@dataclass(frozen=True)
class LabelledPool:
    """The utterances of one speaker split: the training speakers' labelling ``candidates``, the
    scored held-out utterances (``heldout_texts``: ``{utt_id: text}``), every normalised
    transcript of the manifest and how many transcribed utterances CTC cannot use (``skipped``)."""

    train_speakers: list[str]
    test_speakers: list[str]
    candidates: list[Candidate]
    heldout_texts: dict[str, str]
    transcripts: dict[str, str]
    skipped: int

    @property
    def available_minutes(self) -> float:
        """Minutes of audio of every labelling candidate."""
        return sum(c.seconds for c in self.candidates) / 60


@dataclass(frozen=True)
class PlannedRun:
    """One fine-tuning run: ``model`` (an encoder's name or ``scratch``) starting from ``encoder``
    (a checkpoint path) on ``labelled`` (``{"train": {utt_id: text}, "heldout": {utt_id: text}}``,
    written as ``labelled_text``), with the ``[finetune]`` settings of this run alone (``settings``:
    the updates of the section that name it) and its inputs' ``versions`` (the encoder's asset,
    the manifest, clients and shards, and ``labelled``: the hash of ``labelled_text``)."""

    model: str
    minutes: float
    seed: int
    encoder: str
    labelled: dict[str, dict[str, str]]
    labelled_text: str
    settings: dict[str, Any]
    versions: dict[str, str]

    @property
    def key(self) -> RunKey:
        return (self.model, self.minutes, self.seed)

    @property
    def init(self) -> str:
        """``scratch`` (a random encoder of the pretrained architecture) or ``pretrained``."""
        return "scratch" if self.model == SCRATCH else "pretrained"

    @property
    def shard_speakers(self) -> list[str]:
        """The speakers whose shards the run reads (those its versions name), sorted."""
        return sorted({k.split("/", 1)[1] for k in self.versions if k.startswith("vad_features/")})


@dataclass(frozen=True)
class FinetunePlan:
    """Every run of one materialization and what its report says: the ``encoders`` fine-tuned
    (name -> checkpoint, in the settings' order), the labelled ``pool``, the ``decoders`` (and why
    the beam decoder is missing, when it was asked for and is), the sorted ``budgets``, the
    ``seeds``, the data versions every run shares (``base_versions``) and the ``runs``."""

    encoders: dict[str, Checkpoint]
    pool: LabelledPool
    decoders: list[str]
    missing_decoder: str | None
    budgets: list[float]
    seeds: list[int]
    base_versions: dict[str, str]
    runs: list[PlannedRun]

    @property
    def recogniser_key(self) -> RunKey:
        """The run exported as the recogniser: the first encoder, the largest budget, the first seed."""
        return (next(iter(self.encoders)), self.budgets[-1], self.seeds[0])


def choose_encoders(
    wanted: Sequence[str],
    known: Collection[str],
    pretrained: Checkpoint,
    checkpoint_of: Callable[[str], Checkpoint | None],
) -> dict[str, Checkpoint]:
    """The encoders of ``wanted`` that have a checkpoint (``checkpoint_of(name)``; ``pretrained``'s
    is given), in ``wanted``'s order; only ``pretrained`` when none has. Raises
    :class:`FinetuneRefused` for a name outside ``known``."""
    found = {PRETRAINED: pretrained}
    for name in wanted:
        if name not in known:
            raise FinetuneRefused(f"[finetune] encoders: unknown {name!r}; known: {sorted(known)}")
        if name not in found and (checkpoint := checkpoint_of(name)) is not None:
            found[name] = checkpoint
    return {name: found[name] for name in wanted if name in found} or {PRETRAINED: pretrained}


def checkpoint_speakers(checkpoint: str) -> dict | None:
    """The ``speakers`` (``{"train": [...], "heldout": [...]}``) a checkpoint records, if any."""
    import torch

    return torch.load(checkpoint, map_location="cpu", weights_only=True).get("speakers")


def labelled_pool(
    manifest_file: str | os.PathLike[str],
    shard_file: Callable[[str], Path],
    train_speakers: list[str],
    test_speakers: list[str],
    max_frames: int,
    max_eval_utterances: int,
) -> LabelledPool:
    """The transcribed utterances of the speakers' shards (``shard_file(speaker)``) that CTC can
    align and are at most ``max_frames`` long: the training speakers' as candidates, a seeded
    subsample of at most ``max_eval_utterances`` (0: all) of the test speakers' as the held-out set."""
    manifest = pq.read_table(manifest_file, columns=["utt_id", "transcript"])
    texts = {
        u: normalise(t or "")
        for u, t in zip(manifest.column("utt_id").to_pylist(), manifest.column("transcript").to_pylist(), strict=True)
    }
    candidates, heldout, skipped = [], [], 0
    for speaker in sorted(set(train_speakers) | set(test_speakers)):
        shard = read_shard_table(shard_file(speaker), columns=["utt_id", "num_frames"]).to_pylist()
        for row in shard:
            text = texts.get(row["utt_id"], "")
            if not text:
                continue
            if not (ctc_feasible(row["num_frames"], text) and row["num_frames"] <= max_frames):
                skipped += 1
                continue
            if speaker in test_speakers:
                heldout.append(row["utt_id"])
            else:
                candidates.append(Candidate(row["utt_id"], speaker, row["num_frames"] / 100.0))
    heldout = sorted(heldout)
    chosen = [heldout[i] for i in subsample(len(heldout), max_eval_utterances, seed=0)]
    return LabelledPool(train_speakers, test_speakers, candidates, {u: texts[u] for u in chosen}, texts, skipped)


def choose_decoders(wanted: Sequence[str], warn: Callable[[str], None]) -> tuple[list[str], str | None]:
    """(``greedy``, then ``beam`` when a decoder other than greedy is ``wanted`` and installed;
    why the beam decoder is unavailable when it was wanted and is, else None)."""
    if not any(d != "greedy" for d in wanted):
        return ["greedy"], None
    missing = decoding.unavailable()
    if missing:
        warn(f"beam decoding skipped: {missing}; greedy only")
        return ["greedy"], missing
    return ["greedy", "beam"], None


def plan_runs(
    encoders: Mapping[str, Checkpoint],
    pool: LabelledPool,
    budgets: Sequence[float],
    seeds: Sequence[int],
    decoders: list[str],
    base_versions: Mapping[str, str],
    encoder_assets: Mapping[str, str],
    warn: Callable[[str], None],
) -> list[PlannedRun]:
    """One run per budget (minutes), seed and model (each of ``encoders``, then ``scratch`` on the
    pretrained architecture), in that order; a budget and seed label the same subset of the
    pool's candidates for every model (:func:`~speech_assets.evaluation.finetune.labelled_subset`),
    all of them with a warning when there is less audio than asked. A run's versions name its
    encoder's asset (``encoder_assets[model]``; ``pretrained_checkpoint`` for scratch)."""
    runs = []
    for minutes in budgets:
        for seed in seeds:
            subset = labelled_subset(pool.candidates, pool.test_speakers, minutes, seed)
            labelled = {"train": {u: pool.transcripts[u] for u in subset}, "heldout": pool.heldout_texts}
            chosen = set(subset)
            seconds = sum(c.seconds for c in pool.candidates if c.utt_id in chosen)
            if seconds < minutes * 60:
                warn(
                    f"{minutes:g} min asked, {seconds / 60:.1f} min of training speakers' audio available: "
                    f"using all of it"
                )
            labelled_text = json.dumps(labelled, indent=1, sort_keys=True)
            for model in [*encoders, SCRATCH]:
                path, version = encoders[PRETRAINED] if model == SCRATCH else encoders[model]
                asset = encoder_assets.get(model, encoder_assets[PRETRAINED])
                runs.append(
                    PlannedRun(
                        model,
                        minutes,
                        seed,
                        path,
                        labelled,
                        labelled_text,
                        # how many runs train at once does not name a run: parallel_runs 0
                        {
                            "labelled_minutes": [minutes],
                            "seeds": [seed],
                            "encoders": [model],
                            "decoders": decoders,
                            "parallel_runs": 0,
                        },
                        {asset: version, **base_versions, "labelled": sha256_strings([labelled_text])},
                    )
                )
    return runs


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
    speakers_of: Callable[[str], Mapping[str, list[str]] | None] = checkpoint_speakers,
) -> FinetunePlan:
    """Every run of ``options`` (module docstring). ``encoder_assets``: each encoder's name -> its
    asset; ``clients()``: the clients table; ``data_versions(speakers)``: the versions every run
    shares (manifest, clients, those speakers' shards); ``speakers_of(path)``: the split a
    checkpoint records. Raises :class:`FinetuneRefused` (an unknown encoder, nothing to label or
    score) and :class:`~speech_assets.evaluation.protocol.ProbeLeak`."""
    encoders = choose_encoders(options.encoders, encoder_assets, pretrained, checkpoint_of)
    train_speakers, test_speakers = probe_split(
        clients(), {name: speakers_of(path) for name, (path, _) in encoders.items()}
    )
    pool = labelled_pool(
        manifest_file, shard_file, train_speakers, test_speakers, options.max_frames, options.max_eval_utterances
    )
    if not pool.candidates or not pool.heldout_texts:
        raise FinetuneRefused(
            f"nothing to fine-tune on: {len(pool.candidates)} labellable training utterances, "
            f"{len(pool.heldout_texts)} held-out"
        )
    log(
        f"{len(pool.candidates)} transcribed utterances ({pool.available_minutes:.1f} min) of {len(train_speakers)} "
        f"training speakers to label from"
        f" ({pool.skipped} too long or too short for CTC), {len(pool.heldout_texts)} held-out utterances of "
        f"{len(test_speakers)} speakers"
    )
    decoders, missing_decoder = choose_decoders(options.decoders, warn)
    base_versions = data_versions(sorted(set(train_speakers) | set(test_speakers)))
    budgets = sorted(set(float(m) for m in options.labelled_minutes))
    seeds = list(options.seeds)
    runs = plan_runs(encoders, pool, budgets, seeds, decoders, base_versions, encoder_assets, warn)
    return FinetunePlan(encoders, pool, decoders, missing_decoder, budgets, seeds, base_versions, runs)


def collect_results(planned: Mapping[RunKey, Path]) -> tuple[list[dict[str, Any]], dict[RunKey, dict[str, Any]]]:
    """(the rows of ``results.parquet``: one per run, decoder and split; every run's ``result.json``
    by key) of the ``planned`` run folders, in their order. Raises :class:`FinetuneRefused` naming
    a run that left no result."""
    rows, runs = [], {}
    for (model, minutes, seed), run_dir in planned.items():
        result = finished_result(run_dir)
        if result is None:
            raise FinetuneRefused(f"{model}, {minutes:g} min, seed {seed}: no result in {run_dir}")
        runs[(model, minutes, seed)] = result
        rows += [
            {
                "model": model,
                "labelled_minutes": minutes,
                "seed": seed,
                **score,
                "steps": result["step"],
                "labelled_seconds": result["labelled_seconds"],
                "checkpoint_sha256": result["checkpoint_sha256"],
            }
            for score in result["scores"]
        ]
    return rows, runs
