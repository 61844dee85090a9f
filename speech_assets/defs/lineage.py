"""Read the data versions that upstream assets recorded, to stamp them into our metadata."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.parquet as pq

from speech_assets import locations
from speech_assets.corpus.clients import ClientsTable
from speech_assets.corpus.publish import SpeakerRows
from speech_assets.defs import dagster_internals as internals
from speech_assets.defs.partitions import SPEAKER_MANIFEST
from speech_assets.defs.resources import StoragePaths
from speech_assets.layout import TargetFiles
from speech_assets.targets.publish import ClientShards
from speech_assets.utils import atomic_write_text, sha256_strings


def latest_materialization(instance: dg.DagsterInstance, asset: str) -> dg.AssetMaterialization | None:
    """The latest materialization event of an unpartitioned ``asset`` (its metadata), if any."""
    records = instance.fetch_materializations(dg.AssetKey(asset), limit=1).records
    return records[0].asset_materialization if records else None


def latest_data_version(instance: dg.DagsterInstance, asset: str, partition: str | None = None) -> str | None:
    """Data version of the latest materialization of ``asset`` (or one of its partitions)."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(
            asset_key=dg.AssetKey(asset), asset_partitions=[partition] if partition is not None else None
        ),
        limit=1,
    ).records
    if not records:
        return None
    materialization = records[0].asset_materialization
    return materialization.tags.get(internals.DATA_VERSION_TAG) if materialization and materialization.tags else None


def latest_metadata(instance: dg.DagsterInstance, asset: str, partition: str | None = None) -> dict[str, object]:
    """Raw metadata values of the latest materialization (empty when never materialized)."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(
            asset_key=dg.AssetKey(asset), asset_partitions=[partition] if partition is not None else None
        ),
        limit=1,
    ).records
    if not records or records[0].asset_materialization is None:
        return {}
    return {key: value.value for key, value in records[0].asset_materialization.metadata.items()}


def partition_versions(instance: dg.DagsterInstance, asset: str, partitions: Iterable[str]) -> dict[str, str]:
    """Latest data version per partition (partitions never materialized are left out), in one query."""
    tags = instance.event_log_storage.get_latest_tags_by_partition(
        dg.AssetKey(asset),
        dg.DagsterEventType.ASSET_MATERIALIZATION,
        [internals.DATA_VERSION_TAG],
        asset_partitions=list(partitions),
    )
    return {
        key: value[internals.DATA_VERSION_TAG]
        for key, value in sorted(tags.items())
        if internals.DATA_VERSION_TAG in value
    }


def checkpoint_of(context: dg.AssetExecutionContext, asset: str) -> tuple[str, str] | None:
    """(``final.pt`` path, data version) of ``asset``'s latest materialization, if it exists on disk."""
    materialization = latest_materialization(context.instance, asset)
    if materialization is None or "checkpoint" not in (materialization.metadata or {}):
        return None
    path = str(materialization.metadata["checkpoint"].value)
    if not Path(path).is_file():
        context.log.warning(f"{asset}'s checkpoint {path} is gone: materialize {asset} again")
        return None
    return path, latest_data_version(context.instance, asset) or ""


def required_checkpoint(context: dg.AssetExecutionContext, asset: str) -> tuple[str, str]:
    """:func:`checkpoint_of`, or the step fails saying which asset to materialize first."""
    found = checkpoint_of(context, asset)
    if found is None:
        raise dg.Failure(description=f"no {asset} checkpoint: materialize {asset} first")
    return found


def git_commit() -> str | None:
    """The repository's HEAD commit, or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=locations.repo_root(), capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def record_provenance(run_dir: Path, checkpoint_sha256: str, **fields: object) -> None:
    """``<run_dir>/provenance.json``: what made the run's checkpoint (git commit, MLflow run,
    Dagster run), for `speech-assets lineage` and the stats database. Kept while the checkpoint
    is the same one (a later run that reuses a finished run did not make it)."""
    from speech_assets.layout import RunFiles

    path = RunFiles(run_dir).provenance
    if read_json(path).get("checkpoint_sha256") == checkpoint_sha256:
        return
    record = {"checkpoint_sha256": checkpoint_sha256, **{k: v for k, v in fields.items() if v is not None}}
    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")


def input_versions(
    context: dg.AssetExecutionContext,
    paths: StoragePaths,
    clients: dict[str, list[str]],
    targets_dir: Callable[[str], Path] | None = None,
    targets_asset: str = "kmeans_targets",
) -> dict[str, str]:
    """The data versions a training run reads: the manifest, CMVN and clients table, each
    client's targets (from ``targets_dir(client)/quality.json``) and each speaker's shard."""
    targets_dir = targets_dir or paths.kmeans_dir
    versions = {
        "manifest": latest_data_version(context.instance, "manifest") or "",
        "cmvn_stats": latest_data_version(context.instance, "cmvn_stats") or "",
        "client_partitions": latest_data_version(context.instance, "client_partitions") or "",
    }
    for client, speakers in sorted(clients.items()):
        versions[f"{targets_asset}/{client}"] = json.loads(TargetFiles(targets_dir(client)).quality.read_text())[
            "data_version"
        ]
        versions |= {f"vad_features/{speaker}": sha for speaker, sha in shard_hashes(paths, speakers).items()}
    return versions


def shard_hashes(paths: StoragePaths, speakers: Iterable[str], whose: str = "") -> dict[str, str]:
    """``{speaker: content hash}`` of the speakers' published shards; a missing one fails the step."""
    versions = {}
    for speaker in speakers:
        meta = paths.shard_files(speaker).read_meta()
        if meta is None:
            raise dg.Failure(description=f"shard for speaker {speaker}{whose} is missing: materialize vad_features")
        versions[speaker] = meta["shard_sha256"]
    return versions


