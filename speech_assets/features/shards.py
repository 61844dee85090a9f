"""Feature shards: the on-disk format that k-means and training read.

A shard is one Parquet file (zstd) with one row per kept utterance, sorted by ``utt_id``.
Feature matrices are stored as little-endian float32 bytes of C-contiguous arrays
(``logmel``: ``(num_frames, 80)``, ``mfcc``: ``(num_frames, 39)``), which read back with
``np.frombuffer`` and no Python-level copying; nested list columns read several-fold slower
(see docs/BENCHMARKS.md).

Frame rate is 100 Hz: 25 ms windows (400 samples at 16 kHz), 10 ms hop (160 samples), no
centring (Kaldi ``snip_edges``), so ``num_frames = 1 + (num_samples - 400) // 160``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from speech_assets.utils import atomic_path, atomic_write_text, remove_stale_temp_files, sha256_file

SAMPLE_RATE = 16_000
WIN_LENGTH = 400
HOP_LENGTH = 160
FRAME_RATE_HZ = SAMPLE_RATE // HOP_LENGTH
N_MELS = 80
N_MFCC = 13
MFCC_DIM = 3 * N_MFCC

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
SCALAR_COLUMNS = tuple(f.name for f in SHARD_SCHEMA if f.name not in ("logmel", "mfcc"))


def num_frames_for(num_samples: int) -> int:
    """Frames produced for a 16 kHz waveform of ``num_samples`` (0 when shorter than a window)."""
    if num_samples < WIN_LENGTH:
        return 0
    return 1 + (num_samples - WIN_LENGTH) // HOP_LENGTH


@dataclass
class FeatureRecord:
    """One utterance's features. ``logmel``: ``(T, 80)`` float32, ``mfcc``: ``(T, 39)`` float32."""

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
        for name, dim in (("logmel", N_MELS), ("mfcc", MFCC_DIM)):
            value = getattr(self, name)
            if value is not None and value.shape != (self.num_frames, dim):
                raise ValueError(f"{self.utt_id}: {name} has shape {value.shape}, expected ({self.num_frames}, {dim})")


def records_to_table(records: Sequence[FeatureRecord]) -> pa.Table:
    """Build a shard table (rows sorted by ``utt_id``) from records that carry both matrices."""
    ordered = sorted(records, key=lambda r: r.utt_id)
    columns: dict[str, list] = {name: [getattr(r, name) for r in ordered] for name in SCALAR_COLUMNS}
    columns["logmel"] = [_to_blob(r.logmel, r.utt_id, "logmel") for r in ordered]
    columns["mfcc"] = [_to_blob(r.mfcc, r.utt_id, "mfcc") for r in ordered]
    return pa.Table.from_pydict(columns, schema=SHARD_SCHEMA)


def _to_blob(matrix: np.ndarray | None, utt_id: str, name: str) -> bytes:
    if matrix is None:
        raise ValueError(f"{utt_id}: {name} missing, cannot write shard")
    return np.ascontiguousarray(matrix, dtype="<f4").tobytes()


ROW_GROUP_ROWS = 32
"""Utterances per Parquet row group: the unit a reader decompresses. Small enough that the
training loader caches a window of many blocks (~13 MB each at LibriSpeech lengths) and each
block is used for whole batches (see train/sampling.py); large enough to compress well."""


def write_shard(path: str | os.PathLike[str], records: Sequence[FeatureRecord], row_group_rows: int = ROW_GROUP_ROWS) -> Path:
    """Write ``records`` atomically as a shard at ``path``. Byte-identical for identical input."""
    table = records_to_table(records)
    path = Path(path)
    with atomic_path(path) as tmp:
        pq.write_table(
            table,
            tmp,
            compression="zstd",
            compression_level=1,  # same size as level 3 on features, ~40% less write CPU
            use_dictionary=["speaker_id", "chapter_id"],
            write_statistics=["utt_id", "speaker_id", "num_frames"],
            row_group_size=row_group_rows,
        )
    return path


