"""`speech-assets sql` only reads: whatever it is given, nothing under the data dir changes and no
file but those the views read can be opened (a client's secure-aggregation key least of all)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speech_assets.cli import main
from speech_assets.features.shards import FRAME_RATE_HZ, MFCC_DIM, N_MELS, FeatureRecord, ShardFiles, write_shard
from speech_assets.stats.database import StatsInputs, build_database

REJECT_COLUMNS = ("utt_id", "path", "stage", "reason", "detail")


def _utterance(utt_id: str, frames: int = 100) -> FeatureRecord:
    """A silent utterance of speaker 1001: log-mel ``(frames, 80)``, MFCC ``(frames, 39)``."""
    seconds = frames / FRAME_RATE_HZ
    return FeatureRecord(
        utt_id,
        "1001",
        "1",
        frames,
        seconds,
        0.0,
        seconds,
        seconds,
        1.0,
        np.zeros((frames, N_MELS), np.float32),
        np.zeros((frames, MFCC_DIM), np.float32),
    )


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small data dir laid out as the pipeline lays it out, with its stats.duckdb and the state
    root of a local SuperNode holding a round's secure-aggregation secrets, made by the federated
    code itself (the client's answer to an advertise query)."""
    from flwr.app import ConfigRecord, RecordDict

    from speech_assets.federated.auth import make_node_key
    from speech_assets.federated.config import NodeConfig
    from speech_assets.federated.secure_rounds import ADVERTISE, KIND, SECAGG_NONCE, answer_secure_query, state_path

    data = tmp_path_factory.mktemp("data")
    (data / "manifest").mkdir()
    (data / "clients").mkdir()
    manifest = data / "manifest" / "manifest.parquet"
    pq.write_table(
        pa.table(
            {
                "utt_id": ["1001-1-0000", "1001-1-0001"],
                "path": ["a.flac", "b.flac"],
                "transcript": ["A", "B"],
                "duration_s": [1.25, 2.5],
            }
        ),
        manifest,
    )
    pq.write_table(
        pa.table({n: pa.array([], pa.string()) for n in REJECT_COLUMNS}), data / "manifest" / "rejects.parquet"
    )
    pq.write_table(
        pa.table(
            {
                "speaker_id": ["1001"],
                "client_id": ["client_00"],
                "hours": [0.001],
                "utterances": [2],
                "heldout": [False],
            }
        ),
        data / "clients" / "clients.parquet",
    )
    files = ShardFiles.of(data / "features" / "shards", "1001")
    write_shard(files.shard, [_utterance(f"1001-1-000{u}") for u in range(2)])
    pq.write_table(pa.table({n: pa.array([], pa.string()) for n in REJECT_COLUMNS}), files.rejects)
    build_database(
        data / "stats.duckdb",
        StatsInputs(
            manifest=manifest,
            manifest_rejects=data / "manifest" / "rejects.parquet",
            shards=[files.shard],
            shard_rejects=[files.rejects],
            clients=data / "clients" / "clients.parquet",
            kmeans_quality=[],
        ),
    )
    keys = tmp_path_factory.mktemp("node-keys")  # outside the data dir: the node signs its advertisement
    make_node_key(keys, "client_00")
    node = NodeConfig(client_id="client_00", data_dir=str(data), node_keys=str(keys))
    query = ConfigRecord({KIND: ADVERTISE, "run-name": "run-1", "server-round": 1, SECAGG_NONCE: bytes(16)})
    answer_secure_query(query, node, RecordDict())
    assert "self_seed" in state_path(node, "run-1", 1).read_text()
    return data


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (new ones, lock files and WALs included) and its sha256."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _key(data: Path) -> Path:
    return next(data.rglob("round-1.json"))


WRITES = {
    "copy_to_manifest": "COPY (SELECT 'poisoned' AS utt_id) TO '{manifest}'",
    "copy_without_tmp_file": "COPY (SELECT 'poisoned' AS utt_id) TO '{manifest}' (USE_TMP_FILE false)",
    "copy_in_with_clause": (
        "WITH w AS (COPY (SELECT 'poisoned' AS utt_id) TO '{manifest}' (USE_TMP_FILE false)) SELECT 1"
    ),
    "two_statements": "SELECT 1; COPY (SELECT 'poisoned' AS utt_id) TO '{manifest}'",
    "two_selects": "SELECT 1; SELECT 2",
    "pragma": "PRAGMA enable_profiling",
    "set": "SET threads = 1",
    "reset": "RESET threads",
    "install": "INSTALL httpfs",
    "load": "LOAD parquet",
    "attach": "ATTACH '{data}/attached.duckdb' AS other",
    "create_table": "CREATE TABLE poisoned AS SELECT 1 AS x",
    "create_temp_table": "CREATE TEMP TABLE poisoned AS SELECT 1 AS x",
    "explain_analyze_copy": "EXPLAIN ANALYZE COPY (SELECT 'poisoned' AS utt_id) TO '{manifest}' (USE_TMP_FILE false)",
    "explain_options_analyze_copy": (
        "EXPLAIN (ANALYZE) COPY (SELECT 'poisoned' AS utt_id) TO '{manifest}' (USE_TMP_FILE false)"
    ),
    "explain_commented_analyze_copy": (
        "EXPLAIN /* a */ ANALYZE -- b\n COPY (SELECT 1 AS x) TO '{manifest}' (USE_TMP_FILE false)"
    ),
    "explain_analyze_with_copy": (
        "EXPLAIN ANALYZE WITH w AS (COPY (SELECT 1 AS x) TO '{manifest}' (USE_TMP_FILE false)) SELECT 1"
    ),
    "export_database": "EXPORT DATABASE '{data}/export'",
    "checkpoint": "CHECKPOINT",
    "query_function": "SELECT * FROM query('SELECT 1')",
    "serialized_copy": "SELECT * FROM json_execute_serialized_sql(json_serialize_sql("
    "'WITH w AS (COPY (SELECT 1 AS x) TO ''{manifest}'' (USE_TMP_FILE false)) SELECT 1'))",
    "update_extensions": "UPDATE EXTENSIONS",
}


