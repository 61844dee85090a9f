"""The target-label file format: per-utterance int16 labels at the model's 50 Hz rate, one
``labels.parquet`` per client. Written by the targets stage (targets/build.py, iteration2.py),
read by training: light on purpose (numpy and pyarrow only, no k-means, no faiss)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from speech_assets.utils import atomic_path

LABELS_SCHEMA = pa.schema(
    [
        pa.field("utt_id", pa.string(), nullable=False),
        pa.field("speaker_id", pa.string(), nullable=False),
        pa.field("num_labels", pa.int32(), nullable=False),
        pa.field("labels", pa.binary(), nullable=False),
    ]
)


@dataclass
class UtteranceLabels:
    """``labels``: ``(L,)`` int16 cluster ids at 50 Hz, ``L = (num_frames + 1) // 2``."""

    utt_id: str
    speaker_id: str
    labels: np.ndarray


def write_labels(path: str | os.PathLike[str], items: Iterable[UtteranceLabels]) -> Path:
    ordered = sorted(items, key=lambda item: item.utt_id)
    table = pa.Table.from_pydict(
        {
            "utt_id": [i.utt_id for i in ordered],
            "speaker_id": [i.speaker_id for i in ordered],
            "num_labels": [int(i.labels.shape[0]) for i in ordered],
            "labels": [np.ascontiguousarray(i.labels, dtype="<i2").tobytes() for i in ordered],
        },
        schema=LABELS_SCHEMA,
    )
    path = Path(path)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd", use_dictionary=["speaker_id"])
    return path


def iter_labels(path: str | os.PathLike[str]) -> Iterator[UtteranceLabels]:
    table = pq.read_table(path)
    utt_ids = table.column("utt_id").to_pylist()
    speakers = table.column("speaker_id").to_pylist()
    blobs = table.column("labels").combine_chunks()
    for row, (utt_id, speaker) in enumerate(zip(utt_ids, speakers, strict=True)):
        yield UtteranceLabels(utt_id, speaker, np.frombuffer(blobs[row].as_buffer(), dtype="<i2"))


def read_labels(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Map ``utt_id`` -> ``(L,)`` int16 labels."""
    return {item.utt_id: item.labels for item in iter_labels(path)}
