"""Execute asset runs in this process against a real instance (tests, benchmarks, notebooks)."""

from collections.abc import Sequence

import dagster as dg

from speech_assets.defs.partitions import PARTITION_RANGE_END, PARTITION_RANGE_START


def materialize_in_process(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    asset: str | Sequence[str],
    partitions: list[str] | None = None,
    run_config: dict | None = None,
) -> dg.ExecuteInProcessResult:
    """Materialize ``asset`` (or several assets in one run) (for ``partitions``: one key, or a
    first..last range in one run)."""
    tags = {}
    if partitions and len(partitions) > 1:
        tags = {PARTITION_RANGE_START: partitions[0], PARTITION_RANGE_END: partitions[-1]}
    keys = {dg.AssetKey(name) for name in ([asset] if isinstance(asset, str) else asset)}
    # the assets and their checks, as `dagster asset materialize --select` and the UI run them
    checks = {check for check in defs.resolve_asset_graph().asset_check_keys if check.asset_key in keys}
    job = defs.resolve_implicit_global_asset_job_def().get_subset(asset_selection=keys, asset_check_selection=checks)
    result = job.execute_in_process(
        instance=instance,
        partition_key=partitions[0] if partitions and len(partitions) == 1 else None,
        tags=tags,
        run_config=run_config or {},
    )
    if not result.success:
        raise RuntimeError(f"materializing {asset} {partitions or ''} failed")
    return result


def materialize_data_stages(defs: dg.Definitions, instance: dg.DagsterInstance) -> list[str]:
    """manifest (which records the speaker_manifest versions) -> vad_features -> cmvn_stats ->
    client_partitions -> kmeans_targets, one run each (the partitioned ones over every registered
    partition, as the demo's partition ranges do); returns the client partitions."""
    materialize_in_process(defs, instance, "manifest")
    speakers = list(instance.get_dynamic_partitions("speakers"))
    materialize_in_process(defs, instance, "vad_features", speakers)
    materialize_in_process(defs, instance, "cmvn_stats")
    materialize_in_process(defs, instance, "client_partitions")
    clients = list(instance.get_dynamic_partitions("clients"))
    materialize_in_process(defs, instance, "kmeans_targets", clients)
    return clients


def requested_partitions(
    defs: dg.Definitions, instance: dg.DagsterInstance, request: dg.RunRequest
) -> list[str] | None:
    """The partitions a ``RunRequest`` of one partitioning targets (its key, or every key of its
    partition-range tags in partition order); None when it targets no partition."""
    tags = request.tags or {}
    if PARTITION_RANGE_START in tags:
        partitions_def = defs.resolve_asset_graph().get((request.asset_selection or [])[0]).partitions_def
        keys = list(instance.get_dynamic_partitions(partitions_def.name)) if partitions_def is not None else []
        start, end = keys.index(tags[PARTITION_RANGE_START]), keys.index(tags[PARTITION_RANGE_END])
        return keys[start : end + 1]
    return [request.partition_key] if request.partition_key else None


def run_requested(defs: dg.Definitions, instance: dg.DagsterInstance, request: dg.RunRequest) -> str:
    """Execute a sensor's ``RunRequest`` (one asset, a partition or a partition-range tag)."""
    (asset,) = request.asset_selection or []
    partitions = requested_partitions(defs, instance, request)
    materialize_in_process(defs, instance, asset.to_user_string(), partitions)
    name = asset.to_user_string()
    if not partitions:
        return name
    return (
        f"{name}[{', '.join(partitions)}]"
        if len(partitions) <= 3
        else f"{name}[{partitions[0]}...{partitions[-1]}: {len(partitions)}]"
    )


def follow_automation(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    cursor: object | None,
    assets: tuple[str, ...],
    max_ticks: int = 8,
) -> tuple[object, list[str]]:
    """Tick declarative automation and run what it requests among ``assets`` until it is quiet.

    What the ``speech_assets_automation`` sensor and a run launcher do, in this process, and
    like them with no run config: the assets read their settings from the ``settings`` resource.
    Pass the returned cursor to the next call: the first tick on a ``None`` cursor only records
    the current state (automation reacts to updates after it).
    """
    executed: list[str] = []
    for _ in range(max_ticks):
        evaluation = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
        cursor = evaluation.cursor
        requested = [key for key in assets if evaluation.get_num_requested(dg.AssetKey(key))]
        if not requested:
            break
        for key in requested:
            partitions = sorted(p for p in evaluation.get_requested_partitions(dg.AssetKey(key)) if p is not None)
            materialize_in_process(defs, instance, key, partitions or None)
            executed.append(key)
    return cursor, executed
