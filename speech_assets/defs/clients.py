"""Stage 3a: speakers partitioned into non-IID clients (`client_partitions`) and its check."""

import dataclasses

import dagster as dg
import pyarrow.parquet as pq

from speech_assets.corpus import clients as assignment
from speech_assets.defs.conditions import follow_upstream
from speech_assets.defs.lineage import latest_data_version
from speech_assets.defs.partitions import clients_partitions, register_new
from speech_assets.defs.resources import ClientSettings, PipelineSettings, StoragePaths, effective, overrides_of
from speech_assets.utils import markdown_table, sha256_file

CLIENTS_CODE_VERSION = "clients-v2"  # v2: the held-out speakers are chosen here, once


ClientOverrides = overrides_of(ClientSettings)


@dg.asset(
    group_name="clients",
    deps=["cmvn_stats"],
    code_version=CLIENTS_CODE_VERSION,
    automation_condition=follow_upstream(),
    kinds={"parquet"},
)
def client_partitions(
    context: dg.AssetExecutionContext, config: ClientOverrides, paths: StoragePaths, settings: PipelineSettings
) -> dg.MaterializeResult:
    """Speakers assigned to N non-IID clients, never splitting a speaker, balancing trimmed hours;
    speakers already assigned keep their client. The held-out speakers are chosen here, once,
    over the whole corpus (`heldout` column): every encoder, CMVN and k-means codebook leaves
    them out, and the probe tests on them."""
    from speech_assets.train.data import heldout_speakers  # torch: lazily, the code location stays light

    config = effective(settings.clients, config)
    speakers = pq.read_table(paths.layout.cmvn.speakers).to_pylist()
    loads = [assignment.SpeakerLoad(s["speaker_id"], s["trimmed_hours"], s["utterances"]) for s in speakers]
    previous = {}
    if paths.layout.clients_file.exists():  # (only these two columns: a table of an older version keeps its clients)
        table = pq.read_table(paths.layout.clients_file, columns=["speaker_id", "client_id"])
        previous = dict(zip(table.column(0).to_pylist(), table.column(1).to_pylist(), strict=True))
    assigned = assignment.assign_clients(loads, config.num_clients, previous)
    held = heldout_speakers({a.speaker_id: a.client_id for a in assigned}, config.heldout_fraction)
    result = [dataclasses.replace(a, heldout=a.speaker_id in held) for a in assigned]
    assignment.write_clients(paths.layout.clients_file, result)
    ids = assignment.client_ids(config.num_clients)
    added = register_new(context, clients_partitions, ids)
    members = {c: [a for a in result if a.client_id == c] for c in ids}
    summary = [
        (c, len(m), sum(a.heldout for a in m), round(sum(a.hours for a in m), 4), sum(a.utterances for a in m))
        for c, m in members.items()
    ]
    now = {a.speaker_id: a.client_id for a in result}
    moved = sorted(s for s, c in previous.items() if s in now and now[s] != c)
    return dg.MaterializeResult(
        data_version=dg.DataVersion(sha256_file(paths.layout.clients_file)),
        metadata={
            "clients": config.num_clients,
            "speakers": len(result),
            "new_speakers": len([a for a in result if a.speaker_id not in previous]),
            "moved_speakers": dg.MetadataValue.json(moved),
            "heldout_fraction": config.heldout_fraction,
            "heldout_speakers": dg.MetadataValue.json(sorted(held)[:50]),
            "heldout_count": len(held),
            "imbalance": round(assignment.imbalance(result, config.num_clients), 4),
            "summary": dg.MetadataValue.md(
                markdown_table(("client", "speakers", "held out", "hours", "utterances"), summary)
            ),
            "registered_partitions": dg.MetadataValue.json(added),
            "cmvn_version": latest_data_version(context.instance, "cmvn_stats") or "",
            "path": dg.MetadataValue.path(str(paths.layout.clients_file)),
        },
    )


@dg.asset_check(
    asset="client_partitions",
    blocking=True,
    description="Every speaker with a shard is in exactly one client, no speaker is split, and no client is empty.",
)
def every_speaker_in_one_client(context: dg.AssetCheckExecutionContext, paths: StoragePaths) -> dg.AssetCheckResult:
    speakers = set(pq.read_table(paths.layout.cmvn.speakers, columns=["speaker_id"]).column(0).to_pylist())
    rows = assignment.read_clients(paths.layout.clients_file)
    assigned = [r.speaker_id for r in rows]
    clients = {r.client_id for r in rows}
    empty = sorted(set(context.instance.get_dynamic_partitions(clients_partitions.name)) - clients)
    missing, extra = sorted(speakers - set(assigned)), sorted(set(assigned) - speakers)
    twice = sorted({s for s in assigned if assigned.count(s) > 1}) if len(assigned) != len(set(assigned)) else []
    return dg.AssetCheckResult(
        passed=not (missing or extra or twice or empty) and len(clients) > 0,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={
            "speakers": len(speakers),
            "clients": len(clients),
            "unassigned": dg.MetadataValue.json(missing[:50]),
            "unknown": dg.MetadataValue.json(extra[:50]),
            "assigned_twice": dg.MetadataValue.json(twice[:50]),
            "empty_clients": dg.MetadataValue.json(empty),
        },
    )
