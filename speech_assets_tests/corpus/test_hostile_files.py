"""Corpus files that cannot hurt: a file the scan should not open is a reject row, never a hang,
a memory blow-up or a read outside the corpus root; odd formats are rejected from the header; an
undecodable file is not hashed in full; a CSV naming one column twice is an error.

The scans that could hang or grow memory on a broken implementation run in a child process
with its address space capped and a time limit, so that a regression fails the test instead of
the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from speech_assets.corpus import manifest as m
from speech_assets_tests.support.corpora import LibriCorpus, write_flac

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="FIFOs, /dev/zero, /proc and RLIMIT_AS as on Linux")

REPO = Path(__file__).resolve().parents[2]
HEADROOM = 1 << 30  # what the child may allocate beyond its address space after the imports

_CHILD = textwrap.dedent(
    """
    import json, resource, sys

    def cap() -> None:  # the address space as it is now, plus the headroom
        with open("/proc/self/status") as status:
            size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
        limit = size + int(sys.argv[2])
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    {body}
    """
)


def _child(body: str, *args: str, timeout: float = 60) -> dict:
    """Run ``body`` (which calls ``cap()`` once its imports are done and prints one JSON line) in a
    child process; its JSON, or a failure naming what went wrong (a hang, a MemoryError)."""
    script = _CHILD.format(body=textwrap.indent(textwrap.dedent(body), "").strip())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, *args[:1], str(HEADROOM), *args[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child did not finish within {timeout} s (blocked on a file?)")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


SCAN = """
from speech_assets.corpus import manifest as m
cap()
result = m.scan_corpus(m.Path(sys.argv[1]))
print(json.dumps({
    "rows": [[r.utt_id, r.transcript] for r in result.rows],
    "rejects": [[r.utt_id, r.path, r.reason, r.detail] for r in result.rejects],
}))
"""


def _transcript(libri: LibriCorpus) -> Path:
    libri.add("1", "10", 0, "HELLO WORLD")
    libri.add("2", "20", 0, "GOOD MORNING")  # a chapter that stays intact
    return libri.chapter_dir("1", "10") / "1-10.trans.txt"


def _symlink_outside(trans: Path, outside: Path) -> None:
    secret = outside / "secret.trans.txt"
    secret.write_text("1-10-0000 SECRET WORDS FROM OUTSIDE\n")
    trans.unlink()
    trans.symlink_to(secret)


def _fifo(trans: Path, outside: Path) -> None:
    trans.unlink()
    os.mkfifo(trans)


def _dev_zero(trans: Path, outside: Path) -> None:
    trans.unlink()
    trans.symlink_to("/dev/zero")


def _fifo_inside_via_symlink(trans: Path, outside: Path) -> None:
    fifo = trans.parent / "pipe"
    os.mkfifo(fifo)
    trans.unlink()
    trans.symlink_to(fifo)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_symlink_outside, "outside_root"),
        (_fifo, "unreadable"),
        (_dev_zero, "outside_root"),
        (_fifo_inside_via_symlink, "unreadable"),
    ],
    ids=["symlink-outside", "fifo", "dev-zero", "symlink-to-fifo-inside"],
)
def test_hostile_transcript_is_a_reject_and_never_read(libri: LibriCorpus, tmp_path: Path, make, reason: str) -> None:
    """Kills: reading a ``*.trans.txt`` by path without checking where it resolves (its text lands
    in a kept row), opening it blocking (a FIFO hangs the scan), or reading it without a size cap
    or a regular-file check (``/dev/zero`` grows memory until the run dies)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    make(_transcript(libri), outside)
    result = _child(SCAN, str(libri.root))
    assert [row for row in result["rows"] if row[0] == "2-20-0000"] == [["2-20-0000", "GOOD MORNING"]]
    assert not any("SECRET" in text for _, text in result["rows"])
    by_id = {utt: (why, detail) for utt, _path, why, detail in result["rejects"]}
    assert by_id["1-10"][0] == reason, by_id
    assert by_id["1-10-0000"][0] == "no_transcript"  # its only line was in the refused file


def test_fifo_audio_is_unreadable_not_missing_and_never_opened(libri: LibriCorpus) -> None:
    """Kills: treating an audio path that exists but is not a regular file as ``missing_file`` (it
    is there, and unreadable), or opening it blocking."""
    libri.add("1", "10", 0)
    libri.add_line("1", "10", "1-10-0001", "A PIPE")
    os.mkfifo(libri.chapter_dir("1", "10") / "1-10-0001.flac")
    result = _child(SCAN, str(libri.root))
    by_id = {utt: (why, detail) for utt, _path, why, detail in result["rejects"]}
    assert by_id["1-10-0001"][0] == "unreadable" and "FIFO" in by_id["1-10-0001"][1]
    assert [row[0] for row in result["rows"]] == ["1-10-0000"]


