"""One client without Flower: it needs nothing but its own files, its CMVN is its own, only the
encoder leaves it, its head stays (shape (K, D)), and a local round is a pure function of
(global encoder, head saved before the round, seed, client, round)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from speech_assets.federated.client_data import ClientData
from speech_assets.federated.config import FederatedConfig, NodeConfig
from speech_assets.federated.local import HEAD_PREFIX, LocalClient, initial_encoder
from speech_assets.model.presets import get_preset

CLIENT = "client_00"


def _local(run_name: str = "unit", heldout: tuple[str, ...] = ()) -> object:
    config = FederatedConfig(
        run_dir=f"/unused/{run_name}",
        run_name=run_name,
        clients=[CLIENT],
        local_steps=2,
        batch_seconds=8.0,
        heldout_speakers=list(heldout),
    )
    return config.local()


def _isolate(out: Path, client_id: str, target: Path) -> Path:
    """Copy exactly the files ``client_id`` reads into ``target`` (same layout), nothing else."""
    for path in ClientData.resolve(out, client_id).files:
        destination = target / path.relative_to(out)
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, destination)
    return target


def test_client_files_are_its_own(sample_pipeline) -> None:
    out = sample_pipeline.out
    assignment = pq.read_table(out / "clients" / "clients.parquet").to_pylist()
    for client_id in sample_pipeline.clients:
        data = ClientData.resolve(out, client_id)
        own = sorted(row["speaker_id"] for row in assignment if row["client_id"] == client_id)
        assert data.speakers == own
        allowed = {out / "kmeans" / client_id} | {out / "features" / "shards"}
        assert all(path.parent in allowed for path in data.files)
        assert {p.name.split(".")[0] for p in data.shards + data.stats} == set(own)


def test_a_client_trains_from_nothing_but_its_own_files(sample_pipeline, tmp_path: Path) -> None:
    isolated = _isolate(sample_pipeline.out, CLIENT, tmp_path / "client_only")
    everything_else = [p for p in isolated.rglob("*") if p.is_file()]
    assert not any("client_01" in str(p) or "cmvn" in p.parts or "clients" in p.parts for p in everything_else)
    data = ClientData.resolve(isolated, CLIENT)
    node = NodeConfig(client_id=CLIENT, data_dir=str(isolated), state_root=str(tmp_path / "state"), threads=1)
    held = data.speakers[0]
    client = LocalClient(data, _local(heldout=(held, "someone-elsewhere")), node)

    # the pipeline's held-out speakers stay out of training; the rest of the list is not here
    assert {u.speaker_id for u in client.heldout_set.utterances} == {held}
    assert held not in {u.speaker_id for u in client.train_set.utterances} and len(client.train_set) > 0
    # per-utterance CMVN: no statistic beyond the utterance itself (a federation has no global one)
    feats = client.train_set[0].feats
    assert feats.mean(dim=0).abs().max() < 1e-4 and (feats.std(dim=0, unbiased=False) - 1).abs().max() < 1e-3
    assert not (tmp_path / "state" / "unit" / "cmvn.npz").exists()

    start = initial_encoder("tiny", seed=0)
    result = client.train_round(1, start)
    # only the encoder leaves: same names and shapes as the global one, no head
    assert set(result.encoder) == set(start) and not any(k.startswith(HEAD_PREFIX) for k in result.encoder)
    assert all(result.encoder[k].shape == start[k].shape for k in start)
    assert any(not torch.equal(result.encoder[k], start[k]) for k in start)
    assert result.num_examples > 0 and result.steps == 2 and np.isfinite(result.train_loss)
    # the head stays here: (K, D) for this client's own K
    head = torch.load(tmp_path / "state" / "unit" / "heads" / "round_00001.pt", weights_only=True)
    assert head["client_id"] == CLIENT and head["k"] == data.k
    assert tuple(head["head"]["weight"].shape) == (data.k, get_preset("tiny").dim)
    evaluation = client.evaluate(1, result.encoder)
    assert evaluation.utterances >= 1 and evaluation.masked_frames > 0
    assert 0.0 <= evaluation.heldout_masked_accuracy <= 1.0 and 0.0 <= evaluation.majority_accuracy <= 1.0


def test_a_local_round_repeats_exactly(sample_pipeline, tmp_path: Path) -> None:
    """Round r starts from the newest head saved before r, so a re-run round (after a kill)
    computes the same encoder whatever the first attempt left behind."""
    node = NodeConfig(
        client_id=CLIENT, data_dir=str(sample_pipeline.out), state_root=str(tmp_path / "state"), threads=1
    )
    start = initial_encoder("tiny", seed=0)

    def train(round_number: int, encoder: dict) -> dict:
        client = LocalClient(ClientData.resolve(sample_pipeline.out, CLIENT), _local(), node)
        return client.train_round(round_number, encoder).encoder

    first = train(1, start)
    second = train(2, first)  # from round 1's head
    assert all(torch.equal(a, b) for a, b in zip(first.values(), train(1, start).values(), strict=True))
    again = train(2, first)  # the round-2 head now exists; round 2 must still start from round 1's
    assert all(torch.equal(second[k], again[k]) for k in second)
    differs = train(3, first)  # another round draws other batches and masks
    assert any(not torch.equal(second[k], differs[k]) for k in second)


def test_a_client_without_targets_is_told_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="kmeans_targets"):
        ClientData.resolve(tmp_path, "client_09")
