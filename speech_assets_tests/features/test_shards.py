"""Atomic writes, shard round trip and format versions (float16 now, float32 before), CMVN partial sums."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speech_assets.features import cmvn, shards
from speech_assets.features.shards import FeatureRecord, iter_shard, num_frames_for, write_shard
from speech_assets.utils import atomic_path, sha256_file


def record(utt_id: str, frames: int, seed: int) -> FeatureRecord:
    rng = np.random.default_rng(seed)
    return FeatureRecord(
        utt_id,
        "s1",
        "c1",
        frames,
        frames / 100,
        0.1,
        0.9,
        frames / 100,
        0.8,
        rng.normal(size=(frames, 80)).astype(np.float32),
        rng.normal(size=(frames, 39)).astype(np.float32),
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
    assert back[1].logmel.dtype == np.float32 and back[1].mfcc.dtype == np.float32  # the default
    # stored as float16: what comes back is the record rounded through float16, exactly
    np.testing.assert_array_equal(back[1].logmel, records[0].logmel.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(back[1].mfcc, records[0].mfcc.astype(np.float16).astype(np.float32))
    scalars_only = next(iter_shard(tmp_path / "one.parquet", features=()))
    assert scalars_only.logmel is None and scalars_only.num_frames == 3
    write_shard(tmp_path / "empty.parquet", [])
    assert (
        list(iter_shard(tmp_path / "empty.parquet")) == []
        and shards.shard_format(tmp_path / "empty.parquet") == shards.SHARD_FORMAT
    )


def test_shards_record_their_format_and_float16_reads_without_a_copy(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "s.parquet", [record("a", 40, 0), record("b", 9, 1)])
    metadata = pq.read_metadata(path).metadata
    assert metadata[b"speech_assets.shard_format"] == b"2" and metadata[b"speech_assets.feature_dtype"] == b"<f2"
    assert shards.feature_dtype(path) == np.float16
    assert (
        pq.read_metadata(path).num_row_groups == 1 and path.stat().st_size < 40 * 119 * 4
    )  # half of float32, before zstd
    table = shards.read_shard_table(path, columns=["utt_id", "logmel"])
    assert shards.feature_dtype(table.schema) == np.float16  # the metadata survives a column projection
    blobs = table.column("logmel").combine_chunks()
    view = shards.blob_matrices(blobs, shards.N_MELS, shards.feature_dtype(table.schema))[0]
    assert view.dtype == np.float16 and view.shape == (40, 80) and not view.flags.writeable
    assert np.shares_memory(view, np.frombuffer(blobs.buffers()[2], np.uint8))  # a view of Arrow's buffer
    stored = next(iter_shard(path, features=("logmel",), dtype=None))
    assert stored.logmel.dtype == np.float16 and stored.mfcc is None and not stored.logmel.flags.writeable
    np.testing.assert_array_equal(stored.logmel, record("a", 40, 0).logmel.astype(np.float16))


def write_version1_shard(path: Path, records: list[FeatureRecord]) -> Path:
    """A shard as written before formats were recorded: float32 blobs, no format metadata."""
    columns = {name: [getattr(r, name) for r in records] for name in shards.SCALAR_COLUMNS}
    for name in ("logmel", "mfcc"):
        columns[name] = [np.ascontiguousarray(getattr(r, name), dtype="<f4").tobytes() for r in records]
    pq.write_table(pa.Table.from_pydict(columns, schema=shards.SHARD_SCHEMA), path, compression="zstd")
    return path


def test_version1_float32_shards_read_as_float32(tmp_path: Path) -> None:
    records = [record("a", 6, 3), record("b", 11, 4)]
    path = write_version1_shard(tmp_path / "old.parquet", records)
    assert shards.shard_format(path) == 1 and shards.feature_dtype(path) == np.float32
    for dtype in (np.float32, None):  # a view of the float32 blobs either way, never reinterpreted as float16
        back = list(iter_shard(path, dtype=dtype))
        assert [r.logmel.dtype for r in back] == [np.float32, np.float32]
        np.testing.assert_array_equal(back[1].logmel, records[1].logmel)
        np.testing.assert_array_equal(back[1].mfcc, records[1].mfcc)
    # writing format 1 on request (benchmarks) gives the same values back
    write_shard(tmp_path / "v1.parquet", records, version=1)
    assert shards.shard_format(tmp_path / "v1.parquet") == 1
    np.testing.assert_array_equal(next(iter_shard(tmp_path / "v1.parquet")).mfcc, records[0].mfcc)


def test_unknown_or_inconsistent_formats_are_refused(tmp_path: Path) -> None:
    table = shards.records_to_table([record("a", 5, 0)])
    newer = table.replace_schema_metadata({**table.schema.metadata, b"speech_assets.shard_format": b"3"})
    pq.write_table(newer, tmp_path / "newer.parquet")
    for read in (shards.shard_format, shards.read_shard_table, lambda p: list(iter_shard(p, features=()))):
        with pytest.raises(shards.ShardFormatError, match="'3' is not one this code reads"):
            read(tmp_path / "newer.parquet")
    lying = table.replace_schema_metadata({**table.schema.metadata, b"speech_assets.feature_dtype": b"<f4"})
    with pytest.raises(shards.ShardFormatError, match="feature dtype"):
        shards.feature_dtype(lying.schema)
    # float16 blobs that lost the metadata would read as format 1: their length gives them away
    pq.write_table(table.replace_schema_metadata(None), tmp_path / "stripped.parquet")
    with pytest.raises(ValueError, match="shape"):
        list(iter_shard(tmp_path / "stripped.parquet"))
    with pytest.raises(ValueError, match="feature bytes"):
        shards.check_blob_lengths(table.column("logmel"), np.array([5]), shards.N_MELS, np.dtype("<f4"))


def test_features_that_float16_cannot_hold_are_not_written(tmp_path: Path) -> None:
    loud = record("a", 4, 0)
    loud.logmel[2, 3] = 70000.0  # beyond float16's 65504: would be stored as inf
    with pytest.raises(ValueError, match="a: logmel is not finite"):
        write_shard(tmp_path / "x.parquet", [record("b", 3, 1), loud])
    assert not (tmp_path / "x.parquet").exists()


def test_a_caller_that_checked_finiteness_skips_only_the_writers_scan(tmp_path: Path) -> None:
    """``finite_checked`` (build_shard's case: it reads finiteness off the CMVN sums) skips the
    scan of matrices already in the stored dtype; a float32 matrix is still cast and checked."""
    half = record("a", 4, 0)
    half.logmel, half.mfcc = half.logmel.astype(np.float16), half.mfcc.astype(np.float16)
    write_shard(tmp_path / "ok.parquet", [half], finite_checked=True)
    assert write_shard(tmp_path / "same.parquet", [half]).read_bytes() == (tmp_path / "ok.parquet").read_bytes()
    loud = record("b", 4, 1)
    loud.logmel[2, 3] = 70000.0  # float32: cast here, so checked here
    with pytest.raises(ValueError, match="b: logmel is not finite"):
        write_shard(tmp_path / "x.parquet", [half, loud], finite_checked=True)


def test_all_finite_reads_float16_exponent_bits() -> None:
    edges = np.array([0x0000, 0x8000, 0x0001, 0x7BFF, 0xFBFF, 0x3C00], np.uint16).view(
        np.float16
    )  # 0, -0, tiny, ±65504, 1
    assert shards.all_finite(edges) and shards.all_finite(edges[:0]) and shards.all_finite(edges.reshape(2, 3)[:, ::2])
    for bad in (0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7FFF):  # ±inf, NaNs
        values = np.concatenate([edges, np.array([bad], np.uint16).view(np.float16)])
        assert not shards.all_finite(values) and not shards.all_finite(values.reshape(1, -1))
    assert shards.all_finite(edges.astype(np.float32)) and not shards.all_finite(np.float32([1, np.nan]))


def test_stored_features_are_numpys_float16_bit_for_bit(tmp_path: Path) -> None:
    """The writer casts through torch when it is loaded (the shard builder's case) and through
    numpy otherwise: both round to nearest even, so a shard's bytes do not depend on which."""
    import torch  # noqa: F401  (loaded: the fast path)

    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(20_000).astype(np.float32) * s for s in (1e-7, 1e-4, 1.0, 40.0, 1e4)])
    values = np.concatenate([np.float32([65504, 65519.99, -65519.99, 6.1e-5, 5.96e-8, 2.98e-8, 0.0, -0.0]), values])
    values = values[: len(values) // 80 * 80]
    loud = record("a", len(values) // 80, 0)
    loud.logmel = values.reshape(-1, 80)
    (stored,) = iter_shard(write_shard(tmp_path / "x.parquet", [loud]))
    # read back as float32: exact for float16, so equal bits there are equal bits in the file
    assert np.array_equal(
        stored.logmel.view(np.uint32).ravel(), values.astype(np.float16).astype(np.float32).view(np.uint32)
    )
    for bad in (65520.0, np.nan, -np.inf):
        loud.logmel[0, 0] = bad
        with pytest.raises(ValueError, match="not finite"):
            write_shard(tmp_path / "bad.parquet", [loud])


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
