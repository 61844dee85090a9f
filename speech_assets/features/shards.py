"""Feature shards: the on-disk format that k-means and training read.

One Parquet file per speaker, one row per kept utterance sorted by ``utt_id``, feature matrices
(``logmel`` ``(T, 80)``, ``mfcc`` ``(T, 39)``) as binary blobs that read back with
``np.frombuffer`` (nested list columns read several-fold slower, docs/BENCHMARKS.md).

The format version is in the Parquet key-value metadata: 1 (no key) float32 blobs, 2 (written
now) float16 blobs, half the bytes at the same k-means inertia and loss. An unknown format is an
error, never a guess. Frames: 25 ms windows, 10 ms hop, no centring (Kaldi ``snip_edges``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from speech_assets.layout import ShardPaths
from speech_assets.utils import atomic_path, atomic_write_text, deferred_fsync, remove_stale_temp_files, sha256_file

SAMPLE_RATE = 16_000
WIN_LENGTH = 400
HOP_LENGTH = 160
FRAME_RATE_HZ = SAMPLE_RATE // HOP_LENGTH
N_MELS = 80
N_MFCC = 13
MFCC_DIM = 3 * N_MFCC
FEATURE_DIMS = {"logmel": N_MELS, "mfcc": MFCC_DIM}

SHARD_FORMAT = 2  # what write_shard writes
FEATURE_DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<f2")}
FORMAT_KEY = b"speech_assets.shard_format"
DTYPE_KEY = b"speech_assets.feature_dtype"

SHARD_SCHEMA = pa.schema(
    [
        pa.field("utt_id", pa.string(), nullable=False),
        pa.field("speaker_id", pa.string(), nullable=False),
        pa.field("chapter_id", pa.string(), nullable=False),
        pa.field("num_frames", pa.int32(), nullable=False),
        pa.field("duration_s", pa.float32(), nullable=False),
        pa.field("speech_start_s", pa.float32(), nullable=False),
        pa.field("speech_end_s", pa.float32(), nullable=False),
        pa.field("trimmed_duration_s", pa.float32(), nullable=False),
        pa.field("speech_ratio", pa.float32(), nullable=False),
        pa.field("logmel", pa.binary(), nullable=False),
        pa.field("mfcc", pa.binary(), nullable=False),
    ]
)
SCALAR_COLUMNS = tuple(f.name for f in SHARD_SCHEMA if f.name not in FEATURE_DIMS)


class ShardFormatError(ValueError):
    """A shard whose format this code cannot read (newer or unknown): rebuild it or update the code."""


def shard_format(source: str | os.PathLike[str] | pa.Schema | pq.ParquetFile) -> int:
    """The format version of a shard (no key: 1); :class:`ShardFormatError` for an unknown one or a
    dtype key that contradicts it."""
    if isinstance(source, pq.ParquetFile):
        source = source.schema_arrow
    schema, where = (source, "shard") if isinstance(source, pa.Schema) else (pq.read_schema(source), str(source))
    metadata = schema.metadata or {}
    raw = metadata.get(FORMAT_KEY)
    try:
        version = 1 if raw is None else int(raw)
    except ValueError:
        version = -1
    if version not in FEATURE_DTYPES:
        raise ShardFormatError(
            f"{where}: shard format {raw.decode(errors='replace')!r} is not one this code reads "
            f"({', '.join(map(str, FEATURE_DTYPES))}); rebuild the shard or update speech_assets"
        )
    dtype = metadata.get(DTYPE_KEY)
    if (dtype is not None or version > 1) and dtype != FEATURE_DTYPES[version].str.encode():
        raise ShardFormatError(
            f"{where}: shard format {version} with feature dtype {dtype!r}, expected {FEATURE_DTYPES[version].str!r}"
        )
    return version


def feature_dtype(source: str | os.PathLike[str] | pa.Schema | pq.ParquetFile) -> np.dtype:
    return FEATURE_DTYPES[shard_format(source)]


def num_frames_for(num_samples: int) -> int:
    """Frames of a 16 kHz waveform of ``num_samples`` (0 when shorter than a window)."""
    return 0 if num_samples < WIN_LENGTH else 1 + (num_samples - WIN_LENGTH) // HOP_LENGTH


@dataclass
class FeatureRecord:
    """One utterance's features: ``logmel`` ``(T, 80)``, ``mfcc`` ``(T, 39)`` (``None`` when not read)."""

    utt_id: str
    speaker_id: str
    chapter_id: str
    num_frames: int
    duration_s: float
    speech_start_s: float
    speech_end_s: float
    trimmed_duration_s: float
    speech_ratio: float
    logmel: np.ndarray | None = None
    mfcc: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name, dim in FEATURE_DIMS.items():
            value = getattr(self, name)
            if value is not None and value.shape != (self.num_frames, dim):
                raise ValueError(f"{self.utt_id}: {name} has shape {value.shape}, expected ({self.num_frames}, {dim})")


