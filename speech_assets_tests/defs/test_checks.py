"""Every stage's asset checks pass on a sound build and fail on the fault each one is there to catch.

One real build of the sample corpus (manifest -> ... -> dataset_stats); each test works on a copy
of its outputs, breaks one thing the way a bug or a bad disk would, and runs the check.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speech_assets.definitions import build_definitions
from speech_assets.defs import clients, features, stats, targets
from speech_assets.defs.resources import KMeansSettings, PipelineSettings, StoragePaths
from speech_assets.features.cmvn import Cmvn
from speech_assets.features.shards import feature_dtype
from speech_assets_tests.conftest import SAMPLE_CORPUS, fresh_instance
from speech_assets_tests.support.local_runs import materialize_in_process


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("checks")
    paths = StoragePaths(
        corpus=str(SAMPLE_CORPUS), data_dir=str(root / "out"), mlflow_tracking_uri=f"sqlite:///{root}/m.db"
    )
    with fresh_instance(root) as instance:
        defs = build_definitions(paths, PipelineSettings(kmeans=KMeansSettings(k=16)))
        materialize_in_process(defs, instance, "manifest")
        materialize_in_process(defs, instance, "vad_features", list(instance.get_dynamic_partitions("speakers")))
        materialize_in_process(defs, instance, "cmvn_stats")
        materialize_in_process(defs, instance, "client_partitions")
        materialize_in_process(defs, instance, "kmeans_targets", list(instance.get_dynamic_partitions("clients")))
        materialize_in_process(defs, instance, "dataset_stats")
    return root / "out"


@pytest.fixture
def paths(build: Path, tmp_path: Path) -> StoragePaths:
    shutil.copytree(build, tmp_path / "out", copy_function=shutil.copy2)  # copy2 keeps the mtimes metas vouch for
    return StoragePaths(corpus=str(SAMPLE_CORPUS), data_dir=str(tmp_path / "out"), mlflow_tracking_uri="sqlite://")


def first_speaker(paths: StoragePaths) -> str:
    return pq.read_table(paths.layout.manifest.speakers).column("speaker_id")[0].as_py()


def rewrite_shard(paths: StoragePaths, change) -> None:
    """Rewrite a shard (and re-vouch for it, as a buggy writer would) with ``change`` applied."""
    files = paths.shard_files(first_speaker(paths))
    meta = files.read_meta()
    table = change(pq.read_table(files.shard))
    pq.write_table(table, files.shard)
    files.write_meta({k: v for k, v in meta.items() if not k.endswith(("_size", "_mtime_ns", "_sha256"))})


def off_by_one_frame(table: pa.Table) -> pa.Table:
    frames = table.column("num_frames").to_pylist()
    frames[0] += 1
    return table.set_column(table.column_names.index("num_frames"), "num_frames", pa.array(frames, pa.int32()))


def nan_in_features(table: pa.Table) -> pa.Table:
    blobs = table.column("logmel").to_pylist()
    values = np.frombuffer(blobs[0], feature_dtype(table.schema)).copy()
    values[7] = np.nan
    blobs[0] = values.tobytes()
    return table.set_column(table.column_names.index("logmel"), "logmel", pa.array(blobs, pa.binary()))


def constant_dimension(paths: StoragePaths) -> None:
    stats_ = Cmvn.load(paths.layout.cmvn.root / "cmvn.npz")
    std = dict(stats_.std)
    std["mfcc"] = std["mfcc"].copy()
    std["mfcc"][5] = 1e-4
    Cmvn(stats_.mean, std, stats_.frames).save(paths.layout.cmvn.root / "cmvn.npz")


def drop_a_speaker(paths: StoragePaths) -> None:
    table = pq.read_table(paths.layout.clients_file)
    pq.write_table(table.slice(1), paths.layout.clients_file)


def truncate_labels(paths: StoragePaths) -> None:
    file = paths.targets("client_00").root / "labels.parquet"
    table = pq.read_table(file)
    blobs = table.column("labels").to_pylist()
    blobs[0] = blobs[0][:-4]
    pq.write_table(table.set_column(table.column_names.index("labels"), "labels", pa.array(blobs, pa.binary())), file)


def add_a_reject_behind_the_database(paths: StoragePaths) -> None:
    file = paths.shard_files(first_speaker(paths)).rejects
    table = pq.read_table(file)
    extra = pa.table({name: ["x"] for name in table.column_names}, schema=table.schema)
    pq.write_table(pa.concat_tables([table, extra]), file)


def vad_rejects_most_utterances(paths: StoragePaths) -> None:
    """As a VAD threshold set far too high would: more rejected as no_speech than kept."""
    speakers = pq.read_table(paths.layout.manifest.speakers, columns=["speaker_id"]).column(0).to_pylist()
    kept = sum(meta["utterances"] for s in speakers if (meta := paths.shard_files(s).read_meta()) is not None)
    files = paths.shard_files(first_speaker(paths))
    meta = files.read_meta()
    table = pq.read_table(files.rejects)
    extra = pa.table({name: [f"x{i}" for i in range(kept)] for name in table.column_names}, schema=table.schema)
    pq.write_table(pa.concat_tables([table, extra]), files.rejects)
    meta["rejects"] = table.num_rows + kept  # the writer vouches for what it rejected
    files.write_meta({k: v for k, v in meta.items() if not k.endswith(("_size", "_mtime_ns", "_sha256"))})


def collapse_a_codebook(paths: StoragePaths) -> None:
    """Every frame of a client labelled with one cluster (its quality.json still says otherwise)."""
    file = paths.targets("client_00").root / "labels.parquet"
    table = pq.read_table(file)
    blobs = [np.zeros(len(b) // 2, "<i2").tobytes() for b in table.column("labels").to_pylist()]
    pq.write_table(table.set_column(table.column_names.index("labels"), "labels", pa.array(blobs, pa.binary())), file)


CASES = [
    ("shards_are_consistent", lambda p: rewrite_shard(p, off_by_one_frame)),
    ("shards_are_consistent", lambda p: rewrite_shard(p, nan_in_features)),
    ("no_speech_share", vad_rejects_most_utterances),
    ("cmvn_is_not_degenerate", constant_dimension),
    ("every_speaker_in_one_client", drop_a_speaker),
    ("labels_match_shards", truncate_labels),
    ("clusters_are_used", collapse_a_codebook),
    ("row_counts_match_sources", add_a_reject_behind_the_database),
]
CHECKS = {
    "shards_are_consistent": features.shards_are_consistent,
    "no_speech_share": features.no_speech_share,
    "cmvn_is_not_degenerate": features.cmvn_is_not_degenerate,
    "every_speaker_in_one_client": clients.every_speaker_in_one_client,
    "labels_match_shards": targets.labels_match_shards,
    "clusters_are_used": targets.clusters_are_used,
    "row_counts_match_sources": stats.row_counts_match_sources,
}


def run_check(name: str, paths: StoragePaths) -> dg.AssetCheckResult:
    check = CHECKS[name]
    if name == "every_speaker_in_one_client":
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("clients", ["client_00", "client_01", "client_02", "client_03"])
            context = dg.build_asset_check_context(instance=instance)
            return check(context, paths=paths)
    return check(paths=paths)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_every_check_passes_on_a_sound_build(paths: StoragePaths, name: str) -> None:
    result = run_check(name, paths)
    assert result.passed, result.metadata


@pytest.mark.parametrize(("name", "fault"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_each_check_catches_its_fault(paths: StoragePaths, name: str, fault) -> None:
    fault(paths)
    assert not run_check(name, paths).passed
