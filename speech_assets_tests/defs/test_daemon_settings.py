"""How fast the daemon reacts (issue 24): the sensors' intervals, the run queue and sensor loop
settings of the repository's dagster.yaml as a real instance reads them, and the sensors' runs
executing their steps in the run worker (no forked step processes), except runs with a step in a
pool. Times are measured by bench/daemon.py, never asserted here."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.execution.api import create_execution_plan, execute_run

from speech_assets.defs.automation import (
    AUTOMATION_INTERVAL_S,
    CORPUS_SENSOR_INTERVAL_S,
    SENSOR_RUN_TAGS,
    automation_sensor,
    corpus_sensor,
)
from speech_assets.defs.runs import IN_PROCESS_TAG, reaping_multiprocess_executor, runs_in_process
from speech_assets_tests.conftest import fresh_instance

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
    return dg.Definitions(assets=[light], jobs=[job], executor=reaping_multiprocess_executor).resolve_job_def(
        "light_job"
    )


def test_a_sensor_run_executes_its_steps_in_the_run_worker(instance: dg.DagsterInstance) -> None:
    job = dg.reconstructable(light_job)
    run = instance.create_run_for_job(job_def=light_job(), tags=SENSOR_RUN_TAGS)
    finished = execute_run(job, run, instance)
    assert finished.success
    (engine,) = [
        e
        for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)
        if "in process" in (e.message or "")
    ][:1]
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
# The graph's shape with the real assets' conditions: manifest -> shards (per speaker, built by the
# sensor) -> cmvn_stats -> client_partitions -> kmeans_targets (per client) -> dataset_stats, which
# also reads the manifest and a checkpoint that does not exist yet.


def _toy(key: str, real: dg.AssetsDefinition, **kwargs) -> dg.AssetsDefinition:
    @dg.asset(name=key, automation_condition=real.automation_conditions_by_key[dg.AssetKey(key)], **kwargs)
    def _asset() -> None:
        pass

    return _asset


FAIL_TAG = "toy/fail"


def toy_graph() -> list[dg.AssetsDefinition]:
    from speech_assets.defs import clients, features, stats, targets
    from speech_assets.defs.partitions import ALL_SHARDS, ALL_TARGETS, speakers_partitions

    @dg.asset(name="manifest")
    def manifest() -> None:
        pass

    @dg.asset(name="vad_features", partitions_def=speakers_partitions)
    def shards() -> None:
        pass

    @dg.asset(name="pretrained_checkpoint")
    def checkpoint() -> None:  # never materialized here: dataset_stats must not wait for it
        pass

    @dg.asset(
        name="kmeans_targets",
        partitions_def=dg.StaticPartitionsDefinition(["c1", "c2"]),
        deps=["client_partitions", "cmvn_stats", ALL_SHARDS],
        automation_condition=targets.kmeans_targets.automation_conditions_by_key[dg.AssetKey("kmeans_targets")],
    )
    def kmeans(context) -> None:  # (annotations are strings in this module: dagster would refuse one)
        if context.run.tags.get(FAIL_TAG):
            raise dg.Failure("k-means failed")

    return [
        manifest,
        shards,
        _toy("cmvn_stats", features.cmvn_stats, deps=[ALL_SHARDS]),
        _toy("client_partitions", clients.client_partitions, deps=["cmvn_stats"]),
        kmeans,
        checkpoint,
        _toy(
            "dataset_stats",
            stats.dataset_stats,
            deps=["manifest", "cmvn_stats", "client_partitions", ALL_SHARDS, ALL_TARGETS, "pretrained_checkpoint"],
        ),
    ]


class Toy:
    """The toy graph built on a real instance (s1, s2 and every client), then ticked as the daemon does."""

    def __init__(self, instance: dg.DagsterInstance, cursor: object | None = None) -> None:
        """``cursor``: the instance is a copy of one built here, and this its cursor after the build."""
        self.instance, self.assets = instance, {a.key.to_user_string(): a for a in toy_graph()}
        self.defs = dg.Definitions(assets=list(self.assets.values()))
        if cursor is not None:
            self.cursor = cursor
            return
        instance.add_dynamic_partitions("speakers", ["s1", "s2"])
        self.run("manifest")
        for speaker in ("s1", "s2"):
            self.run("vad_features", speaker)
        self.run("cmvn_stats")
        self.run("client_partitions")
        for client in ("c1", "c2"):
            self.run("kmeans_targets", client)
        self.run("dataset_stats")
        self.cursor = dg.evaluate_automation_conditions(
            defs=self.defs, instance=instance
        ).cursor  # records the built state

    def run(self, key: str, partition: str | None = None, fail: bool = False) -> None:
        result = dg.materialize(
            list(self.assets.values()),
            instance=self.instance,
            partition_key=partition,
            selection=[key],
            tags={FAIL_TAG: "yes"} if fail else None,
            raise_on_error=False,
        )
        assert result.success != fail

    def tick(self) -> dict[str, list[str]]:
        """What one automation tick requests: asset -> its partitions ([] when unpartitioned)."""
        evaluation = dg.evaluate_automation_conditions(defs=self.defs, instance=self.instance, cursor=self.cursor)
        self.cursor = evaluation.cursor
        return {
            key: sorted(p for p in evaluation.get_requested_partitions(a.key) if p)
            for key, a in self.assets.items()
            if evaluation.get_num_requested(a.key)
        }

    def run_requested(self, requested: dict[str, list[str]]) -> None:
        for key in self.assets:  # what the runs of a tick do, in dependency order
            for partition in requested.get(key, None) or ([None] if key in requested else []):
                self.run(key, partition)

    def follow(self, ticks: int = 6) -> list[dict[str, list[str]]]:
        """Tick and run what is requested until a tick requests nothing."""
        seen = []
        for _ in range(ticks):
            requested = self.tick()
            if not requested:
                break
            seen.append(requested)
            self.run_requested(requested)
        return seen


@pytest.fixture(scope="module")
def built_toy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """The toy graph built once on a real instance: (its DAGSTER_HOME, the cursor after the build)."""
    root = tmp_path_factory.mktemp("toy")
    with fresh_instance(root) as instance:
        cursor = Toy(instance).cursor
    return root / "dagster_home", cursor


@pytest.fixture
def toy(built_toy: tuple[Path, object], tmp_path: Path) -> Iterator[Toy]:
    """A copy of the built toy's instance (its SQLite storage copied, the build is most of a test's
    time), for one test to change."""
    home, cursor = built_toy
    shutil.copytree(home, tmp_path / "dagster_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
        with dg.DagsterInstance.get() as instance:
            yield Toy(instance, cursor)


def new_speaker(toy: Toy, built: bool = True) -> None:
    """What corpus_sensor's two runs do: a manifest that registers s3, then (``built``) its shard."""
    toy.run("manifest")
    toy.instance.add_dynamic_partitions("speakers", ["s3"])
    if built:
        toy.run("vad_features", "s3")


