"""Fresh data on a real instance: sensor -> only the new shard -> automation -> fresh again.

Runs on a real SQLite Dagster instance in a temp DAGSTER_HOME, with the real sensor and the
real declarative-automation evaluator; runs are executed in process against that instance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest

from speech_assets.definitions import build_definitions
from speech_assets.defs.automation import corpus_sensor
from speech_assets.defs.resources import ClientSettings, KMeansSettings, PipelineSettings, StoragePaths
from speech_assets.stats import database as stats_database
from speech_assets_tests.conftest import SAMPLE_CORPUS
from speech_assets_tests.support.local_runs import (
    PARTITION_RANGE_END,
    PARTITION_RANGE_START,
    follow_automation,
    materialize_in_process,
    run_requested,
)

NEW_SPEAKER = "1008"
DOWNSTREAM = ("cmvn_stats", "client_partitions", "kmeans_targets", "dataset_stats")


@pytest.fixture
def world(tmp_path: Path, instance: dg.DagsterInstance):
    corpus = tmp_path / "corpus"
    shutil.copytree(SAMPLE_CORPUS, corpus, ignore=shutil.ignore_patterns(NEW_SPEAKER))
    paths = StoragePaths(
        corpus=str(corpus), data_dir=str(tmp_path / "out"), mlflow_tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"
    )
    # The user's settings, as pipeline.toml would set them: every run below, the sensor's and
    # automation's included, must use them (none of them passes run config).
    settings = PipelineSettings(kmeans=KMeansSettings(k=20), clients=ClientSettings(num_clients=3))
    yield build_definitions(paths, settings), instance, paths, corpus
    instance.dispose()


def run(defs: dg.Definitions, instance: dg.DagsterInstance, asset: str, partitions: list[str] | None = None) -> None:
    materialize_in_process(defs, instance, asset, partitions)


def stale_status(
    defs: dg.Definitions, instance: dg.DagsterInstance, asset: str, partition: str | None = None
) -> StaleStatus:
    resolver = CachingStaleStatusResolver(instance, defs.resolve_asset_graph(), LoadingContextForTest(instance))
    return resolver.get_status(dg.AssetKey(asset), partition)


def shard_partitions_materialized(instance: dg.DagsterInstance, after_storage_id: int) -> list[str]:
    records = instance.fetch_materializations(dg.AssetKey("vad_features"), limit=1000).records
    return sorted({r.asset_materialization.partition for r in records if r.storage_id > after_storage_id})


def speakers_observed_after(instance: dg.DagsterInstance, storage_id: int) -> list[str]:
    records = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("speaker_manifest"), after_storage_id=storage_id), limit=10_000
    ).records
    return sorted(r.partition_key for r in records)


def latest_storage_id(instance: dg.DagsterInstance) -> int:
    records = instance.fetch_materializations(dg.AssetKey("vad_features"), limit=1).records
    return records[0].storage_id if records else 0


def test_new_speaker_flows_through_only_what_changed(world) -> None:
    defs, instance, paths, corpus = world

    # -- a full build of the corpus without the new speaker
    run(defs, instance, "manifest")
    speakers = list(instance.get_dynamic_partitions("speakers"))
    assert NEW_SPEAKER not in speakers and len(speakers) == 7
    run(defs, instance, "vad_features", speakers)
    run(defs, instance, "cmvn_stats")
    run(defs, instance, "client_partitions")
    assert list(instance.get_dynamic_partitions("clients")) == ["client_00", "client_01", "client_02"]
    run(defs, instance, "kmeans_targets", list(instance.get_dynamic_partitions("clients")))
    cursor, nothing = follow_automation(defs, instance, None, DOWNSTREAM)  # records the built state
    assert nothing == []
    before_clients = {r["speaker_id"]: r["client_id"] for r in pq.read_table(paths.layout.clients_file).to_pylist()}
    assert stale_status(defs, instance, "cmvn_stats") == StaleStatus.FRESH
    with dg.build_sensor_context(instance=instance, resources={"paths": paths}) as context:
        assert isinstance(corpus_sensor(context), dg.SkipReason) or not corpus_sensor(context).run_requests

    # -- a new speaker folder arrives
    shutil.copytree(SAMPLE_CORPUS / NEW_SPEAKER, corpus / NEW_SPEAKER)
    with dg.build_sensor_context(instance=instance, resources={"paths": paths}) as context:
        first = corpus_sensor(context)
    assert [r.asset_selection for r in first.run_requests] == [[dg.AssetKey("manifest")]]
    before = instance.event_log_storage.get_maximum_record_id()
    run(defs, instance, "manifest")
    # the manifest run registered the new speaker and recorded its rows' version; the unchanged
    # speakers got no event at all, and they and their shards stay in sync
    assert list(instance.get_dynamic_partitions("speakers")) == [*speakers, NEW_SPEAKER]
    assert speakers_observed_after(instance, before) == [NEW_SPEAKER]
    for speaker in speakers:
        assert stale_status(defs, instance, "speaker_manifest", speaker) == StaleStatus.FRESH, speaker
        assert stale_status(defs, instance, "vad_features", speaker) == StaleStatus.FRESH, speaker
    assert stale_status(defs, instance, "vad_features", NEW_SPEAKER) == StaleStatus.MISSING
    # ... so the next tick asks for the new speaker's shard only (no run for the speakers' rows)
    with dg.build_sensor_context(instance=instance, resources={"paths": paths}) as context:
        second = corpus_sensor(context)
    assert second.asset_events == []  # nothing left for the sensor to record
    (request,) = second.run_requests
    assert request.asset_selection == [dg.AssetKey("vad_features")]
    assert (request.tags[PARTITION_RANGE_START], request.tags[PARTITION_RANGE_END]) == (NEW_SPEAKER, NEW_SPEAKER)
    # its run is canceled: the sensor asks again under a new run key (the daemon launches a key once)
    canceled = instance.create_run_for_job(
        job_def=defs.resolve_implicit_global_asset_job_def(),
        asset_selection=frozenset({dg.AssetKey("vad_features")}),
        tags={**request.tags, "dagster/run_key": request.run_key},
    )
    instance.report_run_canceling(canceled)
    instance.report_run_canceled(canceled)
    with dg.build_sensor_context(instance=instance, resources={"paths": paths}) as context:
        (request,) = corpus_sensor(context).run_requests
    assert request.run_key == f"{canceled.tags['dagster/run_key']}:retry1"

    mark = latest_storage_id(instance)
    assert run_requested(defs, instance, request) == f"vad_features[{NEW_SPEAKER}]"
    assert shard_partitions_materialized(instance, mark) == [NEW_SPEAKER]  # no other shard re-executed
    assert stale_status(defs, instance, "cmvn_stats") == StaleStatus.STALE
    assert stale_status(defs, instance, "vad_features", NEW_SPEAKER) == StaleStatus.FRESH

    # -- downstream follows declarative automation until nothing more is requested
    cursor, executed = follow_automation(defs, instance, cursor, DOWNSTREAM)
    # one level per tick, and the database once, after the targets (not also beside CMVN)
    assert executed == ["cmvn_stats", "client_partitions", "kmeans_targets", "dataset_stats"]
    assert shard_partitions_materialized(instance, mark) == [NEW_SPEAKER]

    after_clients = {r["speaker_id"]: r["client_id"] for r in pq.read_table(paths.layout.clients_file).to_pylist()}
    assert {s: after_clients[s] for s in before_clients} == before_clients
    assert NEW_SPEAKER in after_clients
    for key in ("cmvn_stats", "client_partitions"):
        assert stale_status(defs, instance, key) == StaleStatus.FRESH
    assert stale_status(defs, instance, "kmeans_targets", after_clients[NEW_SPEAKER]) == StaleStatus.FRESH
    # the automated runs used the user's settings, not the code defaults (4 clients, K=100)
    assert set(after_clients.values()) == {"client_00", "client_01", "client_02"}
    for client in set(after_clients.values()):
        quality = json.loads((paths.targets(client).root / "quality.json").read_text())
        assert quality["k_requested"] == 20 and quality["k"] <= 20
    with dg.build_sensor_context(instance=instance, resources={"paths": paths}) as context:
        done = corpus_sensor(context)
    assert isinstance(done, dg.SkipReason) or not done.run_requests

    # -- a corrupt file arrives: a new reject, no speaker's rows change, no shard to build; the
    # database still follows the manifest, at the next tick
    (corpus / NEW_SPEAKER / "broken.flac").write_bytes(b"not audio")
    with dg.build_sensor_context(instance=instance, resources={"paths": paths}) as context:
        assert [r.asset_selection for r in corpus_sensor(context).run_requests] == [[dg.AssetKey("manifest")]]
    run(defs, instance, "manifest")
    with dg.build_sensor_context(instance=instance, resources={"paths": paths}) as context:
        quiet = corpus_sensor(context)
    assert isinstance(quiet, dg.SkipReason) or not quiet.run_requests
    cursor, executed = follow_automation(defs, instance, cursor, DOWNSTREAM)
    assert executed == ["dataset_stats"]
    con = stats_database.connect_read_only(paths.layout.stats_db, allow_external_access=True)
    try:
        assert con.execute("SELECT count(*) FROM rejects WHERE path LIKE '%broken.flac'").fetchone()[0] == 1
    finally:
        con.close()


@pytest.mark.parametrize(
    ("wanted", "ranges"),
    [
        ({"b", "c", "e"}, [("b", "c"), ("e", "e")]),
        ({"a", "b", "c", "d", "e"}, [("a", "e")]),
        (set(), []),
        ({"a", "e"}, [("a", "a"), ("e", "e")]),
    ],
)
def test_stale_speakers_are_grouped_into_contiguous_runs(wanted: set[str], ranges: list[tuple[str, str]]) -> None:
    from speech_assets.defs.automation import contiguous_ranges

    assert [(first, last) for first, last, _ in contiguous_ranges(list("abcde"), wanted)] == ranges


def test_the_sensor_records_speaker_versions_the_manifest_run_could_not(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    """A manifest published without its speaker_manifest observations (a run killed in between, a
    manifest from before observations): the sensor's next tick records them, runless, once."""
    from speech_assets.corpus.manifest import ManifestRow, corpus_fingerprint
    from speech_assets.corpus.publish import write_speakers

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "README").write_text("a corpus the manifest below describes")
    paths = StoragePaths(corpus=str(corpus), data_dir=str(tmp_path / "out"), mlflow_tracking_uri="sqlite://")
    rows = [
        ManifestRow(f"{s}-1-000{i}", s, "1", f"/c/{s}/{i}.flac", "A", 16000, 1, 16000, 1.0, f"{i:064x}")
        for s in ("s1", "s2")
        for i in range(2)
    ]
    listed = write_speakers(paths.layout.manifest.speakers, rows)
    instance.report_runless_asset_event(
        dg.AssetMaterialization("manifest", metadata={"corpus_fingerprint": corpus_fingerprint(corpus)})
    )
    instance.add_dynamic_partitions("speakers", ["s1", "s2", "s3"])  # s3: registered, its rows all gone
    instance.report_runless_asset_event(
        dg.AssetObservation(
            "speaker_manifest", partition="s1", tags={"dagster/data_version": listed["s1"].manifest_hash}
        )
    )

    with dg.build_sensor_context(instance=instance, resources={"paths": paths}) as context:
        tick = corpus_sensor(context)
    versions = {e.partition: e.tags["dagster/data_version"] for e in tick.asset_events}
    assert set(versions) == {"s2", "s3"} and versions["s2"] == listed["s2"].manifest_hash
    assert [r.asset_selection for r in tick.run_requests] == [[dg.AssetKey("vad_features")]]  # no shards yet
    for event in tick.asset_events:  # what the sensor daemon does with them
        instance.report_runless_asset_event(event)
    with dg.build_sensor_context(instance=instance, resources={"paths": paths}) as context:
        assert corpus_sensor(context).asset_events == []


