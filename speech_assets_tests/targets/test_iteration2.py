"""Iteration-2 targets: k-means in an encoder layer's feature space, streamed shard by shard; the
encoder it clusters in (layer, input normalisation) and the refit key of a client's targets."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from speech_assets.features.cmvn import Cmvn, UtteranceCmvn
from speech_assets.features.shards import read_shard_table
from speech_assets.model.batches import frozen_hidden_states
from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.model.presets import get_preset
from speech_assets.targets.config import KMeansConfig
from speech_assets.targets.iteration2 import (
    EncoderRefused,
    build_iter2_targets,
    default_layer,
    iteration2_targets,
    load_iteration2_encoder,
)
from speech_assets.targets.labels import read_labels
from speech_assets.targets.publish import ClientShards
from speech_assets.utils import sha256_file, sha256_strings
from speech_assets_tests.support.training_data import write_corpus


def _model() -> HubertPretrainModel:
    torch.manual_seed(0)
    return HubertPretrainModel(get_preset("tiny"), {"a": 8}).eval()


def test_frozen_hidden_states_match_one_utterance_at_a_time() -> None:
    model = _model()
    rng = np.random.default_rng(0)
    feats = [rng.normal(size=(t, 80)).astype(np.float32) for t in (37, 120, 64)]
    batched = frozen_hidden_states(model, feats, max_frames=400, layer=2)
    for f, b in zip(feats, batched, strict=True):
        (alone,) = frozen_hidden_states(model, [f], layer=2)
        assert b.shape == ((f.shape[0] + 1) // 2, 128)
        np.testing.assert_allclose(b, alone, atol=1e-4)  # padding and batching do not leak
    assert default_layer(model) == 2


def test_targets_cover_every_frame_at_50_hz_and_repeat_exactly(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "data", clients={"client_a": 8}, speakers_per_client=2, utterances_per_speaker=6)
    shards = [Path(s) for s in corpus.shards]
    cmvn = Cmvn.load(corpus.cmvn)
    first = build_iter2_targets(
        "client_a",
        shards,
        cmvn,
        _model(),
        2,
        tmp_path / "one",
        KMeansConfig(k=500, max_fit_frames=2000),
        log=lambda _: None,
    )
    build_iter2_targets(
        "client_a",
        shards,
        cmvn,
        _model(),
        2,
        tmp_path / "two",
        KMeansConfig(k=500, max_fit_frames=2000),
        log=lambda _: None,
    )
    assert first.k < 500  # shrinks for a small client
    assert np.load(tmp_path / "one" / "codebook.npy").shape == (first.k, 128)
    labels = read_labels(first.labels_path)
    for shard in shards:
        for row in read_shard_table(shard, columns=["utt_id", "num_frames"]).to_pylist():
            assert len(labels[row["utt_id"]]) == (row["num_frames"] + 1) // 2
    assert first.frames_fit <= 2000 + 400 and first.perplexity > 1
    assert (tmp_path / "one" / "labels.parquet").read_bytes() == (tmp_path / "two" / "labels.parquet").read_bytes()


def _final(path: Path, normalisation: dict | None) -> str:
    """A training run's ``final.pt`` of :func:`_model` (4 Transformer layers), with ``normalisation``."""
    model = _model()
    state = {"model": model.state_dict(), "preset": model.preset.to_dict(), "clients": {"a": 8}}
    torch.save(state | ({"normalisation": normalisation} if normalisation is not None else {}), path)
    return str(path)


@pytest.mark.parametrize(
    ("normalisation", "layer", "message"),
    [
        (None, 0, "records no input normalisation: re-materialise pretrained_checkpoint"),
        ({}, 2, "records no input normalisation: re-materialise pretrained_checkpoint"),
        ({"kind": "utterance"}, 5, r"\[iteration2\] layer 5 is outside 1\.\.4"),
        ({"kind": "utterance"}, -1, r"\[iteration2\] layer -1 is outside 1\.\.4"),
        (None, 9, r"layer 9 is outside 1\.\.4"),  # the layer is checked first
    ],
)
def test_an_encoder_is_refused_without_its_normalisation_or_outside_its_layers(
    tmp_path: Path, normalisation: dict | None, layer: int, message: str
) -> None:
    checkpoint = _final(tmp_path / "final.pt", normalisation)
    with pytest.raises(EncoderRefused, match=message):
        load_iteration2_encoder(checkpoint, layer, asset="pretrained_checkpoint", data_version="v1")
    assert issubclass(EncoderRefused, ValueError)


def test_the_encoder_record_and_refit_key_of_a_client(tmp_path: Path) -> None:
    checkpoint = _final(tmp_path / "final.pt", {"kind": "utterance"})
    encoder = load_iteration2_encoder(checkpoint, 0, asset="federated_checkpoint", data_version="v1")
    assert encoder.layer == 2 and isinstance(encoder.cmvn, UtteranceCmvn)
    assert encoder.record() == {
        "encoder_asset": "federated_checkpoint",
        "checkpoint": checkpoint,
        "checkpoint_sha256": encoder.sha256,
        "checkpoint_data_version": "v1",
        "layer": 2,
    }
    corpus = write_corpus(tmp_path / "data", clients={"client_a": 8}, speakers_per_client=2, utterances_per_speaker=4)
    shards = {Path(s).stem: Path(s) for s in corpus.shards}
    client = ClientShards(
        "client_a",
        sorted(shards),
        ["client_a-spk1"],
        {s: sha256_file(p) for s, p in shards.items()},
        shards.__getitem__,
    )
    config = KMeansConfig(k=50, max_fit_frames=2000)
    out = tmp_path / "targets"
    first = iteration2_targets(
        client, out, encoder, config, settings='{"k":50}', code_version="v9", log=lambda _: None, warn=lambda _: None
    )
    # the key every published client's record holds: a different key would refit them all
    assert first["inputs_key"] == sha256_strings(
        [
            json.dumps(client.shard_versions, sort_keys=True),
            json.dumps(["client_a-spk1"]),
            encoder.sha256,
            "2",
            '{"k":50}',
            "v9",
        ]
    )
    assert {key: first[key] for key in encoder.record()} == encoder.record() and first["label_rate_hz"] == 50
    assert first["k_requested"] == 50 and first["heldout_speakers"] == ["client_a-spk1"]
    logged: list[str] = []
    again = iteration2_targets(
        client, out, encoder, config, settings='{"k":50}', code_version="v9", log=logged.append, warn=logged.append
    )
    assert again == first and logged == [
        f"client_a: inputs unchanged, keeping iteration-2 targets {first['data_version'][:12]}"
    ]
