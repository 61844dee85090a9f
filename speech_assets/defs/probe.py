"""Stage 5: what an encoder is worth: `downstream_probe`, a CTC probe on every checkpoint.

The ML lives in speech_assets/evaluation/; torch and jiwer are imported inside the asset.
"""

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import dagster as dg
import pyarrow.parquet as pq

from speech_assets.corpus.clients import ClientsTable, read_clients
from speech_assets.defs.lineage import checkpoint_of, latest_data_version, required_checkpoint
from speech_assets.defs.resources import PipelineSettings, ProbeSettings, StoragePaths, effective, overrides_of
from speech_assets.train.tracking import log_probe_on_encoder_runs
from speech_assets.utils import atomic_path, atomic_write_text, from_fields, sha256_file

if TYPE_CHECKING:
    from speech_assets.evaluation.compare import Standing

# v4: probes train on the non-development training speakers and stop early; a paired verdict over
# held-out utterances (utterances.parquet, leaderboard.parquet); v3: lr and stopping step chosen per
# model on a development split; v2: the recorded split, per-model normalisation, several seeds
PROBE_CODE_VERSION = "probe-v4"


class ProbeOverrides(overrides_of(ProbeSettings)):
    """Run-config overrides of the `[probe]` settings for one manual run."""


class ProbeLeak(ValueError):
    """A probe test speaker was in an encoder's training data, or an encoder records no split."""


def probe_split(
    table: ClientsTable, recorded: Mapping[str, Mapping[str, list[str]] | None]
) -> tuple[list[str], list[str]]:
    """(the probe's training speakers, its test speakers).

    Test speakers are the pipeline's held-out speakers (``table``'s ``heldout``) that every encoder
    (``recorded``: name -> the ``speakers`` its checkpoint records) held out too; the probe trains
    on every speaker that is not held out. Raises :class:`ProbeLeak` naming the encoder and the
    speakers when a test speaker was in an encoder's training speakers, when an encoder records
    no split, or when no test speaker is left.
    """
    heldout = {a.speaker_id for a in table if a.heldout}
    test = set(heldout)
    for name, speakers in recorded.items():
        if not speakers or "train" not in speakers or "heldout" not in speakers:
            raise ProbeLeak(f"the {name} checkpoint records no training/held-out speakers: re-materialise it")
        if leaked := sorted(test & set(speakers["train"])):
            raise ProbeLeak(f"{name} trained on the held-out speakers {leaked[:10]}: its checkpoint predates this split")
        test &= set(speakers["heldout"])
    if not test:
        raise ProbeLeak(f"no speaker is held out by the clients table and every encoder ({sorted(recorded)})")
    return sorted({a.speaker_id for a in table} - heldout), sorted(test)