def client_shards(paths: StoragePaths, assignments: ClientsTable, client_id: str) -> ClientShards:
    """One client's speakers, the held-out ones among them, and their published shards' hashes;
    a client without speakers, or a shard missing, fails the step."""
    speakers = sorted(a.speaker_id for a in assignments if a.client_id == client_id)
    heldout = sorted(a.speaker_id for a in assignments if a.client_id == client_id and a.heldout)
    if not speakers:
        raise dg.Failure(description=f"{client_id} has no speakers: lower num_clients or add data")
    return ClientShards(
        client_id, speakers, heldout, shard_hashes(paths, speakers, f" of {client_id}"), paths.shard_file
    )


def bounded_versions(versions: dict[str, str]) -> dict[str, str]:
    """Input versions for the UI: the unpartitioned ones, and per partitioned asset a count and a
    hash (every one of them is in the checkpoint: `speech-assets lineage <checkpoint>`)."""
    shown = {k: v for k, v in versions.items() if "/" not in k}
    for asset in sorted({k.split("/", 1)[0] for k in versions if "/" in k}):
        parts = sorted((k, v) for k, v in versions.items() if k.startswith(asset + "/"))
        shown[asset] = f"{len(parts)} partitions, combined {sha256_strings(f'{k}:{v}' for k, v in parts)[:16]}"
    return shown


