"""Manifest scanning and validation: every reject reason, both input forms, hashing, caching."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from speech_assets.corpus import manifest as m
from speech_assets_tests.support.corpora import LibriCorpus, write_flac


def reasons(result: m.ScanResult) -> dict[str, str]:
    return {r.utt_id: r.reason for r in result.rejects}


def test_good_corpus_keeps_everything_with_contract_columns(libri: LibriCorpus) -> None:
    libri.add("1", "10", 0, "Hello, world!  It's   fine.")
    libri.add("1", "10", 1)
    result = m.scan_corpus(libri.root)
    assert [r.utt_id for r in result.rows] == ["1-10-0000", "1-10-0001"]
    assert result.rejects == []
    row = result.rows[0]
    assert row.transcript == "HELLO WORLD IT'S FINE"
    assert (row.speaker_id, row.chapter_id, row.sample_rate, row.channels) == ("1", "10", 16000, 1)
    assert row.num_samples == 16000 and row.duration_s == pytest.approx(1.0)
    assert len(row.file_sha256) == 64 and Path(row.path).is_absolute()


@pytest.mark.parametrize(
    ("sample_rate", "channels", "subtype"),
    [(8000, 1, "PCM_16"), (44100, 2, "PCM_24"), (22050, 1, "PCM_24")],
)
def test_other_rates_and_stereo_24_bit_are_kept(
    libri: LibriCorpus, sample_rate: int, channels: int, subtype: str
) -> None:
    libri.add("2", "20", 0, sample_rate=sample_rate, channels=channels, subtype=subtype)
    result = m.scan_corpus(libri.root)
    assert result.rejects == []
    assert (result.rows[0].sample_rate, result.rows[0].channels) == (sample_rate, channels)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _text(path: Path) -> None:
    path.write_text("this is not audio at all\n" * 20)


@pytest.mark.parametrize("damage", [_truncate, _empty, _text], ids=["truncated", "empty", "text"])
def test_unreadable_files_are_rejected_not_raised(libri: LibriCorpus, damage) -> None:
    libri.add("3", "30", 0)
    damage(libri.add("3", "30", 1))
    result = m.scan_corpus(libri.root)
    assert [r.utt_id for r in result.rows] == ["3-30-0000"]
    (reject,) = result.rejects
    assert (reject.utt_id, reject.reason, reject.stage) == ("3-30-0001", "unreadable", "manifest")
    assert reject.detail


def test_symlink_out_of_root_is_rejected(libri: LibriCorpus, tmp_path: Path) -> None:
    libri.add("4", "40", 0)
    outside = write_flac(tmp_path / "elsewhere" / "secret.flac")
    (libri.chapter_dir("4", "40") / "4-40-0001.flac").symlink_to(outside)
    libri.add_line("4", "40", "4-40-0001", "OUTSIDE")
    result = m.scan_corpus(libri.root)
    assert reasons(result) == {"4-40-0001": "outside_root"}
    assert str(outside) in result.rejects[0].detail


def test_duplicate_id_across_chapters_keeps_one(libri: LibriCorpus) -> None:
    libri.add("5", "50", 0)
    # the same utterance id, filed under a second chapter folder
    folder = libri.chapter_dir("5", "51")
    write_flac(folder / "5-50-0000.flac", seed=9)
    (folder / "5-51.trans.txt").write_text("5-50-0000 ANOTHER COPY\n")
    result = m.scan_corpus(libri.root)
    assert [r.utt_id for r in result.rows] == ["5-50-0000"]
    assert reasons(result) == {"5-50-0000": "duplicate_id"}


def test_transcript_line_without_audio_is_missing_file(libri: LibriCorpus) -> None:
    libri.add("6", "60", 0)
    libri.add_line("6", "60", "6-60-0007", "NO AUDIO FOR ME")
    assert reasons(m.scan_corpus(libri.root)) == {"6-60-0007": "missing_file"}


def test_audio_without_transcript_is_no_transcript(libri: LibriCorpus) -> None:
    libri.add("7", "70", 0)
    write_flac(libri.chapter_dir("7", "70") / "7-70-0001.flac")
    assert reasons(m.scan_corpus(libri.root)) == {"7-70-0001": "no_transcript"}


@pytest.mark.parametrize(("seconds", "reason"), [(0.2, "too_short"), (3.0, "too_long")])
def test_duration_bounds(libri: LibriCorpus, seconds: float, reason: str) -> None:
    libri.add("8", "80", 0)
    libri.add("8", "80", 1, seconds=seconds)
    config = m.ValidationConfig(min_duration_s=0.5, max_duration_s=2.0)
    assert reasons(m.scan_corpus(libri.root, config)) == {"8-80-0001": reason}


def _write_csv(path: Path, records: list[dict]) -> None:
    import csv

    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["path", "transcript", "speaker_id", "utt_id", "chapter_id"])
        writer.writeheader()
        writer.writerows(records)


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if v}) + "\n" for r in records))


@pytest.mark.parametrize("writer, suffix", [(_write_csv, ".csv"), (_write_jsonl, ".jsonl")], ids=["csv", "jsonl"])
def test_manifest_file_input(tmp_path: Path, writer, suffix: str) -> None:
    root = tmp_path / "audio"
    write_flac(root / "a.flac")
    write_flac(root / "sub" / "b.flac", seconds=1.5)
    outside = write_flac(tmp_path / "outside.flac")
    records = [
        {"path": "a.flac", "transcript": "first one", "speaker_id": "s1", "utt_id": "", "chapter_id": ""},
        {"path": "sub/b.flac", "transcript": "Second!", "speaker_id": "s2", "utt_id": "b-id", "chapter_id": "c9"},
        {"path": "../outside.flac", "transcript": "escape", "speaker_id": "s1", "utt_id": "esc", "chapter_id": ""},
        {"path": str(outside), "transcript": "absolute escape", "speaker_id": "s1", "utt_id": "abs", "chapter_id": ""},
        {"path": "missing.flac", "transcript": "gone", "speaker_id": "s1", "utt_id": "gone", "chapter_id": ""},
        {"path": "a.flac", "transcript": "", "speaker_id": "s1", "utt_id": "quiet", "chapter_id": ""},
    ]
    manifest_file = root / f"corpus{suffix}"
    writer(manifest_file, records)
    result = m.scan_corpus(manifest_file)
    assert [(r.utt_id, r.speaker_id, r.chapter_id, r.transcript) for r in result.rows] == [
        ("a", "s1", "0", "FIRST ONE"),
        ("b-id", "s2", "c9", "SECOND"),
    ]
    assert reasons(result) == {
        "esc": "outside_root",
        "abs": "outside_root",
        "gone": "missing_file",
        "quiet": "no_transcript",
    }


def test_a_kept_row_names_its_file_resolved(tmp_path: Path) -> None:
    """Kills: a row keeping its path as the manifest wrote it (through a symlinked folder) rather than resolved."""
    root = tmp_path / "audio"
    write_flac(root / "real" / "a.flac")
    (root / "link").symlink_to(root / "real")
    record = {"path": "link/a.flac", "transcript": "one", "speaker_id": "s1", "utt_id": "", "chapter_id": ""}
    _write_csv(root / "corpus.csv", [record])
    assert [r.path for r in m.scan_corpus(root / "corpus.csv").rows] == [str((root / "real" / "a.flac").resolve())]


@pytest.mark.parametrize("make", ["missing", "empty_dir", "wrong_suffix"])
def test_missing_or_empty_corpus_is_a_clear_error(tmp_path: Path, make: str) -> None:
    target = tmp_path / "corpus"
    if make == "empty_dir":
        target.mkdir()
    elif make == "wrong_suffix":
        target = tmp_path / "corpus.txt"
        target.write_text("x")
    with pytest.raises(m.CorpusError, match=str(target)):
        m.scan_corpus(target)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_an_empty_manifest_file_is_a_clear_error(tmp_path: Path, suffix: str) -> None:
    target = tmp_path / f"corpus{suffix}"
    target.write_bytes(b"")
    with pytest.raises(m.CorpusError, match=f"{target} is empty"):
        m.scan_corpus(target)


def test_hash_is_deterministic_and_content_sensitive(libri: LibriCorpus) -> None:
    libri.add("9", "90", 0)
    libri.add("9", "90", 1)
    first = m.manifest_hash(m.scan_corpus(libri.root).rows)
    assert first == m.manifest_hash(list(reversed(m.scan_corpus(libri.root).rows)))
    write_flac(libri.chapter_dir("9", "90") / "9-90-0001.flac", seed=42)  # new audio, same id
    assert m.manifest_hash(m.scan_corpus(libri.root).rows) != first


def test_unchanged_corpus_is_not_decoded_again(libri: LibriCorpus) -> None:
    for utt in range(4):
        libri.add("10", "100", utt)
    first = m.scan_corpus(libri.root)
    assert first.decoded_files == 4
    again = m.scan_corpus(libri.root, cache=first.cache)
    assert again.decoded_files == 0 and again.rows == first.rows
    path = libri.add("10", "100", 2, seconds=1.2)  # rewritten file: new size/mtime
    os.utime(path, ns=(1, 1))
    assert m.scan_corpus(libri.root, cache=first.cache).decoded_files == 1


def test_cache_round_trip(tmp_path: Path, libri: LibriCorpus) -> None:
    libri.add("11", "110", 0)
    result = m.scan_corpus(libri.root)
    m.save_cache(tmp_path / "cache.parquet", result.cache)
    assert m.load_cache(tmp_path / "cache.parquet") == result.cache
    (tmp_path / "broken.parquet").write_text("garbage")
    assert m.load_cache(tmp_path / "broken.parquet") == {}


BAD_IDS = ["../../x", "a.rejects", "spk.1", "", "s" * 300, "spk_é"]
BAD_ID_NAMES = ["parent-path", "sidecar-name", "dot", "empty", "300-chars", "non-ascii"]


@pytest.mark.parametrize("bad", BAD_IDS, ids=BAD_ID_NAMES)
@pytest.mark.parametrize("field", ["speaker_id", "chapter_id", "utt_id"])
@pytest.mark.parametrize("writer, suffix", [(_write_csv, ".csv"), (_write_jsonl, ".jsonl")], ids=["csv", "jsonl"])
def test_unsafe_ids_in_a_manifest_file_are_rejected(tmp_path: Path, writer, suffix: str, field: str, bad: str) -> None:
    root = tmp_path / "audio"
    write_flac(root / "good.flac")
    write_flac(root / "bad.flac", seed=1)
    good = {"path": "good.flac", "transcript": "fine", "speaker_id": "s1", "utt_id": "good", "chapter_id": "c1"}
    record = {
        "path": "bad.flac",
        "transcript": "not fine",
        "speaker_id": "s2",
        "utt_id": "bad",
        "chapter_id": "c1",
        field: bad,
    }
    if field == "utt_id" and bad == "":
        record["path"] = "bad.flac"  # an empty utt_id falls back to the file name: use one that is unsafe too
        (root / "bad.flac").rename(root / "b.a.d.flac")
        record["path"] = "b.a.d.flac"
    writer(root / f"corpus{suffix}", [good, record])
    result = m.scan_corpus(root / f"corpus{suffix}")
    if field == "chapter_id" and bad == "":  # chapter_id is optional: empty means the default chapter "0"
        assert [(r.utt_id, r.chapter_id) for r in result.rows] == [("bad", "0"), ("good", "c1")]
        return
    assert [r.utt_id for r in result.rows] == ["good"]
    (reject,) = result.rejects
    assert reject.reason == "invalid_id" and reject.stage == "manifest"
    assert field in reject.detail or "utt_id" in reject.detail


@pytest.mark.parametrize("bad", ["spk.1", "spk_é", "s" * 70], ids=["dot", "non-ascii", "too-long"])
def test_unsafe_speaker_folder_in_librispeech_layout_is_rejected(libri: LibriCorpus, bad: str) -> None:
    libri.add("1", "10", 0)
    libri.add(bad, "10", 1)
    result = m.scan_corpus(libri.root)
    assert [r.speaker_id for r in result.rows] == ["1"]
    assert {r.reason for r in result.rejects} == {"invalid_id"}
    assert "speaker_id" in result.rejects[0].detail


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("1034", True),
        ("client_00", True),
        ("a-b_C9", True),
        ("x" * 64, True),
        ("x" * 65, False),
        ("", False),
        ("..", False),
        ("a/b", False),
        ("é", False),
        ("a b", False),
    ],
)
def test_safe_id_rule(value: str, ok: bool) -> None:
    from speech_assets.corpus.ids import check_safe_id, is_safe_id

    assert is_safe_id(value) is ok
    if not ok:
        with pytest.raises(ValueError):
            check_safe_id(value, "speaker_id")


def test_storage_paths_refuse_unsafe_ids(tmp_path: Path) -> None:
    from speech_assets.defs.resources import StoragePaths

    paths = StoragePaths(corpus=str(tmp_path), data_dir=str(tmp_path / "out"), mlflow_tracking_uri="sqlite://")
    for bad in ("../../x", "a.rejects", ""):
        with pytest.raises(ValueError, match="speaker_id"):
            paths.shard_files(bad)
        with pytest.raises(ValueError, match="client_id"):
            paths.targets(bad).root


RSS_PROBE = """
import sys
from speech_assets.corpus import manifest as m
probe = m.probe_audio(sys.argv[1], m.ValidationConfig(max_duration_s=float(sys.argv[2])))
print(probe.decoded, probe.num_samples)
"""
# Linux carries ru_maxrss across exec from the address space that exec replaces (here: the forking
# parent's), so a probe started straight from pytest reports at least pytest's own peak and hides
# the difference under test. A small launcher in between keeps that floor at a few MB; it reports
# its child's peak through RUSAGE_CHILDREN.
RSS_LAUNCHER = """
import resource, subprocess, sys
out = subprocess.run([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], check=True, capture_output=True, text=True)
print(out.stdout.strip(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def _peak_rss_kib(path: Path, max_duration_s: float) -> tuple[bool, int, int]:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", RSS_LAUNCHER, RSS_PROBE, str(path), str(max_duration_s)],
        check=True,
        capture_output=True,
        text=True,
    )
    decoded, samples, rss = out.stdout.split()
    return decoded == "True", int(samples), int(rss)


def _long_flac(path: Path, seconds: int) -> Path:
    """A long, quiet, low-entropy FLAC written block by block (small on disk, quick to write)."""
    import numpy as np
    import soundfile as sf

    block = (0.01 * np.sin(np.arange(16_000) * 2 * np.pi * 200 / 16_000)).astype(np.float32)
    with sf.SoundFile(path, "w", samplerate=16_000, channels=1, format="FLAC", subtype="PCM_16") as out:
        for _ in range(seconds):
            out.write(block)
    return path


def test_a_two_hour_file_is_judged_from_its_header_in_bounded_memory(tmp_path: Path) -> None:
    long_file = _long_flac(tmp_path / "two_hours.flac", 2 * 3600)
    short_file = write_flac(tmp_path / "short.flac", seconds=1.0)
    decoded, samples, long_rss = _peak_rss_kib(long_file, 35.0)
    assert (decoded, samples) == (False, 2 * 3600 * 16_000)  # too long: never read
    _, _, short_rss = _peak_rss_kib(short_file, 35.0)
    # KiB. Reading the file whole costs its size (31 MB here); decoding it whole ~230 MB.
    assert long_rss - short_rss < 10 * 1024
    # within bounds it is decoded in full, still block by block
    decoded, samples, full_rss = _peak_rss_kib(long_file, 3 * 3600.0)
    assert (decoded, samples) == (True, 2 * 3600 * 16_000)
    assert full_rss - short_rss < 10 * 1024


def test_a_header_only_probe_is_decoded_once_the_bounds_admit_it(tmp_path: Path) -> None:
    _long_flac(tmp_path / "long.flac", 40)
    strict = m.ValidationConfig(max_duration_s=35.0)
    probes, decoded = m.probe_all([str(tmp_path / "long.flac")], {}, config=strict)
    (probe,) = probes.values()
    assert decoded == 1 and not probe.decoded and probe.file_sha256 == ""
    cache = {m._cache_key(str(tmp_path / "long.flac"), probe.size, probe.mtime_ns): probe}
    _, again = m.probe_all([str(tmp_path / "long.flac")], cache, config=strict)
    assert again == 0  # still out of bounds: the header verdict stands
    probes, again = m.probe_all([str(tmp_path / "long.flac")], cache, config=m.ValidationConfig(max_duration_s=60.0))
    (probe,) = probes.values()
    assert again == 1 and probe.decoded and len(probe.file_sha256) == 64 and probe.num_samples == 40 * 16_000


@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "truncated"])
def test_a_long_file_within_bounds_is_fully_decoded_and_verified(libri: LibriCorpus, damaged: bool) -> None:
    from speech_assets.utils import sha256_file

    libri.add("12", "120", 0)
    path = _long_flac(libri.chapter_dir("12", "120") / "12-120-0001.flac", 30)
    libri.add_line("12", "120", "12-120-0001", "LONG ONE")
    if damaged:  # the header still declares 30 s: only decoding to the end can tell
        _truncate(path)
    result = m.scan_corpus(libri.root, m.ValidationConfig(max_duration_s=35.0))
    probe = next(p for key, p in result.cache.items() if key.startswith(str(path)))
    if damaged:
        assert reasons(result) == {"12-120-0001": "unreadable"}
        # found only by decoding past the first 15 s: a lost frame sync or a short count
        assert result.rejects[0].detail.startswith(("cannot decode as audio", "header declares 480000 samples"))
    else:
        assert result.rejects == [] and probe.decoded
        (row,) = [r for r in result.rows if r.utt_id == "12-120-0001"]
        assert (row.num_samples, row.file_sha256) == (30 * 16_000, sha256_file(path))


