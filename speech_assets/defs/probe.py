"""Stage 5: what an encoder is worth: `downstream_probe`, a CTC probe on every checkpoint.

The ML lives in speech_assets/evaluation/; torch and jiwer are imported inside the asset.
"""

from collections.abc import Sequence

import dagster as dg

from speech_assets.corpus.clients import read_clients
from speech_assets.defs.lineage import checkpoint_of, latest_versions, required_checkpoint
from speech_assets.defs.partitions import CHECKPOINT_ASSETS
from speech_assets.defs.resources import PipelineSettings, ProbeSettings, StoragePaths, effective, overrides_of
from speech_assets.evaluation import compare
from speech_assets.train.tracking import log_probe_on_encoder_runs
from speech_assets.utils import from_fields, sha256_file

# v4: probes train on the non-development training speakers and stop early; a paired verdict over
# held-out utterances (utterances.parquet, leaderboard.parquet); v3: lr and stopping step chosen per
# model on a development split; v2: the recorded split, per-model normalisation, several seeds
PROBE_CODE_VERSION = "probe-v4"


ProbeOverrides = overrides_of(ProbeSettings)


@dg.asset(
    group_name="evaluation",
    deps=[*CHECKPOINT_ASSETS.values(), "manifest", "client_partitions"],
    code_version=PROBE_CODE_VERSION,
    kinds={"pytorch"},
)
def downstream_probe(
    context: dg.AssetExecutionContext, config: ProbeOverrides, paths: StoragePaths, settings: PipelineSettings
) -> dg.MaterializeResult:
    """A character CTC probe (SUPERB-style weighted sum of frozen layers, then linear or BiLSTM)
    trained on the training speakers and scored (greedy CER/WER) on held-out speakers no encoder
    saw, over several seeds, for every checkpoint and the fbank and random baselines:
    `<data>/probe/results.parquet`."""
    import torch

    from speech_assets.evaluation.encoders import manifest_utterances
    from speech_assets.evaluation.probe_options import ProbeOptions
    from speech_assets.evaluation.protocol import ProbeLeak, publish_probe, run_probe
    from speech_assets.model.encoders import LoadedEncoder, load_encoder

    options = effective(settings.probe, config)
    torch.set_num_threads(options.threads or torch.get_num_threads())
    loaded: dict[str, LoadedEncoder] = {}
    for name, asset in CHECKPOINT_ASSETS.items():  # pretrained first: it is required, the others are probed if found
        found = required_checkpoint(context, asset) if name == "pretrained" else checkpoint_of(context, asset)
        if found is not None:
            loaded[name] = load_encoder(found[0])
    try:
        run = run_probe(
            loaded,
            read_clients(paths.layout.clients_file),
            lambda speakers: manifest_utterances(
                paths.layout.manifest.manifest, [paths.shard_file(s) for s in speakers]
            ),
            from_fields(ProbeOptions, options),
            seed=options.seed,
            max_train_utterances=options.max_train_utterances,
            max_eval_utterances=options.max_eval_utterances,
            min_heldout_speakers=options.min_heldout_speakers,
            log=context.log.info,
            on_model=lambda r: context.log.info(
                f"{r.model} seed {r.seed}: held-out CER {r.cer:.3f}, WER {r.wer:.3f} ({r.seconds:.0f} s)"
            ),
        )
    except ProbeLeak as error:
        raise dg.Failure(description=str(error)) from error
    results, board = run.results, run.board
    target = paths.layout.probe.results
    publish_probe(
        run,
        paths.layout.probe,
        options.min_heldout_speakers,
        {n: e.checkpoint.get("speakers") for n, e in loaded.items()},
    )
    lines = compare.standing(results, options.min_heldout_speakers)
    for line in lines:
        context.log.info(line)
    log_probe_on_encoder_runs(
        paths.mlflow_tracking_uri,
        paths.root,
        {n: e.checkpoint for n, e in loaded.items()},
        compare.summarise(results),
        context.log.warning,
    )
    input_versions = latest_versions(context.instance, [*CHECKPOINT_ASSETS.values(), "manifest", "client_partitions"])
    return dg.MaterializeResult(
        data_version=dg.DataVersion(sha256_file(target)),
        metadata={
            "leaderboard": leaderboard_metadata(board),
            # once, beside the table: how to read its verdicts and why they are only indicative (the "*")
            "how_to_read": dg.MetadataValue.md(compare.reading_note(board, options.min_heldout_speakers)),
            **verdict_metadata(board, options.min_heldout_speakers),
            **{f"heldout_cer/{m}": round(v.cer.mean, 4) for m, v in compare.summarise(results).items()},
            "standing": dg.MetadataValue.md("\n".join(f"- {line}" for line in lines)),
            "results_file": dg.MetadataValue.path(str(target)),
            "min_heldout_speakers": options.min_heldout_speakers,
            "probe": options.probe,
            "steps": options.steps,
            "seeds": dg.MetadataValue.json(list(options.seeds)),
            # each model's learning rate and stopping step, chosen on a development split of the training speakers
            "probe_lr_steps": dg.MetadataValue.json(
                {
                    m: [[r.lr, r.steps] for r in results if r.split == "heldout" and r.model == m]
                    for m in compare.summarise(results)
                }
            ),
            "normalisation": dg.MetadataValue.json({m.name: m.normalisation for m in run.models}),
            "train_utterances": len(run.train),
            "heldout_utterances": len(run.test),
            "heldout_speakers": dg.MetadataValue.json(run.test_speakers[:50]),
            "probe_train_speakers": len(run.train_speakers),
            "speakers_file": dg.MetadataValue.path(str(paths.layout.probe.speakers)),
            "input_versions": dg.MetadataValue.json(input_versions),
            # below the leaderboard: each model's probe lr, CER on its own training utterances, top layer
            "details": dg.MetadataValue.md(compare.markdown_table(results)),
        },
    )


