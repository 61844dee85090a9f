"""The probe's protocol: its speaker split (a test speaker in any encoder's training data refuses
the run), the models it compares (the ``fbank`` and ``random`` baselines read through the pretrained
encoder's normalisation, every encoder through its own) and the files it publishes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow.parquet as pq

from speech_assets.corpus.clients import ClientsTable
from speech_assets.evaluation.compare import (
    FBANK,
    RANDOM,
    ProbeModel,
    ProbeResult,
    Standing,
    compare_encoders,
    leaderboard,
    leaderboard_table,
    results_table,
    split_utterances,
    utterances_table,
)
from speech_assets.evaluation.probe_options import ProbeOptions
from speech_assets.layout import ProbeFiles
from speech_assets.utils import atomic_path, atomic_write_text

if TYPE_CHECKING:
    from speech_assets.evaluation.encoders import Utterance
    from speech_assets.model.encoders import LoadedEncoder


class ProbeLeak(ValueError):
    """A probe test speaker was in an encoder's training data, or an encoder records no split."""


def probe_split(
    table: ClientsTable, recorded: Mapping[str, Mapping[str, list[str]] | None]
) -> tuple[list[str], list[str]]:
    """(the probe's training speakers, its test speakers: the held-out speakers every encoder held out too);
    ``recorded``: encoder name -> the ``speakers`` its checkpoint records."""
    heldout = {a.speaker_id for a in table if a.heldout}
    test = set(heldout)
    for name, speakers in recorded.items():
        if not speakers or "train" not in speakers or "heldout" not in speakers:
            raise ProbeLeak(f"the {name} checkpoint records no training/held-out speakers: re-materialise it")
        if leaked := sorted(test & set(speakers["train"])):
            raise ProbeLeak(
                f"{name} trained on the held-out speakers {leaked[:10]}: its checkpoint predates this split"
            )
        test &= set(speakers["heldout"])
    if not test:
        raise ProbeLeak(f"no speaker is held out by the clients table and every encoder ({sorted(recorded)})")
    return sorted({a.speaker_id for a in table} - heldout), sorted(test)


def probe_models(loaded: Mapping[str, LoadedEncoder], seed: int) -> list[ProbeModel]:
    """The baselines (with ``pretrained``'s normalisation and preset), then every encoder of ``loaded``."""
    from speech_assets.features.cmvn import UtteranceCmvn, from_record
    from speech_assets.model.encoders import random_encoder
    from speech_assets.model.presets import ModelPreset

    def model(name: str, encoder: LoadedEncoder | None, record: object) -> ProbeModel:
        normaliser = from_record(record) or UtteranceCmvn()
        label = "utterance" if isinstance(normaliser, UtteranceCmvn) else "global (training speakers)"
        sha256, module = (encoder.sha256, encoder.model) if encoder else ("", None)
        return ProbeModel(name, sha256, label, lambda x: normaliser.apply(x, "logmel"), module)

    pretrained = loaded["pretrained"].checkpoint
    baseline_norm = pretrained.get("normalisation")
    random = random_encoder(ModelPreset(**pretrained["preset"]), seed=seed)
    models = [model(FBANK, None, baseline_norm), model(RANDOM, random, baseline_norm)]
    return models + [model(name, encoder, encoder.checkpoint.get("normalisation")) for name, encoder in loaded.items()]


@dataclass(frozen=True)
class ProbeRun:
    train_speakers: list[str]
    test_speakers: list[str]
    models: list[ProbeModel]
    train: list[Utterance]
    test: list[Utterance]
    results: list[ProbeResult]
    board: list[Standing]


def run_probe(
    loaded: Mapping[str, LoadedEncoder],
    table: ClientsTable,
    load_utterances: Callable[[list[str]], list[Utterance]],
    options: ProbeOptions,
    *,
    seed: int,
    max_train_utterances: int,
    max_eval_utterances: int,
    min_heldout_speakers: int,
    log: Callable[[str], None] = print,
    on_model: Callable[[ProbeResult], None] | None = None,
) -> ProbeRun:
    """The protocol over ``loaded`` encoders; ``load_utterances(speakers)``: their raw log-mel with transcripts."""
    train_speakers, test_speakers = probe_split(
        table, {name: e.checkpoint.get("speakers") for name, e in loaded.items()}
    )
    models = probe_models(loaded, seed)
    utterances = load_utterances(sorted(set(train_speakers) | set(test_speakers)))
    train, test = split_utterances(utterances, set(test_speakers), max_train_utterances, max_eval_utterances, seed)
    log(
        f"probing {', '.join(m.name for m in models)} over seeds {list(options.seeds)}: {len(train)} training "
        f"utterances of {len(train_speakers)} speakers, {len(test)} held-out utterances of "
        f"{len(test_speakers)} speakers ({', '.join(test_speakers[:10])})"
    )
    results = compare_encoders(train, test, models, options, on_model=on_model)
    return ProbeRun(
        train_speakers, test_speakers, models, train, test, results, leaderboard(results, min_heldout_speakers)
    )


def publish_probe(run: ProbeRun, files: ProbeFiles, min_heldout_speakers: int, encoders: Mapping[str, object]) -> None:
    """Write the run's tables (the results last: their hash is the data version) and who the probe
    trained and tested on beside what every encoder held out, for anyone to audit."""
    files.root.mkdir(parents=True, exist_ok=True)
    for table, path in (
        (utterances_table(run.results), files.utterances),
        (leaderboard_table(run.board, min_heldout_speakers), files.leaderboard),
        (results_table(run.results), files.results),
    ):
        with atomic_path(path) as tmp:
            pq.write_table(table, tmp)
    split = {"train": run.train_speakers, "test": run.test_speakers, "encoders": dict(encoders)}
    atomic_write_text(files.speakers, json.dumps(split, indent=1, sort_keys=True))
