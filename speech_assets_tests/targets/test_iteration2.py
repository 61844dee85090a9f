"""Iteration-2 targets: k-means in an encoder layer's feature space, streamed shard by shard."""

from pathlib import Path

import numpy as np
import torch

from speech_assets.features.cmvn import Cmvn
from speech_assets.features.shards import read_shard_table
from speech_assets.model import HubertPretrainModel, get_preset
from speech_assets.targets.config import KMeansConfig
from speech_assets.targets.iteration2 import build_iter2_targets, default_layer, layer_frames
from speech_assets.targets.labels import read_labels
from speech_assets.testing.training_data import write_corpus


def _model() -> HubertPretrainModel:
    torch.manual_seed(0)
    return HubertPretrainModel(get_preset("tiny"), {"a": 8}).eval()


def test_layer_frames_match_one_utterance_at_a_time() -> None:
    model = _model()
    rng = np.random.default_rng(0)
    feats = [rng.normal(size=(t, 80)).astype(np.float32) for t in (37, 120, 64)]
    batched = layer_frames(model, feats, layer=2, max_frames=400)
    for f, b in zip(feats, batched, strict=True):
        (alone,) = layer_frames(model, [f], layer=2)
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