def test_header_verdicts_kept_in_the_cache_file_are_redone_when_the_bounds_change(
    tmp_path: Path, libri: LibriCorpus
) -> None:
    libri.add("13", "130", 0)
    _long_flac(libri.chapter_dir("13", "130") / "13-130-0001.flac", 40)
    libri.add_line("13", "130", "13-130-0001", "FORTY SECONDS")
    strict = m.scan_corpus(libri.root, m.ValidationConfig(max_duration_s=35.0))
    assert reasons(strict) == {"13-130-0001": "too_long"}
    m.save_cache(tmp_path / "cache.parquet", strict.cache)
    cache = m.load_cache(tmp_path / "cache.parquet")
    assert sorted(p.decoded for p in cache.values()) == [False, True]
    again = m.scan_corpus(libri.root, m.ValidationConfig(max_duration_s=35.0), cache=cache)
    assert again.decoded_files == 0 and reasons(again) == {"13-130-0001": "too_long"}
    lax = m.scan_corpus(libri.root, m.ValidationConfig(max_duration_s=60.0), cache=cache)
    assert lax.decoded_files == 1 and lax.rejects == []  # never trusted as verified without a decode
    assert [r.utt_id for r in lax.rows] == ["13-130-0000", "13-130-0001"] and all(
        len(r.file_sha256) == 64 for r in lax.rows
    )


