"""vad_features under faults and concurrency, on a real instance and the committed sample corpus.

- a shard that fails keeps every other shard of its run published; the re-run rebuilds only it;
- two overlapping runs (real `dagster asset materialize` processes) never delete or corrupt each
  other's files: every shard matches its meta afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from speech_assets.definitions import build_definitions
from speech_assets.defs.resources import StoragePaths
from speech_assets.features.cmvn import ShardStats
from speech_assets.utils import sha256_file
from speech_assets_tests.conftest import REPO, SAMPLE_CORPUS
from speech_assets_tests.support.local_runs import materialize_in_process

BIN = Path(sys.executable).parent


@pytest.fixture
def world(tmp_path: Path, instance: dg.DagsterInstance):
    paths = StoragePaths(
        corpus=str(SAMPLE_CORPUS), data_dir=str(tmp_path / "out"), mlflow_tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"
    )
    defs = build_definitions(paths)
    materialize_in_process(defs, instance, "manifest")
    yield defs, instance, paths, list(instance.get_dynamic_partitions("speakers"))
    instance.dispose()


def latest_shard_metadata(instance: dg.DagsterInstance) -> dict[str, dict]:
    records = instance.fetch_materializations(dg.AssetKey("vad_features"), limit=1000).records
    latest: dict[str, dict] = {}
    for record in sorted(records, key=lambda r: r.storage_id):
        event = record.asset_materialization
        latest[event.partition] = {k: v.value for k, v in event.metadata.items()}
    return latest


def assert_every_shard_matches_its_meta(paths: StoragePaths, speakers: list[str]) -> None:
    for speaker in speakers:
        files = paths.shard_files(speaker)
        meta = files.read_meta()
        assert meta is not None, f"{speaker}: no valid meta"
        assert sha256_file(files.shard) == meta["shard_sha256"]
        assert sha256_file(files.stats) == meta["stats_sha256"]
        assert pq.read_table(files.shard).num_rows == meta["utterances"]
        assert pq.read_table(files.rejects).num_rows == meta["rejects"]
        assert speaker in ShardStats.load(files.stats).speakers
    assert not list(paths.layout.shards_dir.glob(".*.tmp")), "temp files left behind"


def test_a_failing_shard_keeps_the_others_and_the_rerun_rebuilds_only_it(world) -> None:
    defs, instance, paths, speakers = world
    broken = speakers[2]
    # A real fault, no test hook: a directory where the shard must be renamed into place.
    paths.shard_file(broken).mkdir(parents=True)
    with pytest.raises(Exception, match=rf"1 of {len(speakers)} shard\(s\) failed \({broken}\)"):
        materialize_in_process(defs, instance, "vad_features", speakers)
    assert paths.shard_files(broken).read_meta() is None
    survivors = [s for s in speakers if s != broken]
    published = {s: paths.shard_files(s).read_meta() for s in survivors}
    assert all(published.values()), "finished shards were lost with the failed one"

    paths.shard_file(broken).rmdir()
    materialize_in_process(defs, instance, "vad_features", speakers)
    rebuilt = {s: m["rebuilt"] for s, m in latest_shard_metadata(instance).items()}
    assert rebuilt == {s: s == broken for s in speakers}
    assert {s: paths.shard_files(s).read_meta() for s in survivors} == published  # untouched
    assert_every_shard_matches_its_meta(paths, speakers)


def test_overlapping_runs_never_corrupt_each_others_shards(world) -> None:
    _defs, _instance, paths, speakers = world
    assert len(speakers) >= 6
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "SPEECH_ASSETS_DATA_DIR": paths.data_dir,
        "SPEECH_ASSETS_CORPUS": paths.corpus,
        "MLFLOW_TRACKING_URI": paths.mlflow_tracking_uri,
    }
    force = json.dumps({"ops": {"vad_features": {"config": {"force": True, "workers": 1}}}})
    ranges = [f"{speakers[0]}...{speakers[-3]}", f"{speakers[2]}...{speakers[-1]}"]  # overlap in the middle
    runs = [
        subprocess.Popen(
            [
                str(BIN / "dagster"),
                "asset",
                "materialize",
                "-m",
                "speech_assets.definitions",
                "--select",
                "vad_features",
                "--partition-range",
                partition_range,
                "--config-json",
                force,
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for partition_range in ranges
    ]
    try:
        outputs = [run.communicate(timeout=600)[0] for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
    for run, output in zip(runs, outputs, strict=True):
        assert run.returncode == 0, output[-4000:]
    assert_every_shard_matches_its_meta(paths, speakers)


@pytest.mark.parametrize(
    ("hours", "cores", "workers"),
    [(0.0, 2, 1), (1.3, 2, 1), (3.9, 2, 1), (4.0, 2, 2), (25.0, 2, 2), (25.0, 16, 7), (100.0, 16, 16), (100.0, 1, 1)],
)
def test_small_jobs_run_in_the_step_process_and_large_ones_use_every_core(
    hours: float, cores: int, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fresh data (a few speakers: a 5 % update of a 25 h corpus is 1.3 h) pays no worker start-up."""
    from speech_assets.features.build import worker_count

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert worker_count(hours * 3600) == workers
