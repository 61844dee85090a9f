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