@pytest.mark.parametrize("root", ["/", "/data", "/data/corpus", "/data/corpus/"])
def test_is_inside_answers_as_path_is_relative_to(root: str) -> None:
    from speech_assets.corpus.manifest import is_inside

    for path in [
        "/",
        "/data",
        "/data/corpus",
        "/data/corpus2/a.flac",
        "/data/corpus/a.flac",
        "/data/corpus/s/c/a.flac",
        "/datum/x",
    ]:
        assert is_inside(path, root) == Path(path).is_relative_to(root), (path, root)


# ---------------------------------------------------------------------------------------------
# Manifest files: a bad line is a reject row naming it; the rest of the corpus is kept

CSV_HEADER = "path,transcript,speaker_id,utt_id\n"
BAD_CSV_LINES = {  # the bad line (line 3 of the file, between two good ones) -> what its detail says
    "over-long-field": ("bad.flac," + "A" * 200_000 + ",s1,bad\n", "field larger than field limit"),
    "quoted-over-long-field": ('bad.flac,"' + "A " * 100_000 + '",s1,bad\n', "field larger than field limit"),
    "nul-byte": ("bad.flac,HELLO\x00WORLD,s1,bad\n", "NUL byte"),
    "nul-in-path": ("bad\x00.flac,HELLO,s1,bad\n", "NUL byte"),
    "missing-column": ("bad.flac,HELLO,s1\n", "has 3 fields, the header names 4"),
    "extra-column": ("bad.flac,HELLO,s1,bad,surplus\n", "has 5 fields, the header names 4"),
}
BAD_JSONL_LINES = {
    "broken-json": ('{"path": "bad.flac", "transcript": "HELLO", \n', "is not JSON"),
    "array": ('["bad.flac", "HELLO", "s1"]\n', "is not a JSON object (a list)"),
    "number": ("42\n", "is not a JSON object (a int)"),
    "transcript-list": (
        '{"path": "bad.flac", "transcript": ["HELLO"], "speaker_id": "s1"}\n',
        "field 'transcript' is a JSON list",
    ),
    "speaker-object": (
        '{"path": "bad.flac", "transcript": "HELLO", "speaker_id": {"id": 1}}\n',
        "field 'speaker_id' is a JSON dict",
    ),
    "path-bool": ('{"path": true, "transcript": "HELLO", "speaker_id": "s1"}\n', "field 'path' is a JSON bool"),
    "nul-escape": ('{"path": "bad.flac", "transcript": "HEL\\u0000LO", "speaker_id": "s1"}\n', "NUL byte"),
    "lone-surrogate": ('{"path": "bad.flac", "transcript": "HEL\\ud800LO", "speaker_id": "s1"}\n', "not valid UTF-8"),
    "huge-integer": ('{"path": "bad.flac", "transcript": "HELLO", "speaker_id": ' + "9" * 5000 + "}\n", "is not JSON"),
    "deep-nesting": ("[" * 100_000 + "]" * 100_000 + "\n", "is not JSON"),
}