@dg.asset(
    group_name="evaluation",
    deps=[
        "pretrained_checkpoint", "federated_checkpoint", "distilled_checkpoint", "pretrained_checkpoint_iter2",
        "manifest", "client_partitions",
    ],  # fmt: skip
    code_version=PROBE_CODE_VERSION,
    kinds={"pytorch"},
)
def downstream_probe(
    context: dg.AssetExecutionContext, config: ProbeOverrides, paths: StoragePaths, settings: PipelineSettings
) -> dg.MaterializeResult:
    """A character CTC probe (SUPERB-style weighted sum of frozen layers, then linear or BiLSTM)
    trained on the training speakers and scored (greedy CER/WER, jiwer) on the held-out speakers
    that no encoder saw, over several probe seeds, for every checkpoint that exists and for the
    log-mel (fbank) and randomly initialised baselines; each model reads its input through the
    normalisation it was trained with: <data>/probe/results.parquet."""
    import torch

    from speech_assets.evaluation.compare import (
        FBANK, RANDOM, ProbeModel, compare_encoders, leaderboard, leaderboard_table, markdown_table, results_table,
        leaderboard_path, reading_note, split_utterances, standing, summarise, utterances_path, utterances_table,
    )  # fmt: skip
    from speech_assets.evaluation.encoders import manifest_utterances
    from speech_assets.evaluation.probe import ProbeOptions
    from speech_assets.features.cmvn import UtteranceCmvn, from_record
    from speech_assets.model.encoders import load_encoder, random_encoder
    from speech_assets.model.presets import ModelPreset

    options = effective(settings.probe, config)
    torch.set_num_threads(options.threads or torch.get_num_threads())
    pretrained_path, _ = required_checkpoint(context, "pretrained_checkpoint")
    loaded = {"pretrained": load_encoder(pretrained_path)}
    optional = (("federated_checkpoint", "federated"), ("distilled_checkpoint", "distilled"), ("pretrained_checkpoint_iter2", "iteration2"))
    for asset, name in optional:
        if (found := checkpoint_of(context, asset)) is not None:
            loaded[name] = load_encoder(found[0])
    table = read_clients(paths.clients_file)
    try:
        train_speakers, test_speakers = probe_split(table, {name: e.checkpoint.get("speakers") for name, e in loaded.items()})
    except ProbeLeak as error:
        raise dg.Failure(description=str(error)) from error

    def model(name: str, encoder, record) -> ProbeModel:
        normaliser = from_record(record) or UtteranceCmvn()
        label = "utterance" if isinstance(normaliser, UtteranceCmvn) else "global (training speakers)"
        return ProbeModel(name, encoder.sha256 if encoder else "", label, lambda x: normaliser.apply(x, "logmel"), encoder.model if encoder else None)

    baseline_norm = loaded["pretrained"].checkpoint.get("normalisation")
    random = random_encoder(ModelPreset(**loaded["pretrained"].checkpoint["preset"]), seed=options.seed)
    models = [model(FBANK, None, baseline_norm), model(RANDOM, random, baseline_norm)]
    models += [model(name, encoder, encoder.checkpoint.get("normalisation")) for name, encoder in loaded.items()]
    utterances = manifest_utterances(paths.manifest_file, [paths.shard_file(s) for s in sorted(set(train_speakers) | set(test_speakers))])
    train, test = split_utterances(utterances, set(test_speakers), options.max_train_utterances, options.max_eval_utterances, options.seed)
    context.log.info(
        f"probing {', '.join(m.name for m in models)} over seeds {list(options.seeds)}: {len(train)} training utterances "
        f"of {len(train_speakers)} speakers, {len(test)} held-out utterances of {len(test_speakers)} speakers "
        f"({', '.join(test_speakers[:10])})"
    )
    results = compare_encoders(
        train, test, models, from_fields(ProbeOptions, options),
        on_model=lambda r: context.log.info(f"{r.model} seed {r.seed}: held-out CER {r.cer:.3f}, WER {r.wer:.3f} ({r.seconds:.0f} s)"),
    )  # fmt: skip
    target = paths.probe.results
    target.parent.mkdir(parents=True, exist_ok=True)
    board = leaderboard(results, options.min_heldout_speakers)
    for table, path in (
        (utterances_table(results), utterances_path(target)),
        (leaderboard_table(board, options.min_heldout_speakers), leaderboard_path(target)),
        (results_table(results), target),  # last: its hash is the data version
    ):
        with atomic_path(path) as tmp:
            pq.write_table(table, tmp)
    # who the probe trained and tested on, in full: the disjointness anyone can audit
    split_file = paths.probe.speakers
    atomic_write_text(split_file, json.dumps({"train": train_speakers, "test": test_speakers, "encoders": {
        name: encoder.checkpoint.get("speakers") for name, encoder in loaded.items()}}, indent=1, sort_keys=True))
    lines = standing(results, options.min_heldout_speakers)
    for line in lines:
        context.log.info(line)
    log_probe_on_encoder_runs(
        paths.mlflow_tracking_uri, paths.root, {n: e.checkpoint for n, e in loaded.items()}, summarise(results),
        context.log.warning,
    )
    pretrained = next(s for s in board if s.model == "pretrained")
    input_versions = {
        asset: latest_data_version(context.instance, asset) or ""
        for asset in (
            "pretrained_checkpoint", "federated_checkpoint", "distilled_checkpoint", "pretrained_checkpoint_iter2",
            "manifest", "client_partitions",
        )  # fmt: skip
    }
    return dg.MaterializeResult(
        data_version=dg.DataVersion(sha256_file(target)),
        metadata={
            "leaderboard": leaderboard_metadata(board),
            "standing": dg.MetadataValue.md("\n".join(f"- {line}" for line in lines) + "\n\n" + reading_note(board, options.min_heldout_speakers)),
            "pretrained_beats_fbank": verdict_word(pretrained, FBANK),
            **{f"heldout_cer/{m}": round(v.cer.mean, 4) for m, v in summarise(results).items()},
            "results_file": dg.MetadataValue.path(str(target)),
            "min_heldout_speakers": options.min_heldout_speakers,
            "probe": options.probe,
            "steps": options.steps,
            "seeds": dg.MetadataValue.json(list(options.seeds)),
            # each model's learning rate and stopping step, chosen on a development split of the training speakers
            "probe_lr_steps": dg.MetadataValue.json(
                {m: [[r.lr, r.steps] for r in results if r.split == "heldout" and r.model == m] for m in summarise(results)}
            ),
            "normalisation": dg.MetadataValue.json({m.name: m.normalisation for m in models}),
            "train_utterances": len(train),
            "heldout_utterances": len(test),
            "heldout_speakers": dg.MetadataValue.json(test_speakers[:50]),
            "probe_train_speakers": len(train_speakers),
            "speakers_file": dg.MetadataValue.path(str(split_file)),
            "input_versions": dg.MetadataValue.json(input_versions),
            # below the leaderboard: each model's probe lr, CER on its own training utterances, top layer
            "details": dg.MetadataValue.md(markdown_table(results)),
        },
    )