def test_probe_refuses_a_fifo_on_the_open_handle(tmp_path: Path) -> None:
    """Kills: a probe that opens the path it is given blocking and without ``fstat`` (the scan's
    earlier ``stat`` is no guard against a file swapped for a FIFO since)."""
    fifo = tmp_path / "a.flac"
    os.mkfifo(fifo)
    probe = _child(
        """
        from speech_assets.corpus import manifest as m
        cap()
        probe = m.probe_audio(sys.argv[1], m.ValidationConfig(), root=m.Path(sys.argv[1]).parent)
        print(json.dumps({"error": probe.error, "reason": probe.reason}))
        """,
        str(fifo),
        timeout=30,
    )
    assert "not a regular file" in probe["error"] and probe["reason"] in ("", "unreadable")


@pytest.mark.parametrize(
    ("sample_rate", "channels", "reason"),
    [
        (8_001, 1, None),
        (4_000, 1, "unsupported_format"),
        (384_000, 1, "unsupported_format"),
        (16_000, 16, "unsupported_format"),
        (16_000, 8, None),
    ],
    ids=["8001Hz-kept", "4kHz", "384kHz", "16-channels", "8-channels-kept"],
)
def test_sample_rate_and_channels_outside_the_bounds_are_unsupported_format(
    libri: LibriCorpus, sample_rate: int, channels: int, reason: str | None
) -> None:
    """Kills: accepting any sample rate and channel count (a 4 kHz or 384 kHz file, or 16 channels,
    goes on to the features step), or rejecting them as anything but ``unsupported_format``."""
    libri.add_line("1", "10", "1-10-0000", "ODD FORMAT")
    path = libri.chapter_dir("1", "10") / "1-10-0000.wav"
    rng = np.random.default_rng(0)
    sf.write(path, (rng.standard_normal((sample_rate, channels)) * 0.1).astype(np.float32), sample_rate, "PCM_16")
    result = m.scan_corpus(libri.root)
    if reason is None:
        assert [(r.utt_id, r.sample_rate, r.channels) for r in result.rows] == [("1-10-0000", sample_rate, channels)]
        return
    (reject,) = result.rejects
    assert (reject.utt_id, reject.reason) == ("1-10-0000", reason)
    assert (str(sample_rate) if channels == 1 else f"{channels} channels") in reject.detail


def test_format_bounds_come_from_the_settings(libri: LibriCorpus) -> None:
    """Kills: bounds fixed in the code rather than taken from ``[manifest]`` (and a cached
    header-only verdict kept after the bounds widen)."""
    libri.add("1", "10", 0, sample_rate=22_050)
    narrow = m.ValidationConfig(min_sample_rate=8_000, max_sample_rate=16_000)
    first = m.scan_corpus(libri.root, narrow)
    assert [r.reason for r in first.rejects] == ["unsupported_format"]
    again = m.scan_corpus(libri.root, m.ValidationConfig(), cache=first.cache)
    assert [r.utt_id for r in again.rows] == ["1-10-0000"] and again.decoded_files == 1


def test_an_odd_accepted_rate_is_resampled_in_bounded_memory(tmp_path: Path) -> None:
    """Kills: resampling with a dense ``new x orig`` kernel (torchaudio's, for rates sharing no
    factor with 16 kHz): a 1-second 8,001 Hz file then needs about 4 GB; here the child may
    allocate 1 GiB, and the features step's loader must fit with room to spare."""
    path = tmp_path / "odd.wav"
    sf.write(path, (np.random.default_rng(0).standard_normal(8_001) * 0.1).astype(np.float32), 8_001, "PCM_16")
    result = _child(
        """
        import resource
        from speech_assets.features import audio
        cap()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        decoded, rate = audio.decode(sys.argv[1])
        wave = audio.to_16k_mono(decoded, rate)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"samples": int(wave.shape[0]), "rate": rate, "grew_kib": after - before}))
        """,
        str(path),
    )
    assert (result["samples"], result["rate"]) == (16_000, 8_001)
    assert result["grew_kib"] < 256 * 1024, result


