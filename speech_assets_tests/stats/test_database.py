"""The stats database shows the split client_partitions recorded, and holds the probe results."""

import json
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speech_assets.stats.database import StatsInputs, build_database


def test_probe_results_and_hours_per_split(tmp_path: Path) -> None:
    import numpy as np

    from speech_assets.features.shards import write_shard
    from speech_assets_tests.support.training_data import _record

    speakers = {"1001": "client_00", "1002": "client_00", "1003": "client_01", "1004": "client_01"}
    shards = []
    for speaker in speakers:
        records = [_record(f"{speaker}-1-{u:04d}", speaker, np.zeros((100 + u, 80), np.float32)) for u in range(3)]
        shards.append(write_shard(tmp_path / "shards" / f"{speaker}.parquet", records))
    extra = write_shard(
        tmp_path / "shards" / "1005.parquet", [_record("1005-1-0000", "1005", np.zeros((50, 80), np.float32))]
    )
    pq.write_table(
        pa.table(
            {
                "speaker_id": list(speakers),
                "client_id": list(speakers.values()),
                "hours": [0.1] * 4,
                "utterances": [3] * 4,
                "heldout": [False, True, False, False],
            }
        ),
        tmp_path / "clients.parquet",
    )
    pq.write_table(
        pa.table({"utt_id": ["1001-1-0000"], "path": ["x"], "transcript": ["A"], "duration_s": [1.0]}),
        tmp_path / "manifest.parquet",
    )
    pq.write_table(
        pa.table({n: pa.array([], pa.string()) for n in ("utt_id", "path", "stage", "reason", "detail")}),
        tmp_path / "rejects.parquet",
    )
    results = pa.table(
        {
            "model": ["fbank", "pretrained"],
            "checkpoint_sha256": [None, "ab" * 32],
            "probe": ["linear", "linear"],
            "layer_weights": pa.array([[1.0], [0.2, 0.3, 0.5]], pa.list_(pa.float64())),
            "split": ["heldout", "heldout"],
            "cer": [0.9, 0.7],
            "wer": [1.0, 0.95],
            "utterances": pa.array([3, 3], pa.int64()),
            "steps": pa.array([100, 100], pa.int64()),
        }
    )
    pq.write_table(results, tmp_path / "results.parquet")
    db = tmp_path / "stats.duckdb"
    inputs = StatsInputs(
        manifest=tmp_path / "manifest.parquet",
        manifest_rejects=tmp_path / "rejects.parquet",
        shards=[*shards, extra],
        shard_rejects=[],
        clients=tmp_path / "clients.parquet",
        kmeans_quality=[],
        probe_results=tmp_path / "results.parquet",
    )
    counts = build_database(db, inputs)
    assert counts["probe_results"] == 2
    con = duckdb.connect(str(db), read_only=True)
    row = con.execute("SELECT model, layer_weights, cer FROM probe_results WHERE model = 'pretrained'").fetchone()
    assert row == ("pretrained", [0.2, 0.3, 0.5], 0.7)
    split = dict(con.execute("SELECT split, speakers FROM hours_per_split").fetchall())
    assert split == {"heldout": 1, "train": 3, "unassigned": 1}
    con.close()

    # today's results file (every column, the probe's chosen lr included) loads whole
    from speech_assets.evaluation.compare import ProbeResult, results_table

    current = [
        ProbeResult("pretrained", "ab" * 32, "linear", [0.5, 0.5], "heldout", 0.6, 0.9, 3, 400, 0, "utterance", 1, 0.01)
    ]
    pq.write_table(results_table(current), tmp_path / "results.parquet")
    assert build_database(db, inputs)["probe_results"] == 1
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT model, seed, lr FROM probe_results").fetchall() == [("pretrained", 0, 0.01)]
    con.close()
    # no probe yet: the table exists with its columns, empty
    inputs.probe_results = tmp_path / "missing.parquet"
    assert build_database(db, inputs)["probe_results"] == 0

    # fine-tuning's results.parquet, as finetuned_asr writes it; none yet: an empty table
    from speech_assets.evaluation.finetune_results import results_table as finetune_table

    rows = [
        {
            "model": m,
            "labelled_minutes": 1.0,
            "seed": 0,
            "decoder": "greedy",
            "split": "heldout",
            "cer": c,
            "wer": 1.0,
            "utterances": 8,
            "steps": 300,
            "labelled_seconds": 61.0,
            "checkpoint_sha256": "cd" * 32,
        }
        for m, c in (("pretrained", 0.7), ("scratch", 0.9))
    ]
    pq.write_table(finetune_table(rows), tmp_path / "finetune.parquet")
    assert build_database(db, inputs)["finetune_results"] == 0
    inputs.finetune_results = tmp_path / "finetune.parquet"
    assert build_database(db, inputs)["finetune_results"] == 2
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT model, cer FROM finetune_results ORDER BY cer").fetchall() == [
            ("pretrained", 0.7),
            ("scratch", 0.9),
        ]
    # a fine-tuning run whose result.json predates labelled_minutes: its budget from results.parquet
    (tmp_path / "ft-run").mkdir()
    (tmp_path / "ft-run" / "result.json").write_text(json.dumps({"checkpoint_sha256": "cd" * 32, "step": 300}))
    inputs.model_results = {"finetuned": [tmp_path / "ft-run" / "result.json"]}
    build_database(db, inputs)
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT labelled_minutes FROM training_runs WHERE kind = 'finetuned'").fetchall() == [(1.0,)]


def test_sql_cli_has_no_external_access_unless_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from speech_assets.cli import main

    data = tmp_path / "out"
    data.mkdir()
    pq.write_table(
        pa.table({"utt_id": ["u1"], "path": ["x"], "transcript": ["A"], "duration_s": [1.0]}), data / "manifest.parquet"
    )
    pq.write_table(
        pa.table({n: pa.array([], pa.string()) for n in ("utt_id", "path", "stage", "reason", "detail")}),
        data / "rejects.parquet",
    )
    inputs = StatsInputs(
        manifest=data / "manifest.parquet",
        manifest_rejects=data / "rejects.parquet",
        shards=[],
        shard_rejects=[],
        clients=data / "clients.parquet",
        kmeans_quality=[],
    )
    build_database(data / "stats.duckdb", inputs)
    outside = tmp_path / "secret.txt"
    outside.write_text("not for queries\n")
    db = ["--db", str(data / "stats.duckdb")]

    for path in ("/etc/passwd", str(outside), str(data / ".." / "secret.txt")):
        assert main(["sql", f"SELECT * FROM read_text('{path}')", *db]) == 1
        assert "Permission Error" in capsys.readouterr().err
    for escape in ("SET enable_external_access = true", "SET allowed_directories = ['/']", "INSTALL httpfs"):
        assert main(["sql", escape, *db]) == 1
        capsys.readouterr()
    # the views over the data dir's parquet files still answer
    assert main(["sql", "SELECT count(*) AS n FROM manifest", *db]) == 0
    assert "n" in capsys.readouterr().out
    assert main(["sql", f"SELECT content FROM read_text('{outside}')", "--allow-external-access", *db]) == 0
    assert "not for queries" in capsys.readouterr().out