def _manifest_with_bad_line(root: Path, suffix: str, bad: str | bytes) -> Path:
    """good1 and good2 around one bad line (line 3 of a CSV with its header, line 2 of a JSONL)."""
    write_flac(root / "good1.flac")
    write_flac(root / "good2.flac")
    write_flac(root / "bad.flac")
    bad = bad.encode("utf-8", "surrogatepass") if isinstance(bad, str) else bad
    if suffix == ".csv":
        lines = [CSV_HEADER.encode(), b"good1.flac,FIRST,s1,good1\n", bad, b"good2.flac,SECOND,s2,good2\n"]
    else:
        lines = [
            b'{"path": "good1.flac", "transcript": "FIRST", "speaker_id": 1001, "utt_id": "good1"}\n',
            bad,
            b'{"path": "good2.flac", "transcript": "SECOND", "speaker_id": "s2", "utt_id": "good2"}\n',
        ]
    location = root / f"corpus{suffix}"
    location.write_bytes(b"".join(lines))
    return location


BAD_LINES = (
    [(".csv", line, detail) for line, detail in BAD_CSV_LINES.values()]
    + [(".jsonl", line, detail) for line, detail in BAD_JSONL_LINES.values()]
    + [
        (".csv", b"bad.flac,HELLO \xff\xfe WORLD,s1,bad\n", "not valid UTF-8"),
        (
            ".jsonl",
            b'{"path": "bad.flac", "transcript": "HELLO \xff WORLD", "speaker_id": "s1"}\n',
            "is not valid UTF-8 (byte 0xff",
        ),
    ]
)
BAD_LINE_IDS = (
    [f"csv-{name}" for name in BAD_CSV_LINES]
    + [f"jsonl-{name}" for name in BAD_JSONL_LINES]
    + ["csv-latin1", "jsonl-latin1"]
)


