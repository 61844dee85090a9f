"""What probes read: the raw log-mel ``(T, 80)`` and transcript of every kept utterance of some shards
(each model under probe normalises it its own way: evaluation/compare.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from speech_assets.evaluation.text import normalise
from speech_assets.features.shards import iter_shard


@dataclass
class Utterance:
    """One utterance: ``feats (T, 80)`` float32 raw log-mel at 100 Hz (no CMVN), its normalised transcript."""

    utt_id: str
    speaker_id: str
    feats: np.ndarray
    text: str


def load_utterances(shards: Sequence[str | os.PathLike[str]], transcripts: Mapping[str, str]) -> list[Utterance]:
    """Every utterance of ``shards`` that has a non-empty transcript, in shard then ``utt_id`` order."""
    found = []
    for shard in shards:
        for record in iter_shard(shard, features=("logmel",), dtype=None):
            text = normalise(transcripts.get(record.utt_id) or "")
            if text and record.logmel is not None:
                # float32 as a copy (one conversion; never a view into Arrow's buffers)
                found.append(Utterance(record.utt_id, record.speaker_id, record.logmel.astype(np.float32), text))
    return found


def manifest_utterances(
    manifest_file: str | os.PathLike[str], shards: Sequence[str | os.PathLike[str]]
) -> list[Utterance]:
    """:func:`load_utterances` of ``shards`` with the transcripts of the manifest (raw log-mel:
    each model normalises its own way)."""
    table = pq.read_table(manifest_file, columns=["utt_id", "transcript"]).to_pydict()
    return load_utterances(shards, dict(zip(table["utt_id"], table["transcript"], strict=True)))
