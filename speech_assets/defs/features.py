"""Stage 2: VAD-trimmed feature shards (one per speaker) and CMVN statistics."""

import contextlib
import json
from collections.abc import Iterator

import dagster as dg
import pyarrow.parquet as pq

from speech_assets.corpus import manifest as corpus
from speech_assets.defs import per_partition
from speech_assets.defs.conditions import follow_upstream
from speech_assets.defs.lineage import latest_data_version
from speech_assets.defs.partitions import ALL_SHARDS, SPEAKER_MANIFEST, speakers_partitions
from speech_assets.defs.progress import ProgressLog
from speech_assets.defs.readable import problems_result
from speech_assets.defs.resources import (
    FeatureSettings,
    PipelineSettings,
    StoragePaths,
    effective,
    overrides_of,
    vad_config,
)
from speech_assets.features import cmvn
from speech_assets.features.jobs import FEATURES_CODE_VERSION, ShardTotals, check_speed_factors, shard_jobs
from speech_assets.features.shards import shard_problems
from speech_assets.utils import atomic_path, atomic_write_text, markdown_table, read_json, sha256_file, sha256_strings

CMVN_CODE_VERSION = "cmvn-v1"


# force: rebuild shards even when their inputs are unchanged
FeatureOverrides = overrides_of(FeatureSettings, force=(bool, False))


@per_partition.per_partition_asset(
    speakers_partitions,
    group_name="features",
    deps=[SPEAKER_MANIFEST],  # the same speaker's rows: other speakers' changes leave a shard in sync
    code_version=FEATURES_CODE_VERSION,
    kinds={"parquet", "torch"},
)
def vad_features(
    context: dg.AssetExecutionContext, config: FeatureOverrides, paths: StoragePaths, settings: PipelineSettings
) -> Iterator[object]:
    """One Parquet shard per speaker: VAD-trimmed log-mel (80) and MFCC (39) per utterance, plus
    no_speech rejects and CMVN partial sums beside it."""
    from speech_assets.features.build import plan_shards, publish_planned  # torch: lazily

    features = effective(settings.features, config)
    vad_cfg = vad_config(features)
    speed_factors = check_speed_factors(features.speed_perturb)
    speakers = list(context.partition_keys)
    manifest_version = latest_data_version(context.instance, "manifest")
    # each shard's input: its own speaker's rows, as last observed (their version and event)
    observed = per_partition.observed_versions(context.instance, SPEAKER_MANIFEST, speakers)
    speaker_manifest = dg.AssetKey(SPEAKER_MANIFEST)
    paths.layout.shards_dir.mkdir(parents=True, exist_ok=True)
    jobs = shard_jobs(
        corpus.read_manifest(paths.layout.manifest.manifest),
        speakers,
        paths.shard_files,
        vad_cfg,
        speed_factors,
        manifest_version,
        force=config.force,
    )
    plan = plan_shards(jobs, features.workers or None)
    context.log.info(plan.describe())
    progress = ProgressLog(context.log, "shards")
    failed: dict[str, str] = {}
    published: list[dg.AssetMaterialization] = []
    totals = ShardTotals()
    # Closed however the loop ends: its pool, frozen heap and torch thread count are let go at once.
    with contextlib.closing(publish_planned(plan, vad_cfg)) as outcomes:
        for done, outcome in enumerate(outcomes, start=1):
            progress(outcome, done, len(jobs))
            if outcome.error is not None or outcome.meta is None:
                failed[outcome.speaker_id] = outcome.error or "no meta"
                context.log.error(f"shard {outcome.speaker_id} failed:\n{outcome.error}")
                continue
            totals.add(outcome)
            published.append(
                per_partition.partition_materialization(
                    context,
                    outcome.speaker_id,
                    outcome.meta["shard_sha256"],
                    shard_metadata(paths, outcome.meta, outcome.rebuilt),
                    per_partition.input_tags(speaker_manifest, *observed.get(outcome.speaker_id, (None, None))),
                )
            )
    context.log.info(totals.summary())
    if not failed:
        yield from per_partition.step_events(context, published)
    else:
        yield from published  # the finished shards are recorded even though the run fails
        raise dg.Failure(
            description=(
                f"{len(failed)} of {len(jobs)} shard(s) failed ({', '.join(sorted(failed)[:10])}); "
                f"the other {len(jobs) - len(failed)} are published and a re-run rebuilds only the failed ones"
            ),
            metadata={"failed_speakers": dg.MetadataValue.json(sorted(failed)[:50]), "failed": len(failed)},
        )


def shard_metadata(paths: StoragePaths, meta: dict, rebuilt: bool) -> dict[str, object]:
    """One shard's page: its own numbers (plotted across partitions by Dagster) and paths."""
    audio_h, trimmed_h = meta["audio_seconds"] / 3600, meta["trimmed_seconds"] / 3600
    return {
        "utterances": meta["utterances"],
        "no_speech_rejects": meta["rejects"],
        "audio_hours": round(audio_h, 4),
        "trimmed_hours": round(trimmed_h, 4),
        "speech_ratio": round(trimmed_h / max(audio_h, 1e-12), 3),
        "frames": meta.get("frames", 0),
        "rebuilt": rebuilt,
        "shard_sha256": meta["shard_sha256"],
        "speaker_manifest_hash": meta["speaker_manifest_hash"],
        "path": dg.MetadataValue.path(str(paths.shard_file(meta["speaker_id"]))),
    }