@pytest.mark.parametrize(("suffix", "bad", "detail"), BAD_LINES, ids=BAD_LINE_IDS)
def test_a_bad_manifest_line_is_a_reject_row_naming_it(
    tmp_path: Path, suffix: str, bad: str | bytes, detail: str
) -> None:
    location = _manifest_with_bad_line(tmp_path / "corpus", suffix, bad)
    assert m.corpus_fingerprint(location)  # the sensor's change detector reads the file too
    m.check_corpus_location(location)
    result = m.scan_corpus(location)
    assert [(r.utt_id, r.transcript) for r in result.rows] == [("good1", "FIRST"), ("good2", "SECOND")]
    (reject,) = result.rejects
    line = 3 if suffix == ".csv" else 2
    assert (reject.utt_id, reject.reason, reject.stage, reject.path) == (
        f"line-{line}",
        "unreadable",
        "manifest",
        str(location),
    )
    assert reject.detail.startswith(f"line {line}: ") and detail in reject.detail, reject.detail
    assert len(reject.detail) < 300
    from speech_assets.corpus.rejects import write_rejects

    write_rejects(tmp_path / "rejects.parquet", result.rejects)  # every string of the row is writable


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_records_with_an_empty_field_name_their_line(tmp_path: Path, suffix: str) -> None:
    root = tmp_path / "corpus"
    write_flac(root / "a.flac")
    records = [
        {"path": "a.flac", "transcript": "", "speaker_id": "s1", "utt_id": "quiet", "chapter_id": ""},
        {"path": "", "transcript": "NO PATH", "speaker_id": "s1", "utt_id": "nowhere", "chapter_id": ""},
    ]
    (_write_csv if suffix == ".csv" else _write_jsonl)(root / f"corpus{suffix}", records)
    result = m.scan_corpus(root / f"corpus{suffix}")
    first, second = (2, 3) if suffix == ".csv" else (1, 2)
    assert {(r.utt_id, r.reason, r.detail) for r in result.rejects} == {
        ("quiet", "no_transcript", f"line {first}: empty transcript"),
        ("nowhere", "missing_file", f"line {second}: no path"),
    }


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"file,text,speaker\na.flac,HI,s1\n", "missing columns ['path', 'transcript', 'speaker_id']"),
        (b"path,transcript\na.flac,HI\n", "missing columns ['speaker_id']"),
        ("path,transcript,speaker_id\n".encode("utf-16"), "missing columns"),
    ],
    ids=["other-columns", "no-speaker-column", "utf-16"],
)
def test_a_csv_without_its_header_is_one_clear_error_and_fingerprints(
    tmp_path: Path, content: bytes, message: str
) -> None:
    location = tmp_path / "corpus.csv"
    location.write_bytes(content)
    for call in (m.check_corpus_location, m.scan_corpus):
        with pytest.raises(m.CorpusError, match=re.escape(message)):
            call(location)
    assert m.corpus_fingerprint(location)