@pytest.mark.parametrize("attack", sorted(WRITES))
def test_sql_refuses_what_is_not_one_read_only_statement(
    attack: str, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(data_dir)
    query = WRITES[attack].format(manifest=data_dir / "manifest" / "manifest.parquet", data=data_dir)
    assert main(["sql", query, "--db", str(data_dir / "stats.duckdb")]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: refused: "), err
    assert _snapshot(data_dir) == before


@pytest.mark.parametrize("external", [False, True], ids=["default", "allow_external_access"])
def test_sql_writes_nothing_even_with_external_access(
    external: bool, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(data_dir)
    manifest = data_dir / "manifest" / "manifest.parquet"
    flags = ["--allow-external-access"] if external else []
    for query in (
        f"COPY (SELECT 'poisoned' AS utt_id) TO '{manifest}'",
        f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{manifest}'",
    ):
        assert main(["sql", query, "--db", str(data_dir / "stats.duckdb"), *flags]) == 1
        assert capsys.readouterr().err.startswith("error: refused: ")
    assert _snapshot(data_dir) == before


@pytest.mark.parametrize(
    "reader",
    ["read_blob", "read_text", "glob"],
)
def test_sql_cannot_read_a_client_key_under_the_data_dir(
    reader: str, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = _key(data_dir)
    before = _snapshot(data_dir)
    target = key if reader != "glob" else key.parent / "*"
    assert main(["sql", f"SELECT * FROM {reader}('{target}')", "--db", str(data_dir / "stats.duckdb")]) == 1
    out, err = capsys.readouterr()
    assert key.read_bytes().hex() not in out and "secagg" not in out
    assert len(err.strip().splitlines()) == 1 and "Permission Error" in err, err
    assert _snapshot(data_dir) == before


@pytest.mark.parametrize(
    "query",
    [
        "SELECT count(*) AS n FROM manifest",
        "WITH m AS (SELECT * FROM manifest) SELECT utt_id FROM m ORDER BY 1",
        "FROM utterances SELECT speaker_id, num_frames",
        "SELECT * FROM rejects",
        "SELECT client_id, hours FROM clients",
        "DESCRIBE manifest",
        "SHOW TABLES",
        "SUMMARIZE manifest",
        "EXPLAIN SELECT * FROM manifest",
        "EXPLAIN ANALYZE SELECT count(*) FROM manifest",
        "SELECT checkpoint, preset FROM training_runs",  # column names that are also keywords
        "SELECT 1 AS x; ",
    ],
)
def test_sql_still_answers_read_only_queries(query: str, data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _snapshot(data_dir)
    assert main(["sql", query, "--db", str(data_dir / "stats.duckdb")]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out
    assert _snapshot(data_dir) == before


@pytest.mark.parametrize("reader", ["read_text", "read_parquet"])
def test_sql_db_from_elsewhere_reads_nothing_outside_its_own_folder(
    reader: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Kills: allowing every path that a database's views name as a string literal, so that
    ``sql --db other.duckdb`` (a database made elsewhere) reads whatever file its views name."""
    import duckdb

    secret = tmp_path / "private" / "secret.parquet"
    secret.parent.mkdir()
    pq.write_table(pa.table({"word": ["SECRETWORD"]}), secret)
    other = tmp_path / "other"
    other.mkdir()
    inside = other / "fine.parquet"
    pq.write_table(pa.table({"word": ["FINE"]}), inside)
    with duckdb.connect(str(other / "stats.duckdb")) as con:
        con.execute(f"CREATE VIEW leak AS SELECT * FROM {reader}('{secret}')")
        con.execute(f"CREATE VIEW fine AS SELECT * FROM read_parquet('{inside}')")
    db = ["--db", str(other / "stats.duckdb")]
    assert main(["sql", "SELECT * FROM leak", *db]) == 1
    out, err = capsys.readouterr()
    assert "SECRETWORD" not in out and "Permission Error" in err, err
    assert main(["sql", "SELECT * FROM fine", *db]) == 0, capsys.readouterr().err
    assert "FINE" in capsys.readouterr().out
