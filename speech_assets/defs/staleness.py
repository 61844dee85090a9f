"""The project's own staleness, from what each output recorded about its inputs.

Dagster stops comparing per-partition data versions once the upstream has 100 or more partitions
(``SKIP_PARTITION_DATA_VERSION_DEPENDENCY_THRESHOLD``); every output here records the exact shard
and target versions it was built from, so comparing them with what is published works at any size:
as warn-level checks (``inputs_are_current``) and as ``speech-assets lineage --stale``.
"""

from __future__ import annotations

import json

import dagster as dg
import pyarrow.parquet as pq

from speech_assets.corpus.clients import read_clients
from speech_assets.defs.resources import StoragePaths
from speech_assets.utils import read_json

MAX_SHOWN = 10


def current_shards(paths: StoragePaths) -> dict[str, str]:
    """speaker -> sha256 of the published shard, for every speaker the manifest lists."""
    return {s: (paths.shard_files(s).read_meta() or {}).get("shard_sha256", "missing") for s in paths.listed_speakers()}


def _diff(what: str, recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    changed = sorted(k for k in recorded.keys() & current.keys() if recorded[k] != current[k])
    added, removed = sorted(current.keys() - recorded.keys()), sorted(recorded.keys() - current.keys())
    reasons = []
    for label, keys in (("changed", changed), ("new", added), ("gone", removed)):
        if keys:
            shown = ", ".join(keys[:MAX_SHOWN]) + (f" (+{len(keys) - MAX_SHOWN})" if len(keys) > MAX_SHOWN else "")
            reasons.append(f"{len(keys)} {label} {what}: {shown}")
    return reasons


def _shards_and_targets(paths: StoragePaths, shards: dict[str, str], targets: dict[str, str]) -> list[str]:
    """How the recorded shard and client target versions differ from those published now."""
    published = {t.root.name: json.loads(t.quality.read_text())["data_version"] for t in paths.layout.all_targets()}
    return _diff("shard(s)", shards, current_shards(paths)) + _diff("client target set(s)", targets, published)


def cmvn_staleness(paths: StoragePaths) -> list[str]:
    file = paths.layout.cmvn.speakers
    if not file.exists():
        return ["never built"]
    table = pq.read_table(file, columns=["speaker_id", "shard_sha256"]).to_pylist()
    return _diff("shard(s)", {r["speaker_id"]: r["shard_sha256"] for r in table}, current_shards(paths))


def kmeans_staleness(paths: StoragePaths) -> dict[str, list[str]]:
    """Per client: shards of its speakers that changed since its targets were built."""
    if not paths.layout.clients_file.exists():
        return {}
    shards = current_shards(paths)
    report = {}
    for client, speakers in sorted(read_clients(paths.layout.clients_file).speakers.items()):
        quality = paths.targets(client).quality
        current = {s: shards.get(s, "missing") for s in speakers}
        recorded = read_json(quality, strict=True).get("shard_versions", {})
        if reasons := _diff("shard(s)", recorded, current) if quality.exists() else ["never built"]:
            report[client] = reasons
    return report


def checkpoint_staleness(paths: StoragePaths) -> list[str]:
    results = sorted(paths.layout.results_of(paths.layout.training_dir), key=lambda p: p.stat().st_mtime)
    if not results:
        return ["never built"]
    recorded = json.loads(results[-1].read_text()).get("data_versions", {})
    partitions = {
        asset: {k.split("/", 1)[1]: v for k, v in recorded.items() if k.startswith(asset + "/")}
        for asset in ("vad_features", "kmeans_targets")
    }
    return _shards_and_targets(paths, partitions["vad_features"], partitions["kmeans_targets"])


def stats_staleness(paths: StoragePaths) -> list[str]:
    file = paths.layout.report.input_versions
    if not file.exists():
        return ["never built"]
    recorded = json.loads(file.read_text())
    return _shards_and_targets(paths, recorded.get("vad_features", {}), recorded.get("kmeans_targets", {}))


def stale_report(paths: StoragePaths) -> dict[str, list[str]]:
    """Asset (or asset[partition]) -> why it no longer matches its inputs on disk; in sync: absent."""
    report = {
        "cmvn_stats": cmvn_staleness(paths),
        "pretrained_checkpoint": checkpoint_staleness(paths),
        "dataset_stats": stats_staleness(paths),
    }
    report |= {f"kmeans_targets[{client}]": reasons for client, reasons in kmeans_staleness(paths).items()}
    return {name: reasons for name, reasons in sorted(report.items()) if reasons}


def _check(reasons: list[str], what: str) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        passed=not reasons,
        severity=dg.AssetCheckSeverity.WARN,
        description=f"{what} was built from other inputs than those published now"
        if reasons
        else f"{what} matches its inputs on disk",
        metadata={"reasons": dg.MetadataValue.md("\n".join(f"- {r}" for r in reasons) or "none")},
    )


DESCRIPTION = (
    "The {} recorded the exact shard versions it was built from; they still match the published shards "
    "(the project's own staleness, which keeps working past Dagster's 100-partition limit)."
)


@dg.asset_check(asset="cmvn_stats", description=DESCRIPTION.format("CMVN statistics"))
def cmvn_inputs_are_current(paths: StoragePaths) -> dg.AssetCheckResult:
    return _check(cmvn_staleness(paths), "cmvn_stats")


@dg.asset_check(asset="kmeans_targets", description=DESCRIPTION.format("targets of every client"))
def targets_inputs_are_current(paths: StoragePaths) -> dg.AssetCheckResult:
    report = kmeans_staleness(paths)
    return _check([f"{client}: {'; '.join(reasons)}" for client, reasons in report.items()], "kmeans_targets")


@dg.asset_check(asset="pretrained_checkpoint", description=DESCRIPTION.format("latest checkpoint"))
def checkpoint_inputs_are_current(paths: StoragePaths) -> dg.AssetCheckResult:
    return _check(checkpoint_staleness(paths), "the latest checkpoint")


@dg.asset_check(asset="dataset_stats", description=DESCRIPTION.format("database"))
def stats_inputs_are_current(paths: StoragePaths) -> dg.AssetCheckResult:
    return _check(stats_staleness(paths), "dataset_stats")


def format_report(report: dict[str, list[str]]) -> str:
    if not report:
        return "everything is in sync with the published shards and targets"
    return "\n".join(f"{asset}: stale\n" + "\n".join(f"  - {r}" for r in reasons) for asset, reasons in report.items())
