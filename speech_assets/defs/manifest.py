"""Stage 1: the validated manifest of the corpus, and its rows per speaker."""

import os
from collections.abc import Iterator

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq

from speech_assets.corpus import manifest as corpus
from speech_assets.defs.lineage import input_provenance, markdown_table, partition_materialization, step_events
from speech_assets.defs.partitions import register_new, speakers_partitions
from speech_assets.defs.resources import StoragePaths
from speech_assets.utils import atomic_path, sha256_strings

CODE_VERSION = "manifest-v1"

REQUIRED_COLUMNS = tuple(corpus.MANIFEST_SCHEMA.names)


class ManifestConfig(dg.Config):
    min_duration_s: float = 0.5
    max_duration_s: float = 35.0
    max_reject_ratio: float = 0.2
    workers: int = 0  # 0: one decoder per core


@dg.asset(
    group_name="corpus",
    code_version=CODE_VERSION,
    kinds={"parquet"},
    description="One row per valid utterance of the corpus; bad files quarantined in rejects.parquet with a reason.",
    check_specs=[
        dg.AssetCheckSpec("schema", asset="manifest", description="Every documented column, with its type."),
        dg.AssetCheckSpec("no_nulls", asset="manifest", description="No null in any column."),
        dg.AssetCheckSpec("unique_ids", asset="manifest", description="utt_id is unique."),
        dg.AssetCheckSpec(
            "reject_ratio", asset="manifest", blocking=True,
            description="Rejected / (kept + rejected) stays within max_reject_ratio; blocks downstream assets.",
        ),
    ],
)
def manifest(context: dg.AssetExecutionContext, config: ManifestConfig, paths: StoragePaths) -> dg.MaterializeResult:
    location = paths.corpus_path
    try:
        validation = corpus.ValidationConfig(config.min_duration_s, config.max_duration_s)
        fingerprint = corpus.corpus_fingerprint(location)
        cache = corpus.load_cache(paths.decode_cache_file)
        result = corpus.scan_corpus(location, validation, cache, workers=config.workers or os.cpu_count() or 1)
    except (corpus.CorpusError, ValueError) as err:
        raise dg.Failure(description=str(err)) from err

    corpus.write_manifest(paths.manifest_file, result.rows)
    corpus.write_rejects(paths.rejects_file, result.rejects)
    if result.cache != cache:
        corpus.save_cache(paths.decode_cache_file, result.cache)
    per_speaker = _write_speakers(paths, result.rows)
    added = register_new(context, speakers_partitions, sorted(per_speaker))

    data_hash = corpus.manifest_hash(result.rows)
    hours = sum(r.duration_s for r in result.rows) / 3600
    by_reason = corpus.count_by_reason(result.rejects)
    context.log.info(
        f"manifest: {len(result.rows)} kept ({hours:.3f} h), {len(result.rejects)} rejected, "
        f"{result.decoded_files} files decoded, {len(per_speaker)} speakers ({len(added)} new)"
    )
    return dg.MaterializeResult(
        data_version=dg.DataVersion(data_hash),
        metadata={
            "rows": len(result.rows),
            "hours": round(hours, 4),
            "speakers": len(per_speaker),
            "new_speakers": dg.MetadataValue.json(added),
            "rejects": len(result.rejects),
            "rejects_by_reason": dg.MetadataValue.md(markdown_table(("reason", "count"), by_reason.items())),
            "reject_ratio": round(result.reject_ratio, 4),
            "manifest_hash": data_hash,
            "files_decoded": result.decoded_files,
            "corpus": str(location),
            "corpus_fingerprint": fingerprint,
            "path": dg.MetadataValue.path(str(paths.manifest_file)),
            "rejects_path": dg.MetadataValue.path(str(paths.rejects_file)),
        },
        check_results=_checks(paths, result, config.max_reject_ratio),
    )


