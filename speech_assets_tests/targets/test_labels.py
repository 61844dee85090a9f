"""The labels file: appending writes what writing everything would, and the column reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speech_assets.targets.labels import (
    LABELS_SCHEMA,
    UtteranceLabels,
    append_labels,
    read_label_columns,
    read_labels,
    write_labels,
)


def items(speaker: str, count: int, seed: int) -> list[UtteranceLabels]:
    rng = np.random.default_rng(seed)
    return [
        UtteranceLabels(
            f"{speaker}-c-{i:03d}", speaker, rng.integers(0, 100, int(rng.integers(0, 60))).astype(np.int16)
        )
        for i in range(count)
    ]


def test_appending_writes_the_same_file_as_writing_all(tmp_path: Path) -> None:
    old, new = items("b", 7, 0), items("a", 5, 1) + items("c", 3, 2)  # newcomers sort before and after
    write_labels(tmp_path / "all.parquet", old + new)
    write_labels(tmp_path / "grown.parquet", old)
    append_labels(tmp_path / "grown.parquet", new)
    assert (tmp_path / "grown.parquet").read_bytes() == (tmp_path / "all.parquet").read_bytes()


def test_label_columns_are_the_labels_back_to_back(tmp_path: Path) -> None:
    written = items("s", 9, 3) + [UtteranceLabels("s-c-999", "s", np.zeros(0, np.int16))]  # an empty one last
    write_labels(tmp_path / "labels.parquet", written)
    columns = read_label_columns(tmp_path / "labels.parquet")
    expected = read_labels(tmp_path / "labels.parquet")
    assert columns.utt_ids == list(expected)
    assert columns.lengths.tolist() == [len(v) for v in expected.values()]
    np.testing.assert_array_equal(columns.values, np.concatenate(list(expected.values())))

    write_labels(tmp_path / "empty.parquet", [])
    empty = read_label_columns(tmp_path / "empty.parquet")
    assert empty.utt_ids == [] and empty.lengths.size == 0 and empty.values.size == 0


def test_a_labels_blob_of_an_odd_number_of_bytes_is_refused(tmp_path: Path) -> None:
    rows = {"utt_id": ["a", "b"], "speaker_id": ["s", "s"], "num_labels": [1, 1], "labels": [b"\x01\x00", b"\x02"]}
    pq.write_table(pa.Table.from_pydict(rows, schema=LABELS_SCHEMA), tmp_path / "odd.parquet")
    with pytest.raises(ValueError, match="odd number of bytes"):
        read_label_columns(tmp_path / "odd.parquet")


def test_appending_an_utterance_the_file_holds_is_refused(tmp_path: Path) -> None:
    old = items("b", 4, 0)
    write_labels(tmp_path / "labels.parquet", old)
    before = (tmp_path / "labels.parquet").read_bytes()
    with pytest.raises(ValueError, match="already holds labels for 1 of these utterances"):
        append_labels(tmp_path / "labels.parquet", items("a", 2, 1) + [old[2]])
    assert (tmp_path / "labels.parquet").read_bytes() == before