def test_a_new_speaker_reaches_dataset_stats_once_one_level_per_tick(toy: Toy) -> None:
    new_speaker(toy)
    assert toy.follow() == [
        {"cmvn_stats": [], "client_partitions": []},  # one run; dataset_stats waits for what follows
        {"kmeans_targets": ["c1", "c2"]},  # alone: its backfill is one run, one level
        {"dataset_stats": []},  # once, after every client's targets
    ]
    # several clients in a tick go to a backfill (one run for all, whose checks read every client)
    assert automation_sensor.emit_backfills


def test_dataset_stats_waits_for_the_shard_the_sensor_has_yet_to_build(toy: Toy) -> None:
    new_speaker(toy, built=False)  # the manifest run is done, the shard's run not yet started
    assert toy.tick() == {}
    toy.run("vad_features", "s3")
    assert [set(requested) for requested in toy.follow()] == [
        {"cmvn_stats", "client_partitions"},
        {"kmeans_targets"},
        {"dataset_stats"},
    ]


def test_a_manifest_change_with_no_shard_to_wait_for_refreshes_dataset_stats(toy: Toy) -> None:
    toy.run("manifest")  # e.g. a corrupt file added: a new reject, no speaker's rows changed
    assert toy.follow() == [{"dataset_stats": []}]


@pytest.mark.parametrize("kmeans_fails", [False, True])
def test_dataset_stats_waits_for_the_kmeans_backfill_until_its_run_ends(toy: Toy, kmeans_fails: bool) -> None:
    new_speaker(toy)
    toy.run_requested(toy.tick())  # cmvn_stats, client_partitions
    assert toy.tick() == {"kmeans_targets": ["c1", "c2"]}
    # handed to a backfill, whose run the backfill daemon launches at its next loop: not in progress yet
    assert toy.tick() == {}
    assert toy.tick() == {}
    toy.run("kmeans_targets", "c1", fail=kmeans_fails)
    toy.run("kmeans_targets", "c2", fail=kmeans_fails)
    # after the run, whether or not the backfill daemon has recorded its end; a failed run does
    # not hold the database back: it describes the targets still published
    assert toy.tick() == {"dataset_stats": []}


def created_run(toy: Toy, key: str, partition: str) -> dg.DagsterRun:
    """A run of ``key[partition]`` as the sensor or the backfill daemon creates it (queued: in progress)."""
    job = toy.defs.resolve_implicit_global_asset_job_def()
    return toy.instance.create_run_for_job(
        job_def=job, asset_selection=frozenset({dg.AssetKey(key)}), tags={"dagster/partition": partition}
    )


def cancel(toy: Toy, run: dg.DagsterRun) -> None:
    toy.instance.report_run_canceling(run)
    toy.instance.report_run_canceled(run)


def test_a_canceled_shard_run_does_not_hold_dataset_stats_back(toy: Toy) -> None:
    new_speaker(toy, built=False)
    assert toy.tick() == {}  # the shard is still to be built
    run = created_run(toy, "vad_features", "s3")
    assert toy.tick() == {}  # its run is queued
    cancel(toy, run)
    # Dagster counts a canceled run as neither failed nor in progress: without the "stopped" reset
    # the database would wait for this shard until the speaker's rows change again
    assert toy.tick() == {"dataset_stats": []}


def test_a_canceled_kmeans_run_does_not_hold_dataset_stats_back(toy: Toy) -> None:
    new_speaker(toy)
    toy.run_requested(toy.tick())  # cmvn_stats, client_partitions
    assert toy.tick() == {"kmeans_targets": ["c1", "c2"]}
    runs = [created_run(toy, "kmeans_targets", client) for client in ("c1", "c2")]
    assert toy.tick() == {}
    for run in runs:
        cancel(toy, run)
    assert toy.tick() == {"dataset_stats": []}  # describes the targets still published