def test_a_manifest_file_that_cannot_be_opened_is_a_clear_error(tmp_path: Path) -> None:
    location = tmp_path / "corpus.jsonl"
    location.write_text('{"path": "a.flac"}\n')
    location.chmod(0)
    try:
        if os.access(location, os.R_OK):  # root reads anything
            pytest.skip("this user reads files whatever their mode")
        with pytest.raises(m.CorpusError, match="cannot be read: Permission denied"):
            m.scan_corpus(location)
        assert m.corpus_fingerprint(location)
    finally:
        location.chmod(0o644)


# ---------------------------------------------------------------------------------------------
# transcript_too_long, duplicate_audio, and audio that decodes but is not what it claims


@pytest.mark.parametrize("form", ["librispeech", "csv", "jsonl"])
@pytest.mark.parametrize(
    ("bound", "length", "reason"),
    [(2000, 2000, None), (2000, 2001, "transcript_too_long"), (10, 11, "transcript_too_long")],
)
def test_transcript_over_the_bound_is_rejected(
    tmp_path: Path, form: str, bound: int, length: int, reason: str | None
) -> None:
    text = "Hi, " + "A" * (length - 3)  # normalised: "HI " and the As
    assert len(m.normalise_transcript(text)) == length
    root = tmp_path / "corpus"
    if form == "librispeech":
        libri = LibriCorpus(root)
        libri.add("1", "10", 0, "FINE")
        libri.add("1", "10", 1, text)
        location, long_id = root, "1-10-0001"
    else:
        write_flac(root / "fine.flac")
        write_flac(root / "long.flac")
        records = [
            {"path": "fine.flac", "transcript": "FINE", "speaker_id": "1", "utt_id": "fine", "chapter_id": ""},
            {"path": "long.flac", "transcript": text, "speaker_id": "1", "utt_id": "long", "chapter_id": ""},
        ]
        location, long_id = root / f"corpus.{form}", "long"
        (_write_csv if form == "csv" else _write_jsonl)(location, records)
    config = m.ValidationConfig() if bound == 2000 else m.ValidationConfig(max_transcript_chars=bound)
    result = m.scan_corpus(location, config)
    if reason is None:
        assert result.rejects == [] and len(result.rows) == 2
        return
    assert len(result.rows) == 1 and result.rows[0].transcript == "FINE"
    (reject,) = result.rejects
    assert (reject.utt_id, reject.reason) == (long_id, reason)
    assert f"{length} characters" in reject.detail and f"max_transcript_chars={bound}" in reject.detail


