"""Per-client k-means targets: isolation between clients, label rate, determinism, K shrink."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from speech_assets.features import cmvn
from speech_assets.features.shards import FeatureRecord, write_shard
from speech_assets.targets.build import build_client_targets
from speech_assets.targets.config import KMeansConfig
from speech_assets.targets.labels import read_labels
from speech_assets.utils import sha256_file


def make_shard(path: Path, speaker: str, utterances: int, seed: int) -> list[FeatureRecord]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 4, (8, 39))
    records = []
    for index in range(utterances):
        frames = int(rng.integers(40, 120))
        mfcc = (centres[rng.integers(0, 8, frames)] + rng.normal(0, 0.3, (frames, 39))).astype(np.float32)
        records.append(
            FeatureRecord(
                f"{speaker}-1-{index:04d}",
                speaker,
                "1",
                frames,
                frames / 100,
                0,
                frames / 100,
                frames / 100,
                1.0,
                np.zeros((frames, 80), np.float32),
                mfcc,
            )
        )
    write_shard(path, records)
    return records


def client_cmvn(paths: list[Path]) -> cmvn.Cmvn:
    from speech_assets.features.shards import iter_shard

    stats = cmvn.ShardStats()
    for path in paths:
        for record in iter_shard(path, features=("mfcc",)):
            stats.add(record.speaker_id, "mfcc", record.mfcc)
    return cmvn.Cmvn.from_sums(cmvn.combine([stats]))


@pytest.fixture
def shards(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for seed, speaker in enumerate(["a1", "a2", "b1"]):
        out[speaker] = tmp_path / f"{speaker}.parquet"
        make_shard(out[speaker], speaker, 12, seed)
    return out


def test_client_reads_only_its_own_shards(shards: dict[str, Path], tmp_path: Path) -> None:
    mine = [shards["a1"], shards["a2"]]
    stats = client_cmvn(mine)
    shards["b1"].write_bytes(b"another client's data: must never be opened")
    shards["b1"].chmod(0)
    result = build_client_targets("client_a", mine, stats, tmp_path / "client_a", KMeansConfig(k=8))
    assert result.shards_read == [str(p) for p in mine]
    labels = read_labels(result.labels_path)
    assert {utt.split("-")[0] for utt in labels} == {"a1", "a2"}


def test_labels_at_50hz_and_deterministic(shards: dict[str, Path], tmp_path: Path) -> None:
    from speech_assets.features.shards import iter_shard

    mine = [shards["a1"]]
    stats = client_cmvn(mine)
    first = build_client_targets("c", mine, stats, tmp_path / "one", KMeansConfig(k=8, seed=3))
    second = build_client_targets("c", mine, stats, tmp_path / "two", KMeansConfig(k=8, seed=3))
    assert sha256_file(first.codebook_path) == sha256_file(second.codebook_path)
    assert sha256_file(first.labels_path) == sha256_file(second.labels_path)
    labels = read_labels(first.labels_path)
    for record in iter_shard(shards["a1"], features=()):
        assert labels[record.utt_id].dtype == np.int16
        assert labels[record.utt_id].shape == ((record.num_frames + 1) // 2,)
    assert first.empty_clusters == 0 and 1 < first.perplexity <= 8
    assert first.frames_labelled == sum(r.num_frames for r in iter_shard(shards["a1"], features=()))


def test_k_shrinks_with_a_warning_when_frames_are_scarce(shards: dict[str, Path], tmp_path: Path) -> None:
    warnings: list[str] = []
    mine = [shards["a1"]]
    result = build_client_targets(
        "c", mine, client_cmvn(mine), tmp_path / "out", KMeansConfig(k=500), log=warnings.append
    )
    assert result.k < 500 and result.k_requested == 500
    assert warnings and "500" in warnings[0]
    assert np.load(result.codebook_path).shape == (result.k, 39)


def test_fit_budget_samples_whole_utterances(shards: dict[str, Path], tmp_path: Path) -> None:
    mine = [shards["a1"], shards["a2"]]
    result = build_client_targets("c", mine, client_cmvn(mine), tmp_path / "out", KMeansConfig(k=4, max_fit_frames=300))
    assert 0 < result.frames_fit <= 300
    assert result.frames_labelled > result.frames_fit  # labelling still covers every frame


def test_extending_a_client_keeps_codebook_and_old_labels(shards: dict[str, Path], tmp_path: Path) -> None:
    from speech_assets.targets.build import extend_client_targets

    out = tmp_path / "client"
    first = build_client_targets("c", [shards["a1"]], client_cmvn([shards["a1"]]), out, KMeansConfig(k=8))
    codebook = np.load(first.codebook_path)
    old_labels = read_labels(first.labels_path)
    grown = extend_client_targets("c", [shards["a2"]], out)
    assert grown.shards_read == [str(shards["a2"])]  # the old shard is not read again
    np.testing.assert_array_equal(np.load(grown.codebook_path), codebook)
    labels = read_labels(grown.labels_path)
    assert {u.split("-")[0] for u in labels} == {"a1", "a2"}
    for utt_id, old in old_labels.items():
        np.testing.assert_array_equal(labels[utt_id], old)
    assert grown.frames_labelled > first.frames_labelled and grown.utterances == 24


@pytest.mark.parametrize(
    "knobs",
    [{"niter": 1}, {"init": "random", "nredo": 2}, {"max_points_per_centroid": 2, "min_train_frames": 0}],
    ids=lambda knobs: ",".join(knobs),
)
def test_every_k_means_knob_reaches_the_fit(shards: dict[str, Path], tmp_path: Path, knobs: dict) -> None:
    """The builder fits with its whole KMeansConfig, not only k and seed: a
    changed knob gives another fit; the same config, the same one."""
    mine = [shards["a1"], shards["a2"]]
    stats = client_cmvn(mine)
    base = build_client_targets("c", mine, stats, tmp_path / "base", KMeansConfig(k=8))
    changed = build_client_targets("c", mine, stats, tmp_path / "changed", KMeansConfig(k=8, **knobs))
    again = build_client_targets("c", mine, stats, tmp_path / "again", KMeansConfig(k=8, **knobs))
    assert sha256_file(changed.codebook_path) != sha256_file(base.codebook_path)
    assert sha256_file(changed.codebook_path) == sha256_file(again.codebook_path)


def test_k_shrinks_by_the_configs_frames_per_centroid(shards: dict[str, Path], tmp_path: Path) -> None:
    mine = [shards["a1"]]
    warnings: list[str] = []
    frames = build_client_targets("c", mine, client_cmvn(mine), tmp_path / "all", KMeansConfig(k=8)).frames_fit
    config = KMeansConfig(k=8, min_frames_per_centroid=frames // 2)
    result = build_client_targets("c", mine, client_cmvn(mine), tmp_path / "out", config, log=warnings.append)
    assert result.k == 2 and result.k_requested == 8
    assert warnings == [f"client c: only {frames} frames, K shrinks from 8 to 2"]
