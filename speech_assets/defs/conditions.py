"""Declarative automation conditions shared by the assets (see automation.py for the flow)."""

import os

import dagster as dg

RETRAIN_CRON = os.environ.get("SPEECH_ASSETS_RETRAIN_CRON", "0 3 * * *")


def follow_upstream(require_all_deps: bool = True) -> dg.AutomationCondition:
    """Materialize after any dependency updates, once none is running and blocking checks pass.

    ``eager`` also waits until no dependency (partition) is missing, e.g. a speaker registered by
    the sensor whose shard is still being built; ``require_all_deps=False`` drops that clause
    for assets that are useful before every input exists (the stats database before training).
    """
    eager = dg.AutomationCondition.eager()
    if not require_all_deps:
        eager = eager.without(~dg.AutomationCondition.any_deps_missing())
    return eager & dg.AutomationCondition.all_deps_blocking_checks_passed()


def retrain_on_cron() -> dg.AutomationCondition:
    """At most once per ``RETRAIN_CRON`` tick, and only once every input updated since that tick."""
    return dg.AutomationCondition.on_cron(RETRAIN_CRON) & dg.AutomationCondition.all_deps_blocking_checks_passed()
