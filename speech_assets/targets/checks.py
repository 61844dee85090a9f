"""Checks of a client's published targets, reading only the files (never how they were written)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from speech_assets.corpus.clients import ClientsTable
from speech_assets.layout import TargetFiles
from speech_assets.targets import labels


def label_problems(
    assignments: ClientsTable, shard_file: Callable[[str], Path], targets_dir: Callable[[str], Path]
) -> list[str]:
    """What is wrong with every client's ``targets_dir(client)/labels.parquet`` (``assignments``:
    the clients table) against the shards of its speakers (``shard_file(speaker)``): utterances
    missing or foreign, label counts other than one per 50 Hz frame, ids outside the client's
    codebook (``codebook.npy``)."""
    problems: list[str] = []
    for client in assignments.clients:
        out = targets_dir(client)
        files = TargetFiles(out)
        if not files.codebook.is_file() or not files.labels.is_file():
            problems.append(f"{client}: no codebook.npy or labels.parquet in {out}")
            continue
        k = int(np.load(files.codebook, mmap_mode="r").shape[0])
        found = labels.read_label_columns(files.labels)
        expected: dict[str, int] = {}
        for speaker in (a.speaker_id for a in assignments if a.client_id == client):
            table = pq.ParquetFile(shard_file(speaker)).read(columns=["utt_id", "num_frames"])
            expected |= dict(zip(table.column(0).to_pylist(), table.column(1).to_pylist(), strict=True))
        lengths = dict(zip(found.utt_ids, found.lengths.tolist(), strict=True))
        if set(lengths) != set(expected):
            problems.append(
                f"{client}: {len(set(expected) - set(lengths))} utterance(s) unlabelled, "
                f"{len(set(lengths) - set(expected))} foreign"
            )
        # ids are checked over all of the client's labels at once; per utterance only if some fail
        outside = (found.values < 0) | (found.values >= k)
        bad_ids = set()
        if outside.any():
            owner = np.repeat(np.arange(len(found.utt_ids)), found.lengths)  # label -> its utterance
            bad_ids = {found.utt_ids[i] for i in np.unique(owner[outside]).tolist()}
        for utt, frames in expected.items():
            count = lengths.get(utt)
            if count is not None and (count != (frames + 1) // 2 or utt in bad_ids):
                problems.append(f"{client}/{utt}: {count} labels for {frames} frames or ids outside [0, {k})")
    return problems
