"""The stats database reads the shards of the manifest's speakers, vouched for by their metas,
never whatever `*.parquet` happens to lie in the shards folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from speech_assets.defs.resources import StoragePaths
from speech_assets.defs.stats import _inputs
from speech_assets.utils import save_npz


def _publish_shard(paths: StoragePaths, speaker: str) -> None:
    files = paths.shard_files(speaker)
    files.shard.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"utt_id": [f"{speaker}-1-0"], "speaker_id": [speaker]}), files.shard)
    pq.write_table(pa.table({"utt_id": pa.array([], pa.string())}), files.rejects)
    save_npz(files.stats, {"count": np.zeros(1)})
    files.write_meta({"speaker_id": speaker})


def test_shards_are_listed_from_the_manifests_speakers(tmp_path: Path) -> None:
    paths = StoragePaths(corpus=str(tmp_path), data_dir=str(tmp_path / "out"), mlflow_tracking_uri="sqlite://")
    paths.layout.manifest.root.mkdir(parents=True)
    pq.write_table(pa.table({"speaker_id": ["a", "b_2", "c-3"]}), paths.layout.manifest.speakers)
    for speaker in ("a", "b_2", "gone"):  # "gone" left the corpus; "c-3" is listed but not built yet
        _publish_shard(paths, speaker)
    (paths.layout.shards_dir / "stray.parquet").write_bytes(b"not a shard")

    inputs = _inputs(paths)
    assert [p.name for p in inputs.shards] == ["a.parquet", "b_2.parquet"]
    assert [p.name for p in inputs.shard_rejects] == ["a.rejects.parquet", "b_2.rejects.parquet"]

    paths.shard_files("b_2").shard.write_bytes(b"rewritten after its meta")  # no longer vouched for
    assert [p.name for p in _inputs(paths).shards] == ["a.parquet"]


def test_every_kind_of_model_reaches_checkpoints_training_runs_and_the_cli(tmp_path: Path, capsys) -> None:
    """Run folders laid out as each model asset leaves them (speech_assets_tests/stats/test_report.py's
    model_runs; the real runs are in defs/test_model_runs.py and federated/test_federation.py)."""
    from speech_assets import cli
    from speech_assets.stats.database import build_database
    from speech_assets_tests.stats.test_report import model_runs

    paths = StoragePaths(corpus=str(tmp_path), data_dir=str(tmp_path / "out"), mlflow_tracking_uri="sqlite://")
    paths.layout.manifest.root.mkdir(parents=True)
    pq.write_table(
        pa.table({"utt_id": ["a-1-0"], "speaker_id": ["a"], "duration_s": [1.0]}), paths.layout.manifest.manifest
    )
    pq.write_table(
        pa.table({n: pa.array([], pa.string()) for n in ("utt_id", "path", "stage", "reason", "detail")}),
        paths.layout.manifest.rejects,
    )
    model_runs(paths.root)
    (paths.root / "federated" / "failed-run").mkdir()  # a run that never finished: no result.json, not a checkpoint
    build_database(paths.layout.stats_db, _inputs(paths))
    import duckdb

    with duckdb.connect(str(paths.layout.stats_db), read_only=True) as con:
        rows = con.execute(
            "SELECT kind, step, step_unit, sha256, mlflow_run_id, manifest_hash, git_commit FROM checkpoints "
            "ORDER BY kind"
        ).fetchall()
        runs = con.execute("SELECT kind, steps FROM training_runs ORDER BY kind").fetchall()
        assert con.execute("SELECT max_abs_diff FROM exports").fetchall() == [(3.2e-6,)]
        assert con.execute("SELECT speedup FROM distillation").fetchall() == [(3.456,)]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("centralised", 300, "step"),
        ("distilled", 40, "step"),
        ("federated", 3, "round"),
        ("iteration2", 20, "step"),
    ]
    assert all(len(r[3]) == 64 and len(r[4]) == 32 and r[5] == "9" * 64 for r in rows)
    assert (
        rows[2][4] == "f" * 32 and rows[2][6] == "a" * 40
    )  # the federated run's MLflow run and commit, from its provenance
    assert runs == [("centralised", 300), ("distilled", 40), ("federated", 3), ("iteration2", 20)]

    assert cli.main(["stats", "--db", str(paths.layout.stats_db)]) == 0
    out = capsys.readouterr().out
    for line in (
        "centralised model: 300 steps",
        "federated model: 3 rounds",
        "distilled model: 40 steps",
        "iteration2 model: 20 steps",
    ):
        assert line in out
    assert "3.46x the teacher" in out and "ONNX max |diff| 3.2e-06" in out and "0.03368966634272757" not in out
