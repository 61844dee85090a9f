"""Declarative automation conditions shared by the assets (see automation.py for the flow)."""

import os
from collections.abc import Sequence

import dagster as dg

RETRAIN_CRON = os.environ.get("SPEECH_ASSETS_RETRAIN_CRON", "0 3 * * *")


def follow_upstream(ignore_updates_of: Sequence[str] = ()) -> dg.AutomationCondition:
    """Materialize after any dependency updates, once none is missing or running and blocking checks pass.

    ``ignore_updates_of``: dependencies whose updates another dependency follows (``kmeans_targets``
    ignores the shards: ``client_partitions`` is rebuilt after them). Without it an asset is
    requested in the same tick as its inputs' inputs (another partitioning is never "will be
    requested" with it). They still count as inputs: missing, in progress, checks.
    """
    eager = dg.AutomationCondition.eager()
    if ignore_updates_of:
        ignored = dg.AssetSelection.assets(*ignore_updates_of)
        eager = eager.replace("any_deps_updated", dg.AutomationCondition.any_deps_updated().ignore(ignored))
    return eager & dg.AutomationCondition.all_deps_blocking_checks_passed()


def after_upstream_settles(
    ignore_updates_of: Sequence[str], requested_in_backfills: Sequence[str], built_by_sensor: Sequence[str]
) -> dg.AutomationCondition:
    """Materialize once after its dependencies update, when nothing upstream is still to come
    (``dataset_stats``: once per fresh data, not once per level; docs/ARCHITECTURE.md).

    The update is kept while a dependency is requested or running; one of
    ``requested_in_backfills`` has inputs updated now (``will_be_requested`` does not show
    across partitionings) or was requested and not updated since (a backfill's run exists only
    after the backfill daemon's next 30 s loop); or a partition of ``built_by_sensor`` is
    registered and never materialized. A failed or stopped run ends the wait. Missing
    dependencies do not hold it back: the database is useful before any model is trained.
    """
    updated = dg.AutomationCondition.any_deps_updated().ignore(dg.AssetSelection.assets(*ignore_updates_of))
    trigger = (dg.AutomationCondition.newly_missing() | updated).since_last_handled()
    # Dagster counts only a FAILURE as a failed execution: a canceled (or deleted) run ends a wait
    # when its partition is seen to stop being in progress
    stopped = (~dg.AutomationCondition.in_progress()).newly_true().with_label("stopped_being_in_progress")
    run_stopped = (~dg.AutomationCondition.run_in_progress()).newly_true().with_label("its_run_stopped")
    awaited = dg.AutomationCondition.any_deps_match(
        dg.AutomationCondition.newly_updated() | dg.AutomationCondition.will_be_requested()
    ).with_label("inputs_updated_now") | dg.AutomationCondition.newly_requested().since(
        dg.AutomationCondition.newly_updated() | dg.AutomationCondition.execution_failed() | stopped
    ).with_label("requested_not_yet_updated")
    unbuilt = dg.AutomationCondition.missing() & ~(
        dg.AutomationCondition.execution_failed() | run_stopped.since(dg.AutomationCondition.newly_missing())
    )
    pending = (
        dg.AutomationCondition.any_deps_match(
            dg.AutomationCondition.will_be_requested() | dg.AutomationCondition.run_in_progress()
        ).with_label("any_deps_requested_or_running")
        | dg.AutomationCondition.any_deps_match(awaited)
        .allow(dg.AssetSelection.assets(*requested_in_backfills))
        .with_label("backfilled_deps_awaited")
        | dg.AutomationCondition.any_deps_match(unbuilt)
        .allow(dg.AssetSelection.assets(*built_by_sensor))
        .with_label("sensor_built_deps_missing")
    )
    # a dependency that was never materialized has no check to pass (no checkpoint yet)
    checks_passed = dg.AutomationCondition.all_checks_match(
        dg.AutomationCondition.check_passed() | dg.AutomationCondition.will_be_requested(), blocking_only=True
    )
    present_checks_passed = dg.AutomationCondition.all_deps_match(checks_passed | dg.AutomationCondition.missing())
    return (
        trigger.with_label("deps_updated_since_handled")
        & ~pending
        & ~dg.AutomationCondition.in_progress()
        & present_checks_passed.with_label("all_present_deps_blocking_checks_passed")
    ).with_label("after_upstream_settles")


def retrain_on_cron() -> dg.AutomationCondition:
    """At most once per ``RETRAIN_CRON`` tick, and only once every input updated since that tick."""
    return dg.AutomationCondition.on_cron(RETRAIN_CRON) & dg.AutomationCondition.all_deps_blocking_checks_passed()