def test_a_megabyte_transcript_is_rejected_and_the_rest_kept(libri: LibriCorpus) -> None:
    libri.add("1", "10", 0)
    libri.add("1", "10", 1, "WORDS " * 200_000)
    result = m.scan_corpus(libri.root)
    assert [r.utt_id for r in result.rows] == ["1-10-0000"]
    assert reasons(result) == {"1-10-0001": "transcript_too_long"}


def _samples(seconds: float = 1.0, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(16_000 * seconds))).astype(np.float32)


def _write(path: Path, data, subtype: str = "PCM_16", format: str | None = None) -> Path:
    import soundfile as sf

    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, data, 16_000, subtype=subtype, format=format)
    return path


def _copy_same_file(libri: LibriCorpus) -> tuple[str, str]:
    first = libri.add("1", "10", 0)
    (libri.chapter_dir("2", "20") / "2-20-0000.flac").write_bytes(first.read_bytes())
    libri.add_line("2", "20", "2-20-0000", "SAME AUDIO OTHER SPEAKER")
    return "1-10-0000", "2-20-0000"


def _wav_and_flac(libri: LibriCorpus) -> tuple[str, str]:
    data = (_samples() * 32767).astype("int16")  # as integers: libsndfile rounds floats per format
    _write(libri.chapter_dir("3", "30") / "3-30-0005.wav", data)  # the same samples, once as WAV ...
    _write(libri.chapter_dir("3", "30") / "3-30-0001.flac", data, format="FLAC")  # ... once as FLAC
    libri.add_line("3", "30", "3-30-0005", "AS WAV")
    libri.add_line("3", "30", "3-30-0001", "AS FLAC")
    return "3-30-0001", "3-30-0005"


def _same_file_twice_in_chapter(libri: LibriCorpus) -> tuple[str, str]:
    path = libri.add("4", "40", 7)
    (path.parent / "4-40-0002.flac").write_bytes(path.read_bytes())
    libri.add_line("4", "40", "4-40-0002", "A COPY")
    return "4-40-0002", "4-40-0007"


@pytest.mark.parametrize(
    "make",
    [_copy_same_file, _wav_and_flac, _same_file_twice_in_chapter],
    ids=["two-speakers", "wav-and-flac", "one-chapter"],
)
def test_the_same_audio_under_a_second_id_is_rejected_naming_the_first(libri: LibriCorpus, make) -> None:
    libri.add("9", "90", 0)  # unrelated, kept
    libri.add("9", "90", 1)
    first, second = make(libri)
    result = m.scan_corpus(libri.root)
    assert sorted(r.utt_id for r in result.rows) == sorted([first, "9-90-0000", "9-90-0001"])
    (reject,) = result.rejects
    assert (reject.utt_id, reject.reason, reject.stage) == (second, "duplicate_audio", "manifest")
    assert reject.detail.startswith(f"the same decoded audio as {first} ")
    # the verdict does not depend on the cache: a re-run from it says the same
    again = m.scan_corpus(libri.root, cache=result.cache)
    assert again.decoded_files == 0 and again.rows == result.rows and again.rejects == result.rejects


