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
import pyarrow.compute as pc
import pyarrow.parquet as pq

from speech_assets.features.shards import blob_buffers
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
    return _write_table(Path(path), _labels_table(items))


def append_labels(path: str | os.PathLike[str], items: Iterable[UtteranceLabels]) -> Path:
    """Rewrite ``path`` with its rows plus ``items`` (utterances it does not hold yet): the same
    file :func:`write_labels` would write for all of them, without decoding the existing rows
    into Python objects, so extending a client costs about its new utterances."""
    path = Path(path)
    existing, added = pq.read_table(path, schema=LABELS_SCHEMA), _labels_table(items)
    held = pc.is_in(added["utt_id"], value_set=existing["utt_id"])
    if pc.any(held).as_py():
        repeated = pc.filter(added["utt_id"], held).to_pylist()
        raise ValueError(f"{path} already holds labels for {len(repeated)} of these utterances, e.g. {repeated[:3]}")
    merged = pa.concat_tables([existing, added])
    return _write_table(path, merged.sort_by("utt_id").combine_chunks())


def _labels_table(items: Iterable[UtteranceLabels]) -> pa.Table:
    ordered = sorted(items, key=lambda item: item.utt_id)
    return pa.Table.from_pydict(
        {
            "utt_id": [i.utt_id for i in ordered],
            "speaker_id": [i.speaker_id for i in ordered],
            "num_labels": [int(i.labels.shape[0]) for i in ordered],
            "labels": [np.ascontiguousarray(i.labels, dtype="<i2").tobytes() for i in ordered],
        },
        schema=LABELS_SCHEMA,
    )


def _write_table(path: Path, table: pa.Table) -> Path:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd", use_dictionary=["speaker_id"])
    return path


@dataclass
class LabelColumns:
    """A labels.parquet read whole as arrays: ``utt_ids`` (U,) in file order, ``lengths`` (U,)
    int64 labels per utterance (from the blobs, not ``num_labels``), ``values`` (sum(lengths),)
    int16 every utterance's labels back to back."""

    utt_ids: list[str]
    lengths: np.ndarray
    values: np.ndarray


def read_label_columns(path: str | os.PathLike[str]) -> LabelColumns:
    table = pq.read_table(path, columns=["utt_id", "labels"])
    offsets, data = blob_buffers(table.column("labels"))
    nbytes = np.diff(offsets)
    if offsets[0] % 2 or (nbytes % 2).any():
        raise ValueError(f"{path}: a labels blob of an odd number of bytes is not int16")
    return LabelColumns(table.column("utt_id").to_pylist(), nbytes // 2, data[offsets[0] : offsets[-1]].view("<i2"))


def iter_labels(path: str | os.PathLike[str]) -> Iterator[UtteranceLabels]:
    columns = pq.read_table(path, columns=["utt_id", "speaker_id", "labels"]).to_pydict()
    for utt_id, speaker, blob in zip(*columns.values(), strict=True):
        yield UtteranceLabels(utt_id, speaker, np.frombuffer(blob, dtype="<i2"))


def read_labels(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Map ``utt_id`` -> ``(L,)`` int16 labels."""
    return {item.utt_id: item.labels for item in iter_labels(path)}
