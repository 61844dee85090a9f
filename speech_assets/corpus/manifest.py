"""Scan a corpus (a LibriSpeech-layout folder, or a ``.csv``/``.jsonl`` manifest with columns
``path, transcript, speaker_id`` and optional ``utt_id, chapter_id``) into manifest and reject rows.

Every file is decoded once, block by block, so corrupt audio is caught here, not in feature extraction;
results are cached by ``(path, size, mtime)``. A bad file or line (also a FIFO, a device or a symlink out
of the root: :func:`open_corpus_file`) is a :class:`RejectRow`, never a hang nor an exception; only an
unreadable corpus is a :class:`CorpusError`.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from stat import S_ISREG, filemode
from typing import Annotated, BinaryIO, Self

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf
from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from speech_assets.corpus.ids import why_unsafe
from speech_assets.corpus.rejects import RejectReason, RejectRow
from speech_assets.runtime.processes import die_with_parent
from speech_assets.utils import atomic_path, sha256_strings

AUDIO_SUFFIXES = (".flac", ".wav")
MANIFEST_SUFFIXES = (".csv", ".jsonl")


class CorpusError(ValueError):
    """The corpus as a whole cannot be read (missing, empty, malformed manifest file)."""


@dataclass(frozen=True)
class ManifestRow:
    """One valid utterance. ``path`` is absolute and resolved inside the corpus root."""

    utt_id: str
    speaker_id: str
    chapter_id: str
    path: str
    transcript: str
    sample_rate: int
    channels: int
    num_samples: int
    duration_s: float
    file_sha256: str


@pydantic_dataclass(frozen=True)
class ValidationConfig:
    """What an utterance must be to be kept: its duration in seconds and its normalised
    transcript's length (``[manifest]`` takes these defaults and their constraints)."""

    min_duration_s: float = 0.5
    max_duration_s: float = 35.0
    max_transcript_chars: Annotated[int, Field(ge=1)] = 2000  # of the normalised transcript
    # the header's sample rate (Hz) and channel count: outside these, reject unsupported_format
    # (never decoded, never resampled)
    min_sample_rate: int = 8_000
    max_sample_rate: int = 192_000
    max_channels: Annotated[int, Field(ge=1)] = 8

    @model_validator(mode="after")
    def _ranges(self) -> Self:
        problems = []
        if not 0 <= self.min_duration_s < self.max_duration_s:
            problems.append("need 0 <= min_duration_s < max_duration_s")
        if not 1 <= self.min_sample_rate <= self.max_sample_rate <= 768_000:
            problems.append("need 1 <= min_sample_rate <= max_sample_rate <= 768000")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def format_problem(self, sample_rate: int, channels: int) -> str | None:
        """Why a file of this rate and channel count is not accepted (None: it is)."""
        if not self.min_sample_rate <= sample_rate <= self.max_sample_rate:
            return (
                f"sample rate {sample_rate} Hz is outside [min_sample_rate={self.min_sample_rate}, "
                f"max_sample_rate={self.max_sample_rate}]"
            )
        if not 1 <= channels <= self.max_channels:
            return f"{channels} channels, outside [1, max_channels={self.max_channels}]"
        return None


@dataclass(frozen=True)
class Candidate:
    """An utterance the corpus declares, before its audio is looked at."""

    utt_id: str
    speaker_id: str
    chapter_id: str
    transcript: str
    path: str  # as written (joined to its folder), not yet resolved


@dataclass(frozen=True)
class AudioProbe:
    """What decoding one file found: either the audio facts or an error detail."""

    size: int
    mtime_ns: int
    sample_rate: int = 0
    channels: int = 0
    num_samples: int = 0
    file_sha256: str = ""
    error: str = ""
    # False when the header alone showed the duration out of bounds, so the file was never read:
    # such a probe is trusted only while the bounds still exclude it.
    decoded: bool = True
    audio_sha256: str = ""  # of the decoded samples (with rate and channels): finds one recording under two ids
    reason: str = ""  # with ``error``: the reject reason when it is not ``unreadable`` (e.g. ``outside_root``)


@dataclass
class ScanResult:
    rows: list[ManifestRow]
    rejects: list[RejectRow]
    decoded_files: int  # files actually decoded (not served from the cache)
    cache: dict[str, AudioProbe]

    @property
    def reject_ratio(self) -> float:
        total = len(self.rows) + len(self.rejects)
        return len(self.rejects) / total if total else 0.0


_PUNCTUATION = re.compile(r"[^\w\s']|_")
_SPACES = re.compile(r"\s+")


