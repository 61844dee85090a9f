"""Unsafe ids through the manifest asset on a real instance, for each corpus form: every one is an
invalid_id reject, the good rows beside them are published, only good speakers become partitions,
and nothing is written anywhere but the data dir's own files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from speech_assets.definitions import build_definitions
from speech_assets.defs.resources import ManifestSettings, PipelineSettings, StoragePaths
from speech_assets_tests.support.corpora import LibriCorpus, write_flac
from speech_assets_tests.support.local_runs import materialize_in_process

BAD = {
    "parent": "../../x",
    "sidecar": "a.rejects",
    "dot": "spk.1",
    "empty": "",
    "300-chars": "s" * 300,
    "non-ascii": "spk_é",
}
GOOD_SPEAKERS = ["g1", "g2"]


def manifest_file_corpus(root: Path, suffix: str) -> tuple[Path, int]:
    """good rows for g1, g2 and, for each field and bad value, one row with only that id bad."""
    for index, speaker in enumerate(GOOD_SPEAKERS):  # a recording each (one under two ids: duplicate_audio)
        write_flac(root / f"{speaker}.flac", seed=10 + index)
    write_flac(root / "bad.flac", seed=1)
    write_flac(root / "b.a.d.flac", seed=2)  # an empty utt_id falls back to this file name
    records = [
        {"path": f"{s}.flac", "transcript": "fine", "speaker_id": s, "utt_id": f"{s}-u", "chapter_id": "c"}
        for s in GOOD_SPEAKERS
    ]
    bad_rows = 0
    for field in ("speaker_id", "chapter_id", "utt_id"):
        for name, value in BAD.items():
            if field == "chapter_id" and value == "":
                continue  # optional: empty means chapter "0"
            record = {
                "path": "bad.flac",
                "transcript": "bad",
                "speaker_id": "b1",
                "utt_id": f"{field}-{name}",
                "chapter_id": "c",
            }
            record[field] = value
            if field == "utt_id" and value == "":
                record["path"] = "b.a.d.flac"
            records.append(record)
            bad_rows += 1
    location = root / f"corpus{suffix}"
    if suffix == ".csv":
        with open(location, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    else:
        location.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return location, bad_rows


def librispeech_corpus(root: Path) -> tuple[Path, int]:
    libri = LibriCorpus(root)
    for speaker in GOOD_SPEAKERS:
        libri.add(speaker, "10", 0)
    bad_files = [
        ("a.rejects", "10", "a.rejects-10-0001"),
        ("spk_é", "10", "spk_é-10-0001"),
        ("7", "10", "-10-0001"),
        ("7", "10.x", "7-10.x-0001"),
        ("7", "10", "7--0001"),
        ("7", "10", "7-10-0001.rejects"),
        ("7", "10", "7-10-é"),
    ]
    for speaker, chapter, stem in bad_files:
        write_flac(libri.chapter_dir(speaker, chapter) / f"{stem}.flac")
        libri.add_line(speaker, chapter, stem, "BAD")
    for utt_id in ("../../x", "u" * 300):  # possible only as transcript lines (no such file name)
        libri.add_line("7", "10", utt_id, "BAD")
    return root, len(bad_files) + 2


@pytest.mark.parametrize("form", ["csv", "jsonl", "librispeech"])
def test_unsafe_ids_are_rejected_and_never_reach_a_path_or_partition(tmp_path: Path, instance, form: str) -> None:
    root = tmp_path / "data" / "corpus"
    location, bad_rows = librispeech_corpus(root) if form == "librispeech" else manifest_file_corpus(root, f".{form}")
    out = tmp_path / "data" / "out"
    paths = StoragePaths(corpus=str(location), data_dir=str(out), mlflow_tracking_uri="sqlite://")
    settings = PipelineSettings(manifest=ManifestSettings(max_reject_ratio=0.95, workers=1))
    materialize_in_process(build_definitions(paths, settings), instance, "manifest")

    assert list(instance.get_dynamic_partitions("speakers")) == GOOD_SPEAKERS
    assert sorted(pq.read_table(paths.layout.manifest.manifest).column("speaker_id").to_pylist()) == GOOD_SPEAKERS
    rejects = pq.read_table(paths.layout.manifest.rejects).to_pylist()
    assert len(rejects) == bad_rows
    assert {(r["stage"], r["reason"]) for r in rejects} == {("manifest", "invalid_id")}
    assert all(r["detail"].split(" ")[0] in ("speaker_id", "chapter_id", "utt_id") for r in rejects)
    # the run wrote its own files and nothing else, anywhere
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    ours = [p for p in written if not p.startswith(("data/corpus/", "dagster_home/"))]
    assert ours == [
        f"data/out/manifest/{name}"
        for name in (".publish.lock", "decode_cache.parquet", "manifest.parquet", "rejects.parquet", "speakers.parquet")
    ]
