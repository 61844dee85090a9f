"""Declarative automation conditions shared by the assets (see automation.py for the flow)."""

import os
from collections.abc import Sequence

import dagster as dg

RETRAIN_CRON = os.environ.get("SPEECH_ASSETS_RETRAIN_CRON", "0 3 * * *")


def follow_upstream(
    require_all_deps: bool = True, ignore_updates_of: Sequence[str] = (), wait_for_backfills: bool = True
) -> dg.AutomationCondition:
    """Materialize after any dependency updates, once none is running and blocking checks pass.

    ``eager`` also waits until no dependency (partition) is missing, e.g. a speaker registered by
    the sensor whose shard is still being built; ``require_all_deps=False`` drops that clause
    for assets that are useful before every input exists (the stats database before training).

    ``ignore_updates_of`` names dependencies whose updates are no reason to run, because another
    dependency follows them through automation and its update comes after (``kmeans_targets``
    ignores the shards and ``cmvn_stats``: ``client_partitions`` is rebuilt after them). A
    dependency of another partitioning is requested in a run of its own, so without this an
    asset would be requested in the same tick as its inputs' inputs and, with several
    partitions, the whole set would go to one backfill, which the daemon advances one dependency
    level per 30 s loop. They still count as inputs: missing, in progress, checks.

    ``wait_for_backfills=False``: a dependency counts as in progress while a run materializes it,
    not until the backfill that launched the run has been told that the run ended (the backfill
    daemon learns it at its next 30 s loop). For ``dataset_stats``, after ``kmeans_targets``,
    whose clients are one backfill of one run.
    """
    eager = dg.AutomationCondition.eager()
    if ignore_updates_of:
        ignored = dg.AssetSelection.assets(*ignore_updates_of)
        eager = eager.replace("any_deps_updated", dg.AutomationCondition.any_deps_updated().ignore(ignored))
    if not wait_for_backfills:
        eager = eager.replace(
            "any_deps_in_progress",
            dg.AutomationCondition.any_deps_match(dg.AutomationCondition.run_in_progress()).with_label("any_deps_run_in_progress"),
        )
    if require_all_deps:
        return eager & dg.AutomationCondition.all_deps_blocking_checks_passed()
    # a dependency that was never materialized has no check to pass (no checkpoint yet)
    checks_passed = dg.AutomationCondition.all_checks_match(
        dg.AutomationCondition.check_passed() | dg.AutomationCondition.will_be_requested(), blocking_only=True
    )
    deps_ok = dg.AutomationCondition.all_deps_match(checks_passed | dg.AutomationCondition.missing())
    return eager.without(~dg.AutomationCondition.any_deps_missing()) & deps_ok.with_label("all_present_deps_blocking_checks_passed")


def retrain_on_cron() -> dg.AutomationCondition:
    """At most once per ``RETRAIN_CRON`` tick, and only once every input updated since that tick."""
    return dg.AutomationCondition.on_cron(RETRAIN_CRON) & dg.AutomationCondition.all_deps_blocking_checks_passed()
