"""Per-partition materializations and observations, each with its own data version.

Dagster stamps one ``DataVersion`` on every partition of a multi-partition run
(dagster-io/dagster#34013), marking unchanged partitions' downstream unsynced. So partitioned
assets yield one AssetMaterialization per partition, tagged exactly as Dagster tags its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import dagster as dg

from speech_assets.corpus.publish import SpeakerRows
from speech_assets.defs import dagster_internals as internals
from speech_assets.defs.partitions import SPEAKER_MANIFEST
from speech_assets.defs.progress import ProgressLog
from speech_assets.utils import sha256_strings


def per_partition_asset(partitions_def: dg.PartitionsDefinition, **asset_args: Any) -> Any:
    """``dg.asset`` yielding one materialization per partition, a backfill run as one run."""
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
        tags |= input_tags(dep, version, records[0].storage_id if records else None)
    return tags


def input_tags(key: dg.AssetKey, version: str | None, storage_id: int | None) -> dict[str, str]:
    """Provenance tags of one input (an observed partition too): its data version and event's storage id."""
    return {
        internals.get_input_data_version_tag(key): version or internals.DEFAULT_DATA_VERSION.value,
        internals.get_input_event_pointer_tag(key): internals.NULL_EVENT_POINTER
        if storage_id is None
        else str(storage_id),
    }


def observed_versions(
    instance: dg.DagsterInstance, asset: str, partitions: Iterable[str]
) -> dict[str, tuple[str, int]]:
    """``{partition: (data version, storage id)}`` of each partition's latest observation, in two queries."""
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
    """What a per-partition asset's step yields once its work succeeded: a bare ``MaterializeResult``
    first, since a step with no output makes Dagster skip every step waiting on it; the
    per-partition ones after it are the latest."""
    yield dg.MaterializeResult(metadata={"event": dg.MetadataValue.text(FIRST_OF_TWO)})
    yield from materializations


def per_client_events(
    context: dg.AssetExecutionContext, publish: Callable[[str], tuple[str, dict[str, object]]]
) -> Iterator[object]:
    """A per-client asset's step: ``publish(client)`` gives each client's (data version, metadata)."""
    provenance = input_provenance(context)
    progress = ProgressLog(context.log, "clients")
    clients, published = list(context.partition_keys), []
    for done, client_id in enumerate(clients, start=1):
        version, metadata = publish(client_id)
        published.append(partition_materialization(context, client_id, version, metadata, provenance))
        progress(client_id, done, len(clients))
    yield from step_events(context, published)


FIRST_OF_TWO = (
    "1 of 2 for this partition: the step's completion, recorded by Dagster with a version shared by the run's "
    "partitions. The next event (2 of 2) is the partition's own, with its content hash as data version and its "
    "metadata; it is the latest."
)


SECOND_OF_TWO = "2 of 2 for this partition: its own materialization, with its content hash as data version"


def speaker_observations(
    instance: dg.DagsterInstance, listed: Mapping[str, SpeakerRows], registered: Iterable[str]
) -> list[dg.AssetObservation]:
    """Observations of the ``speaker_manifest`` partitions whose rows' version changed (none for the others)."""
    # a registered speaker with no rows left is a real state too: its shard must become empty
    versions = {s: sha256_strings(["no manifest rows", s]) for s in registered}
    versions |= {s: row.manifest_hash for s, row in listed.items()}
    observed = observed_versions(instance, SPEAKER_MANIFEST, versions)
    events = []
    for speaker, version in sorted(versions.items()):
        if observed.get(speaker, ("", 0))[0] == version:
            continue
        row = listed.get(speaker)
        metadata: dict[str, object] = {"speaker_manifest_hash": version}
        if row is not None:
            metadata |= {"utterances": row.utterances, "hours": round(row.hours, 4)}
        # tagged as Dagster tags the observations of observable source assets
        events.append(
            dg.AssetObservation(
                asset_key=SPEAKER_MANIFEST,
                partition=speaker,
                metadata={**metadata, "event": dg.MetadataValue.text(SECOND_OF_TWO)},
                tags={internals.DATA_VERSION_TAG: version, internals.DATA_VERSION_IS_USER_PROVIDED_TAG: "true"},
            )
        )
    return events