def _cast(matrix: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``matrix`` in ``dtype``; float32 -> float16 through torch when already imported (bit-identical,
    ~10x numpy's cast); the code location must not import torch."""
    torch = sys.modules.get("torch")
    halving = torch is not None and dtype == np.float16 and matrix.dtype == np.float32
    if halving and matrix.flags.c_contiguous and matrix.flags.writeable:
        return torch.from_numpy(matrix).to(torch.float16).numpy()
    with np.errstate(over="ignore"):  # overflow to inf is reported by the caller
        return np.asarray(matrix, dtype=dtype)


def all_finite(values: np.ndarray) -> bool:
    """Whether every value is finite; float16 by its bits (inf is 0x7C00 without the sign, NaN above),
    faster than numpy's emulated float16 ``isfinite``."""
    if values.dtype == np.float16:
        return values.size == 0 or int(np.bitwise_and(values.view(np.uint16), 0x7FFF).max()) < 0x7C00
    return bool(np.isfinite(values).all())


_MAX_CHUNK_BYTES = 2**31 - 1  # a BinaryArray's int32 offsets


def _feature_column(
    ordered: Sequence[FeatureRecord], name: str, dtype: np.dtype, checked: bool = False
) -> pa.ChunkedArray:
    """One binary column from one numpy buffer per chunk; ``checked``: matrices in ``dtype`` are known finite."""
    dim = FEATURE_DIMS[name]
    matrices = [getattr(record, name) for record in ordered]
    if (missing := next((r.utt_id for r, m in zip(ordered, matrices) if m is None), None)) is not None:
        raise ValueError(f"{missing}: {name} missing, cannot write shard")
    row_bytes = np.array([m.shape[0] * dim * dtype.itemsize for m in matrices], dtype=np.int64)
    chunks, start = [], 0
    while start < len(matrices) or not chunks:
        # as many rows as the chunk's offsets can address, at least one
        fits = int(np.searchsorted(np.cumsum(row_bytes[start:]), _MAX_CHUNK_BYTES, side="right"))
        end = min(len(matrices), start + max(fits, 1))
        values = np.empty((int(sum(m.shape[0] for m in matrices[start:end])), dim), dtype=dtype)
        row = 0
        for matrix in matrices[start:end]:
            # the one cast to the stored dtype (a copy when build_shard already stored it)
            values[row : row + matrix.shape[0]] = matrix if matrix.dtype == dtype else _cast(matrix, dtype)
            row += matrix.shape[0]
        if not (checked and all(m.dtype == dtype for m in matrices[start:end])) and not all_finite(values):
            bounds = np.cumsum([0, *(m.shape[0] for m in matrices[start:end])])
            bad = next(
                r.utt_id
                for r, a, b in zip(ordered[start:end], bounds[:-1], bounds[1:], strict=True)
                if not all_finite(values[a:b])
            )
            raise ValueError(
                f"{bad}: {name} is not finite in {dtype} (NaN, inf or beyond its range), cannot write shard"
            )
        offsets = np.zeros(end - start + 1, dtype=np.int32)
        np.cumsum(row_bytes[start:end], out=offsets[1:])
        chunks.append(
            pa.BinaryArray.from_buffers(pa.binary(), end - start, [None, pa.py_buffer(offsets), pa.py_buffer(values)])
        )
        start = end
    return pa.chunked_array(chunks, type=pa.binary())


def records_to_table(
    records: Sequence[FeatureRecord], version: int = SHARD_FORMAT, *, finite_checked: bool = False
) -> pa.Table:
    """A shard table of format ``version``, rows sorted by ``utt_id``. Every value must be finite in
    the stored dtype, checked unless ``finite_checked`` vouches for matrices already in it."""
    if version not in FEATURE_DTYPES:
        raise ShardFormatError(f"cannot write shard format {version!r} (known: {sorted(FEATURE_DTYPES)})")
    metadata = {FORMAT_KEY: str(version).encode(), DTYPE_KEY: FEATURE_DTYPES[version].str.encode()}
    schema = SHARD_SCHEMA if version == 1 else SHARD_SCHEMA.with_metadata(metadata)  # format 1: no key
    ordered = sorted(records, key=lambda r: r.utt_id)
    columns = [
        pa.array([getattr(r, f.name) for r in ordered], type=f.type) for f in SHARD_SCHEMA if f.name in SCALAR_COLUMNS
    ]
    features = [_feature_column(ordered, name, FEATURE_DTYPES[version], finite_checked) for name in FEATURE_DIMS]
    return pa.Table.from_arrays([*columns, *features], schema=schema)


# Utterances per row group, the unit a reader decompresses: small enough for the training loader to
# cache many (~6.5 MB each at LibriSpeech lengths), large enough to compress well
ROW_GROUP_ROWS = 32


def write_shard(
    path: str | os.PathLike[str],
    records: Sequence[FeatureRecord],
    row_group_rows: int = ROW_GROUP_ROWS,
    version: int = SHARD_FORMAT,
    *,
    finite_checked: bool = False,
) -> Path:
    """Write ``records`` atomically as a shard; byte-identical for identical input."""
    table = records_to_table(records, version, finite_checked=finite_checked)
    # float16 features are stored uncompressed: zstd saves ~10 % of their bytes (63.6 -> 57.3 MB per
    # hour of audio) for ~0.035 ms CPU per audio second, a sixth of the shard builder's cost beyond
    # decoding and featurising, and readers skip decompressing them (docs/BENCHMARKS.md).
    raw = FEATURE_DIMS if version >= 2 else ()
    compression = {name: "none" if name in raw else "zstd" for name in table.column_names}
    path = Path(path)
    with atomic_path(path) as tmp:
        pq.write_table(
            table,
            tmp,
            compression=compression,
            # level 1: as small as 3, less CPU
            compression_level={name: 1 for name, codec in compression.items() if codec == "zstd"},
            use_dictionary=["speaker_id", "chapter_id"],
            write_statistics=["utt_id", "speaker_id", "num_frames"],
            row_group_size=row_group_rows,
        )
    return path


def read_shard_table(path: str | os.PathLike[str], columns: Sequence[str] | None = None) -> pa.Table:
    """A shard (or some of its columns) as a table whose schema keeps the format metadata."""
    table = pq.read_table(path, columns=list(columns) if columns is not None else None)
    shard_format(table.schema)  # an unknown format fails here, not as garbage later
    return table


def blob_buffers(blobs: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A binary column's ``len + 1`` offsets and its value bytes (read-only ``uint8``), without a copy."""
    if isinstance(blobs, pa.ChunkedArray):
        blobs = blobs.combine_chunks()  # one chunk per row group read: no copy then
    if len(blobs) == 0:
        return np.zeros(1, np.int64), np.empty(0, np.uint8)
    _, offsets, values = blobs.buffers()
    offsets = np.frombuffer(offsets, dtype=np.int32)[blobs.offset : blobs.offset + len(blobs) + 1].astype(np.int64)
    data = np.frombuffer(values, dtype=np.uint8) if values is not None else np.empty(0, np.uint8)
    data.flags.writeable = False  # Arrow's buffers may be mutable; nobody else expects writes
    return offsets, data


def blob_matrices(blobs: pa.Array | pa.ChunkedArray, dim: int, dtype: np.dtype | str) -> list[np.ndarray]:
    """Every blob of a binary column as a read-only ``(T, dim)`` view into its value buffer."""
    offsets, data = blob_buffers(blobs)
    return [
        data[start:end].view(dtype).reshape(-1, dim)
        for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
    ]


def check_blob_lengths(
    blobs: pa.Array | pa.ChunkedArray, num_frames: np.ndarray, dim: int, dtype: np.dtype, where: str = "shard"
) -> None:
    """``ValueError`` unless every blob holds ``num_frames * dim`` values of ``dtype`` (a blob of another
    dtype has the wrong length)."""
    lengths = pc.binary_length(blobs).to_numpy(zero_copy_only=False)
    expected = np.asarray(num_frames, dtype=np.int64) * dim * np.dtype(dtype).itemsize
    if not np.array_equal(lengths, expected):
        row = int(np.flatnonzero(lengths != expected)[0])
        raise ValueError(
            f"{where}: row {row} has {lengths[row]} feature bytes, expected {expected[row]} ({dim} x "
            f"{np.dtype(dtype)} per frame)"
        )


def iter_shard(
    path: str | os.PathLike[str],
    features: Sequence[str] = ("logmel", "mfcc"),
    dtype: np.dtype | type | str | None = np.float32,
) -> Iterator[FeatureRecord]:
    """Stream a shard's utterances in ``utt_id`` order, row group by row group.

    ``features``: the matrices to decode (``()``: scalars only). ``dtype``: theirs (``None``:
    read-only views of the stored blobs, for consumers that go through CMVN's ``apply``).
    """
    if unknown := set(features) - set(FEATURE_DIMS):
        raise ValueError(f"unknown feature columns: {sorted(unknown)}")
    parquet = pq.ParquetFile(path)
    stored = feature_dtype(parquet)  # also for scalars only: an unknown format is never read
    columns = [*SCALAR_COLUMNS, *features]
    for group in range(parquet.num_row_groups):
        table = parquet.read_row_group(group, columns=columns)
        scalars = {name: table.column(name).to_pylist() for name in SCALAR_COLUMNS}
        views = {name: blob_matrices(table.column(name), FEATURE_DIMS[name], stored) for name in features}
        for row in range(table.num_rows):
            matrices = {
                name: views[name][row] if dtype is None else views[name][row].astype(dtype, copy=False)
                for name in features
            }
            # FeatureRecord checks each shape against num_frames: a blob misread in the wrong dtype fails here
            yield FeatureRecord(**{name: scalars[name][row] for name in SCALAR_COLUMNS}, **matrices)


@dataclass(frozen=True)
class ShardFiles(ShardPaths):
    """The files of one speaker's shard. ``meta`` is written last and vouches for the other three by
    their size and mtime, so a stat tells whether the files are the ones it describes; a crash
    costs at most rebuilding that one shard. ``lock`` serialises writers of this shard.
    """

    @property
    def vouched(self) -> dict[str, Path]:
        return {"shard": self.shard, "rejects": self.rejects, "stats": self.stats}

    def read_meta(self) -> dict | None:
        """The shard's metadata if every file it vouches for is present and unchanged, else None."""
        try:
            meta = json.loads(self.meta.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        # A stat per file is enough (sensors call this every tick for every shard); the sizes
        # and mtimes were recorded when the files were hashed.
        for name, path in self.vouched.items():
            try:
                stat = path.stat()
            except OSError:
                return None
            if (meta.get(f"{name}_size"), meta.get(f"{name}_mtime_ns")) != (stat.st_size, stat.st_mtime_ns):
                return None
        return meta

    def publish(self) -> contextlib.AbstractContextManager[None]:
        """A block to write the vouched files in (then :meth:`write_meta`): the old meta goes now and
        the files are made durable together when the block ends, before any meta can vouch for them."""
        self.meta.unlink(missing_ok=True)
        return deferred_fsync()

    def write_meta(self, meta: dict) -> dict:
        """Record ``meta`` plus the vouched files' sizes and mtimes; not fsynced (a lost meta only rebuilds)."""
        full = dict(meta)
        for name, path in self.vouched.items():
            stat = path.stat()
            full[f"{name}_size"], full[f"{name}_mtime_ns"] = stat.st_size, stat.st_mtime_ns
        full["shard_sha256"] = sha256_file(self.shard)
        full["stats_sha256"] = sha256_file(self.stats)
        atomic_write_text(self.meta, json.dumps(full, indent=1, sort_keys=True), durable=False)
        return full

    def remove_temp_files(self) -> int:
        """Leftovers of this shard's writers that died mid-write (call while holding ``lock``)."""
        return sum(remove_stale_temp_files(path) for path in (*self.vouched.values(), self.meta))


ROWS_SCANNED_PER_SHARD = 256  # the first row group: NaN/inf scan stays bounded at any corpus size


def shard_problems(files: ShardFiles, meta: dict) -> list[str]:
    """What is wrong with one published shard: counts against the meta, frames against durations,
    and the first :data:`ROWS_SCANNED_PER_SHARD` rows' blobs for size and NaN/inf."""
    problems = []
    parquet = pq.ParquetFile(files.shard)
    table = parquet.read(columns=["utt_id", "num_frames", "trimmed_duration_s"])
    if table.num_rows != meta["utterances"] or pq.read_metadata(files.rejects).num_rows != meta["rejects"]:
        problems.append(f"{meta['speaker_id']}: {table.num_rows} rows / meta says {meta['utterances']}")
    for utt, frames, trimmed in zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True):
        if frames != num_frames_for(round(trimmed * SAMPLE_RATE)):
            problems.append(f"{utt}: {frames} frames for {trimmed:.4f} s")
    if parquet.num_row_groups:
        dtype = feature_dtype(parquet)
        group = parquet.read_row_group(0, columns=["utt_id", "num_frames", *FEATURE_DIMS])
        group = group.slice(0, ROWS_SCANNED_PER_SHARD)
        utt_ids, frames = group.column("utt_id").to_pylist(), group.column("num_frames").to_numpy()
        for name, dim in FEATURE_DIMS.items():
            try:  # the feature bytes match the frames (a blob of another dtype would not)
                check_blob_lengths(group.column(name), frames, dim, dtype, f"{meta['speaker_id']} {name}")
            except ValueError as error:
                problems.append(str(error))
                continue
            problems += [
                f"{utt}: NaN or inf in its {name}"
                for utt, matrix in zip(utt_ids, blob_matrices(group.column(name), dim, dtype), strict=True)
                if not all_finite(matrix)
            ]
    return problems