def read_json(path: Path, *, strict: bool = False) -> dict:
    """The JSON object a step recorded in ``path``; ``{}`` when there is none. An unreadable or
    corrupt file reads as ``{}`` too (the step rebuilds it), unless ``strict``: a check, or a
    reader that needs the file, fails on it instead."""
    if strict:
        return json.loads(path.read_text()) if path.is_file() else {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def markdown_table(header: tuple[str, ...], rows: Iterable[tuple[object, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Per-partition materializations with their own data version.
#
# Dagster stamps the one `DataVersion` of a MaterializeResult on every partition of a
# multi-partition run (dagster-io/dagster#34013), so re-running one unchanged partition would
# give it a "new" version and mark everything downstream unsynced. Partitioned assets here are
# declared with `output_required=False` and yield one AssetMaterialization per partition instead,
# tagged exactly as Dagster tags its own (code version, input data versions and event pointers),
# each with that partition's content hash. test_lineage.py checks Dagster's staleness API agrees.


def per_partition_asset(partitions_def: dg.PartitionsDefinition, **asset_args: Any) -> Any:
    """``dg.asset`` for a partitioned asset that yields one materialization per partition
    (:func:`partition_materialization`, each with its own content hash) and runs a backfill as one
    run; ``asset_args`` go to ``dg.asset``."""
    return dg.asset(
        partitions_def=partitions_def,
        backfill_policy=dg.BackfillPolicy.single_run(),
        output_required=False,
        **asset_args,
    )


def input_provenance(context: dg.AssetExecutionContext) -> dict[str, str]:
    """Provenance tags of this step's inputs: each dependency's latest data version and event."""
    tags: dict[str, str] = {}
    for dep in sorted(context.assets_def.asset_deps[context.asset_key]):
        records = context.instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=dep), limit=1).records
        event = records[0].asset_materialization if records else None
        version = (event.tags or {}).get(internals.DATA_VERSION_TAG) if event else None
        tags[internals.get_input_data_version_tag(dep)] = version or internals.DEFAULT_DATA_VERSION.value
        tags[internals.get_input_event_pointer_tag(dep)] = (
            str(records[0].storage_id) if records else internals.NULL_EVENT_POINTER
        )
    return tags


def observed_versions(
    instance: dg.DagsterInstance, asset: str, partitions: Iterable[str]
) -> dict[str, tuple[str, int]]:
    """``{partition: (data version, storage id)}`` of the latest observation of each of ``asset``'s
    ``partitions`` that has one, in two queries whatever the number of partitions."""
    key, wanted = dg.AssetKey(asset), sorted(set(partitions))
    if not wanted:
        return {}
    storage = instance.event_log_storage
    tags = storage.get_latest_tags_by_partition(
        key, dg.DagsterEventType.ASSET_OBSERVATION, [internals.DATA_VERSION_TAG], asset_partitions=wanted
    )
    ids = storage.get_latest_storage_id_by_partition(key, dg.DagsterEventType.ASSET_OBSERVATION, set(wanted))
    return {
        p: (tags[p][internals.DATA_VERSION_TAG], ids[p])
        for p in wanted
        if internals.DATA_VERSION_TAG in tags.get(p, {}) and p in ids
    }


def partition_observation(
    asset: str, partition: str, data_version: str, metadata: dict[str, object]
) -> dg.AssetObservation:
    """An observation of one partition with ``data_version`` as its own (tagged as Dagster tags
    the observations of observable source assets)."""
    return dg.AssetObservation(
        asset_key=asset,
        partition=partition,
        metadata={**metadata, "event": dg.MetadataValue.text(SECOND_OF_TWO)},
        tags={internals.DATA_VERSION_TAG: data_version, internals.DATA_VERSION_IS_USER_PROVIDED_TAG: "true"},
    )


def observed_input_provenance(observed: tuple[str, int] | None, asset: str) -> dict[str, str]:
    """Provenance tags for one input partition of an observed (external) asset: its observed data
    version and the observation's storage id (what Dagster compares later observations with)."""
    key = dg.AssetKey(asset)
    version, storage_id = observed if observed else (internals.DEFAULT_DATA_VERSION.value, None)
    return {
        internals.get_input_data_version_tag(key): version,
        internals.get_input_event_pointer_tag(key): str(storage_id)
        if storage_id is not None
        else internals.NULL_EVENT_POINTER,
    }


def partition_materialization(
    context: dg.AssetExecutionContext,
    partition: str,
    data_version: str,
    metadata: dict[str, object],
    provenance: dict[str, str],
) -> dg.AssetMaterialization:
    """The materialization of one partition, with ``data_version`` (a content hash) as its own."""
    code_version = context.assets_def.code_versions_by_key[context.asset_key] or context.run.run_id
    return dg.AssetMaterialization(
        asset_key=context.asset_key,
        partition=partition,
        metadata={**metadata, "event": dg.MetadataValue.text(SECOND_OF_TWO)},
        tags={
            **provenance,
            internals.CODE_VERSION_TAG: code_version,
            internals.DATA_VERSION_TAG: data_version,
            internals.DATA_VERSION_IS_USER_PROVIDED_TAG: "true",
        },
    )


def step_events(context: dg.AssetExecutionContext, materializations: list[dg.AssetMaterialization]) -> Iterator[object]:
    """What a per-partition asset's step yields once its work succeeded.

    A step that yields no output makes Dagster skip every later step that waits on it (its asset
    checks, child assets in the same run), so a bare ``MaterializeResult`` comes first. Dagster
    turns it into one materialization per partition with one shared version; the per-partition
    ones, yielded after it, are the latest and carry each partition's content hash. The first
    says so in its metadata (:data:`FIRST_OF_TWO`), where the UI lists the two.
    """
    yield dg.MaterializeResult(metadata={"event": dg.MetadataValue.text(FIRST_OF_TWO)})
    yield from materializations


FIRST_OF_TWO = (
    "1 of 2 for this partition: the step's completion, recorded by Dagster with a version shared by the run's "
    "partitions. The next event (2 of 2) is the partition's own, with its content hash as data version and its "
    "metadata; it is the latest."
)
SECOND_OF_TWO = "2 of 2 for this partition: its own materialization, with its content hash as data version"


def no_rows_version(speaker: str) -> str:
    """The version of a registered speaker with no rows left (all its files deleted or rejected): a
    real state too, its shard must become empty."""
    return sha256_strings(["no manifest rows", speaker])


def speaker_observations(
    instance: dg.DagsterInstance, listed: Mapping[str, SpeakerRows], registered: Iterable[str]
) -> list[dg.AssetObservation]:
    """Observations of the ``speaker_manifest`` partitions whose rows' version differs from the
    latest one recorded (new speakers, changed rows, speakers whose rows are all gone): one query
    for all of them, nothing for the unchanged ones."""
    versions = {s: no_rows_version(s) for s in registered} | {s: row.manifest_hash for s, row in listed.items()}
    observed = observed_versions(instance, SPEAKER_MANIFEST, versions)
    events = []
    for speaker, version in sorted(versions.items()):
        if observed.get(speaker, ("", 0))[0] == version:
            continue
        row = listed.get(speaker)
        metadata: dict[str, object] = {"speaker_manifest_hash": version}
        if row is not None:
            metadata |= {"utterances": row.utterances, "hours": round(row.hours, 4)}
        events.append(partition_observation(SPEAKER_MANIFEST, speaker, version, metadata))
    return events


def listed_speakers(paths: StoragePaths) -> dict[str, SpeakerRows]:
    """speakers.parquet as published (empty before the first manifest)."""
    if not paths.layout.manifest.speakers.exists():
        return {}
    return {
        r["speaker_id"]: SpeakerRows(r["manifest_hash"], r["utterances"], r["hours"])
        for r in pq.read_table(
            paths.layout.manifest.speakers, columns=["speaker_id", "manifest_hash", "utterances", "hours"]
        ).to_pylist()
    }