def normalise_transcript(text: str) -> str:
    """Upper case, punctuation stripped (apostrophes kept), whitespace collapsed."""
    return _SPACES.sub(" ", _PUNCTUATION.sub(" ", text.upper())).strip()


# A transcript file larger than this is not read (a LibriSpeech chapter's is a few kB)
MAX_TRANSCRIPT_FILE_BYTES = 64 << 20
# A manifest line longer than this is a reject row, read past in chunks, never held whole (a
# sparse file without a newline would otherwise be one line of its whole size)
MAX_MANIFEST_LINE_BYTES = 16 << 20
_SKIP_CHUNK = 1 << 20
_TOO_LONG = f"is longer than {MAX_MANIFEST_LINE_BYTES} bytes (not read)"

_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)  # the real path is opened: a symlink put there since is refused
    | getattr(os, "O_NONBLOCK", 0)  # a FIFO opens at once (and is then refused), it never blocks
    | getattr(os, "O_NOCTTY", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


class RefusedFile(Exception):
    """A corpus file that is not opened or read: its reject reason and a detail naming it."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


_KINDS = dict(d="a directory", p="a FIFO", c="a character device", b="a block device", s="a socket", l="a symlink")


def _kind(mode: int) -> str:
    return _KINDS.get(filemode(mode)[0], "not a regular file")


def open_corpus_file(path: str, root: str | os.PathLike[str] | None = None) -> tuple[BinaryIO, os.stat_result]:
    """Open ``path`` (binary) with its ``fstat``, or raise :class:`RefusedFile`. Its real path must be
    inside ``root`` (resolved; None: anywhere) and a regular file, both checked on the open handle, so a
    file swapped for a symlink, a FIFO or a device since is refused too. Never blocks (a FIFO opens at once)."""
    real = os.path.realpath(path)
    if root is not None and not is_inside(real, root):
        raise RefusedFile(RejectReason.OUTSIDE_ROOT, f"resolves to {real}, outside the corpus root {root}")
    try:
        fd = os.open(real, _OPEN_FLAGS)
    except OSError as err:
        raise RefusedFile(RejectReason.UNREADABLE, f"cannot open {real}: {err.strerror or err}") from err
    try:
        stat = os.fstat(fd)
        if not S_ISREG(stat.st_mode):
            raise RefusedFile(RejectReason.UNREADABLE, f"{real} is {_kind(stat.st_mode)}, not a regular file")
        held = None
        with contextlib.suppress(OSError):  # the path the kernel holds for fd (Linux only)
            held = os.readlink(f"/proc/self/fd/{fd}") if root is not None else None
        if held is not None and not is_inside(held, root):
            raise RefusedFile(RejectReason.OUTSIDE_ROOT, f"opened as {held}, outside the corpus root {root}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), stat
    except BaseException:
        os.close(fd)
        raise


def corpus_root_of(location: Path) -> Path:
    """The folder every audio path must stay inside."""
    return location.parent if location.suffix.lower() in MANIFEST_SUFFIXES else location


def is_manifest_file(location: Path) -> bool:
    """Whether the corpus is given as a ``.csv``/``.jsonl`` manifest file (then opened only as
    :func:`open_corpus_file` opens, so a FIFO or device there is refused)."""
    return location.suffix.lower() in MANIFEST_SUFFIXES and not location.is_dir()


def check_corpus_location(location: Path) -> None:
    """Raise :class:`CorpusError` if ``location`` is missing, holds no corpus, or is a manifest file
    that cannot be read at all (a bad line only becomes a reject row)."""
    if not location.exists():
        raise CorpusError(f"corpus not found: {location} does not exist")
    if is_manifest_file(location):
        with contextlib.closing(_read_manifest_records(location)) as records:
            next(records, None)  # opens it and reads a CSV's header: CorpusError if either fails
        return
    if not location.is_dir():
        kind = "a file" if location.is_file() else _kind(location.stat().st_mode)
        raise CorpusError(f"corpus {location} is {kind}, neither a folder nor a .csv or .jsonl manifest")
    if not any(_walk_corpus_files(location)):
        raise CorpusError(f"corpus {location} is empty: no audio files and no *.trans.txt transcripts")


def _walk_corpus_files(root: Path) -> Iterator[str]:
    for folder, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(".trans.txt") or name.lower().endswith(AUDIO_SUFFIXES):
                yield os.path.join(folder, name)


def discover(location: Path) -> tuple[list[Candidate], list[RejectRow]]:
    """Candidates declared by the corpus and rejects that need no audio (e.g. no transcript)."""
    return _discover_manifest_file(location) if is_manifest_file(location) else _discover_librispeech(location)


def _discover_librispeech(root: Path) -> tuple[list[Candidate], list[RejectRow]]:
    candidates: list[Candidate] = []
    rejects: list[RejectRow] = []
    # by folder, as strings (a Path per file and sorting them cost more than the rest together);
    # a folder's transcripts are read in name order, as a sorted walk of Paths would
    transcripts: dict[str, dict[str, str]] = {}
    audio: dict[str, dict[str, str]] = {}
    real_root = os.path.realpath(root)
    for folder, _dirs, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".trans.txt"):
                path = os.path.join(folder, name)
                try:
                    lines = _read_trans_file(path, real_root)
                except RefusedFile as refused:
                    # its utterances then have no transcript line: each becomes its own reject
                    rejects.append(
                        RejectRow(name[: -len(".trans.txt")], path, "manifest", refused.reason, refused.detail)
                    )
                    continue
                transcripts.setdefault(folder, {}).update(lines)
            elif name.lower().endswith(AUDIO_SUFFIXES):
                audio.setdefault(folder, {})[os.path.splitext(name)[0]] = os.path.join(folder, name)
    for folder in sorted(map(Path, set(transcripts) | set(audio))):
        texts = transcripts.get(str(folder), {})
        files = audio.get(str(folder), {})  # utt_id -> path: strings, as pathlib would write them
        parts = folder.relative_to(root).parts
        speaker_id = parts[-2] if len(parts) >= 2 else (parts[-1] if parts else "unknown")
        chapter_id = parts[-1] if len(parts) >= 2 else "0"
        for utt_id in sorted(set(texts) | set(files)):
            text = normalise_transcript(texts.get(utt_id, ""))
            if utt_id not in files:
                if (reason := why_unsafe(utt_id)) is not None:  # never joined to a folder, not even in a reject
                    where, why, detail = str(folder), RejectReason.INVALID_ID, _id_detail("utt_id", utt_id, reason)
                else:
                    where, why = str(folder / f"{utt_id}.flac"), RejectReason.MISSING_FILE
                    detail = f"transcript line for {utt_id} in {folder} has no audio file"
                rejects.append(RejectRow(utt_id, where, "manifest", why, detail))
                continue
            if not text:
                detail = (
                    "transcript is empty" if utt_id in texts else f"no line for {utt_id} in any *.trans.txt of {folder}"
                )
                rejects.append(RejectRow(utt_id, files[utt_id], "manifest", RejectReason.NO_TRANSCRIPT, detail))
                continue
            ids = utt_id.split("-")
            speaker, chapter = (ids[0], ids[1]) if len(ids) == 3 else (speaker_id, chapter_id)
            candidates.append(Candidate(utt_id, speaker, chapter, text, files[utt_id]))
    return candidates, rejects


def _read_trans_file(path: str, root: str) -> dict[str, str]:
    """``{utt_id: text}`` of a ``*.trans.txt`` inside ``root`` (:class:`RefusedFile` if it cannot be)."""
    try:
        handle, _stat = open_corpus_file(path, root)
        with handle:
            data = handle.read(MAX_TRANSCRIPT_FILE_BYTES + 1)
        if len(data) > MAX_TRANSCRIPT_FILE_BYTES:
            raise RefusedFile(
                RejectReason.UNREADABLE, f"transcript file {path} holds more than {MAX_TRANSCRIPT_FILE_BYTES} bytes"
            )
    except OSError as err:  # a read error (EIO, EISDIR): the file is unreadable, the run goes on
        raise RefusedFile(RejectReason.UNREADABLE, f"cannot read {path}: {err.strerror or err}") from err
    pairs = (line.strip().partition(" ") for line in data.decode("utf-8", errors="replace").splitlines())
    return {utt_id: text for utt_id, _, text in pairs if utt_id}


REQUIRED_COLUMNS = ("path", "transcript", "speaker_id")
_FIELDS = (*REQUIRED_COLUMNS, "utt_id", "chapter_id")


def _discover_manifest_file(manifest: Path) -> tuple[list[Candidate], list[RejectRow]]:
    candidates: list[Candidate] = []
    rejects: list[RejectRow] = []

    def reject(utt_id: str, where: object, reason: RejectReason, detail: str) -> None:  # of the current line
        rejects.append(RejectRow(utt_id, str(where), "manifest", reason, f"line {line}: {detail}"))

    for line, record in _read_manifest_records(manifest):
        if isinstance(record, str):  # the line could not be read into a record
            reject(f"line-{line}", manifest, RejectReason.UNREADABLE, record)
            continue
        raw_path = record["path"].strip()
        utt_id = record["utt_id"].strip() or (Path(raw_path).stem if raw_path else f"line-{line}")
        if not raw_path:
            reject(utt_id, manifest, RejectReason.MISSING_FILE, "no path")
            continue
        path = Path(raw_path) if os.path.isabs(raw_path) else manifest.parent / raw_path
        text = normalise_transcript(record["transcript"])
        if not text:
            reject(utt_id, path, RejectReason.NO_TRANSCRIPT, "empty transcript")
            continue
        speaker = record["speaker_id"].strip()  # empty: an invalid_id reject, not a failed run
        chapter = record["chapter_id"].strip() or "0"
        candidates.append(Candidate(utt_id, speaker, chapter, text, str(path)))
    return candidates, rejects


def _read_manifest_records(manifest: Path) -> Iterator[tuple[int, dict[str, str] | str]]:
    """``(line number, record)`` of a .csv/.jsonl manifest: its :data:`_FIELDS` as text (``""`` when
    absent), or a problem for a line that cannot be one. :class:`CorpusError` only when the file cannot be
    read at all (refused, empty, or a CSV header without the required columns)."""
    try:
        handle, stat = open_corpus_file(str(manifest))
        with handle:
            if stat.st_size == 0:
                raise CorpusError(f"corpus manifest {manifest} is empty")
            if manifest.suffix.lower() == ".csv":
                yield from _read_csv_records(handle, manifest)
            else:
                yield from _read_jsonl_records(handle)
    except RefusedFile as refused:
        raise CorpusError(f"corpus manifest {manifest} cannot be read: {refused.detail}") from refused
    except OSError as err:
        raise CorpusError(f"corpus manifest {manifest} cannot be read: {err.strerror or err}") from err


def _bounded_lines(handle: BinaryIO) -> Iterator[bytes | None]:
    """The lines of ``handle`` (newline kept), ``None`` for one longer than the limit: the rest of
    that line is read in chunks and dropped, so no more than the limit is held."""
    while True:
        line = handle.readline(MAX_MANIFEST_LINE_BYTES + 1)
        if not line:
            return
        if len(line) <= MAX_MANIFEST_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        while (rest := handle.readline(_SKIP_CHUNK)) and not rest.endswith(b"\n"):
            pass
        yield None


def _read_csv_records(handle: BinaryIO, manifest: Path) -> Iterator[tuple[int, dict[str, str] | str]]:
    too_long: list[int] = []

    def text_lines(handle: BinaryIO) -> Iterator[str]:
        # undecodable bytes become lone surrogates, so that one bad line is found (by
        # _record_problem) without losing the parser's place in the file; an over-long line
        # reaches the parser as a blank one and is reported by its number
        for number, line in enumerate(_bounded_lines(handle), start=1):
            if line is None:
                too_long.append(number)
                yield "\n"
            else:
                yield line.decode("utf-8-sig" if number == 1 else "utf-8", errors="surrogateescape")

    reader = csv.reader(text_lines(handle))
    try:
        header = [name.strip() for name in next(reader, [])]
    except csv.Error as err:
        raise CorpusError(f"{manifest}: the header line cannot be parsed as CSV ({err})") from err
    if duplicated := sorted({name for name in header if header.count(name) > 1}):
        raise CorpusError(
            f"{manifest}: the header line names {', '.join(repr(name) for name in duplicated)} more than once "
            "(which column to use would be a guess)"
        )
    if missing := [name for name in REQUIRED_COLUMNS if name not in header]:
        raise CorpusError(
            f"{manifest}: missing columns {missing} in the header line (a UTF-8 CSV with columns {', '.join(_FIELDS)})"
        )
    while True:
        start = reader.line_num + 1
        values: list[str] | str | None
        try:
            values = next(reader, None)
        except csv.Error as err:  # e.g. a field over csv.field_size_limit(): the rest of its line is skipped
            values = f"cannot be parsed as CSV ({err})"
        yield from [(number, _TOO_LONG) for number in too_long]
        too_long.clear()
        if values is None:
            return
        if isinstance(values, str):
            yield reader.line_num, values
        elif values and len(values) != len(header):
            yield start, f"has {len(values)} fields, the header names {len(header)}"
        elif values:  # not a blank line
            record = dict(zip(header, values, strict=True))
            yield start, _record_problem(record) or {name: record.get(name, "") for name in _FIELDS}


def _read_jsonl_records(handle: BinaryIO) -> Iterator[tuple[int, dict[str, str] | str]]:
    for number, raw in enumerate(_bounded_lines(handle), start=1):
        if raw is None:
            yield number, _TOO_LONG
            continue
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as err:
            yield number, f"is not valid UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start})"
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as err:  # ValueError: also an integer of over 4,300 digits
            yield number, f"is not JSON ({getattr(err, 'msg', None) or str(err) or 'nested too deeply'})"
            continue
        if not isinstance(record, dict):
            yield number, f"is not a JSON object (a {type(record).__name__})"
            continue
        wrong = next((name for name in _FIELDS if type(record.get(name)) not in (str, int, type(None))), None)
        if wrong is not None:
            yield number, f"field {wrong!r} is a JSON {type(record[wrong]).__name__}, not a string"
            continue
        # an int is a numeric id, as LibriSpeech's are
        texts = {name: "" if record.get(name) is None else str(record[name]) for name in _FIELDS}
        yield number, _record_problem(texts) or texts


def _record_problem(record: Mapping[str, str]) -> str | None:
    """Why the record's fields cannot be used as text (None: they can)."""
    for name in _FIELDS:
        value = record.get(name, "")
        if "\x00" in value:
            return f"field {name!r} contains a NUL byte"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return f"field {name!r} is not valid UTF-8 text (character {err.start + 1})"
    return None


_BLOCK_FRAMES = 1 << 16
_UNKNOWN_LENGTH = 2**63 - 1  # SF_COUNT_MAX: what libsndfile reports for a FLAC with no total in its header
_HEAD_BYTES = 1 << 20


_SAMPLE_TYPES = {"FLOAT": "float32", "DOUBLE": "float64", "PCM_24": "int32", "PCM_32": "int32"}  # others: int16


def riff_data_problem(head: bytes, size: int) -> str | None:
    """Why a RIFF/WAVE file's ``data`` chunk declares more than its ``size`` bytes hold (libsndfile
    clamps the frame count to what is there, so decoding cannot tell); None if it does not or cannot tell."""
    if len(head) < 12 or head[:4] not in (b"RIFF", b"RIFX") or head[8:12] != b"WAVE":
        return None
    order = "<" if head[:4] == b"RIFF" else ">"
    offset = 12
    while offset + 8 <= len(head):
        name, (length,) = head[offset : offset + 4], struct.unpack(order + "I", head[offset + 4 : offset + 8])
        if name == b"data":
            held = size - offset - 8
            if length <= held:
                return None
            return f"header declares {length} bytes of audio data, the file holds {held} (truncated, or a wrong header)"
        offset += 8 + length + (length & 1)  # chunks are padded to an even length
    return None


def probe_audio(
    path: str, config: ValidationConfig | None = None, root: str | os.PathLike[str] | None = None
) -> AudioProbe:
    """Validate ``path``; never raises for bad audio (the error goes in ``error``). A file outside
    ``config``'s format or duration bounds is judged from its header and never read (``decoded=False``);
    else it is decoded block by block (memory does not grow with its length), its samples hashed on
    the way (the same audio in another format hashes the same), then the file is hashed."""
    try:
        handle, stat = open_corpus_file(path, None if root is None else os.path.realpath(root))
    except RefusedFile as refused:
        stat = _stat_or_none(path, os.lstat)
        size, mtime_ns = (stat.st_size, stat.st_mtime_ns) if stat else (0, 0)
        return AudioProbe(size, mtime_ns, error=refused.detail, reason=refused.reason)
    with handle:
        return _probe_open(handle, stat, config)


def _stat_or_none(path: str, stat: Callable[[str], os.stat_result] = os.stat) -> os.stat_result | None:
    try:
        return stat(path)
    except OSError:
        return None


def _probe_open(handle: BinaryIO, stat: os.stat_result, config: ValidationConfig | None) -> AudioProbe:
    base = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if stat.st_size == 0:
        return AudioProbe(**base, error="file is empty (0 bytes)")
    try:
        with sf.SoundFile(handle.fileno(), closefd=False) as audio:
            declared, sample_rate, channels = audio.frames, audio.samplerate, audio.channels
            facts = {**base, "sample_rate": sample_rate, "channels": channels}
            header = AudioProbe(**facts, num_samples=max(declared, 0), decoded=False)  # judged from it alone
            if config is not None and config.format_problem(sample_rate, channels) is not None:
                return header  # never decoded (a thousand channels) nor resampled (an odd rate)
            if declared >= _UNKNOWN_LENGTH:
                # libsndfile can neither seek nor read such a file through soundfile; rejecting
                # it as too long from a made-up duration would misreport it
                return AudioProbe(
                    **base,
                    error="header does not declare the number of samples (a streamed FLAC?), so it cannot be validated",
                )
            if config is not None and declared > 0 and _out_of_bounds(header, config):
                return header
            limit = None if config is None else int(config.max_duration_s * sample_rate) + 1
            dtype = _SAMPLE_TYPES.get(audio.subtype, "int16")
            samples = hashlib.sha256(f"{sample_rate}|{channels}|{dtype}|".encode())
            decoded = 0
            for block in audio.blocks(blocksize=_BLOCK_FRAMES, dtype=dtype, always_2d=True):  # (frames, channels)
                if dtype.startswith("float") and not (finite := np.isfinite(block).all(axis=1)).all():
                    first = decoded + int(np.argmin(finite))
                    return AudioProbe(**base, error=f"float samples include NaN or infinity (first at frame {first})")
                decoded += block.shape[0]
                samples.update(block)
                if limit is not None and declared <= 0 and decoded > limit:  # no length in the header
                    return AudioProbe(**facts, num_samples=decoded, decoded=False)
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as err:
        reason = getattr(err, "error_string", None) or str(err)
        return AudioProbe(**base, error=f"cannot decode as audio: {reason}")
    if decoded == 0:
        return AudioProbe(**base, error="decodes to zero samples")
    try:
        handle.seek(0)
        head = handle.read(_HEAD_BYTES)  # where a WAV's chunk headers are
        handle.seek(0)
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError as err:
        return AudioProbe(**base, error=f"cannot read: {err.strerror or err}")
    if declared > 0 and declared != decoded:
        return AudioProbe(
            **base,
            file_sha256=digest,
            error=f"header declares {declared} samples but {decoded} decoded (truncated or corrupt)",
        )
    if (problem := riff_data_problem(head, stat.st_size)) is not None:
        return AudioProbe(**base, file_sha256=digest, error=problem)
    return AudioProbe(**facts, num_samples=decoded, file_sha256=digest, audio_sha256=samples.hexdigest())


def _cache_key(path: str, size: int, mtime_ns: int) -> str:
    return f"{path}|{size}|{mtime_ns}"


def probe_all(
    paths: Sequence[str],
    cache: dict[str, AudioProbe],
    workers: int = 1,
    config: ValidationConfig | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    stats: Mapping[str, os.stat_result] | None = None,
    root: str | os.PathLike[str] | None = None,
) -> tuple[dict[str, AudioProbe], int]:
    """Probe each path once, reusing cache hits keyed by (path, size, mtime_ns); a cached probe judged
    from its header alone is reused only while ``config``'s bounds still exclude it."""
    results: dict[str, AudioProbe] = {}
    todo: list[str] = []
    for path in paths:
        stat = (stats or {}).get(path) or os.stat(path)
        hit = cache.get(_cache_key(path, stat.st_size, stat.st_mtime_ns))
        if hit is not None and (hit.decoded or (config is not None and _out_of_bounds(hit, config))):
            results[path] = hit
        else:
            todo.append(path)
    probe = functools.partial(probe_audio, config=config, root=None if root is None else os.path.realpath(root))
    with contextlib.ExitStack() as stack:
        if workers > 1 and len(todo) > 32:
            # a killed validation run leaves no decoder behind
            pool = stack.enter_context(ProcessPoolExecutor(max_workers=workers, initializer=die_with_parent))
            probes: Iterable[AudioProbe] = pool.map(probe, todo, chunksize=16)
        else:
            probes = map(probe, todo)
        for done, (path, result) in enumerate(zip(todo, probes, strict=True), start=1):
            results[path] = result
            if progress is not None:
                progress(path, done, len(todo))
    return results, len(todo)


def _out_of_bounds(probe: AudioProbe, config: ValidationConfig) -> bool:
    if config.format_problem(probe.sample_rate, probe.channels) is not None:
        return True
    duration = probe.num_samples / probe.sample_rate if probe.sample_rate else 0.0
    return not config.min_duration_s <= duration <= config.max_duration_s


def scan_corpus(
    location: Path,
    config: ValidationConfig = ValidationConfig(),
    cache: dict[str, AudioProbe] | None = None,
    workers: int = 1,
    progress: Callable[[str, int, int], None] | None = None,
) -> ScanResult:
    """Validate every utterance; :class:`CorpusError` only when the corpus itself is missing, empty or malformed."""
    location = Path(location).absolute()
    check_corpus_location(location)
    root = corpus_root_of(location).resolve()
    candidates, rejects = discover(location)

    inside: list[tuple[Candidate, str]] = []
    stats: dict[str, os.stat_result] = {}  # each file stat'ed once, here
    real = RealPaths()
    for candidate in candidates:

        def reject(reason: RejectReason, detail: str) -> None:
            rejects.append(RejectRow(candidate.utt_id, candidate.path, "manifest", reason, detail))

        if (bad_id := invalid_id_detail(candidate)) is not None:
            reject(RejectReason.INVALID_ID, bad_id)
        elif len(candidate.transcript) > config.max_transcript_chars:
            reject(
                RejectReason.TRANSCRIPT_TOO_LONG,
                f"transcript of {len(candidate.transcript)} characters (normalised), "
                f"more than max_transcript_chars={config.max_transcript_chars}",
            )
        elif not is_inside(resolved := real(candidate.path), root):
            reject(RejectReason.OUTSIDE_ROOT, f"resolves to {resolved}, outside the corpus root {root}")
        elif (stat := _stat_or_none(resolved)) is None:
            reject(RejectReason.MISSING_FILE, f"no file at {resolved}")
        elif not S_ISREG(stat.st_mode):
            reject(RejectReason.UNREADABLE, f"{resolved} is {_kind(stat.st_mode)}, not a regular file")
        else:
            inside.append((candidate, resolved))
            stats[resolved] = stat

    paths = sorted({path for _, path in inside})
    probes, decoded = probe_all(paths, dict(cache or {}), workers, config, progress, stats, root)
    rows: list[ManifestRow] = []
    kept_at: dict[str, str] = {}
    kept_audio: dict[str, str] = {}  # audio_sha256 -> the utt_id kept with it
    for candidate, path in sorted(inside, key=lambda item: (item[0].utt_id, item[1])):
        probe = probes[path]
        if (problem := _judge(candidate.utt_id, probe, config, kept_at, kept_audio)) is not None:
            rejects.append(RejectRow(candidate.utt_id, path, "manifest", *problem))
            continue
        kept_at[candidate.utt_id] = path
        if probe.audio_sha256:
            kept_audio[probe.audio_sha256] = candidate.utt_id
        rows.append(
            ManifestRow(
                **{**vars(candidate), "path": path},
                sample_rate=probe.sample_rate,
                channels=probe.channels,
                num_samples=probe.num_samples,
                duration_s=probe.num_samples / probe.sample_rate,
                file_sha256=probe.file_sha256,
            )
        )
    # keyed by the stat each probe was judged with (its own, or its cache entry's)
    new_cache = {_cache_key(path, probe.size, probe.mtime_ns): probe for path, probe in probes.items()}
    rejects.sort(key=lambda r: (r.utt_id, r.path, r.reason))
    return ScanResult(rows=rows, rejects=rejects, decoded_files=decoded, cache=new_cache)


def is_inside(path: str, root: Path | str) -> bool:
    """Whether the normalised absolute ``path`` is ``root`` or below it (what
    ``Path(path).is_relative_to(root)`` answers, without building a Path per file)."""
    root = str(root).rstrip(os.sep) or os.sep
    return path == root or path.startswith(root if root == os.sep else root + os.sep)


class RealPaths:
    """``os.path.realpath`` for many files with each folder resolved once (a name that is itself a
    symlink is resolved in full): one ``lstat`` per file instead of one per path component."""

    def __init__(self) -> None:
        self._folder = functools.cache(lambda folder: os.path.realpath(folder or os.curdir))

    def __call__(self, path: str) -> str:
        folder, name = os.path.split(path)
        if name in ("", os.curdir, os.pardir) or os.path.islink(path):
            return os.path.realpath(path)
        return os.path.join(self._folder(folder), name)


def invalid_id_detail(candidate: Candidate) -> str | None:
    """Which of the candidate's ids cannot become a file name or partition key, and why (None: all safe)."""
    ids = {"speaker_id": candidate.speaker_id, "chapter_id": candidate.chapter_id, "utt_id": candidate.utt_id}
    problems = [_id_detail(what, value, reason) for what, value in ids.items() if (reason := why_unsafe(value))]
    return "; ".join(problems) or None


def _id_detail(what: str, value: str, reason: str) -> str:
    return f"{what} {value[:80]!r}{'...' if len(value) > 80 else ''} {reason}"


def _judge(
    utt_id: str, probe: AudioProbe, config: ValidationConfig, kept_at: dict[str, str], kept_audio: dict[str, str]
) -> tuple[RejectReason, str] | None:
    if probe.error:
        return RejectReason(probe.reason or RejectReason.UNREADABLE), probe.error
    if (problem := config.format_problem(probe.sample_rate, probe.channels)) is not None:
        return RejectReason.UNSUPPORTED_FORMAT, problem
    if utt_id in kept_at:
        return RejectReason.DUPLICATE_ID, f"utt_id {utt_id} already kept from {kept_at[utt_id]}"
    duration = probe.num_samples / probe.sample_rate
    if duration < config.min_duration_s:
        return RejectReason.TOO_SHORT, f"{duration:.3f} s is shorter than min_duration_s={config.min_duration_s}"
    if duration > config.max_duration_s:
        return RejectReason.TOO_LONG, f"{duration:.3f} s is longer than max_duration_s={config.max_duration_s}"
    if probe.audio_sha256 and (first := kept_audio.get(probe.audio_sha256)) is not None:
        return (
            RejectReason.DUPLICATE_AUDIO,
            f"the same decoded audio as {first} (kept from {kept_at[first]}): one recording under two ids",
        )
    return None


def manifest_hash(rows: Iterable[ManifestRow]) -> str:
    """sha256 over the sorted ``(utt_id, file_sha256, transcript)`` of kept rows."""
    return hash_triples((r.utt_id, r.file_sha256, r.transcript) for r in rows)


def hash_triples(triples: Iterable[tuple[str, str, str]]) -> str:
    """The manifest hash of ``(utt_id, file_sha256, transcript)`` triples, in any order."""
    return sha256_strings(part for triple in sorted(triples) for part in triple)


def speaker_hashes(rows: Iterable[ManifestRow]) -> dict[str, str]:
    """Per-speaker manifest hash: what a speaker's feature shard depends on."""
    by_speaker: dict[str, list[ManifestRow]] = {}
    for row in rows:
        by_speaker.setdefault(row.speaker_id, []).append(row)
    return {speaker: manifest_hash(group) for speaker, group in sorted(by_speaker.items())}


MANIFEST_SCHEMA = pa.schema(
    [
        ("utt_id", pa.string()),
        ("speaker_id", pa.string()),
        ("chapter_id", pa.string()),
        ("path", pa.string()),
        ("transcript", pa.string()),
        ("sample_rate", pa.int32()),
        ("channels", pa.int16()),
        ("num_samples", pa.int64()),
        ("duration_s", pa.float64()),
        ("file_sha256", pa.string()),
    ]
)
_CACHE_SCHEMA = pa.schema(
    [("key", pa.string())]
    + [(f.name, {"str": pa.string(), "bool": pa.bool_()}.get(str(f.type), pa.int64())) for f in fields(AudioProbe)]
)


def _write_table(path: Path, columns: dict[str, list], schema: pa.Schema) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(pa.Table.from_pydict(columns, schema=schema), tmp, compression="zstd")


def write_manifest(path: Path, rows: Sequence[ManifestRow]) -> None:
    _write_table(path, {name: [getattr(row, name) for row in rows] for name in MANIFEST_SCHEMA.names}, MANIFEST_SCHEMA)


def read_manifest(path: Path) -> list[ManifestRow]:
    return [ManifestRow(**record) for record in pq.read_table(path).to_pylist()]


def load_cache(path: Path) -> dict[str, AudioProbe]:
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid):
        return {}  # none yet, or a damaged one: it only costs a re-decode
    if table.column_names != _CACHE_SCHEMA.names:
        return {}  # written by a version that checked less (or other) than this one: decode again
    return {record.pop("key"): AudioProbe(**record) for record in table.to_pylist()}