def leaderboard_metadata(board: Sequence[compare.Standing]) -> dg.MetadataValue:
    """The leaderboard as a Dagster table with its column schema."""
    schema = dg.TableSchema(
        columns=[dg.TableColumn(name, type, description) for name, type, description in compare.LEADERBOARD_COLUMNS]
    )
    return dg.MetadataValue.table([dg.TableRecord(row) for row in compare.leaderboard_rows(board)], schema=schema)


def verdict_metadata(board: Sequence[compare.Standing], min_speakers: int) -> dict[str, str]:
    """``pretrained_beats_fbank``: word for word the description of the check of that name (same function, same row)."""
    rows = {row["model"]: row for row in compare.leaderboard_table(board, min_speakers).to_pylist()}
    return {"pretrained_beats_fbank": compare.beats_baseline(rows.get("pretrained"), "pretrained", compare.FBANK).text}


PRETRAINED_BEATS_FBANK = (
    "Warns unless the pretrained encoder's probe errs less than the log-mel (fbank) probe on the same held-out "
    "utterances (a paired bootstrap over utterances of the CER difference, 95 % interval below 0) with at least "
    "min_heldout_speakers held-out speakers. Its description is the asset's pretrained_beats_fbank metadata word "
    "for word ('pass: ...' or 'warn: ...'). At demo scale it warns: the sample holds out one speaker, so any "
    "verdict is indicative only (and 300 steps on minutes of audio rarely beat fbank)."
)


@dg.asset_check(asset=downstream_probe, description=PRETRAINED_BEATS_FBANK)
def pretrained_beats_fbank(paths: StoragePaths) -> dg.AssetCheckResult:
    """Judged by the function that writes the asset's ``pretrained_beats_fbank`` metadata, so they never disagree."""
    try:
        found = {row["model"]: row for row in compare.read_leaderboard(paths.layout.probe.results)}
    except FileNotFoundError as error:
        return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN, description=str(error))
    row = found.get("pretrained")
    verdict = compare.beats_baseline(row, "pretrained", compare.FBANK)
    metadata = {}
    if row is not None:
        metadata = {
            "verdict": row["verdict"],
            "heldout_cer/pretrained": round(row["cer"], 4),
            **({"heldout_cer/fbank": round(found[compare.FBANK]["cer"], 4)} if compare.FBANK in found else {}),
            "heldout_speakers": row["speakers"],
            "min_heldout_speakers": row["min_heldout_speakers"],
        }
    return dg.AssetCheckResult(
        passed=verdict.passed, severity=dg.AssetCheckSeverity.WARN, description=verdict.text, metadata=metadata
    )