def test_two_manifest_rows_on_one_file_keep_the_first_id(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    write_flac(root / "one.flac")
    write_flac(root / "other.flac")
    (root / "corpus.csv").write_text(
        CSV_HEADER + "one.flac,ZED,s2,zed\none.flac,ALPHA,s1,alpha\nother.flac,OTHER,s1,other\n"
    )
    result = m.scan_corpus(root / "corpus.csv")
    assert [r.utt_id for r in result.rows] == ["alpha", "other"]  # ids in order, whatever the lines' order
    (reject,) = result.rejects
    assert (reject.utt_id, reject.reason) == ("zed", "duplicate_audio") and "as alpha " in reject.detail


@pytest.mark.parametrize(
    "change",
    ["one-sample", "other-rate", "stereo"],
)
def test_nearly_the_same_audio_is_kept(libri: LibriCorpus, change: str) -> None:
    import numpy as np
    import soundfile as sf

    data = _samples()
    _write(libri.chapter_dir("5", "50") / "5-50-0000.flac", data, format="FLAC")
    libri.add_line("5", "50", "5-50-0000", "ORIGINAL")
    other = libri.chapter_dir("5", "50") / "5-50-0001.flac"
    if change == "one-sample":
        changed = data.copy()
        changed[8000] += 0.01
        _write(other, changed, format="FLAC")
    elif change == "other-rate":
        sf.write(other, data, 22_050, format="FLAC")
    else:
        _write(other, np.stack([data, data], axis=1), format="FLAC")
    libri.add_line("5", "50", "5-50-0001", "CHANGED")
    result = m.scan_corpus(libri.root)
    assert result.rejects == [] and len(result.rows) == 2


def _lying_wav(path: Path, factor: int = 10, subtype: str = "PCM_16") -> Path:
    """A WAV whose data chunk declares ``factor`` times the bytes the file holds."""
    import struct

    _write(path, _samples(), subtype)
    data = bytearray(path.read_bytes())
    offset = data.find(b"data")
    (size,) = struct.unpack("<I", data[offset + 4 : offset + 8])
    data[offset + 4 : offset + 8] = struct.pack("<I", size * factor)
    path.write_bytes(bytes(data))
    return path


def _float_wav_with(value: float, subtype: str = "FLOAT"):
    def make(path: Path) -> Path:
        data = _samples()
        data[12_345] = value
        return _write(path, data, subtype)

    return make


@pytest.mark.parametrize(
    ("make", "detail"),
    [
        (_lying_wav, "header declares 320000 bytes of audio data, the file holds 32000"),
        (
            lambda path: _lying_wav(path, factor=2, subtype="FLOAT"),
            "header declares 128000 bytes of audio data, the file holds 64000",
        ),
        (_float_wav_with(float("nan")), "NaN or infinity (first at frame 12345)"),
        (_float_wav_with(float("inf")), "NaN or infinity (first at frame 12345)"),
        (_float_wav_with(float("-inf"), "DOUBLE"), "NaN or infinity (first at frame 12345)"),
    ],
    ids=["header-claims-10x", "float-header-claims-2x", "float-nan", "float-inf", "double-minus-inf"],
)
def test_audio_that_decodes_but_is_not_what_it_claims_is_unreadable(libri: LibriCorpus, make, detail: str) -> None:
    libri.add("6", "60", 0)
    _write(libri.chapter_dir("6", "60") / "6-60-0001.wav", _samples(seed=1), "FLOAT")  # a good float WAV: kept
    libri.add_line("6", "60", "6-60-0001", "GOOD FLOAT")
    make(libri.chapter_dir("6", "60") / "6-60-0002.wav")
    libri.add_line("6", "60", "6-60-0002", "BAD")
    result = m.scan_corpus(libri.root)
    assert [r.utt_id for r in result.rows] == ["6-60-0000", "6-60-0001"]
    (reject,) = result.rejects
    assert (reject.utt_id, reject.reason, reject.stage) == ("6-60-0002", "unreadable", "manifest")
    assert detail in reject.detail, reject.detail


def test_a_wav_with_chunks_after_its_data_is_kept(libri: LibriCorpus) -> None:
    path = _write(libri.chapter_dir("6", "60") / "6-60-0000.wav", _samples())
    with open(path, "ab") as handle:  # a trailing LIST chunk, as some editors write
        handle.write(b"LIST\x04\x00\x00\x00INFO")
    libri.add_line("6", "60", "6-60-0000", "TRAILING CHUNK")
    result = m.scan_corpus(libri.root)
    assert result.rejects == [] and [r.num_samples for r in result.rows] == [16_000]


def test_a_decode_cache_from_a_version_that_checked_less_is_not_trusted(tmp_path: Path, libri: LibriCorpus) -> None:
    import pyarrow.parquet as pq

    libri.add("11", "110", 0)
    result = m.scan_corpus(libri.root)
    m.save_cache(tmp_path / "cache.parquet", result.cache)
    table = pq.read_table(tmp_path / "cache.parquet")
    pq.write_table(table.drop_columns(["audio_sha256"]), tmp_path / "old.parquet")
    assert m.load_cache(tmp_path / "old.parquet") == {}
    assert m.load_cache(tmp_path / "cache.parquet") == result.cache
