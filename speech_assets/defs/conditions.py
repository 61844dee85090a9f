"""Declarative automation conditions shared by the assets (see automation.py for the flow)."""

import os
from collections.abc import Sequence

import dagster as dg

RETRAIN_CRON = os.environ.get("SPEECH_ASSETS_RETRAIN_CRON", "0 3 * * *")


def follow_upstream(ignore_updates_of: Sequence[str] = ()) -> dg.AutomationCondition:
    """Materialize after any dependency updates, once none is missing or running and blocking checks pass.

    ``eager`` waits until no dependency (partition) is missing, e.g. a speaker registered by the
    sensor whose shard is still being built.

    ``ignore_updates_of`` names dependencies whose updates are no reason to run, because another
    dependency follows them through automation and its update comes after (``kmeans_targets``
    ignores the shards and ``cmvn_stats``: ``client_partitions`` is rebuilt after them). A
    dependency of another partitioning is requested in a run of its own, so without this an
    asset would be requested in the same tick as its inputs' inputs and, with several
    partitions, the whole set would go to one backfill, which the daemon advances one dependency
    level per 30 s loop. They still count as inputs: missing, in progress, checks.
    """
    eager = dg.AutomationCondition.eager()
    if ignore_updates_of:
        ignored = dg.AssetSelection.assets(*ignore_updates_of)
        eager = eager.replace("any_deps_updated", dg.AutomationCondition.any_deps_updated().ignore(ignored))
    return eager & dg.AutomationCondition.all_deps_blocking_checks_passed()


def after_upstream_settles(
    ignore_updates_of: Sequence[str], requested_in_backfills: Sequence[str], built_by_sensor: Sequence[str]
) -> dg.AutomationCondition:
    """Materialize once after its dependencies update, when nothing upstream is still to come.

    For ``dataset_stats``, which describes every stage: a manifest update with new speakers is
    followed by their shards (``corpus_sensor``), then CMVN and clients, then ``kmeans_targets``
    (automation), and it should run once, after the last of them, not once per level. The update
    (``any_deps_updated`` ignoring ``ignore_updates_of``, whose updates another dependency follows)
    is kept (``since_last_handled``) while anything upstream is pending:

    * a dependency requested in this tick (``will_be_requested``) or in a run (``run_in_progress``:
      a run counts from its creation, queued included);
    * a dependency in ``requested_in_backfills`` whose own inputs updated in this tick: it may be
      requested now, which ``will_be_requested`` does not show across partitionings (a tick
      that requests several partitions hands them to a backfill);
    * a partition of those requested by automation and not updated since
      (``newly_requested().since(newly_updated() | execution_failed() | stopped)``): a backfill's
      run exists only after the backfill daemon's next 30 s loop; ``in_progress`` alone would also
      wait for that daemon to record the run's end (``backfill_in_progress`` until then), another
      loop;
    * a partition of ``built_by_sensor`` registered and never materialized, until its run fails
      or stops: the sensor's work (``vad_features`` of a new speaker), which automation does not
      request; once the sensor's run exists, ``run_in_progress``.

    A failed execution ends the wait (the last published outputs are described, as before), and
    so does a canceled run or backfill: Dagster counts only a failure as a failed execution, so
    "stopped" is the partition seen in progress at one tick and not at the next. (A run created
    and canceled between two ticks is never seen in progress; the wait then lasts until that
    partition next materializes or fails.) A manifest change with nothing of the kind to wait for
    (rejects only: a corrupt file added) runs it at the next tick. Blocking checks of the
    dependencies that exist must pass; missing dependencies do not hold it back (the database is
    useful before any model is trained).
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
