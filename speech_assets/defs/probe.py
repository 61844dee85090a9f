"""Stage 5: what an encoder is worth: `downstream_probe`, a CTC probe on every checkpoint.

The ML lives in speech_assets/evaluation/; torch and jiwer are imported inside the asset.
"""

import dagster as dg
import pyarrow.parquet as pq

from speech_assets.corpus.clients import read_clients
from speech_assets.defs.lineage import checkpoint_of, latest_data_version, required_checkpoint
from speech_assets.defs.resources import PipelineSettings, ProbeSettings, StoragePaths, effective, overrides_of
from speech_assets.utils import atomic_path, from_fields, sha256_file

PROBE_CODE_VERSION = "probe-v1"


class ProbeOverrides(overrides_of(ProbeSettings)):
    """Run-config overrides of the `[probe]` settings for one manual run."""


def speaker_clients(paths: StoragePaths) -> dict[str, str]:
    """``{speaker: client}`` from the clients table."""
    return {row.speaker_id: row.client_id for row in read_clients(paths.clients_file)}


def shard_utterances(paths: StoragePaths, speakers: list[str]) -> list:
    """The utterances of ``speakers``' shards, CMVN-normalised, with their transcripts."""
    from speech_assets.evaluation.encoders import load_utterances
    from speech_assets.features.cmvn import Cmvn

    table = pq.read_table(paths.manifest_file, columns=["utt_id", "transcript"])
    transcripts = dict(zip(table.column("utt_id").to_pylist(), table.column("transcript").to_pylist(), strict=True))
    return load_utterances([paths.shard_file(s) for s in speakers], Cmvn.load(paths.cmvn_dir / "cmvn.npz"), transcripts)


@dg.asset(
    group_name="evaluation",
    deps=[
        "pretrained_checkpoint", "federated_checkpoint", "distilled_checkpoint", "pretrained_checkpoint_iter2",
        "manifest", "cmvn_stats", "client_partitions",
    ],  # fmt: skip
    code_version=PROBE_CODE_VERSION,
    kinds={"pytorch"},
)
def downstream_probe(
    context: dg.AssetExecutionContext, config: ProbeOverrides, paths: StoragePaths, settings: PipelineSettings
) -> dg.MaterializeResult:
    """A character CTC probe (SUPERB-style weighted sum of frozen layers, then linear or BiLSTM)
    trained on the training speakers and scored (greedy CER/WER, jiwer) on held-out speakers,
    for every checkpoint that exists and for the log-mel (fbank) and randomly initialised
    baselines: <data>/probe/results.parquet."""
    import pyarrow as pa

    from speech_assets.evaluation.compare import RANDOM, RESULT_COLUMNS, compare_encoders, markdown_table, split_utterances
    import torch

    from speech_assets.model.encoders import load_encoder, random_encoder
    from speech_assets.evaluation.probe import ProbeOptions
    from speech_assets.model.presets import ModelPreset
    from speech_assets.train.data import heldout_speakers

    options = effective(settings.probe, config)
    torch.set_num_threads(options.threads or torch.get_num_threads())
    pretrained_path, _ = required_checkpoint(context, "pretrained_checkpoint")
    encoders = {"pretrained": load_encoder(pretrained_path)}
    pretrained = encoders["pretrained"]
    encoders[RANDOM] = random_encoder(ModelPreset(**pretrained.checkpoint["preset"]), seed=options.seed)
    optional = (("federated_checkpoint", "federated"), ("distilled_checkpoint", "distilled"), ("pretrained_checkpoint_iter2", "iteration2"))
    for asset, name in optional:
        if (found := checkpoint_of(context, asset)) is not None:
            encoders[name] = load_encoder(found[0])
    # the speakers pretraining held out are the probe's test speakers: never seen by any encoder
    fraction = (pretrained.checkpoint.get("config") or {}).get("heldout_fraction", settings.training.heldout_fraction)
    held = heldout_speakers(speaker_clients(paths), fraction)
    utterances = shard_utterances(paths, sorted(speaker_clients(paths)))
    train, test = split_utterances(utterances, held, options.max_train_utterances, options.max_eval_utterances, options.seed)
    context.log.info(
        f"probing {', '.join(['fbank', *encoders])}: {len(train)} training utterances, {len(test)} held-out "
        f"utterances of {len(held)} held-out speakers ({', '.join(sorted(held)[:10])})"
    )
    results = compare_encoders(
        train, test, encoders, from_fields(ProbeOptions, options),
        on_model=lambda r: context.log.info(f"{r.model}: held-out CER {r.cer:.3f}, WER {r.wer:.3f} ({r.seconds:.0f} s)"),
    )  # fmt: skip
    table = pa.Table.from_pylist([r.row() for r in results]).select(list(RESULT_COLUMNS))
    target = paths.root / "probe" / "results.parquet"
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        pq.write_table(table, tmp)
    heldout = {r.model: r for r in results if r.split == "heldout"}
    input_versions = {
        asset: latest_data_version(context.instance, asset) or ""
        for asset in (
            "pretrained_checkpoint", "federated_checkpoint", "distilled_checkpoint", "pretrained_checkpoint_iter2",
            "manifest", "cmvn_stats", "client_partitions",
        )  # fmt: skip
    }
    return dg.MaterializeResult(
        data_version=dg.DataVersion(sha256_file(target)),
        metadata={
            "results": dg.MetadataValue.md(markdown_table(results)),
            "results_file": dg.MetadataValue.path(str(target)),
            **{f"heldout_cer/{model}": round(r.cer, 4) for model, r in heldout.items()},
            "pretrained_beats_fbank": heldout["pretrained"].cer < heldout["fbank"].cer,
            "probe": options.probe,
            "steps": options.steps,
            "train_utterances": len(train),
            "heldout_utterances": len(test),
            "heldout_speakers": dg.MetadataValue.json(sorted(held)[:50]),
            "seconds_per_model": dg.MetadataValue.json({r.model: round(r.seconds, 1) for r in heldout.values()}),
            "input_versions": dg.MetadataValue.json(input_versions),
        },
    )


@dg.asset_check(asset=downstream_probe, description="Warns when the pretrained encoder's probe does not beat the log-mel (fbank) baseline on held-out speakers.")
def pretrained_beats_fbank(paths: StoragePaths) -> dg.AssetCheckResult:
    rows = pq.read_table(paths.root / "probe" / "results.parquet").to_pylist()
    cer = {row["model"]: row["cer"] for row in rows if row["split"] == "heldout"}
    return dg.AssetCheckResult(
        passed=cer["pretrained"] < cer["fbank"],
        severity=dg.AssetCheckSeverity.WARN,
        metadata={f"heldout_cer/{model}": round(value, 4) for model, value in cer.items()},
        description=None if cer["pretrained"] < cer["fbank"] else (
            "the pretrained encoder's features transcribe no better than log-mel: train longer or on more data"
        ),
    )