def save_cache(path: Path, cache: dict[str, AudioProbe]) -> None:
    keys = sorted(cache)
    columns = {"key": keys, **{name: [getattr(cache[k], name) for k in keys] for name in _CACHE_SCHEMA.names[1:]}}
    _write_table(path, columns, _CACHE_SCHEMA)


def corpus_fingerprint(location: Path) -> str:
    """sha256 over (relative path, size, mtime) of every corpus file: stats only, so a sensor can call it every tick."""
    location = Path(location).absolute()
    if not location.exists():
        return ""
    if is_manifest_file(location):
        paths = [str(location)]
        with contextlib.suppress(CorpusError):
            paths += [c.path for c in discover(location)[0]]
        found = [(path, os.path.relpath(path, location.parent)) for path in paths]
    else:
        # relative paths cut from the strings, in the order Paths sort (by parts), without a Path or
        # a relpath per file: a sensor tick and every manifest run fingerprint thousands of files
        cut = len(os.path.join(location, ""))
        found = sorted(((full, full[cut:]) for full in _walk_corpus_files(location)), key=lambda f: f[1].split(os.sep))
    parts = []
    for full, relative in found:
        try:
            stat = os.stat(full)
        except (OSError, ValueError):  # ValueError: a path no file can have
            parts.append(f"{full}|missing")
        else:
            parts.append(f"{relative}|{stat.st_size}|{stat.st_mtime_ns}")
    return sha256_strings(parts)
