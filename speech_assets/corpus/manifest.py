"""Scan a corpus and validate every audio file into manifest rows and reject rows.

Two input forms are accepted:

* a folder in LibriSpeech layout: ``<spk>/<chap>/<spk>-<chap>-<utt>.flac`` beside
  ``<spk>-<chap>.trans.txt`` (``<utt_id> TEXT`` per line);
* a ``.csv`` or ``.jsonl`` file with columns ``path, transcript, speaker_id`` and optional
  ``utt_id, chapter_id``; relative paths resolve against the manifest file's folder, which is
  then the corpus root.

A file whose header declares a duration outside the configured bounds is rejected without being
read. Every other file is hashed in chunks and decoded once, fully, block by block from disk
(memory does not grow with its length), so that truncated or corrupt audio is caught here rather
than in feature extraction. Decode results are cached by ``(path, size, mtime)`` so an unchanged
corpus is re-validated without decoding anything. No path that resolves outside the corpus root
is ever opened, and no speaker, chapter or utterance id that is not a safe id
(:mod:`speech_assets.corpus.ids`) goes further than a reject row. A bad file never raises: it
becomes a :class:`RejectRow` with a reason from :class:`RejectReason` and a human-readable detail.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from stat import S_ISREG

import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

from speech_assets.corpus.ids import why_unsafe
from speech_assets.corpus.rejects import RejectReason, RejectRow
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


@dataclass(frozen=True)
class ValidationConfig:
    min_duration_s: float = 0.5
    max_duration_s: float = 35.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_duration_s < self.max_duration_s:
            raise ValueError(
                f"need 0 <= min_duration_s < max_duration_s, got {self.min_duration_s}, {self.max_duration_s}"
            )


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


# ---------------------------------------------------------------------------------------------
# Discovering candidates


def corpus_root_of(location: Path) -> Path:
    """The folder every audio path must stay inside."""
    return location.parent if location.suffix.lower() in MANIFEST_SUFFIXES else location


def check_corpus_location(location: Path) -> None:
    """Raise :class:`CorpusError` naming ``location`` if it is missing or holds no corpus."""
    if not location.exists():
        raise CorpusError(f"corpus not found: {location} does not exist")
    if location.is_file():
        if location.suffix.lower() not in MANIFEST_SUFFIXES:
            raise CorpusError(f"corpus {location} is a file but not a .csv or .jsonl manifest")
        if location.stat().st_size == 0:
            raise CorpusError(f"corpus manifest {location} is empty")
        return
    if not any(_walk_corpus_files(location)):
        raise CorpusError(f"corpus {location} is empty: no audio files and no *.trans.txt transcripts")


def _walk_corpus_files(root: Path) -> Iterator[Path]:
    for folder, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(".trans.txt") or name.lower().endswith(AUDIO_SUFFIXES):
                yield Path(folder) / name


def discover(location: Path) -> tuple[list[Candidate], list[RejectRow]]:
    """Candidates declared by the corpus and rejects that need no audio (e.g. no transcript)."""
    if location.is_file():
        return _discover_manifest_file(location)
    return _discover_librispeech(location)


def _discover_librispeech(root: Path) -> tuple[list[Candidate], list[RejectRow]]:
    candidates: list[Candidate] = []
    rejects: list[RejectRow] = []
    # by folder, as strings (a Path per file and sorting them cost more than the rest together);
    # a folder's transcripts are read in name order, as a sorted walk of Paths would
    transcripts: dict[str, dict[str, str]] = {}
    audio: dict[str, dict[str, str]] = {}
    for folder, _dirs, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".trans.txt"):
                transcripts.setdefault(folder, {}).update(_read_trans_file(Path(folder, name)))
            elif name.lower().endswith(AUDIO_SUFFIXES):
                audio.setdefault(folder, {})[os.path.splitext(name)[0]] = os.path.join(folder, name)
    for folder in sorted(map(Path, set(transcripts) | set(audio))):
        texts = transcripts.get(str(folder), {})
        files = audio.get(str(folder), {})  # utt_id -> path: strings, as pathlib would write them
        speaker_id, chapter_id = _speaker_chapter(root, folder)
        for utt_id in sorted(set(texts) | set(files)):
            if utt_id not in files:
                if (reason := why_unsafe(utt_id)) is not None:  # never joined to a folder, not even in a reject
                    rejects.append(RejectRow(utt_id, str(folder), "manifest", RejectReason.INVALID_ID, _id_detail("utt_id", utt_id, reason)))
                    continue
                rejects.append(
                    RejectRow(
                        utt_id, str(folder / f"{utt_id}.flac"), "manifest", RejectReason.MISSING_FILE,
                        f"transcript line for {utt_id} in {folder} has no audio file",
                    )
                )
                continue
            text = normalise_transcript(texts.get(utt_id, ""))
            if not text:
                detail = "transcript is empty" if utt_id in texts else f"no line for {utt_id} in any *.trans.txt of {folder}"
                rejects.append(RejectRow(utt_id, files[utt_id], "manifest", RejectReason.NO_TRANSCRIPT, detail))
                continue
            parts = utt_id.split("-")
            candidates.append(
                Candidate(
                    utt_id=utt_id,
                    speaker_id=parts[0] if len(parts) == 3 else speaker_id,
                    chapter_id=parts[1] if len(parts) == 3 else chapter_id,
                    transcript=text,
                    path=files[utt_id],
                )
            )
    return candidates, rejects


def _speaker_chapter(root: Path, folder: Path) -> tuple[str, str]:
    parts = folder.relative_to(root).parts
    speaker = parts[-2] if len(parts) >= 2 else (parts[-1] if parts else "unknown")
    chapter = parts[-1] if len(parts) >= 2 else "0"
    return speaker, chapter


def _read_trans_file(path: Path) -> dict[str, str]:
    lines: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        utt_id, _, text = line.strip().partition(" ")
        if utt_id:
            lines[utt_id] = text
    return lines


def _discover_manifest_file(manifest: Path) -> tuple[list[Candidate], list[RejectRow]]:
    records = list(_read_manifest_records(manifest))
    candidates: list[Candidate] = []
    rejects: list[RejectRow] = []
    for number, record in enumerate(records, start=1):
        raw_path = str(record.get("path") or "").strip()
        utt_id = str(record.get("utt_id") or "").strip() or (Path(raw_path).stem if raw_path else f"line-{number}")
        if not raw_path:
            rejects.append(RejectRow(utt_id, "", "manifest", RejectReason.MISSING_FILE, f"{manifest.name} record {number} has no path"))
            continue
        path = Path(raw_path) if os.path.isabs(raw_path) else manifest.parent / raw_path
        text = normalise_transcript(str(record.get("transcript") or ""))
        if not text:
            rejects.append(RejectRow(utt_id, str(path), "manifest", RejectReason.NO_TRANSCRIPT, f"{manifest.name} record {number} has an empty transcript"))
            continue
        speaker = str(record.get("speaker_id") or "").strip()  # empty: an invalid_id reject, not a failed run
        chapter = str(record.get("chapter_id") or "").strip() or "0"
        candidates.append(Candidate(utt_id, speaker, chapter, text, str(path)))
    return candidates, rejects


def _read_manifest_records(manifest: Path) -> Iterator[dict[str, object]]:
    if manifest.suffix.lower() == ".csv":
        with open(manifest, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            missing = {"path", "transcript", "speaker_id"} - set(reader.fieldnames or [])
            if missing:
                raise CorpusError(f"{manifest}: missing columns {sorted(missing)}")
            yield from reader
        return
    with open(manifest, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise CorpusError(f"{manifest}: line {number} is not JSON ({err.msg})") from err
            if not isinstance(record, dict):
                raise CorpusError(f"{manifest}: line {number} is not a JSON object")
            yield record


# ---------------------------------------------------------------------------------------------
# Decoding


_BLOCK_FRAMES = 1 << 16
_UNKNOWN_LENGTH = 2**63 - 1  # SF_COUNT_MAX: what libsndfile reports for a FLAC with no total in its header
_HASH_CHUNK = 1 << 20


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def probe_audio(path: str, config: ValidationConfig | None = None) -> AudioProbe:
    """Validate ``path``; never raises for bad audio (the error goes in ``error``).

    The header is read first: a file whose declared duration is outside ``config``'s bounds is
    judged from it and never read (``decoded=False``). Otherwise the file is hashed in chunks
    and decoded block by block from disk, so memory does not grow with the file's length.
    """
    stat = os.stat(path)
    base = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if stat.st_size == 0:
        return AudioProbe(**base, error="file is empty (0 bytes)")
    try:
        with sf.SoundFile(path) as audio:
            declared, sample_rate, channels = audio.frames, audio.samplerate, audio.channels
            if declared >= _UNKNOWN_LENGTH:
                # libsndfile can neither seek nor read such a file through soundfile; rejecting
                # it as too long from a made-up duration would misreport it
                return AudioProbe(
                    **base, file_sha256=_file_sha256(path),
                    error="header does not declare the number of samples (a streamed FLAC?), so it cannot be validated",
                )
            if config is not None and declared > 0 and not config.min_duration_s <= declared / sample_rate <= config.max_duration_s:
                return AudioProbe(**base, sample_rate=sample_rate, channels=channels, num_samples=declared, decoded=False)
            limit = None if config is None else int(config.max_duration_s * sample_rate) + 1
            decoded = 0
            for block in audio.blocks(blocksize=_BLOCK_FRAMES, dtype="int16", always_2d=True):
                decoded += block.shape[0]
                if limit is not None and declared <= 0 and decoded > limit:  # no length in the header
                    return AudioProbe(**base, sample_rate=sample_rate, channels=channels, num_samples=decoded, decoded=False)
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as err:
        reason = getattr(err, "error_string", None) or str(err)
        return AudioProbe(**base, file_sha256=_file_sha256(path), error=f"cannot decode as audio: {reason}")
    digest = _file_sha256(path)
    if decoded == 0:
        return AudioProbe(**base, file_sha256=digest, error="decodes to zero samples")
    if declared > 0 and declared != decoded:
        return AudioProbe(
            **base, file_sha256=digest,
            error=f"header declares {declared} samples but {decoded} decoded (truncated or corrupt)",
        )
    return AudioProbe(**base, sample_rate=sample_rate, channels=channels, num_samples=decoded, file_sha256=digest)


def _cache_key(path: str, size: int, mtime_ns: int) -> str:
    return f"{path}|{size}|{mtime_ns}"


def probe_all(
    paths: Sequence[str],
    cache: dict[str, AudioProbe],
    workers: int = 1,
    config: ValidationConfig | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    stats: Mapping[str, os.stat_result] | None = None,
) -> tuple[dict[str, AudioProbe], int]:
    """Probe each path once, reusing cache hits keyed by (path, size, mtime_ns) (from ``stats``
    where the caller has just stat'ed the path).

    A cached probe that was judged from its header alone is reused only while ``config``'s
    bounds still exclude it; otherwise the file is read and decoded now.
    """
    results: dict[str, AudioProbe] = {}
    todo: list[str] = []
    for path in paths:
        stat = (stats or {}).get(path) or os.stat(path)
        hit = cache.get(_cache_key(path, stat.st_size, stat.st_mtime_ns))
        if hit is not None and (hit.decoded or (config is not None and _out_of_bounds(hit, config))):
            results[path] = hit
        else:
            todo.append(path)
    probe = functools.partial(probe_audio, config=config)
    with contextlib.ExitStack() as stack:
        if workers > 1 and len(todo) > 32:
            pool = stack.enter_context(ProcessPoolExecutor(max_workers=workers, initializer=_init_probe_worker))
            probes: Iterable[AudioProbe] = pool.map(probe, todo, chunksize=16)
        else:
            probes = map(probe, todo)
        for done, (path, result) in enumerate(zip(todo, probes, strict=True), start=1):
            results[path] = result
            if progress is not None:
                progress(path, done, len(todo))
    return results, len(todo)


def _init_probe_worker() -> None:
    from speech_assets.runtime.processes import die_with_parent

    die_with_parent()  # a killed validation run leaves no decoder behind


def _out_of_bounds(probe: AudioProbe, config: ValidationConfig) -> bool:
    duration = probe.num_samples / probe.sample_rate if probe.sample_rate else 0.0
    return not config.min_duration_s <= duration <= config.max_duration_s


# ---------------------------------------------------------------------------------------------
# The whole scan


def scan_corpus(
    location: Path,
    config: ValidationConfig = ValidationConfig(),
    cache: dict[str, AudioProbe] | None = None,
    workers: int = 1,
    progress: Callable[[str, int, int], None] | None = None,
) -> ScanResult:
    """Validate every utterance of the corpus at ``location``.

    Raises :class:`CorpusError` only when the corpus itself is missing, empty or malformed.
    """
    location = Path(location).absolute()
    check_corpus_location(location)
    root = corpus_root_of(location).resolve()
    candidates, rejects = discover(location)

    inside: list[tuple[Candidate, str]] = []
    stats: dict[str, os.stat_result] = {}  # each file stat'ed once, here
    real = RealPaths()
    for candidate in candidates:
        bad_id = invalid_id_detail(candidate)
        if bad_id is not None:
            rejects.append(RejectRow(candidate.utt_id, candidate.path, "manifest", RejectReason.INVALID_ID, bad_id))
            continue
        resolved = real(candidate.path)
        if not is_inside(resolved, root):
            rejects.append(
                RejectRow(
                    candidate.utt_id, candidate.path, "manifest", RejectReason.OUTSIDE_ROOT,
                    f"resolves to {resolved}, outside the corpus root {root}",
                )
            )
            continue
        try:
            stat = os.stat(resolved)
        except OSError:
            stat = None
        if stat is None or not S_ISREG(stat.st_mode):
            rejects.append(
                RejectRow(candidate.utt_id, candidate.path, "manifest", RejectReason.MISSING_FILE, f"no file at {resolved}")
            )
        else:
            inside.append((candidate, resolved))
            stats[resolved] = stat

    probes, decoded = probe_all(sorted({path for _, path in inside}), dict(cache or {}), workers, config, progress, stats)
    rows: list[ManifestRow] = []
    kept_at: dict[str, str] = {}
    for candidate, path in sorted(inside, key=lambda item: (item[0].utt_id, item[1])):
        probe = probes[path]
        reject = _judge(candidate, path, probe, config, kept_at)
        if reject is not None:
            rejects.append(reject)
            continue
        kept_at[candidate.utt_id] = path
        rows.append(
            ManifestRow(
                utt_id=candidate.utt_id,
                speaker_id=candidate.speaker_id,
                chapter_id=candidate.chapter_id,
                path=path,
                transcript=candidate.transcript,
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
    """``os.path.realpath`` for many files, each folder resolved once: a file's real path is its
    folder's real path joined with its name, unless the name is itself a symlink (or ``.``/``..``),
    which is then resolved in full. Same answers, one ``lstat`` per file instead of one per
    component of its path."""

    def __init__(self) -> None:
        self._folders: dict[str, str] = {}

    def __call__(self, path: str) -> str:
        folder, name = os.path.split(path)
        if name in ("", os.curdir, os.pardir) or os.path.islink(path):
            return os.path.realpath(path)
        real = self._folders.get(folder)
        if real is None:
            real = self._folders[folder] = os.path.realpath(folder or os.curdir)
        return os.path.join(real, name)


def invalid_id_detail(candidate: Candidate) -> str | None:
    """Which of the candidate's ids cannot become a file name or partition key, and why (None: all safe)."""
    problems = [
        _id_detail(what, value, reason)
        for what, value in (("speaker_id", candidate.speaker_id), ("chapter_id", candidate.chapter_id), ("utt_id", candidate.utt_id))
        if (reason := why_unsafe(value)) is not None
    ]
    return "; ".join(problems) or None


def _id_detail(what: str, value: str, reason: str) -> str:
    return f"{what} {value[:80]!r}{'...' if len(value) > 80 else ''} {reason}"


def _judge(
    candidate: Candidate, path: str, probe: AudioProbe, config: ValidationConfig, kept_at: dict[str, str]
) -> RejectRow | None:
    def reject(reason: RejectReason, detail: str) -> RejectRow:
        return RejectRow(candidate.utt_id, path, "manifest", reason, detail)

    if probe.error:
        return reject(RejectReason.UNREADABLE, probe.error)
    if candidate.utt_id in kept_at:
        return reject(RejectReason.DUPLICATE_ID, f"utt_id {candidate.utt_id} already kept from {kept_at[candidate.utt_id]}")
    duration = probe.num_samples / probe.sample_rate
    if duration < config.min_duration_s:
        return reject(RejectReason.TOO_SHORT, f"{duration:.3f} s is shorter than min_duration_s={config.min_duration_s}")
    if duration > config.max_duration_s:
        return reject(RejectReason.TOO_LONG, f"{duration:.3f} s is longer than max_duration_s={config.max_duration_s}")
    return None


# ---------------------------------------------------------------------------------------------
# Hashes and files


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
        ("utt_id", pa.string()), ("speaker_id", pa.string()), ("chapter_id", pa.string()),
        ("path", pa.string()), ("transcript", pa.string()), ("sample_rate", pa.int32()),
        ("channels", pa.int16()), ("num_samples", pa.int64()), ("duration_s", pa.float64()),
        ("file_sha256", pa.string()),
    ]
)
_CACHE_SCHEMA = pa.schema(
    [("key", pa.string())]
    + [(f.name, {"str": pa.string(), "bool": pa.bool_()}.get(str(f.type), pa.int64())) for f in fields(AudioProbe)]
)


