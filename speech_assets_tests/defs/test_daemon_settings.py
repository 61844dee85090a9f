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
    return dg.Definitions(assets=[light], jobs=[job], executor=reaping_multiprocess_executor).resolve_job_def("light_job")


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


# --- the automation levels follow each other over ticks, never beside each other ---------------
# The graph's shape with the real assets' conditions: shards (per speaker, built by the sensor) ->
# cmvn_stats -> client_partitions -> kmeans_targets (per client) -> dataset_stats.

def _toy(key: str, real: dg.AssetsDefinition, **kwargs) -> dg.AssetsDefinition:
    @dg.asset(name=key, automation_condition=real.automation_conditions_by_key[dg.AssetKey(key)], **kwargs)
    def _asset() -> None:
        pass

    return _asset


def toy_graph() -> list[dg.AssetsDefinition]:
    from speech_assets.defs import clients, features, stats, targets
    from speech_assets.defs.partitions import ALL_SHARDS, ALL_TARGETS

    @dg.asset(name="vad_features", partitions_def=dg.StaticPartitionsDefinition(["s1", "s2"]))
    def shards() -> None:
        pass

    clients_def = dg.StaticPartitionsDefinition(["c1", "c2"])
    return [
        shards,
        _toy("cmvn_stats", features.cmvn_stats, deps=[ALL_SHARDS]),
        _toy("client_partitions", clients.client_partitions, deps=["cmvn_stats"]),
        _toy("kmeans_targets", targets.kmeans_targets, deps=["client_partitions", "cmvn_stats", ALL_SHARDS], partitions_def=clients_def),
        _toy("dataset_stats", stats.dataset_stats, deps=["cmvn_stats", "client_partitions", ALL_SHARDS, ALL_TARGETS]),
    ]


def test_a_new_shard_reaches_dataset_stats_one_level_per_tick(instance: dg.DagsterInstance) -> None:
    assets = toy_graph()
    defs = dg.Definitions(assets=assets)
    for partition in ("s1", "s2"):
        assert dg.materialize(assets[:1], instance=instance, partition_key=partition).success
    assert dg.materialize(assets[1:3], instance=instance).success
    for partition in ("c1", "c2"):
        assert dg.materialize(assets[3:4], selection=["kmeans_targets"], instance=instance, partition_key=partition).success
    assert dg.materialize(assets[4:], instance=instance).success
    cursor = dg.evaluate_automation_conditions(defs=defs, instance=instance).cursor  # records the built state

    assert dg.materialize(assets[:1], instance=instance, partition_key="s2").success  # the sensor's shard run
    ticks = []
    for _ in range(5):
        evaluation = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
        cursor = evaluation.cursor
        requested = {a.key.to_user_string(): sorted(p for p in evaluation.get_requested_partitions(a.key) if p)
                     for a in assets if evaluation.get_num_requested(a.key)}
        if not requested:
            break
        ticks.append(requested)
        for asset in assets:  # what the runs of this tick do, in dependency order
            for partition in requested.get(asset.key.to_user_string(), None) or ([None] if asset.key.to_user_string() in requested else []):
                assert dg.materialize([asset], instance=instance, partition_key=partition, selection=[asset.key]).success
    assert ticks == [
        {"cmvn_stats": [], "client_partitions": []},  # one run
        {"kmeans_targets": ["c1", "c2"]},  # alone: its backfill is one run, one level
        {"dataset_stats": []},  # after every client's targets, not beside them
    ]
    # several clients in a tick go to a backfill (one run for all, whose checks read every client)
    assert automation_sensor.emit_backfills
