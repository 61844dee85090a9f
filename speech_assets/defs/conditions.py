"""Declarative automation conditions shared by the assets (see automation.py for the flow)."""

import os

import dagster as dg

RETRAIN_CRON = os.environ.get("SPEECH_ASSETS_RETRAIN_CRON", "0 3 * * *")


def follow_upstream(require_all_deps: bool = True) -> dg.AutomationCondition:
    """Materialize after any dependency updates, once none is running and blocking checks pass.

    With ``require_all_deps`` it also waits until no dependency (partition) is missing, e.g. a
    speaker registered by the sensor whose shard is still being built.
    """
    condition = dg.AutomationCondition.eager() & dg.AutomationCondition.all_deps_blocking_checks_passed()
    return condition & ~dg.AutomationCondition.any_deps_missing() if require_all_deps else condition


def retrain_on_cron() -> dg.AutomationCondition:
    """At most once per ``RETRAIN_CRON`` tick, and only once every input updated since that tick."""
    return dg.AutomationCondition.on_cron(RETRAIN_CRON) & dg.AutomationCondition.all_deps_blocking_checks_passed()
