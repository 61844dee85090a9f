"""Atomic writes, shard round trip and CMVN partial sums."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from speech_assets.features import cmvn
from speech_assets.features.shards import FeatureRecord, iter_shard, num_frames_for, write_shard
from speech_assets.utils import atomic_path, sha256_file


def record(utt_id: str, frames: int, seed: int) -> FeatureRecord:
    rng = np.random.default_rng(seed)
    return FeatureRecord(
        utt_id, "s1", "c1", frames, frames / 100, 0.1, 0.9, frames / 100, 0.8,
        rng.normal(size=(frames, 80)).astype(np.float32), rng.normal(size=(frames, 39)).astype(np.float32),
    )


def test_atomic_path_leaves_nothing_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"old"
    assert list(tmp_path.iterdir()) == [target]


def test_shard_round_trip_and_determinism(tmp_path: Path) -> None:
    records = [record("b", 7, 1), record("a", 3, 2)]
    write_shard(tmp_path / "one.parquet", records)
    write_shard(tmp_path / "two.parquet", list(reversed(records)))
    assert sha256_file(tmp_path / "one.parquet") == sha256_file(tmp_path / "two.parquet")
    back = list(iter_shard(tmp_path / "one.parquet"))
    assert [r.utt_id for r in back] == ["a", "b"]
    np.testing.assert_array_equal(back[1].logmel, records[0].logmel)
    np.testing.assert_array_equal(back[1].mfcc, records[0].mfcc)
    scalars_only = next(iter_shard(tmp_path / "one.parquet", features=()))
    assert scalars_only.logmel is None and scalars_only.num_frames == 3


def test_record_shape_is_validated() -> None:
    with pytest.raises(ValueError, match="logmel"):
        FeatureRecord("x", "s", "c", 5, 1, 0, 1, 1, 1, np.zeros((4, 80), np.float32), np.zeros((5, 39), np.float32))


@pytest.mark.parametrize(("samples", "frames"), [(0, 0), (399, 0), (400, 1), (559, 1), (560, 2), (16000, 98)])
def test_frame_count_formula(samples: int, frames: int) -> None:
    assert num_frames_for(samples) == frames


def test_partial_sums_combine_to_global_statistics(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(3, 2, (500, 39)), rng.normal(-1, 0.5, (300, 39))
    first, second = cmvn.ShardStats(), cmvn.ShardStats()
    first.add("s1", "mfcc", a)
    second.add("s2", "mfcc", b)
    first.save(tmp_path / "a.npz")
    second.save(tmp_path / "b.npz")
    parts = [cmvn.ShardStats.load(tmp_path / "a.npz"), cmvn.ShardStats.load(tmp_path / "b.npz")]
    stats = cmvn.Cmvn.from_sums(cmvn.combine(parts))
    both = np.concatenate([a, b])
    np.testing.assert_allclose(stats.mean["mfcc"], both.mean(0), rtol=1e-5)
    np.testing.assert_allclose(stats.std["mfcc"], both.std(0), rtol=1e-4)
    only_s2 = cmvn.Cmvn.from_sums(cmvn.combine(parts, speakers=["s2"]))
    np.testing.assert_allclose(only_s2.mean["mfcc"], b.mean(0), rtol=1e-5)
    normalised = stats.apply(both.astype(np.float32), "mfcc")
    np.testing.assert_allclose(normalised.mean(0), 0, atol=1e-4)


def test_npz_is_byte_deterministic(tmp_path: Path) -> None:
    part = cmvn.ShardStats()
    part.add("s", "logmel", np.ones((4, 80)))
    part.save(tmp_path / "x.npz")
    first = sha256_file(tmp_path / "x.npz")
    part.save(tmp_path / "x.npz")
    assert sha256_file(tmp_path / "x.npz") == first


@pytest.mark.parametrize("rewritten", ["shard", "rejects", "stats"])
def test_a_file_rewritten_behind_its_meta_is_not_trusted(tmp_path: Path, rewritten: str) -> None:
    from speech_assets.features.shards import ShardFiles

    files = ShardFiles.of(tmp_path / "shards", "spk")
    files.shard.parent.mkdir(parents=True)
    for path in files.vouched.values():
        path.write_bytes(b"content")
    meta = files.write_meta({"inputs_key": "k"})
    assert files.read_meta() == meta and len(meta["shard_sha256"]) == 64
    getattr(files, rewritten).write_bytes(b"other content, half written by a killed process")
    assert files.read_meta() is None
    getattr(files, rewritten).unlink()
    assert files.read_meta() is None


def test_temp_files_of_one_shard_only_are_removed(tmp_path: Path) -> None:
    from speech_assets.features.shards import ShardFiles

    mine, other = ShardFiles.of(tmp_path, "a"), ShardFiles.of(tmp_path, "a-b")
    leftovers = [tmp_path / ".a.parquet.x1.tmp", tmp_path / ".a.meta.json.x2.tmp", tmp_path / ".a.stats.npz.x3.tmp"]
    theirs = [tmp_path / ".a-b.parquet.y1.tmp", tmp_path / ".b.parquet.y2.tmp"]
    for path in leftovers + theirs:
        path.write_bytes(b"partial")
    assert mine.remove_temp_files() == 3
    assert not any(p.exists() for p in leftovers) and all(p.exists() for p in theirs)
    assert other.remove_temp_files() == 1