def leaderboard_metadata(board: Sequence["Standing"]) -> dg.MetadataValue:
    """The leaderboard (:func:`~speech_assets.evaluation.compare.leaderboard_rows`) as a Dagster
    table with its column schema."""
    from speech_assets.evaluation.compare import LEADERBOARD_COLUMNS, leaderboard_rows

    schema = dg.TableSchema(columns=[dg.TableColumn(name, type, description) for name, type, description in LEADERBOARD_COLUMNS])
    return dg.MetadataValue.table([dg.TableRecord(row) for row in leaderboard_rows(board)], schema=schema)


def verdict_word(standing: "Standing", baseline: str) -> str:
    """``yes`` / ``no`` / ``no evidence`` for ``standing`` against ``baseline``, ``(indicative only)`` added below the minimum of held-out speakers."""
    word = {"better": "yes", "worse": "no", "no evidence": "no evidence", None: "not compared"}[standing.verdict_against(baseline)]
    return word if standing.established else f"{word} (indicative only)"


PRETRAINED_BEATS_FBANK = (
    "Warns unless the pretrained encoder's probe errs less than the log-mel (fbank) probe on the same held-out "
    "utterances (a paired bootstrap over utterances of the CER difference, 95 % interval below 0) with at least "
    "min_heldout_speakers held-out speakers. At demo scale it warns: the sample holds out one speaker, so any "
    "verdict is indicative only (and 300 steps on minutes of audio rarely beat fbank)."
)


@dg.asset_check(asset=downstream_probe, description=PRETRAINED_BEATS_FBANK)
def pretrained_beats_fbank(paths: StoragePaths) -> dg.AssetCheckResult:
    """The verdict the probe recorded (``probe/leaderboard.parquet``), word for word."""
    from speech_assets.evaluation.compare import FBANK, read_leaderboard

    target = paths.probe.results
    try:
        found = {row["model"]: row for row in read_leaderboard(target)}
    except FileNotFoundError as error:
        return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN, description=str(error))
    row = found.get("pretrained")
    if row is None:
        return dg.AssetCheckResult(
            passed=False, severity=dg.AssetCheckSeverity.WARN, description="no pretrained row in the probe's leaderboard: rematerialize downstream_probe"
        )
    passed = row.get(f"verdict_{FBANK}") == "better" and not row["indicative"]
    return dg.AssetCheckResult(
        passed=passed,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "verdict": row["verdict"],
            "heldout_cer/pretrained": round(row["cer"], 4),
            **({"heldout_cer/fbank": round(found[FBANK]["cer"], 4)} if FBANK in found else {}),
            "cer_change_fbank": dg.MetadataValue.text(
                "n/a" if row.get(f"cer_change_{FBANK}") is None else
                f"{row[f'cer_change_{FBANK}']:+.3f} [{row[f'cer_change_{FBANK}_low']:+.3f}, {row[f'cer_change_{FBANK}_high']:+.3f}]"
            ),
            "heldout_speakers": row["speakers"],
            "min_heldout_speakers": row["min_heldout_speakers"],
        },
        description=f"pretrained: {row['verdict']}",
    )