def read_shard_table(path: str | os.PathLike[str], columns: Sequence[str] | None = None) -> pa.Table:
    """Read a shard (or some of its columns) as a pyarrow Table."""
    return pq.read_table(path, columns=list(columns) if columns is not None else None)


def blob_to_matrix(blob: bytes | memoryview | pa.Scalar, dim: int) -> np.ndarray:
    """View a float32 feature blob as a ``(T, dim)`` array (zero-copy when possible)."""
    buffer = blob.as_buffer() if isinstance(blob, pa.Scalar) else blob
    return np.frombuffer(buffer, dtype="<f4").reshape(-1, dim)


def iter_shard(
    path: str | os.PathLike[str], features: Sequence[str] = ("logmel", "mfcc")
) -> Iterator[FeatureRecord]:
    """Stream a shard's utterances in ``utt_id`` order, row group by row group.

    ``features`` selects which matrices to decode (``()`` reads only the scalar columns).
    The arrays are read-only views into Arrow buffers; copy them before writing in place.
    """
    unknown = set(features) - {"logmel", "mfcc"}
    if unknown:
        raise ValueError(f"unknown feature columns: {sorted(unknown)}")
    dims = {"logmel": N_MELS, "mfcc": MFCC_DIM}
    parquet = pq.ParquetFile(path)
    columns = [*SCALAR_COLUMNS, *features]
    for group in range(parquet.num_row_groups):
        table = parquet.read_row_group(group, columns=columns)
        scalars = {name: table.column(name).to_pylist() for name in SCALAR_COLUMNS}
        blobs = {name: table.column(name).combine_chunks() for name in features}
        for row in range(table.num_rows):
            matrices = {name: blob_to_matrix(blobs[name][row], dims[name]) for name in features}
            yield FeatureRecord(**{name: scalars[name][row] for name in SCALAR_COLUMNS}, **matrices)


def sidecar_paths(shard_path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``<dir>/<stem>.rejects.parquet`` and ``<dir>/<stem>.stats.npz`` beside ``<dir>/<stem>.parquet``."""
    shard_path = Path(shard_path)
    stem = shard_path.name.removesuffix(".parquet")
    return shard_path.with_name(f"{stem}.rejects.parquet"), shard_path.with_name(f"{stem}.stats.npz")


@dataclass(frozen=True)
class ShardFiles:
    """The files one speaker's shard consists of.

    ``meta`` is written last and vouches for the other three: it records each one's size and
    mtime (and the shard's sha256), so a stat tells whether the files on disk are the ones it
    describes. ``lock`` serialises writers of this shard across runs and processes.
    """

    shard: Path
    rejects: Path
    stats: Path
    meta: Path
    lock: Path

    @classmethod
    def of(cls, shards_dir: str | os.PathLike[str], speaker_id: str) -> ShardFiles:
        shard = Path(shards_dir) / f"{speaker_id}.parquet"
        rejects, stats = sidecar_paths(shard)
        return cls(shard, rejects, stats, shard.with_name(f"{speaker_id}.meta.json"), shard.with_name(f".{speaker_id}.lock"))

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

    def write_meta(self, meta: dict) -> dict:
        """Record ``meta`` plus the size, mtime (and the shard's sha256) of the vouched files."""
        full = dict(meta)
        for name, path in self.vouched.items():
            stat = path.stat()
            full[f"{name}_size"], full[f"{name}_mtime_ns"] = stat.st_size, stat.st_mtime_ns
        full["shard_sha256"] = sha256_file(self.shard)
        full["stats_sha256"] = sha256_file(self.stats)
        atomic_write_text(self.meta, json.dumps(full, indent=1, sort_keys=True))
        return full

    def remove_temp_files(self) -> int:
        """Leftovers of this shard's writers that died mid-write (call while holding ``lock``)."""
        return sum(remove_stale_temp_files(path) for path in (*self.vouched.values(), self.meta))
