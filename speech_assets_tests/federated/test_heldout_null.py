"""A client that holds no held-out speaker has no held-out result: null in the records, the round
table, the result and the round summaries (never a 0.0 accuracy over 0 frames), and the server
names it in a warning. The real ServerApp round loop with the real ClientApp functions in process."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from speech_assets.federated.config import FederatedConfig
from speech_assets.federated.history import summarize_rounds
from speech_assets.federated.server_app import Server
from speech_assets.layout import FederatedPaths
from speech_assets_tests.support.federated_data import InProcessGrid, serverapp_identity, write_federated_corpus


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_client_without_heldout_speakers_reports_null(tmp_path: Path) -> None:
    corpus = write_federated_corpus(tmp_path / "data", {"c0": 6, "c1": 6}, speakers_per_client=2)
    # c1's held-out speaker trains instead: c1 holds none
    moved = [s for s in corpus.heldout_speakers if s.startswith("c1")]
    assert moved
    heldout = sorted(set(corpus.heldout_speakers) - set(moved))
    config = FederatedConfig(
        run_dir=str(tmp_path / "run"),
        run_name="null",
        clients=["c0", "c1"],
        rounds=1,
        local_steps=1,
        strategy="fedavg",
        client_lr=5e-3,
        precision="fp32",
        batch_seconds=4.0,
        heldout_speakers=heldout,
        train_speakers=sorted(corpus.train_speakers + moved),
        connect_timeout_s=5,
        round_timeout_s=600,
    )
    grid = InProcessGrid({1: "c0", 2: "c1"}, corpus.data_dir, tmp_path / "state")
    warnings, server_log = _Warnings(), logging.getLogger("speech_assets.federated.server")
    server_log.addHandler(warnings)
    try:
        with serverapp_identity():
            result = Server(grid, config).run()  # type: ignore[arg-type]
    finally:
        server_log.removeHandler(warnings)

    scored, empty = result["heldout_per_client"]["c0"], result["heldout_per_client"]["c1"]
    assert scored["masked_frames"] > 0 and 0 <= scored["masked_accuracy"] <= 1
    assert empty["masked_frames"] == 0
    assert (empty["masked_accuracy"], empty["majority_accuracy"], empty["leak_free_masked_accuracy"]) == (
        None,
        None,
        None,
    )
    paths = FederatedPaths(config.run_dir)
    (row,) = [r for r in pq.read_table(paths.evaluation_table).to_pylist() if r["client_id"] == "c1"]
    assert row["heldout_masked_accuracy"] is None and row["majority_accuracy"] is None and row["heldout_loss"] is None
    record = json.loads(paths.round_record(1).read_text())
    # the round's accuracy is c0's alone, not diluted by a 0.0 for c1
    (line,) = summarize_rounds([record])
    assert line["heldout_masked_accuracy"] == pytest.approx(scored["masked_accuracy"])
    assert any("c1" in message and "null" in message for message in warnings.messages), warnings.messages