@dg.asset(
    group_name="features",
    deps=[ALL_SHARDS],
    code_version=CMVN_CODE_VERSION,
    automation_condition=follow_upstream(),
    kinds={"numpy"},
)
def cmvn_stats(context: dg.AssetExecutionContext, paths: StoragePaths) -> dg.MaterializeResult:
    """Global and per-speaker mean/std of log-mel and MFCC, combined from per-shard partial sums."""
    speakers, metas = sorted(paths.listed_speakers()), paths.published_shards()
    if missing := [s for s in speakers if s not in metas]:
        raise dg.Failure(
            description=f"{len(missing)} speaker shard(s) missing or incomplete ({', '.join(missing[:10])}): "
            "materialize vad_features for them first"
        )
    parts = [cmvn.ShardStats.load(paths.shard_files(s).stats) for s in speakers]
    global_cmvn = cmvn.Cmvn.from_sums(cmvn.combine(parts))
    per_speaker = cmvn.merge(parts)
    paths.layout.cmvn.root.mkdir(parents=True, exist_ok=True)
    global_cmvn.save(paths.layout.cmvn.cmvn)
    per_speaker.save(paths.layout.cmvn.speaker_sums)
    with atomic_path(paths.layout.cmvn.speakers) as tmp:
        pq.write_table(cmvn.speakers_table(speakers, metas, per_speaker), tmp)
    files = paths.layout.cmvn
    version = sha256_strings([sha256_file(path) for path in (files.cmvn, files.speaker_sums, files.speakers)])
    return dg.MaterializeResult(
        data_version=dg.DataVersion(version),
        metadata={
            "frames": global_cmvn.frames,
            "speakers": len(speakers),
            "logmel_mean_of_means": round(float(global_cmvn.mean["logmel"].mean()), 3),
            "mfcc_c0_mean": round(float(global_cmvn.mean["mfcc"][0]), 3),
            "manifest_version": latest_data_version(context.instance, "manifest") or "",
            "speakers_table": dg.MetadataValue.md(
                markdown_table(
                    ("speaker", "utterances", "trimmed h"),
                    ((s, metas[s]["utterances"], round(metas[s]["trimmed_seconds"] / 3600, 3)) for s in speakers[:50]),
                )
                + (f"\n\n... and {len(speakers) - 50} more speakers: see speakers_path" if len(speakers) > 50 else "")
            ),
            "speakers_path": dg.MetadataValue.path(str(paths.layout.cmvn.speakers)),
            "path": dg.MetadataValue.path(str(paths.layout.cmvn.cmvn)),
        },
    )


# --- checks: each reads the published files, independently of how they were written -------------

MAX_NO_SPEECH_SHARE = 0.2
VERIFIED_BY = ("shard_sha256", "rejects_size", "rejects_mtime_ns", "utterances", "rejects")


@dg.asset_check(
    asset="vad_features",
    blocking=True,
    description=(
        "Every published shard: finite log-mel and MFCC (first row group scanned), feature sizes and frame "
        "counts equal 1 + (trimmed samples - 400) // 160, row and reject counts equal what its meta vouches for. "
        "A shard whose content (sha256 in its meta) this check already found sound is not read again."
    ),
)
def shards_are_consistent(paths: StoragePaths) -> dg.AssetCheckResult:
    problems: list[str] = []
    shards = paths.published_shards()
    verified_file = paths.layout.verified
    verified = set(read_json(verified_file).get("sound", []))
    sound, read = [], 0
    for speaker, meta in sorted(shards.items()):
        # what the verdict depends on (the meta vouches for the files by size and mtime)
        key = sha256_strings(str(meta.get(k)) for k in VERIFIED_BY)
        if key not in verified:
            read += 1
            found = shard_problems(paths.shard_files(speaker), meta)
            problems += found
            if found:
                continue
        sound.append(key)
    if sound != sorted(verified):  # a cache: losing it only means reading every shard once more
        atomic_write_text(verified_file, json.dumps({"sound": sorted(sound)}), durable=False)
    found = (
        f"{len(problems)} problem(s) in {len(shards)} shard(s)" if problems else f"{len(shards)} shard(s) consistent"
    )
    return problems_result(problems, found, shards=len(shards), shards_read=read)


@dg.asset_check(
    asset="vad_features",
    description=f"VAD found too little speech in at most {MAX_NO_SPEECH_SHARE:.0%} of the utterances.",
)
def no_speech_share(paths: StoragePaths) -> dg.AssetCheckResult:
    shards = paths.published_shards()
    kept = sum(m["utterances"] for m in shards.values())
    # the counts each meta vouches for (shards_are_consistent checks them against the files)
    rejected = sum(m["rejects"] for m in shards.values())
    share = rejected / max(kept + rejected, 1)
    return dg.AssetCheckResult(
        passed=share <= MAX_NO_SPEECH_SHARE,
        severity=dg.AssetCheckSeverity.WARN,
        description=f"{rejected} of {kept + rejected} utterances rejected as no_speech",
        metadata={"no_speech_share": round(share, 4), "max_share": MAX_NO_SPEECH_SHARE},
    )


@dg.asset_check(
    asset="cmvn_stats",
    blocking=True,
    description=(
        "Every dimension of the global CMVN is finite with a standard deviation well above the variance "
        "floor (a floored or constant dimension means silent, clipped or broken features)."
    ),
)
def cmvn_is_not_degenerate(paths: StoragePaths) -> dg.AssetCheckResult:
    stats = cmvn.Cmvn.load(paths.layout.cmvn.cmvn)
    bad = cmvn.degenerate_dimensions(stats)
    return dg.AssetCheckResult(
        passed=not bad and stats.frames > 0,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={"frames": stats.frames, "degenerate_dimensions": dg.MetadataValue.json(bad)},
    )
