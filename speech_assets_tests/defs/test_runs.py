"""A run is alive while any of its processes is: a real ``dagster-daemon`` with run monitoring
watches a real multi-step ``dagster asset materialize`` run whose training step ends long before
the run does, and a second training run started meanwhile; then a ``kill -9``'d run is failed by
the daemon and its slot freed. (Before, the run was tagged with its training step's process only:
once that step ended, the daemon failed the live run and the next run's executor freed its slot.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import dagster as dg
import pytest
import yaml

from speech_assets.defs.dagster_internals import stop_forkserver
from speech_assets.defs.runs import (
    CORPUS_TAG,
    IN_PROCESS_TAG,
    PROCESS_TAG,
    SETTINGS_TAG,
    STEP_PROCESS_TAG_PREFIX,
    recorded_processes,
)
from speech_assets.runtime import waiting
from speech_assets.runtime.processes import process_start_time
from speech_assets_tests.conftest import REPO

BIN = Path(sys.executable).parent
LOCATION = "speech_assets_tests.defs.liveness_location"
POLL_S = 2  # run monitoring checks every run this often: many checks during the slow step


def wait_until(predicate, timeout_s: float, what: str, services: list[subprocess.Popen] = ()) -> None:
    """:func:`speech_assets.runtime.waiting.wait_until`, failing at once if a service exits."""

    def check() -> bool:
        for service in services:
            assert service.poll() is None, (
                f"{service.args[:3]} exited with {service.returncode} while waiting for {what}"
            )
        return predicate()

    waiting.wait_until(check, timeout_s, what, interval=0.5)


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def span(found: list[dict], step: str) -> tuple[float, float]:
    times = {e["event"]: e["t"] for e in found if e["step"] == step}
    return times["start"], times["end"]


@pytest.fixture(scope="module")
def instance_with_daemon(tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp("liveness")
    home = tmp_path / "dagster_home"
    home.mkdir()
    config = yaml.safe_load((REPO / "dagster.yaml").read_text())
    config["run_monitoring"].update(poll_interval_seconds=POLL_S, free_slots_after_run_end_seconds=POLL_S)
    config["run_launcher"] = {"module": LOCATION, "class": "RecordingLauncher"}
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")},
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "DAGSTER_HOME": str(home),
        "LIVENESS_EVENTS": str(tmp_path / "events.jsonl"),
        "LIVENESS_SLOW_S": str(4 * POLL_S),
    }
    started: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        process = subprocess.Popen(
            [str(BIN / args[0]), *args[1:]],
            env=env,
            cwd=REPO,
            start_new_session=True,
            stdout=open(tmp_path / f"{args[0]}-{len(started)}.log", "w"),
            stderr=subprocess.STDOUT,
        )
        started.append(process)
        return process

    instance = dg.DagsterInstance.from_config(str(home))
    daemon = start("dagster-daemon", "run", "-m", LOCATION)
    try:  # the first run starts beside the daemon; its slow step waits for run monitoring
        yield instance, start, daemon, tmp_path / "events.jsonl"
    finally:
        for process in started:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        instance.dispose()


def materialize(start, *assets: str) -> subprocess.Popen:
    return start("dagster", "asset", "materialize", "-m", LOCATION, "--select", ",".join(assets))


def run_of(instance: dg.DagsterInstance, asset: str) -> dg.DagsterRun:
    records = instance.get_run_records(dg.RunsFilter(tags={}), limit=50)
    (run,) = [r.dagster_run for r in records if dg.AssetKey(asset) in (r.dagster_run.asset_selection or ())]
    return run


def test_the_daemon_leaves_a_live_multi_step_run_alone_and_its_slot_serialises_trainers(instance_with_daemon) -> None:
    instance, start, daemon, log = instance_with_daemon
    first = materialize(start, "short_training", "slow_evaluation", "second_training")
    wait_until(
        lambda: any(e["step"] == "short_training" for e in events(log)), 180, "the first training step", [daemon]
    )
    second = materialize(start, "other_training")  # a second trainer, while the first holds the slot
    assert first.wait(timeout=300) == 0
    assert second.wait(timeout=300) == 0

    found = events(log)
    run = run_of(instance, "short_training")
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.SUCCESS
    assert not instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)
    # the daemon checked the run while only its slow, slot-less step was left, and found it alive ...
    slow_start, slow_end = span(found, "slow_evaluation")
    checks = [e for e in found if e["step"] == "health" and e["run_id"] == run.run_id]
    assert len([e for e in checks if span(found, "short_training")[1] < e["t"] < slow_end]) >= 2, checks
    assert {e["event"] for e in checks} == {"RUNNING"} and daemon.poll() is None
    # ... and the run was known by its worker (this CLI process's run), beside its training steps
    tags = instance.get_run_by_id(run.run_id).tags
    worker = [p for p in recorded_processes(instance.get_run_by_id(run.run_id)) if p.encode() == tags[PROCESS_TAG]]
    assert worker and worker[0].pid not in {e["pid"] for e in found}
    assert {k for k in tags if k.startswith(STEP_PROCESS_TAG_PREFIX)} == {
        STEP_PROCESS_TAG_PREFIX + "short_training",
        STEP_PROCESS_TAG_PREFIX + "second_training",
    }
    # one trainer at a time: the second run's training waited for the first's slot
    trainers = sorted(span(found, step) for step in ("short_training", "other_training", "second_training"))
    assert all(earlier[1] <= later[0] for earlier, later in zip(trainers, trainers[1:])), trainers
    assert span(found, "other_training")[0] >= span(found, "short_training")[1]
    wait_until(lambda: not instance.event_log_storage.get_concurrency_run_ids(), 60, "every slot to be given back")


def test_the_daemon_fails_a_kill_9d_run_and_frees_its_slot(instance_with_daemon) -> None:
    instance, start, daemon, log = instance_with_daemon
    doomed = materialize(start, "endless_training")
    wait_until(lambda: any(e["step"] == "endless_training" for e in events(log)), 180, "the training step", [daemon])
    run = run_of(instance, "endless_training")
    assert instance.event_log_storage.get_concurrency_run_ids() == {run.run_id}
    os.killpg(doomed.pid, signal.SIGKILL)  # the CLI (run worker), its forkserver and the step
    doomed.wait()
    wait_until(
        lambda: instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE,
        120,
        "the daemon to fail the run",
        [daemon],
    )
    wait_until(lambda: not instance.event_log_storage.get_concurrency_run_ids(), 120, "its slot to be freed", [daemon])
    (failure,) = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)
    assert "is gone" in (failure.message or "") or "gone" in str(failure.dagster_event.event_specific_data)


def test_the_executor_ends_its_forkserver_when_the_run_ends() -> None:
    """The local executor's steps fork from a forkserver; once the run is done it is killed and
    reaped at once (left to exit on its own it tore down torch for minutes), and the next run
    in the same process starts a new one."""
    import multiprocessing
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    for _ in range(2):
        step = context.Process(target=os.getpid)
        step.start()
        step.join(timeout=120)
        assert step.exitcode == 0
        server = forkserver._forkserver._forkserver_pid
        assert server is not None and process_start_time(server) is not None
        stop_forkserver()
        assert not os.path.exists(f"/proc/{server}")  # gone and reaped, not a zombie
        assert forkserver._forkserver._forkserver_pid is None
    stop_forkserver()  # nothing to stop: a no-op


FROZEN_DURING_STEP: list[int] = []


@dg.asset
def records_the_frozen_heap() -> None:
    import gc

    FROZEN_DURING_STEP.append(gc.get_freeze_count())


def frozen_heap_job() -> dg.JobDefinition:
    from speech_assets.defs.runs import reaping_multiprocess_executor

    job = dg.define_asset_job("frozen_heap_job", selection=[records_the_frozen_heap])
    return dg.Definitions(
        assets=[records_the_frozen_heap], jobs=[job], executor=reaping_multiprocess_executor
    ).resolve_job_def("frozen_heap_job")


def test_a_run_in_its_worker_keeps_the_loaded_heap_out_of_garbage_collection(instance: dg.DagsterInstance) -> None:
    """The objects loaded before an in-process run (the code location) are frozen while its steps
    run, and handed back to the collector when it ends."""
    import gc

    from dagster._core.execution.api import execute_run

    from speech_assets.defs.runs import IN_PROCESS_TAG

    FROZEN_DURING_STEP.clear()
    before = gc.get_freeze_count()
    run = instance.create_run_for_job(job_def=frozen_heap_job(), tags={IN_PROCESS_TAG: "true"})
    assert execute_run(dg.reconstructable(frozen_heap_job), run, instance).success
    assert len(FROZEN_DURING_STEP) == 1 and FROZEN_DURING_STEP[0] > before + 10_000
    assert gc.get_freeze_count() == before


def test_bookkeeping_tags_are_hidden_and_the_corpus_and_settings_shown(instance: dg.DagsterInstance) -> None:
    """The Runs list shows what a person reads (the corpus, the settings' hash), not the process
    identities the reaper keeps: those are under Dagster's hidden-tag prefix, as the in-process flag."""
    from dagster._core.execution.api import execute_run
    from dagster._core.storage.tags import TagType, get_tag_type

    from speech_assets.defs.runs import CORPUS_TAG, IN_PROCESS_TAG, SETTINGS_TAG, recorded_processes

    run = instance.create_run_for_job(job_def=frozen_heap_job(), tags={IN_PROCESS_TAG: "true"})
    assert execute_run(dg.reconstructable(frozen_heap_job), run, instance).success
    finished = instance.get_run_by_id(run.run_id)
    tags = finished.tags
    shown = {key for key in tags if get_tag_type(key) == TagType.USER_PROVIDED}
    assert shown == {CORPUS_TAG, SETTINGS_TAG}, tags
    assert get_tag_type(PROCESS_TAG) == get_tag_type(STEP_PROCESS_TAG_PREFIX + "x") == TagType.HIDDEN
    assert PROCESS_TAG in tags and recorded_processes(finished)  # still what the reaper reads
    assert len(tags[SETTINGS_TAG]) == 12 and tags[CORPUS_TAG]


def test_bookkeeping_and_shown_tag_keys_are_keys_dagster_accepts() -> None:
    """Dagster deprecates tag keys with more than one namespace ("a/b/c"): a run request with
    every tag this project sets must not warn (a warning here is an error in a later release)."""
    tags = {PROCESS_TAG: "1", STEP_PROCESS_TAG_PREFIX + "pretrained_checkpoint": "1", IN_PROCESS_TAG: "true"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dg.RunRequest(tags=tags | {CORPUS_TAG: "sample", SETTINGS_TAG: "0123456789ab"})
