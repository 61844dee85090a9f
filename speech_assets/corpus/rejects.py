"""The rejects table's format (``rejects.parquet`` of the manifest, ``<speaker>.rejects.parquet``
beside each feature shard): one row per utterance left out, with a reason from ``RejectReason``.
Written by the manifest and features stages, read by the audits and the stats database."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import pyarrow as pa
import pyarrow.parquet as pq

from speech_assets.utils import atomic_path


class RejectReason(StrEnum):
    """Reject reasons, exactly as docs/REFERENCE.md spells them (users and CI rely on these strings)."""

    UNREADABLE = "unreadable"
    MISSING_FILE = "missing_file"
    NO_TRANSCRIPT = "no_transcript"
    DUPLICATE_ID = "duplicate_id"
    TOO_SHORT = "too_short"
    TOO_LONG = "too_long"
    OUTSIDE_ROOT = "outside_root"
    INVALID_ID = "invalid_id"
    TRANSCRIPT_TOO_LONG = "transcript_too_long"
    DUPLICATE_AUDIO = "duplicate_audio"
    UNSUPPORTED_FORMAT = "unsupported_format"
    NO_SPEECH = "no_speech"


@dataclass(frozen=True)
class RejectRow:
    utt_id: str
    path: str
    stage: str
    reason: str
    detail: str


REJECTS_SCHEMA = pa.schema(
    [pa.field(name, pa.string(), nullable=False) for name in ("utt_id", "path", "stage", "reason", "detail")]
)


def write_rejects(path: str | os.PathLike[str], rejects: Sequence[RejectRow]) -> None:
    """Write the rows, in their order, atomically (zstd Parquet, ``REJECTS_SCHEMA``)."""
    columns = {name: [getattr(row, name) for row in rejects] for name in REJECTS_SCHEMA.names}
    table = pa.Table.from_pydict(columns, schema=REJECTS_SCHEMA)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
