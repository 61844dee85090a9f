"""Runs whose processes are gone give back their concurrency slots.

A run killed with ``kill -9`` never reports its end, so Dagster keeps its pool slot claimed and the
next training run waits forever. Dead runs are failed by the daemon's run monitoring
(``LocalProcessRunLauncher``), by the default executor before it claims a slot, or by
``speech-assets runs reap``. A run is alive while any process recorded in its tags (its worker and
each slot-taking step) is alive on this host (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import dagster as dg

from speech_assets.defs import dagster_internals
from speech_assets.runtime.heap import frozen_heap
from speech_assets.runtime.processes import ProcessIdentity, pid_exists

# Bookkeeping tags sit under Dagster's hidden-tag prefix, which the UI leaves out; a tag key has
# one namespace ("a/b"; Dagster deprecates more), so the names below it are dotted.
HIDDEN = ".dagster/"
PROCESS_TAG = HIDDEN + "speech_assets.process"  # the run worker
STEP_PROCESS_TAG_PREFIX = HIDDEN + "speech_assets.step_process."  # + step key: one tag per slot-taking step
# the tag names older runs may still carry: read too, so that those runs are reaped
LEGACY_PROCESS_TAGS = (
    ("speech_assets/process", HIDDEN + "speech_assets/process"),
    ("speech_assets/step_process.", HIDDEN + "speech_assets/step_process."),
)
CORPUS_TAG = "speech_assets/corpus"  # the corpus folder's name
SETTINGS_TAG = "speech_assets/settings"  # the first 12 hex digits of the settings' sha256
SILENT_FOR_S = 60.0
REAP_COMMAND = "speech-assets runs reap"
log = logging.getLogger(__name__)


def readable_tags() -> dict[str, str]:
    """The corpus folder's name and the hash of the pipeline settings."""
    from speech_assets import locations
    from speech_assets.defs.resources import PipelineSettings

    try:
        settings = PipelineSettings.load()
    except (OSError, ValueError) as error:  # the run fails on it later, with the reason
        log.warning("no settings tag: %s", error)
        return {CORPUS_TAG: locations.corpus_location().name}
    return {CORPUS_TAG: locations.corpus_location().name, SETTINGS_TAG: settings.digest()[:12]}


def record_run_process(context: dg.AssetExecutionContext) -> None:
    """Tag the run with this step process; in an in-process run it is the worker too, if none is yet."""
    me = ProcessIdentity.current().encode()
    step = context.get_step_execution_context().step.key
    tags = {STEP_PROCESS_TAG_PREFIX + step: me}
    current = context.instance.get_run_by_id(context.run.run_id)
    if current is None or PROCESS_TAG not in current.tags:
        tags[PROCESS_TAG] = me
    context.instance.add_run_tags(context.run.run_id, tags)


def recorded_processes(run: dg.DagsterRun) -> list[ProcessIdentity]:
    """Every process ``run`` is known to run in: its worker and its slot-taking steps."""
    return [
        ProcessIdentity.decode(value)
        for key, value in sorted(run.tags.items())
        if key in (PROCESS_TAG, *LEGACY_PROCESS_TAGS[0])
        or key.startswith((STEP_PROCESS_TAG_PREFIX, *LEGACY_PROCESS_TAGS[1]))
    ]


def why_dead(instance: dg.DagsterInstance, run: dg.DagsterRun, now: float | None = None) -> str | None:
    """Why ``run`` (not finished) has no live process left, or None if it may still be running."""
    recorded = recorded_processes(run)
    if recorded:
        if any(process.host != socket.gethostname() or process.alive() for process in recorded):
            return None
        pids = ", ".join(str(process.pid) for process in recorded)
        return f"every process it ran in ({pids} on {recorded[0].host}: its worker and steps) is gone"
    if not dagster_internals.is_local_storage(instance):
        return None
    records = instance.get_records_for_run(run.run_id, ascending=False, limit=1).records
    if not records or (now or time.time()) - records[0].event_log_entry.timestamp < SILENT_FOR_S:
        return None
    pids = {e.dagster_event.pid for e in instance.all_logs(run.run_id) if e.dagster_event and e.dagster_event.pid}
    if not pids or any(pid_exists(pid) for pid in pids):
        return None
    return (
        f"none of its processes ({', '.join(map(str, sorted(pids)))}) is running and it has been silent for "
        f"{SILENT_FOR_S:.0f} s"
    )


def reap_dead_runs(instance: dg.DagsterInstance, say: Callable[[str], None] = log.warning) -> list[str]:
    """Fail runs holding concurrency slots whose processes are gone, and free their slots."""
    reaped = []
    for run_id in sorted(instance.event_log_storage.get_concurrency_run_ids()):
        run = instance.get_run_by_id(run_id)
        if run is not None and not run.is_finished:
            reason = why_dead(instance, run)
            if reason is None:
                continue
            instance.report_run_failed(
                run, f"run worker died without reporting ({reason}); freeing its concurrency slots"
            )
        instance.event_log_storage.free_concurrency_slots_for_run(run_id)
        say(f"freed the concurrency slots of run {run_id} ({'finished' if run is None or run.is_finished else reason})")
        reaped.append(run_id)
    return reaped


# The sensors' small runs execute their steps in the run worker: starting a forkserver that imports
# the code location and torch again costs more than their work (docs/BENCHMARKS.md). Runs with a
# step in a pool still get their own step processes.
IN_PROCESS_TAG = HIDDEN + "speech_assets.in_process"


def runs_in_process(run: dg.DagsterRun, execution_plan) -> bool:
    if run.tags.get(IN_PROCESS_TAG) != "true":
        return False
    return not any(step.pool for step in execution_plan.get_steps_to_execute_in_topo_order())


# --- without a daemon: the default executor reaps before it claims slots ---------------------


def prepare_run(plan_context, execution_plan) -> AbstractContextManager[None] | None:
    """Before any step: tag the run with this process as its worker (and the corpus and settings hash
    for people), reap dead local runs, and give the context for in-process steps."""
    worker = {PROCESS_TAG: ProcessIdentity.current().encode(), **readable_tags()}
    plan_context.instance.add_run_tags(plan_context.dagster_run.run_id, worker)
    reap_dead_runs(plan_context.instance, say=plan_context.log.warning)
    return frozen_heap() if runs_in_process(plan_context.dagster_run, execution_plan) else None


# Steps fork from a server that has already imported these (most of a short step's time on 2 cores);
# nothing here starts a thread on import, so forking after it is safe.
FORKSERVER_PRELOAD = ["speech_assets.definitions", "torch", "pyarrow.parquet", "numpy"]


reaping_multiprocess_executor = dagster_internals.multiprocess_executor(
    description=(
        "Dagster's multiprocess executor (steps fork from a preloaded forkserver unless start_method says "
        "otherwise); first frees concurrency slots of runs whose processes are gone."
    ),
    preload_modules=FORKSERVER_PRELOAD,
    prepare=prepare_run,
)


# --- with a daemon: run monitoring learns that a local run worker is gone ---------------------


LocalProcessRunLauncher = dagster_internals.local_run_launcher(
    why_dead, remedy=f"or free its slots with `{REAP_COMMAND}`"
)