def test_undecodable_sparse_junk_is_not_hashed_in_full(libri: LibriCorpus) -> None:
    """Kills: hashing a whole file for its reject row when decoding it failed at once (1 GiB of
    sparse junk was read end to end: seconds per file, and all of a huge file's bytes)."""
    libri.add("1", "10", 0)
    libri.add_line("1", "10", "1-10-0001", "JUNK")
    junk = libri.chapter_dir("1", "10") / "1-10-0001.flac"
    with open(junk, "wb") as handle:
        handle.write(b"this is not audio" * 64)
        handle.truncate(1 << 30)  # sparse: no disk space, but every byte reads back

    def read_bytes() -> int:
        with open("/proc/self/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))

    before = read_bytes()
    result = m.scan_corpus(libri.root)
    read = read_bytes() - before
    assert {r.utt_id: r.reason for r in result.rejects} == {"1-10-0001": "unreadable"}
    assert read < 64 << 20, f"the scan read {read} bytes"
    (probe,) = (p for p in result.cache.values() if p.error)
    assert probe.file_sha256 == ""  # nothing hashed that was not read


@pytest.mark.parametrize("header", ["path,transcript,speaker_id,path", "path,transcript,speaker_id,utt_id, utt_id"])
def test_a_csv_header_naming_a_column_twice_is_an_error_naming_it(tmp_path: Path, header: str) -> None:
    """Kills: reading a CSV whose header names a column twice with the last column silently winning."""
    write_flac(tmp_path / "a.flac")
    twice = header.split(",")[-1].strip()
    rows = "a.flac,HELLO,1,a.flac\n" if twice == "path" else "a.flac,HELLO,1,a,b\n"
    manifest = tmp_path / "corpus.csv"
    manifest.write_text(f"{header}\n{rows}")
    with pytest.raises(m.CorpusError, match=f"'{twice}' more than once"):
        m.scan_corpus(manifest)


MANIFEST_CHECK = """
from speech_assets.corpus import manifest as m
cap()
location = m.Path(sys.argv[1])
out = {}
for name, call in (("check", m.check_corpus_location), ("scan", m.scan_corpus)):
    try:
        result = call(location)
        out[name] = "ok" if result is None else sorted([r.utt_id, r.reason, r.detail] for r in result.rejects)
    except m.CorpusError as error:
        out[name] = f"CorpusError: {error}"
out["fingerprint"] = bool(m.corpus_fingerprint(location))
print(json.dumps(out))
"""


def _manifest_fifo(manifest: Path) -> str:
    os.mkfifo(manifest)
    return f"{manifest} is a FIFO, not a regular file"


def _manifest_dev_zero(manifest: Path) -> str:
    manifest.symlink_to("/dev/zero")
    return "/dev/zero is a character device, not a regular file"


def _manifest_symlink_to_fifo(manifest: Path) -> str:
    fifo = manifest.parent / "pipe"
    os.mkfifo(fifo)
    manifest.symlink_to(fifo)
    return f"{fifo} is a FIFO, not a regular file"


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
@pytest.mark.parametrize(
    "make",
    [_manifest_fifo, _manifest_dev_zero, _manifest_symlink_to_fifo],
    ids=["fifo", "dev-zero", "symlink-to-fifo"],
)
def test_a_manifest_that_is_not_a_regular_file_is_a_clear_error_never_a_hang(tmp_path: Path, make, suffix: str) -> None:
    """The corpus given as a manifest that is a FIFO, a symlink to ``/dev/zero`` or to a FIFO:
    checked and scanned in a child with capped memory and a time limit, each is one CorpusError
    naming what it is (checked on the open handle), and it still fingerprints. Kills: opening the
    manifest by path without O_NONBLOCK (a FIFO hangs), reading it without a regular-file check
    (``/dev/zero`` grows memory), and judging it by ``Path.is_file()`` (the code before: "corpus
    ... is empty: no audio files", as if it were a folder)."""
    manifest = tmp_path / f"corpus{suffix}"
    what = make(manifest)
    result = _child(MANIFEST_CHECK, str(manifest))
    expected = f"CorpusError: corpus manifest {manifest} cannot be read: {what}"
    assert result == {"check": expected, "scan": expected, "fingerprint": True}


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_manifest_line_without_end_is_a_reject_read_in_bounded_memory(tmp_path: Path, suffix: str) -> None:
    """A regular manifest whose last line is 1.5 GiB of NUL bytes without a newline (a sparse
    file: no disk) is scanned in a child whose memory is capped 1 GiB above its start: that line
    is an ``unreadable`` reject row naming it, the row before it is judged as usual. Kills:
    iterating the manifest's lines unbounded (the code before: MemoryError in the child)."""
    manifest = tmp_path / f"corpus{suffix}"
    row = "a.flac,HELLO,s1\n" if suffix == ".csv" else '{"path": "a.flac", "transcript": "HELLO", "speaker_id": "s1"}\n'
    header = "path,transcript,speaker_id\n" if suffix == ".csv" else ""
    manifest.write_text(header + row)
    with open(manifest, "r+b") as handle:
        handle.truncate((3 << 29) + manifest.stat().st_size)
    line = 3 if suffix == ".csv" else 2
    result = _child(MANIFEST_CHECK, str(manifest), timeout=120)
    assert result["check"] == "ok" and result["fingerprint"]
    assert result["scan"] == [
        ["a", "missing_file", result["scan"][0][2]],
        [f"line-{line}", "unreadable", f"line {line}: is longer than {m.MAX_MANIFEST_LINE_BYTES} bytes (not read)"],
    ], result["scan"]
