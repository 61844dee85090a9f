"""A federated run learns: the ServerApp's round loop (its FedAdam, built as the ServerApp builds
it) with the real ClientApp functions answering in process (no SuperLink, no SuperNodes), on the
synthetic learnable corpus in the pipeline's layout."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from speech_assets.federated.config import FederatedConfig, FederatedPaths
from speech_assets.federated.server_app import Server
from speech_assets.testing.federated_data import InProcessGrid, serverapp_identity, write_federated_corpus

ROUNDS, LOCAL_STEPS, CLIENT_LR, ETA = 3, 10, 5e-3, 0.1
# Measured after 3 rounds (corpus and run seed 0 / 1 / 2), held-out leak-free masked accuracy
# against the leak-free majority-class rate: overall 0.568 vs 0.107 / 0.496 vs 0.109 / 0.486 vs
# 0.107; client_a's head 0.753 vs 0.143 / 0.539 vs 0.116 / 0.589 vs 0.125, client_b's 0.404 vs
# 0.074 / 0.465 vs 0.104 / 0.380 vs 0.089 (smallest margin 0.29). With FedAdam's eta = 0.01 (the default before this measurement) instead, even 4 rounds reach only
# 0.360 / 0.147 / 0.180 vs 0.107 / 0.109 / 0.107 (seeds 0 / 1 / 2). The test runs seed 0 and asks
# for about half the smallest measured margin, overall and for each client's own head.
LEARNING_MARGIN = 0.15


def test_the_global_encoder_and_each_head_learn(tmp_path: Path) -> None:
    corpus = write_federated_corpus(tmp_path / "data")
    clients = sorted(corpus.k)
    config = FederatedConfig(
        run_dir=str(tmp_path / "run"), run_name="learn", clients=clients, rounds=ROUNDS, local_steps=LOCAL_STEPS,
        strategy="fedadam", eta=ETA, client_lr=CLIENT_LR, precision="fp32", heldout_speakers=corpus.heldout_speakers,
        train_speakers=corpus.train_speakers, connect_timeout_s=5, round_timeout_s=600,
    )  # fmt: skip
    grid = InProcessGrid({node: client for node, client in enumerate(clients, start=1)}, corpus.data_dir, tmp_path / "state")
    with serverapp_identity():
        result = Server(grid, config).run()  # type: ignore[arg-type]

    assert result["rounds"] == ROUNDS and not result["missing_by_round"]
    accuracy, majority = result["heldout_leak_free_masked_accuracy"], result["heldout_leak_free_majority_accuracy"]
    assert accuracy > majority + LEARNING_MARGIN, f"leak-free masked accuracy {accuracy:.3f}, majority class {majority:.3f}"
    for client, scores in result["heldout_per_client"].items():
        assert scores["leak_free_frames"] > 100
        assert scores["leak_free_masked_accuracy"] > scores["leak_free_majority_accuracy"] + LEARNING_MARGIN, client
    # the figures the server recorded are the clients' own, round by round
    evaluation = pq.read_table(FederatedPaths(config.run_dir).evaluation_table).to_pylist()
    assert len(evaluation) == ROUNDS * len(clients)
    last = [row for row in evaluation if row["round"] == ROUNDS]
    assert {row["client_id"]: row["heldout_leak_free_masked_accuracy"] for row in last} == pytest.approx(
        {client: scores["leak_free_masked_accuracy"] for client, scores in result["heldout_per_client"].items()}
    )