def test_a_corpus_file_that_cannot_be_read_is_reported_once_per_change(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    """A manifest file without its columns: one error per version of the file, not one per tick,
    no failed tick, no manifest run (it could only fail); fixed, it is validated as usual."""
    import logging
    import os

    from speech_assets_tests.support.corpora import write_flac

    root = tmp_path / "corpus"
    write_flac(root / "a.flac")
    location = root / "corpus.csv"
    location.write_text("file,text,speaker\na.flac,HELLO,s1\n")
    paths = StoragePaths(corpus=str(location), data_dir=str(tmp_path / "out"), mlflow_tracking_uri="sqlite://")
    cursor: str | None = None
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]

    def tick() -> dg.SensorResult:
        nonlocal cursor
        with dg.build_sensor_context(instance=instance, resources={"paths": paths}, cursor=cursor) as context:
            context.log.addHandler(handler)  # beside the tick's own handlers: what the tick logs
            result = corpus_sensor(context)
        cursor = result.cursor
        return result

    def errors() -> list[str]:
        return [r.getMessage() for r in records if "corpus cannot be read" in r.getMessage()]

    first = tick()
    assert (
        not first.run_requests
        and "missing columns ['path', 'transcript', 'speaker_id']" in first.skip_reason.skip_message
    )
    assert len(errors()) == 1 and str(location) in errors()[0]
    for _ in range(3):  # the same file: nothing new to say
        later = tick()
        assert not later.run_requests and "still cannot be read" in later.skip_reason.skip_message
    assert len(errors()) == 1

    location.write_text("path,text,speaker\na.flac,HELLO,s1\n")  # changed, still without its columns
    os.utime(location, ns=(1, 1))
    assert (
        not tick().run_requests and len(errors()) == 2 and "missing columns ['transcript', 'speaker_id']" in errors()[1]
    )
    assert len(errors()) == 2 and not tick().run_requests and len(errors()) == 2

    location.write_text("path,transcript,speaker_id\na.flac,HELLO,s1\n")  # fixed
    assert [r.asset_selection for r in tick().run_requests] == [[dg.AssetKey("manifest")]]
    assert len(errors()) == 2


@pytest.mark.parametrize(
    "bad",
    ["a.flac," + "A" * 200_000 + ",s1\n", "a\x00.flac,HELLO,s1\n", "a.flac,HEL\udcffLO,s1\n"],
    ids=["over-long-field", "nul-in-path", "latin1"],
)
def test_a_bad_line_in_the_corpus_file_never_fails_a_sensor_tick(
    tmp_path: Path, instance: dg.DagsterInstance, bad: str
) -> None:
    from speech_assets_tests.support.corpora import write_flac

    root = tmp_path / "corpus"
    write_flac(root / "a.flac")
    location = root / "corpus.csv"
    location.write_bytes(
        ("path,transcript,speaker_id\n" + bad + "a.flac,HELLO,s1\n").encode("utf-8", "surrogateescape")
    )
    paths = StoragePaths(corpus=str(location), data_dir=str(tmp_path / "out"), mlflow_tracking_uri="sqlite://")
    with dg.build_sensor_context(instance=instance, resources={"paths": paths}) as context:
        assert [r.asset_selection for r in corpus_sensor(context).run_requests] == [[dg.AssetKey("manifest")]]
