"""The server's side without processes: round records and what a resumed run reads back, the
round tables and report, the privacy check every reply passes, the stats database table."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, Metadata, MetricRecord, RecordDict

from speech_assets.federated import history, rounds
from speech_assets.federated.config import FederatedConfig
from speech_assets.federated.messages import EVAL_METRICS, TRAIN_METRICS
from speech_assets.federated.server_app import Server
from speech_assets.layout import FederatedPaths
from speech_assets.stats import database as stats_db
from speech_assets.stats.plots import round_curve

CLIENTS = ["client_00", "client_01"]


def _config(run_dir: Path, **overrides: object) -> FederatedConfig:
    return FederatedConfig(run_dir=str(run_dir), run_name=run_dir.name, clients=CLIENTS, **overrides)  # type: ignore[arg-type]


def _encoder(seed: int) -> dict[str, np.ndarray]:
    """A stand-in encoder: ``frontend.w (4, 3)`` and ``frontend.b (4,)`` float32."""
    rng = np.random.default_rng(seed)
    return {
        "frontend.w": rng.standard_normal((4, 3)).astype(np.float32),
        "frontend.b": rng.standard_normal(4).astype(np.float32),
    }


def _record(round_number: int, missing: list[str] | None = None) -> dict:
    rows = [
        {
            "round": round_number,
            "client_id": c,
            "num_examples": 10 + i,
            "train_loss": 4.0 - 0.1 * round_number + i,
            "masked_accuracy": 0.1 * round_number,
            "bytes_up": 1000,
            "bytes_down": 1000,
            "seconds": 2.5,
        }
        for i, c in enumerate(CLIENTS)
        if c not in (missing or [])
    ]
    # leak-free frames: 30, then none (accuracies None, as the server records them)
    free = [(30, 0.3, 0.1), (0, None, None)]
    evaluation = [
        {
            "round": round_number,
            "client_id": c,
            "utterances": 2,
            "masked_frames": 50,
            "heldout_loss": 4.0,
            "heldout_masked_accuracy": 0.2,
            "majority_accuracy": 0.05,
            "leak_free_frames": free[i][0],
            "heldout_leak_free_masked_accuracy": free[i][1],
            "leak_free_majority_accuracy": free[i][2],
        }
        for i, c in enumerate(CLIENTS)
    ]
    return {"rows": rows, "evaluation": evaluation, "missing": missing or [], "failures": [], "round_seconds": 30.0}


def _moments(seed: int) -> dict[str, dict[str, np.ndarray]]:
    encoder = _encoder(seed)
    return {
        "m_t": {k: v.astype(np.float64) * 0.1 for k, v in encoder.items()},
        "v_t": {k: (v.astype(np.float64) ** 2) for k, v in encoder.items()},
    }


def test_a_resumed_run_reads_back_exactly_the_last_complete_round(tmp_path: Path) -> None:
    config = _config(tmp_path / "run", keep_rounds=2)
    paths = FederatedPaths(config.run_dir)
    for r in (1, 2, 3):
        rounds.save_round(
            paths, config, r, _encoder(r), _moments(r), _record(r, missing=["client_01"] if r == 2 else None)
        )
    # a kill between the checkpoint and the record of round 4: round 4 is not complete
    rounds.save_checkpoint(paths.round_checkpoint(4), {"encoder": rounds.to_tensors(_encoder(4))})
    assert history.complete_rounds(paths) == [2, 3]  # keep_rounds=2 checkpoints; every record kept
    assert history.record_rounds(paths) == [1, 2, 3]

    state = rounds.load_latest(paths, config)
    assert state is not None and state.round == 3
    assert not paths.round_checkpoint(4).exists()  # the incomplete round's leftovers are gone
    for name, value in _encoder(3).items():
        assert state.encoder[name].dtype == np.float32 and np.array_equal(state.encoder[name], value)
    for kind, moments in _moments(3).items():
        for name, value in moments.items():
            assert state.strategy[kind][name].dtype == np.float64 and np.array_equal(state.strategy[kind][name], value)
    assert [r["round"] for r in state.records] == [1, 2, 3]
    assert state.records[1]["missing"] == ["client_01"]
    assert state.records[2]["weights_sha256"] == rounds.encoder_sha256(_encoder(3))
    # every .pt the server writes loads with weights_only=True
    for path in paths.rounds_dir.glob("*.pt"):
        torch.load(path, map_location="cpu", weights_only=True)

    table = pq.read_table(paths.rounds_table)
    assert (
        table.column_names
        == history.ROUNDS_SCHEMA.names
        == [
            "round",
            "client_id",
            "num_examples",
            "train_loss",
            "masked_accuracy",
            "bytes_up",
            "bytes_down",
            "seconds",
        ]
    )
    assert table.num_rows == 2 + 1 + 2  # client_01 missed round 2
    evaluation = pq.read_table(paths.evaluation_table)
    assert evaluation.num_rows == 6
    assert evaluation.column_names == [
        "round",
        "client_id",
        "utterances",
        "masked_frames",
        "heldout_loss",
        "heldout_masked_accuracy",
        "majority_accuracy",
        "leak_free_frames",
        "heldout_leak_free_masked_accuracy",
        "leak_free_majority_accuracy",
    ]
    assert evaluation.column("heldout_leak_free_masked_accuracy").to_pylist()[:2] == [0.3, None]


def test_a_run_folder_of_another_strategy_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path / "run")
    rounds.save_round(FederatedPaths(config.run_dir), config, 1, _encoder(1), _moments(1), _record(1))
    with pytest.raises(ValueError, match="fedadam"):
        rounds.load_latest(FederatedPaths(config.run_dir), _config(tmp_path / "run", strategy="fedavg"))


def test_round_summaries_and_report() -> None:
    records = [{**_record(1), "round": 1}, {**_record(2, missing=["client_01"]), "round": 2}]
    records[0]["evaluation"].append(
        records[0]["evaluation"][0]
        | {
            "client_id": "client_02",
            "leak_free_frames": 10,
            "heldout_leak_free_masked_accuracy": 0.1,
            "leak_free_majority_accuracy": 0.02,
        }
    )
    lines = history.summarize_rounds(records)
    # train loss weighted by training utterances, held-out accuracy by masked frames
    assert lines[0]["train_loss"] == pytest.approx((10 * 3.9 + 11 * 4.9) / 21)
    assert lines[1]["clients"] == 1 and lines[1]["missing"] == ["client_01"]
    assert lines[0]["heldout_masked_accuracy"] == pytest.approx(0.2) and lines[0]["majority_accuracy"] == pytest.approx(
        0.05
    )
    # ... and on leak-free frames by leak-free frames (a client with none counts for nothing)
    assert lines[0]["leak_free_frames"] == 40
    assert lines[0]["heldout_leak_free_masked_accuracy"] == pytest.approx((30 * 0.3 + 10 * 0.1) / 40)
    assert lines[0]["heldout_leak_free_majority_accuracy"] == pytest.approx((30 * 0.1 + 10 * 0.02) / 40)
    # a record written before leak-free frames were measured: none
    old = {
        **records[0],
        "evaluation": [{k: v for k, v in e.items() if "leak" not in k} for e in records[0]["evaluation"]],
    }
    line = history.summarize_rounds([old])[0]
    assert (
        line["leak_free_frames"],
        line["heldout_leak_free_masked_accuracy"],
        line["heldout_leak_free_majority_accuracy"],
    ) == (0, None, None)
    png = round_curve(lines)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 100_000


def test_the_round_log_line_says_n_a_where_nothing_was_measured() -> None:
    """The held-out masked accuracy of the round's log line is the leak-free one (0.300 here, not
    the all-frames 0.200). Kills: the log line reading the all-frames figure (one_accuracy)."""
    measured = {**_record(3, missing=["client_01"]), "round": 3}
    assert history.round_log_line(measured, 10) == (
        "round 3/10: 1 clients, missing client_01, train loss 3.7000, held-out masked accuracy 0.300 "
        "(majority class 0.100), 30 s"
    )
    # train losses withheld (DP) and no held-out frames anywhere: n/a, never a 0.0 or a crash
    blank = {
        **measured,
        "rows": [{**row, "train_loss": None} for row in measured["rows"]],
        "evaluation": [
            {**e, "masked_frames": 0, "heldout_masked_accuracy": None, "leak_free_frames": 0}
            for e in measured["evaluation"]
        ],
        "missing": ["client_01", "client_02"],
    }
    assert history.round_log_line(blank, 10) == (
        "round 3/10: 1 clients, missing client_01, client_02, train loss n/a, held-out masked accuracy n/a "
        "(majority class n/a), 30 s"
    )
    assert history.round_log_line({**_record(1), "round": 1, "evaluation": []}, 2).startswith(
        "round 1/2: 2 clients, train loss "
    )


def _reply(arrays: dict[str, np.ndarray] | None, metrics: dict[str, float], extra: dict | None = None) -> Message:
    content = RecordDict({"metrics": MetricRecord(metrics), "client": ConfigRecord({"client-id": "client_00"})})
    if arrays is not None:
        content["arrays"] = ArrayRecord({k: torch.from_numpy(v) for k, v in arrays.items()})
    for name, record in (extra or {}).items():
        content[name] = record
    # a reply as the Grid hands it to the ServerApp (metadata from the SuperLink)
    metadata = Metadata(
        run_id=1,
        message_id="m",
        src_node_id=7,
        dst_node_id=0,
        reply_to_message_id="i",
        group_id="",
        created_at=0.0,
        ttl=60.0,
        message_type="train",
    )
    return Message(metadata=metadata, content=content)


def test_the_server_accepts_only_the_encoder_and_scalar_metrics(tmp_path: Path) -> None:
    """The privacy boundary as the server enforces it: a reply carrying a head, a codebook or
    statistics (as extra arrays, an extra record or extra metrics) is refused."""
    server = Server(grid=None, config=_config(tmp_path / "run"))  # type: ignore[arg-type]
    encoder = _encoder(0)
    server.expect(encoder)
    train = {name: 1.0 for name in TRAIN_METRICS}
    assert server.check_reply(_reply(encoder, train), "train") is None
    assert server.check_reply(_reply(None, {n: 1.0 for n in EVAL_METRICS}), "evaluate") is None
    evaluate = {n: 1.0 for n in EVAL_METRICS}
    for bad, why in [
        ({"leak-free-frames": 2.0}, "exceeds num-examples"),  # more leak-free frames than masked frames
        ({"leak-free-frames": 0.0}, "must be 0 with no leak-free frames"),  # accuracies over no frames
        ({"leak-free-frames": 0.5}, "not a whole number"),
        ({"leak-free-majority-accuracy": 1.5}, "above 1"),
    ]:
        assert why in (server.check_reply(_reply(None, evaluate | bad), "evaluate") or "")
    assert "exactly" in (server.check_reply(_reply(None, {n: 1.0 for n in EVAL_METRICS[:5]}), "evaluate") or "")

    head = {"heads.0.weight": np.zeros((100, 3), np.float32), "heads.0.bias": np.zeros(100, np.float32)}
    refused = [
        _reply({**encoder, **head}, train),  # the head inside the encoder's record
        _reply(encoder, train, {"codebook": ArrayRecord({"codebook": torch.zeros(100, 39)})}),
        _reply(encoder, train, {"cmvn": ConfigRecord({"mean": [0.0] * 80})}),
        _reply(encoder, {**train, "cmvn-mean-0": 0.5}),
        _reply({k: v.astype(np.float64) for k, v in encoder.items()}, train),  # not the encoder's dtypes
        _reply({"frontend.w": encoder["frontend.w"]}, train),  # not the whole encoder
    ]
    for reply in refused:
        assert server.check_reply(reply, "train") is not None


def test_stats_database_has_the_rounds_table(tmp_path: Path, sample_pipeline) -> None:
    from speech_assets.defs.resources import StoragePaths
    from speech_assets.defs.stats import _inputs

    config = _config(tmp_path / "federated" / "run")
    paths = FederatedPaths(config.run_dir)
    rounds.save_round(paths, config, 1, _encoder(1), _moments(1), _record(1))
    rounds.save_round(paths, config, 2, _encoder(2), _moments(2), _record(2, missing=["client_01"]))
    out = sample_pipeline.out
    storage = StoragePaths(corpus="", data_dir=str(out), mlflow_tracking_uri=sample_pipeline.mlflow_uri)
    inputs = _inputs(storage)  # the real pipeline's outputs, as dataset_stats reads them
    inputs.federated_rounds = paths.rounds_table
    db = tmp_path / "stats.duckdb"
    counts = stats_db.build_database(db, inputs)
    assert counts["federated_rounds"] == 3
    con = duckdb.connect(str(db), read_only=True)
    try:
        columns = [row[0] for row in con.execute("DESCRIBE federated_rounds").fetchall()]
        assert columns == history.ROUNDS_SCHEMA.names
        rows = con.execute("SELECT * FROM federated_rounds ORDER BY round, client_id").fetchall()
    finally:
        con.close()
    assert [tuple(r.values()) for r in pq.read_table(paths.rounds_table).to_pylist()] == rows
    # without a federated run the table exists and is empty
    inputs.federated_rounds = None
    assert stats_db.build_database(tmp_path / "empty.duckdb", inputs)["federated_rounds"] == 0
    assert json.loads(paths.round_record(2).read_text())["missing"] == ["client_01"]


@pytest.mark.parametrize(
    ("overrides", "uniform"),
    [({}, False), ({"secure_aggregation": True, "fraction_train": 1.0}, True), ({"dp_noise_multiplier": 1.0}, True)],
)
def test_the_server_weights_by_its_table_only_without_secure_aggregation_or_dp(
    tmp_path: Path, overrides: dict, uniform: bool
) -> None:
    """Secure aggregation hands the server a sum it cannot reweight, and DP's guarantee is for a
    uniformly weighted mean: both weigh every client 1, whatever the clients table says."""
    weights = {"client_00": 3.0, "client_01": 0.5}
    server = Server(grid=None, config=_config(tmp_path / "run", client_weights=weights, **overrides))  # type: ignore[arg-type]
    assert [server.weight(c) for c in CLIENTS] == ([1.0, 1.0] if uniform else [3.0, 0.5])
