"""How fast the daemon reacts (issue 24): the sensors' intervals, the run queue and sensor loop
settings of the repository's dagster.yaml as a real instance reads them, and the sensors' runs
executing their steps in the run worker (no forked step processes), except runs with a step in a
pool. Times are measured by bench/daemon.py, never asserted here."""

from __future__ import annotations

import os

import dagster as dg
from dagster._core.execution.api import create_execution_plan, execute_run

from speech_assets.defs.automation import (
    AUTOMATION_INTERVAL_S,
    CORPUS_SENSOR_INTERVAL_S,
    SENSOR_RUN_TAGS,
    automation_sensor,
    corpus_sensor,
)
from speech_assets.defs.runs import IN_PROCESS_TAG, reaping_multiprocess_executor, runs_in_process

DAEMON_LOOP_S = 5  # dagster's sensor and asset daemons come round every 5 s at most


def test_both_sensors_tick_on_every_loop_of_the_daemon() -> None:
    # a sensor is skipped while less than its interval has passed since its last tick ended:
    # an interval of 5 would skip every other 5 s loop
    assert corpus_sensor.minimum_interval_seconds == CORPUS_SENSOR_INTERVAL_S < DAEMON_LOOP_S
    assert automation_sensor.minimum_interval_seconds == AUTOMATION_INTERVAL_S < DAEMON_LOOP_S
    assert automation_sensor.run_tags == SENSOR_RUN_TAGS == {IN_PROCESS_TAG: "true"}


def test_the_repository_instance_dequeues_every_second_and_ticks_in_threads(instance: dg.DagsterInstance) -> None:
    coordinator = instance.run_coordinator
    assert type(coordinator).__name__ == "QueuedRunCoordinator"
    assert coordinator.dequeue_interval_seconds == 1 and coordinator.dequeue_use_threads
    assert instance.get_concurrency_config().run_queue_config.max_concurrent_runs == 4
    assert instance.get_settings("sensors") == {"use_threads": True, "num_workers": 2}
    automation = instance.get_settings("auto_materialize")
    assert automation["use_sensors"] and automation["use_threads"]


@dg.asset
def light() -> None:
    dg.get_dagster_logger().info(f"step pid {os.getpid()}")


@dg.asset(pool="accelerator")
def pooled() -> None:
    pass


def light_job() -> dg.JobDefinition:
    job = dg.define_asset_job("light_job", selection=[light])
    return dg.Definitions(assets=[light], jobs=[job], executor=reaping_multiprocess_executor).get_job_def("light_job")


def test_a_sensor_run_executes_its_steps_in_the_run_worker(instance: dg.DagsterInstance) -> None:
    job = dg.reconstructable(light_job)
    run = instance.create_run_for_job(job_def=light_job(), tags=SENSOR_RUN_TAGS)
    finished = execute_run(job, run, instance)
    assert finished.success
    (engine,) = [e for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)
                 if "in process" in (e.message or "")][:1]
    assert f"pid: {os.getpid()}" in engine.message
    step_pids = {e.dagster_event.pid for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_START)}
    assert step_pids == {os.getpid()}


def test_untagged_runs_and_runs_with_a_pooled_step_keep_their_step_processes(instance: dg.DagsterInstance) -> None:
    defs = dg.Definitions(assets=[light, pooled], executor=reaping_multiprocess_executor)
    job = defs.resolve_implicit_global_asset_job_def()
    plan = create_execution_plan(job)
    tagged = instance.create_run_for_job(job_def=job, tags=SENSOR_RUN_TAGS)
    untagged = instance.create_run_for_job(job_def=job)
    assert not runs_in_process(tagged, plan)  # `pooled` is in a pool
    assert not runs_in_process(untagged, plan)
    light_only = create_execution_plan(job, step_keys_to_execute=["light"])
    assert runs_in_process(tagged, light_only)
    assert not runs_in_process(untagged, light_only)
