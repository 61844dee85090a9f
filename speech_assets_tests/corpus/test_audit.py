"""Manifest audits read the written files back: each passes on a sound manifest and fails on the
fault it is there for (parametrised good/bad, tiny real files made in the test)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speech_assets.corpus import audit
from speech_assets.corpus import manifest as m
from speech_assets.testing.corpora import write_flac

CONFIG = m.ValidationConfig(min_duration_s=0.5, max_duration_s=35.0)


@pytest.fixture
def sound(tmp_path: Path) -> tuple[Path, list[dict]]:
    root = tmp_path / "corpus"
    rows = []
    for index in range(4):
        path = write_flac(root / "s1" / "c1" / f"s1-c1-{index}.flac", seconds=1.0, seed=index)
        rows.append({"utt_id": f"s1-c1-{index}", "speaker_id": "s1", "chapter_id": "c1", "path": str(path), "transcript": "HI",
                     "sample_rate": 16000, "channels": 1, "num_samples": 16000, "duration_s": 1.0, "file_sha256": "0" * 64})
    return root, rows


def run(tmp_path: Path, root: Path, rows: list[dict], rejects: int = 0, table: pa.Table | None = None) -> dict[str, bool]:
    manifest = tmp_path / "manifest.parquet"
    pq.write_table(table if table is not None else pa.Table.from_pylist(rows, schema=m.MANIFEST_SCHEMA), manifest)
    rejected = [{"utt_id": f"r{i}", "path": "", "stage": "manifest", "reason": "unreadable", "detail": "x"} for i in range(rejects)]
    pq.write_table(pa.Table.from_pylist(rejected, schema=m.REJECTS_SCHEMA), tmp_path / "rejects.parquet")
    return {a.name: a.passed for a in audit.audit_manifest(manifest, tmp_path / "rejects.parquet", root, CONFIG, 0.2)}


def test_a_sound_manifest_passes_every_audit(tmp_path: Path, sound) -> None:
    root, rows = sound
    assert run(tmp_path, root, rows) == dict.fromkeys(audit.AUDITS, True)


def _duplicate(rows): rows[1]["utt_id"] = rows[0]["utt_id"]
def _dotted_speaker(rows): rows[0]["speaker_id"] = "a.rejects"
def _escaping_path(rows): rows[0]["path"] = "/etc/hostname"
def _deleted_file(rows): Path(rows[0]["path"]).unlink()
def _wrong_duration(rows): rows[0]["duration_s"] = 2.0
def _too_long(rows): rows[0].update(num_samples=16000 * 40, duration_s=40.0)
def _zero_rate(rows): rows[0]["sample_rate"] = 0


@pytest.mark.parametrize(
    ("fault", "failing"),
    [(_duplicate, "unique_ids"), (_dotted_speaker, "safe_ids"), (_escaping_path, "paths_inside_root"),
     (_deleted_file, "paths_inside_root"), (_wrong_duration, "durations"), (_too_long, "durations"), (_zero_rate, "durations")],
)
def test_each_audit_catches_its_fault(tmp_path: Path, sound, fault, failing: str) -> None:
    root, rows = sound
    fault(rows)
    results = run(tmp_path, root, rows)
    assert results[failing] is False
    assert {name for name, passed in results.items() if not passed} == {failing}


def test_schema_and_nulls_are_read_from_the_file(tmp_path: Path, sound) -> None:
    root, rows = sound
    loose = pa.Table.from_pylist(rows).drop_columns(["file_sha256"]).cast(
        pa.schema([f if f.name != "num_samples" else pa.field("num_samples", pa.int32()) for f in pa.Table.from_pylist(rows).drop_columns(["file_sha256"]).schema])
    )
    results = run(tmp_path, root, rows, table=loose)
    assert results["schema"] is False
    rows[2]["transcript"] = None
    assert run(tmp_path, root, rows)["no_nulls"] is False


@pytest.mark.parametrize(("rejects", "passed"), [(1, True), (2, False)])
def test_reject_ratio(tmp_path: Path, sound, rejects: int, passed: bool) -> None:
    root, rows = sound  # 4 kept: 1 reject is 20 % (allowed), 2 are 33 %
    assert run(tmp_path, root, rows, rejects=rejects)["reject_ratio"] is passed
