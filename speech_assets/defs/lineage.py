"""Read the data versions that upstream assets recorded, to stamp them into our metadata."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import dagster as dg

from speech_assets.corpus.clients import ClientsTable
from speech_assets.defs import dagster_internals as internals
from speech_assets.defs.partitions import TARGETS_ASSETS
from speech_assets.defs.resources import StoragePaths
from speech_assets.targets.publish import ClientShards
from speech_assets.utils import sha256_strings


def latest_materialization(instance: dg.DagsterInstance, asset: str) -> dg.AssetMaterialization | None:
    records = instance.fetch_materializations(dg.AssetKey(asset), limit=1).records
    return records[0].asset_materialization if records else None


def latest_data_version(instance: dg.DagsterInstance, asset: str) -> str | None:
    materialization = latest_materialization(instance, asset)
    return (materialization.tags or {}).get(internals.DATA_VERSION_TAG) if materialization else None


def latest_versions(instance: dg.DagsterInstance, assets: Iterable[str]) -> dict[str, str]:
    """Each asset's latest data version ("" before its first)."""
    return {asset: latest_data_version(instance, asset) or "" for asset in assets}


def latest_metadata(instance: dg.DagsterInstance, asset: str) -> dict[str, object]:
    """Raw metadata values of the latest materialization (empty when never materialized)."""
    materialization = latest_materialization(instance, asset)
    return {key: value.value for key, value in materialization.metadata.items()} if materialization else {}


def partition_versions(instance: dg.DagsterInstance, asset: str, partitions: Iterable[str]) -> dict[str, str]:
    """Latest data version per partition (partitions never materialized are left out), in one query."""
    tags = instance.event_log_storage.get_latest_tags_by_partition(
        dg.AssetKey(asset),
        dg.DagsterEventType.ASSET_MATERIALIZATION,
        [internals.DATA_VERSION_TAG],
        asset_partitions=list(partitions),
    )
    return {k: v[internals.DATA_VERSION_TAG] for k, v in sorted(tags.items()) if internals.DATA_VERSION_TAG in v}


def checkpoint_of(context: dg.AssetExecutionContext, asset: str) -> tuple[str, str] | None:
    """(``final.pt`` path, data version) of ``asset``'s latest materialization, if it exists on disk."""
    path = latest_metadata(context.instance, asset).get("checkpoint")
    if path is None:
        return None
    if not Path(str(path)).is_file():
        context.log.warning(f"{asset}'s checkpoint {path} is gone: materialize {asset} again")
        return None
    return str(path), latest_data_version(context.instance, asset) or ""


def required_checkpoint(context: dg.AssetExecutionContext, asset: str) -> tuple[str, str]:
    """:func:`checkpoint_of`, or the step fails saying which asset to materialize first."""
    found = checkpoint_of(context, asset)
    if found is None:
        raise dg.Failure(description=f"no {asset} checkpoint: materialize {asset} first")
    return found


def input_versions(
    context: dg.AssetExecutionContext,
    paths: StoragePaths,
    clients: dict[str, list[str]],
    iteration: int = 1,
) -> dict[str, str]:
    """The data versions a training run reads, each client's targets of ``iteration`` from their quality.json."""
    versions = latest_versions(context.instance, ["manifest", "cmvn_stats", "client_partitions"])
    for client, speakers in sorted(clients.items()):
        quality = json.loads(paths.targets(client, iteration).quality.read_text())
        versions[f"{TARGETS_ASSETS[iteration]}/{client}"] = quality["data_version"]
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
    """One client's speakers, its held-out ones and their shards' hashes; fails the step without them."""
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
