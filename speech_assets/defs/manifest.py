"""Stage 1: the validated manifest of the corpus, and its rows per speaker.

``speaker_manifest`` is observed, never run: the manifest run records a version only for speakers
whose rows changed, so unchanged speakers' shards stay in sync whatever their number.
"""

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from speech_assets.corpus import audit
from speech_assets.corpus import manifest as corpus
from speech_assets.corpus.publish import publish_manifest
from speech_assets.defs.partitions import SPEAKER_MANIFEST, register_new, speakers_partitions
from speech_assets.defs.per_partition import speaker_observations
from speech_assets.defs.progress import ProgressLog
from speech_assets.defs.readable import problems_result
from speech_assets.defs.resources import ManifestSettings, PipelineSettings, StoragePaths, effective, overrides_of
from speech_assets.utils import from_fields, markdown_table

CODE_VERSION = "manifest-v3"


ManifestOverrides = overrides_of(ManifestSettings)


@dg.asset(
    group_name="corpus",
    code_version=CODE_VERSION,
    kinds={"parquet"},
    check_specs=[
        dg.AssetCheckSpec(name, asset="manifest", blocking=True, description=text)
        for name, text in audit.AUDITS.items()
    ],
)
def manifest(
    context: dg.AssetExecutionContext, config: ManifestOverrides, paths: StoragePaths, settings: PipelineSettings
) -> Iterator[object]:
    """One row per valid utterance of the corpus; bad files quarantined in rejects.parquet with a
    reason. Written to a staging folder, audited by reading it back, and published only if every
    check passes."""
    options = effective(settings.manifest, config)
    location = paths.corpus_path
    try:
        validation = from_fields(corpus.ValidationConfig, options)
        fingerprint = corpus.corpus_fingerprint(location)
        cache = corpus.load_cache(paths.layout.manifest.decode_cache)
        result = corpus.scan_corpus(
            location,
            validation,
            cache,
            workers=options.workers or os.cpu_count() or 1,
            progress=ProgressLog(context.log, "audio files validated"),
        )
    except (corpus.CorpusError, ValueError) as err:
        raise dg.Failure(description=str(err)) from err
    if result.cache != cache:
        corpus.save_cache(paths.layout.manifest.decode_cache, result.cache)  # a cache, not an output: safe either way

    with publish_manifest(
        result.rows,
        result.rejects,
        paths.layout.manifest,
        corpus.corpus_root_of(location),
        validation,
        options.max_reject_ratio,
        staging_name=context.run.run_id,
    ) as publication:
        for outcome in publication.audits:
            yield dg.AssetCheckResult(
                check_name=outcome.name,
                passed=outcome.passed,
                severity=dg.AssetCheckSeverity.ERROR,
                description=outcome.description,
                metadata={
                    k: v if isinstance(v, int | float | str) else dg.MetadataValue.json(v)
                    for k, v in outcome.metadata.items()
                },
            )
        if failed := publication.failed:
            raise dg.Failure(
                description="manifest not published, the previous one stays: "
                + "; ".join(f"{o.name} failed: {o.description}" for o in failed),
                metadata={o.name: o.description for o in failed},
            )
        per_speaker = publication.per_speaker
        # still under the publish lock: the new speakers and their rows' versions go with the rows
        known = list(context.instance.get_dynamic_partitions(speakers_partitions.name))
        added = register_new(context, speakers_partitions, sorted(per_speaker), known=known)
        observations = speaker_observations(context.instance, per_speaker, [*known, *added])
    yield from observations

    data_hash = corpus.manifest_hash(result.rows)
    hours = sum(r.duration_s for r in result.rows) / 3600
    by_reason = dict(sorted(Counter(reject.reason for reject in result.rejects).items()))
    context.log.info(
        f"manifest: {len(result.rows)} kept ({hours:.3f} h), {len(result.rejects)} rejected, {result.decoded_files} "
        f"files decoded, {len(per_speaker)} speakers ({len(added)} new, {len(observations)} with new or changed rows)"
    )
    yield dg.MaterializeResult(
        data_version=dg.DataVersion(data_hash),
        metadata={
            "rows": len(result.rows),
            "hours": round(hours, 4),
            "speakers": len(per_speaker),
            "new_speakers": len(added),
            "speakers_changed": len(observations),
            "rejects": len(result.rejects),
            "rejects_by_reason": dg.MetadataValue.md(markdown_table(("reason", "count"), by_reason.items())),
            "reject_ratio": round(result.reject_ratio, 4),
            "manifest_hash": data_hash,
            "files_decoded": result.decoded_files,
            "corpus": str(location),
            "corpus_fingerprint": fingerprint,
            "path": dg.MetadataValue.path(str(paths.layout.manifest.manifest)),
            "rejects_path": dg.MetadataValue.path(str(paths.layout.manifest.rejects)),
        },
    )


speaker_manifest = dg.AssetSpec(
    SPEAKER_MANIFEST,
    group_name="corpus",
    partitions_def=speakers_partitions,
    deps=["manifest"],
    kinds={"parquet"},
    description=(
        "One speaker's rows of the manifest (a view of manifest/speakers.parquet). Observed, never "
        "run: the manifest run records a data version (the hash of the speaker's rows) for each speaker "
        "whose rows are new or changed, so only those speakers' shards turn stale; the others stay in sync."
    ),
)


@dg.asset_check(
    asset=SPEAKER_MANIFEST,
    description=(
        "The rows every speaker's partition is a view of (manifest/speakers.parquet) match the manifest: "
        "exactly its speakers, each with its utterance count, hours and row hash."
    ),
)
def rows_match_manifest(paths: StoragePaths) -> dg.AssetCheckResult:
    problems = speaker_rows_problems(paths.layout.manifest.manifest, paths.layout.manifest.speakers)
    mismatches = f"{len(problems)} mismatch(es) between speakers.parquet and manifest.parquet"
    return problems_result(problems, mismatches if problems else None)


def speaker_rows_problems(manifest_file: Path, speakers_file: Path) -> list[str]:
    """How ``speakers_file`` differs from the per-speaker summary of ``manifest_file`` (a publish
    interrupted between the two renames, or either file replaced by hand)."""
    table = pq.read_table(manifest_file, columns=["utt_id", "speaker_id", "file_sha256", "transcript", "duration_s"])
    listed = pq.read_table(speakers_file)
    outcome = audit.speakers(table, listed)  # the manifest's own audit of the same file, at publish time
    problems = [] if outcome.passed else [str(p) for p in outcome.metadata.get("problems", [])] or [outcome.description]
    sums = table.group_by("speaker_id").aggregate([("duration_s", "sum")]).to_pylist()
    seconds = {row["speaker_id"]: row["duration_s_sum"] for row in sums}
    if "hours" not in listed.column_names:
        return [*problems, "speakers.parquet has no hours column"]
    for row in listed.select(["speaker_id", "hours"]).to_pylist():
        expected = seconds.get(row["speaker_id"], 0.0) / 3600
        if row["hours"] is None or abs(row["hours"] - expected) > 1e-9 + 1e-6 * expected:
            problems.append(
                f"{row['speaker_id']}: {row['hours']} hours listed, the manifest's rows make {expected:.6f}"
            )
    return problems