def _write_table(path: Path, rows: Sequence[object], schema: pa.Schema) -> None:
    columns = {name: [getattr(row, name) for row in rows] for name in schema.names}
    table = pa.Table.from_pydict(columns, schema=schema)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def write_manifest(path: Path, rows: Sequence[ManifestRow]) -> None:
    _write_table(path, rows, MANIFEST_SCHEMA)


def read_manifest(path: Path) -> list[ManifestRow]:
    return [ManifestRow(**record) for record in pq.read_table(path).to_pylist()]


def load_cache(path: Path) -> dict[str, AudioProbe]:
    if not path.exists():
        return {}
    try:
        records = pq.read_table(path).to_pylist()
    except (OSError, pa.ArrowInvalid):
        return {}  # a damaged cache only costs a re-decode
    return {record.pop("key"): AudioProbe(**record) for record in records}


def save_cache(path: Path, cache: dict[str, AudioProbe]) -> None:
    keys = sorted(cache)
    columns = {"key": keys, **{name: [getattr(cache[k], name) for k in keys] for name in _CACHE_SCHEMA.names[1:]}}
    table = pa.Table.from_pydict(columns, schema=_CACHE_SCHEMA)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def count_by_reason(rejects: Iterable[RejectRow]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for reject in rejects:
        counts[reject.reason] = counts.get(reject.reason, 0) + 1
    return dict(sorted(counts.items()))



def corpus_fingerprint(location: Path) -> str:
    """A cheap change detector: sha256 over (relative path, size, mtime) of every corpus file.

    Stats only, no reads, so a sensor can call it every tick; the manifest records it so the
    sensor knows whether the last manifest saw the corpus as it is now.
    """
    location = Path(location).absolute()
    if not location.exists():
        return ""
    if location.is_file():
        paths = [location]
        try:
            paths += [
                Path(c.path) for c in discover(location)[0]
            ]
        except CorpusError:
            pass
        root = location.parent
    else:
        # the same strings, in the same order, as for the Paths of _walk_corpus_files sorted and
        # made relative one by one, without building a Path or a relative path per file (a sensor
        # tick and every manifest run fingerprint thousands of files)
        found: list[tuple[list[str], str, str]] = []
        for folder, _dirs, files in os.walk(location):
            relative_folder = os.path.relpath(folder, location)
            for name in files:
                if name.endswith(".trans.txt") or name.lower().endswith(AUDIO_SUFFIXES):
                    relative = name if relative_folder == os.curdir else os.path.join(relative_folder, name)
                    found.append((relative.split(os.sep), os.path.join(folder, name), relative))
        found.sort(key=lambda item: item[0])  # a Path sorts by its parts
        parts = []
        for _, full, relative in found:
            try:
                stat = os.stat(full)
            except OSError:
                parts.append(f"{full}|missing")
                continue
            parts.append(f"{relative}|{stat.st_size}|{stat.st_mtime_ns}")
        return sha256_strings(parts)
    parts: list[str] = []
    for path in paths:
        try:
            stat = path.stat()
        except OSError:
            parts.append(f"{path}|missing")
            continue
        parts.append(f"{os.path.relpath(path, root)}|{stat.st_size}|{stat.st_mtime_ns}")
    return sha256_strings(parts)