def _write_speakers(paths: StoragePaths, rows: list[corpus.ManifestRow]) -> dict[str, str]:
    hashes = corpus.speaker_hashes(rows)
    counts: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for row in rows:
        counts[row.speaker_id] = counts.get(row.speaker_id, 0) + 1
        seconds[row.speaker_id] = seconds.get(row.speaker_id, 0.0) + row.duration_s
    table = pa.table(
        {
            "speaker_id": list(hashes),
            "utterances": [counts[s] for s in hashes],
            "hours": [seconds[s] / 3600 for s in hashes],
            "manifest_hash": list(hashes.values()),
        }
    )
    with atomic_path(paths.speakers_file) as tmp:
        pq.write_table(table, tmp)
    return hashes


def _checks(paths: StoragePaths, result: corpus.ScanResult, max_ratio: float) -> list[dg.AssetCheckResult]:
    table = pq.read_table(paths.manifest_file)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    wrong = [
        f"{c}: {table.schema.field(c).type} != {corpus.MANIFEST_SCHEMA.field(c).type}"
        for c in REQUIRED_COLUMNS
        if c not in missing and table.schema.field(c).type != corpus.MANIFEST_SCHEMA.field(c).type
    ]
    nulls = {c: table.column(c).null_count for c in table.column_names if table.column(c).null_count}
    ids = table.column("utt_id").to_pylist() if "utt_id" in table.column_names else []
    duplicates = len(ids) - len(set(ids))
    return [
        dg.AssetCheckResult(
            check_name="schema", passed=not missing and not wrong,
            metadata={"missing": dg.MetadataValue.json(missing), "wrong_types": dg.MetadataValue.json(wrong)},
        ),
        dg.AssetCheckResult(check_name="no_nulls", passed=not nulls, metadata={"nulls": dg.MetadataValue.json(nulls)}),
        dg.AssetCheckResult(check_name="unique_ids", passed=duplicates == 0, metadata={"duplicates": duplicates}),
        dg.AssetCheckResult(
            check_name="reject_ratio",
            passed=result.reject_ratio <= max_ratio,
            severity=dg.AssetCheckSeverity.ERROR,
            description=f"{len(result.rejects)} of {len(result.rows) + len(result.rejects)} utterances rejected",
            metadata={"reject_ratio": round(result.reject_ratio, 4), "max_reject_ratio": max_ratio},
        ),
    ]


SPEAKER_MANIFEST_CODE_VERSION = "speaker-manifest-v1"


@dg.asset(
    group_name="corpus",
    partitions_def=speakers_partitions,
    backfill_policy=dg.BackfillPolicy.single_run(),
    deps=["manifest"],
    code_version=SPEAKER_MANIFEST_CODE_VERSION,
    kinds={"parquet"},
    output_required=False,  # one materialization per speaker, each with its own content hash
    description=(
        "One speaker's rows of the manifest (a view of manifest/speakers.parquet). Its data version "
        "is the hash of those rows, so when one speaker's audio changes only that speaker's feature "
        "shard turns stale; the others stay in sync."
    ),
)
def speaker_manifest(context: dg.AssetExecutionContext, paths: StoragePaths) -> Iterator[object]:
    rows = {r["speaker_id"]: r for r in pq.read_table(paths.speakers_file).to_pylist()}
    provenance = input_provenance(context)
    published = []
    for speaker in context.partition_keys:
        row = rows.get(speaker)
        # A registered speaker with no rows left (all its files deleted or rejected) is a real
        # state too: its shard must become empty, so it gets a version of its own.
        version = row["manifest_hash"] if row else sha256_strings(["no manifest rows", speaker])
        published.append(partition_materialization(
            context,
            speaker,
            version,
            {
                "utterances": row["utterances"] if row else 0,
                "hours": round(row["hours"], 4) if row else 0.0,
                "speaker_manifest_hash": version,
                "path": dg.MetadataValue.path(str(paths.speakers_file)),
            },
            provenance,
        ))
    yield from step_events(context, published)
