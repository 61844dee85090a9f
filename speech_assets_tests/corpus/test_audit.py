"""Manifest audits read the written files back: each passes on a sound manifest and fails on the
fault it is there for, and only that one (parametrised good/bad; tiny real files made in the test)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speech_assets import layout
from speech_assets.corpus import audit
from speech_assets.corpus import manifest as m
from speech_assets.corpus.rejects import REJECTS_SCHEMA
from speech_assets_tests.support.corpora import write_flac

CONFIG = m.ValidationConfig(min_duration_s=0.5, max_duration_s=35.0)
NULLABLE_REJECTS = pa.schema([pa.field(f.name, f.type) for f in REJECTS_SCHEMA])


@pytest.fixture
def sound(tmp_path: Path) -> tuple[Path, list[dict]]:
    root = tmp_path / "corpus"
    rows = []
    for index in range(4):
        speaker = f"s{index % 2}"
        path = write_flac(root / speaker / "c1" / f"{speaker}-c1-{index}.flac", seconds=1.0, seed=index)
        rows.append(
            {
                "utt_id": f"{speaker}-c1-{index}",
                "speaker_id": speaker,
                "chapter_id": "c1",
                "path": str(path),
                "transcript": "HI",
                "sample_rate": 16000,
                "channels": 1,
                "num_samples": 16000,
                "duration_s": 1.0,
                "file_sha256": f"{index:064d}",
            }
        )
    return root, rows


def speakers_of(rows: list[dict]) -> list[dict]:
    """speakers.parquet as the manifest rows imply it (built here, not by the code under test)."""
    by_speaker: dict[str, list[dict]] = {}
    for row in rows:
        by_speaker.setdefault(row["speaker_id"], []).append(row)
    return [
        {
            "speaker_id": s,
            "utterances": len(g),
            "hours": sum(r["duration_s"] for r in g) / 3600,
            "manifest_hash": m.hash_triples((r["utt_id"], r["file_sha256"], r["transcript"]) for r in g),
        }
        for s, g in sorted(by_speaker.items())
    ]


def run(
    tmp_path: Path,
    root: Path,
    rows: list[dict],
    *,
    rejects: list[dict] | None = None,
    speakers: list[dict] | None = None,
    table: pa.Table | None = None,
    rejects_schema: pa.Schema = REJECTS_SCHEMA,
    max_ratio: float = 0.5,
) -> dict[str, audit.Audit]:
    files = layout.ManifestFiles(tmp_path)
    pq.write_table(table if table is not None else pa.Table.from_pylist(rows, schema=m.MANIFEST_SCHEMA), files.manifest)
    pq.write_table(pa.Table.from_pylist(rejects or [], schema=rejects_schema), files.rejects)
    pq.write_table(pa.Table.from_pylist(speakers if speakers is not None else speakers_of(rows)), files.speakers)
    return {a.name: a for a in audit.audit_manifest(files, root, CONFIG, max_ratio)}


def failing(results: dict[str, audit.Audit]) -> set[str]:
    return {name for name, a in results.items() if not a.passed}


def test_a_sound_manifest_passes_every_audit(tmp_path: Path, sound) -> None:
    root, rows = sound
    results = run(tmp_path, root, rows)
    assert list(results) == list(audit.AUDITS)
    assert failing(results) == set()


def reject(reason: str = "unreadable", detail: str | None = "cannot decode") -> dict:
    return {"utt_id": "r", "path": "/x.flac", "stage": "manifest", "reason": reason, "detail": detail}


def _set(index: int, **values) -> Callable[[list[dict]], None]:
    return lambda rows: rows[index].update(values)


def _delete_file(rows: list[dict]) -> None:
    Path(rows[0]["path"]).unlink()


def _symlink_out(rows: list[dict]) -> None:
    link = Path(rows[0]["path"])
    link.unlink()
    link.symlink_to("/etc/hostname")


# (fault applied to the manifest rows, the one audit it must fail)
ROW_FAULTS = {
    "duplicate-utt": (_set(1, utt_id="s0-c1-0", speaker_id="s0"), "unique_ids"),
    "dotted-speaker": (_set(0, speaker_id="a.rejects"), "safe_ids"),
    "parent-chapter": (_set(0, chapter_id=".."), "safe_ids"),
    "long-utt": (_set(0, utt_id="u" * 65), "safe_ids"),
    "non-ascii-utt": (_set(0, utt_id="spk_é"), "safe_ids"),
    "path-outside": (_set(0, path="/etc/hostname"), "paths_inside_root"),
    "path-relative": (_set(0, path="s0/c1/s0-c1-0.flac"), "paths_inside_root"),
    "path-deleted": (_delete_file, "paths_inside_root"),
    "symlink-out": (_symlink_out, "paths_inside_root"),
    "duration-mismatch": (_set(0, duration_s=2.0), "durations"),
    "too-long": (_set(0, num_samples=16000 * 40, duration_s=40.0), "durations"),
    "too-short": (_set(0, num_samples=1600, duration_s=0.1), "durations"),
    "zero-rate": (_set(0, sample_rate=0), "durations"),
    "zero-channels": (_set(0, channels=0), "durations"),
    "zero-samples": (_set(0, num_samples=0, duration_s=0.0), "durations"),
}


@pytest.mark.parametrize(("fault", "expected"), ROW_FAULTS.values(), ids=ROW_FAULTS.keys())
def test_each_audit_catches_its_fault_in_the_rows(tmp_path: Path, sound, fault, expected: str) -> None:
    root, rows = sound
    fault(rows)
    results = run(tmp_path, root, rows)
    assert failing(results) == {expected}, {k: v.description for k, v in results.items()}
    assert results[expected].description  # says what is wrong, with numbers


# (fault applied to the speakers.parquet rows that match the manifest)
SPEAKER_FAULTS = {
    "speaker-missing": lambda s: s.pop(0),
    "speaker-extra": lambda s: s.append({**s[0], "speaker_id": "ghost"}),
    "speaker-twice": lambda s: s.append(dict(s[0])),
    "count-wrong": lambda s: s[0].update(utterances=3),
    "hash-wrong": lambda s: s[1].update(manifest_hash="0" * 64),
}


@pytest.mark.parametrize("fault", SPEAKER_FAULTS.values(), ids=SPEAKER_FAULTS.keys())
def test_speakers_file_must_match_the_manifest(tmp_path: Path, sound, fault) -> None:
    root, rows = sound
    speakers = speakers_of(rows)
    fault(speakers)
    assert failing(run(tmp_path, root, rows, speakers=speakers)) == {"speakers"}


def test_schema_is_read_from_the_file(tmp_path: Path, sound) -> None:
    root, rows = sound
    narrow = pa.Table.from_pylist(rows, schema=m.MANIFEST_SCHEMA).set_column(
        7, "num_samples", pa.array([16000] * 4, pa.int32())
    )
    results = run(tmp_path, root, rows, table=narrow)
    assert failing(results) == {"schema"}
    assert "num_samples is int32 (expected int64)" in results["schema"].description


def test_a_missing_column_fails_every_audit_that_needs_it(tmp_path: Path, sound) -> None:
    root, rows = sound
    table = pa.Table.from_pylist(rows, schema=m.MANIFEST_SCHEMA).drop_columns(["duration_s", "path"])
    results = run(tmp_path, root, rows, table=table)
    assert failing(results) == {"schema", "durations", "paths_inside_root"}
    assert "lacks column(s) duration_s" in results["durations"].description


@pytest.mark.parametrize(
    ("bad_reject", "schema_fails"),
    [(reject(reason="no_such_reason"), True), (reject(detail=None), False)],
    ids=["unknown-reason", "null-detail"],
)
def test_rejects_file_is_audited_too(tmp_path: Path, sound, bad_reject: dict, schema_fails: bool) -> None:
    root, rows = sound
    results = run(tmp_path, root, rows, rejects=[bad_reject], rejects_schema=NULLABLE_REJECTS)
    assert failing(results) == ({"schema"} if schema_fails else {"no_nulls"})


def test_a_null_in_the_rows_fails_no_nulls(tmp_path: Path, sound) -> None:
    root, rows = sound
    rows[2]["transcript"] = None
    results = run(
        tmp_path, root, rows, speakers=speakers_of([{**r, "transcript": r["transcript"] or ""} for r in rows])
    )
    assert "no_nulls" in failing(results)
    assert "manifest:transcript (1)" in results["no_nulls"].description
    assert failing(results) <= {"no_nulls", "speakers"}  # the hash cannot be recomputed either: it fails, never passes


@pytest.mark.parametrize(("rejects", "passed"), [(0, True), (4, True), (5, False)])
def test_reject_ratio(tmp_path: Path, sound, rejects: int, passed: bool) -> None:
    root, rows = sound  # 4 kept: 4 rejects are 50 % (allowed), 5 are 55.6 %
    result = run(tmp_path, root, rows, rejects=[reject()] * rejects)["reject_ratio"]
    assert result.passed is passed
    assert f"{rejects} of {rejects + 4} utterances rejected" in result.description


def test_unreadable_files_fail_every_audit(tmp_path: Path, sound) -> None:
    root, rows = sound
    run(tmp_path, root, rows)
    (tmp_path / "manifest.parquet").write_bytes(b"PAR1 this is not parquet")
    files = layout.ManifestFiles(tmp_path)
    assert {a.name: a.passed for a in audit.audit_manifest(files, root, CONFIG, 0.5)} == dict.fromkeys(
        audit.AUDITS, False
    )
