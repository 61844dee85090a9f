"""The exported recogniser at work: audio files in, text out (``speech-assets transcribe``), with only
onnxruntime, numpy, soundfile and webrtcvad (torch only for ``decoder="beam"``). A speech span longer
than ``max_segment_s`` is cut at VAD pauses, else hard with ``OVERLAP_S`` of overlap, so memory stays
bounded whatever the file's length.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from speech_assets.evaluation.text import ALPHABET, BLANK
from speech_assets.layout import FinetuneFiles, RecogniserFiles

DECODERS = ("greedy", "beam")
MAX_SEGMENT_S = 20.0
MIN_PAUSE_S = 0.3
OVERLAP_S = 1.0
MIN_SEGMENT_SAMPLES = 560  # 2 feature frames: the exported graphs' shortest input
FEATURE_ATOL = 1e-3  # |frontend.onnx - the pipeline's CMVN log-mel| on held-out audio (measured ~1e-4)
# libsndfile's format names that are also file suffixes, with common aliases; headerless RAW is not audio
DECODABLE = frozenset(
    {f".{name.lower()}" for name in sf.available_formats() if name != "RAW"}
    | {".aif", ".aifc", ".oga", ".opus", ".snd", ".sph"}
)


class RecogniserError(ValueError):
    """A recogniser folder that cannot be used, or a file that cannot be transcribed."""


def vocabulary() -> list[str]:
    """Token ``i``'s text: ``""`` for the blank (0), then the alphabet (what the JSON records)."""
    return ["" if i == BLANK else ALPHABET[i - 1] for i in range(len(ALPHABET) + 1)]


def model_folder(path: str | os.PathLike[str]) -> Path:
    """The recogniser folder of ``path``: the folder itself, or the folder of its ONNX or JSON file."""
    path = Path(path)
    folder = path.parent if path.suffix in (".onnx", ".json") else path
    files = RecogniserFiles(folder)
    if not all(f.is_file() for f in (files.onnx, files.frontend, files.card)):
        names = ", ".join(f.name for f in (RecogniserFiles.onnx, RecogniserFiles.frontend, RecogniserFiles.card))
        raise RecogniserError(f"no recogniser at {path}: expected {names} (materialize finetuned_asr)")
    return folder


def fetch_recogniser(uri: str, destination: Path, tracking_uri: str) -> Path:
    """The recogniser MLflow model ``uri`` downloaded into ``destination`` as a recogniser folder."""
    from speech_assets.train.tracking import download_onnx_model

    try:
        onnx_file, extras = download_onnx_model(uri, tracking_uri, destination / "download")
    except ValueError as error:
        raise RecogniserError(str(error)) from error
    card = RecogniserFiles.card.name
    if card not in extras:
        raise RecogniserError(
            f"{uri} is not a speech_assets recogniser: the model has no {card} beside its ONNX file "
            "(finetuned_asr logs the recogniser with it)"
        )
    files = RecogniserFiles(destination / FinetuneFiles.recogniser.name)
    files.root.mkdir(parents=True)
    onnx_file.replace(files.onnx)
    for name, path in extras.items():
        path.replace(files.root / name)
    return files.root


def labelled_files(inputs: Iterable[str | os.PathLike[str]]) -> list[tuple[str, Path]]:
    """``inputs`` as unique ``(id, path)``: a file as given, a folder's decodable files by relative path,
    ``-`` the paths on stdin; a repeated id becomes the joined path, then gets ``#<n>``."""
    found: list[tuple[str, Path]] = []
    for item in inputs:
        if str(item) == "-":
            found += [(line, Path(line)) for line in sys.stdin.read().splitlines() if line.strip()]
        elif Path(item).is_dir():
            files = sorted(p for p in Path(item).rglob("*") if p.is_file() and p.suffix.lower() in DECODABLE)
            found += [(p.relative_to(item).as_posix(), p) for p in files]
        else:
            found.append((os.fspath(item), Path(item)))
    unique: dict[str, Path] = {}
    for name, path in found:
        name = name if name not in unique else path.as_posix()
        if name in unique:
            name = next(f"{name}#{n}" for n in range(2, len(found) + 2) if f"{name}#{n}" not in unique)
        unique[name] = path
    return list(unique.items())


@dataclass(frozen=True)
class Word:
    word: str
    start: float
    end: float
    confidence: float


@dataclass(frozen=True)
class Segment:
    """A stretch of the file (seconds) and its text; ``words`` None under beam decoding."""

    start: float
    end: float
    text: str
    words: list[Word] | None


@dataclass(frozen=True)
class Transcript:
    """One file's outcome: ``text`` and the audio's ``seconds``, or ``error`` (and no text)."""

    id: str
    path: str
    text: str | None
    seconds: float | None
    error: str | None = None
    segments: list[Segment] = field(default_factory=list)

    def line(self) -> str:
        if self.error is not None:
            return f"{self.id}\terror: {self.error}"
        return f"{self.id}\t{self.text}\t{self.seconds:.2f}"

    def subtitles(self, kind: str) -> str:
        """The segments as SRT or WebVTT cues, headed by the id for VTT."""

        def stamp(t: float) -> str:
            ms = round(t * 1000)
            sep = "," if kind == "srt" else "."
            return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"

        cues = [f"{stamp(s.start)} --> {stamp(s.end)}\n{s.text}\n" for s in self.segments if s.text]
        if kind == "srt":
            return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(cues, 1))
        return "\n".join([f"WEBVTT\n\nNOTE {self.id}\n", *cues])


def plan_segments(
    flags: np.ndarray, start: int, end: int, max_len: int, min_pause: int, pad: int, overlap: int
) -> list[tuple[int, int, int, int]]:
    """Cut VAD frames ``[start, end)`` into ``(start, end, lo, hi)`` of at most ``max_len`` frames: at the
    window's last pause of ``min_pause`` frames (keeping ``pad`` each side), else hard with ``overlap``;
    a segment keeps the words centred in ``[lo, hi)``."""
    edges = np.diff(np.concatenate([[1], np.asarray(flags[start:end], np.int8), [1]]))
    pause_start, pause_end = np.flatnonzero(edges == -1) + start, np.flatnonzero(edges == 1) + start
    long = pause_end - pause_start >= min_pause
    pause_start, pause_end = pause_start[long], pause_end[long]
    out, a, lo = [], start, start
    while end - a > max_len:
        limit = a + max_len
        inside = np.flatnonzero((pause_start > a) & (pause_start < limit))
        if inside.size:
            ps, pe = int(pause_start[inside[-1]]), int(pause_end[inside[-1]])
            middle = (ps + pe) // 2
            out.append((a, min(ps + pad, middle, limit), lo, middle))
            a, lo = max(pe - pad, middle), middle
        else:
            out.append((a, limit, lo, limit - overlap // 2))
            a, lo = limit - overlap, limit - overlap // 2
    out.append((a, end, lo, end))
    return out


class Recogniser:
    """A recogniser folder loaded for transcription (CUDA when present, else ``threads`` CPU threads,
    0: onnxruntime's choice), ``batch_size`` segments of at most ``max_segment_s`` per run."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        decoder: str = "greedy",
        *,
        threads: int = 0,
        batch_size: int = 8,
        max_segment_s: float = MAX_SEGMENT_S,
    ) -> None:
        import onnxruntime

        from speech_assets.features.vad import VadConfig

        self.folder = model_folder(path)
        self.files = RecogniserFiles(self.folder)
        self.spec = json.loads(self.files.card.read_text(encoding="utf-8"))
        if self.spec.get("vocabulary") != vocabulary():
            raise RecogniserError(f"{self.files.card}: its vocabulary is not this version's {len(vocabulary())} tokens")
        if not self.spec.get("cmvn"):
            raise RecogniserError(f"{self.files.card} records no CMVN")
        if decoder not in DECODERS:
            raise RecogniserError(f"unknown decoder {decoder!r}; known: {', '.join(DECODERS)}")
        if not MIN_PAUSE_S * 2 < max_segment_s or batch_size < 1:
            raise RecogniserError(f"max_segment_s must exceed {2 * MIN_PAUSE_S:g} s and batch_size be >= 1")
        self.vad = VadConfig(**self.spec["featurisation"]["vad"])
        self.frame_s = 1.0 / float((self.spec.get("outputs") or {}).get("frame_rate_hz", 50))
        self.batch_size, self.max_segment_s = batch_size, max_segment_s
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        self.providers = [p for p in ("CUDAExecutionProvider",) if p in onnxruntime.get_available_providers()]
        self.providers.append("CPUExecutionProvider")
        self.frontend, self.session = (
            onnxruntime.InferenceSession(str(f), options, providers=self.providers)
            for f in (self.files.frontend, self.files.onnx)
        )
        self.beam = self._beam() if decoder == "beam" else None

    def _beam(self):
        """The beam decoder of the files ``recogniser.json`` names (inside the folder only)."""
        from speech_assets.evaluation.decoding import beam_decoder_from_files, unavailable

        beam = self.spec.get("beam")
        if not beam:
            raise RecogniserError(
                f"{self.files.card} records no n-gram LM and lexicon for beam decoding "
                "(rematerialize finetuned_asr with the beam decoder installed), or use --decoder greedy"
            )
        files = []
        for key in ("lm", "lexicon"):
            name = str(beam.get(key) or "")
            if not name or Path(name).name != name or not (self.folder / name).is_file():
                raise RecogniserError(f"{self.files.card}: beam {key} file {name!r} is not in {self.folder}")
            files.append(self.folder / name)
        if reason := unavailable():
            raise RecogniserError(f"beam decoding cannot run here: {reason}")
        return beam_decoder_from_files(
            *files, int(beam["beam_size"]), float(beam["lm_weight"]), float(beam["word_score"])
        )

    def features(self, waves: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``feats (B, T, 80)``, ``lengths (B,)`` of peak-normalised 16 kHz ``waves``."""
        batch = np.zeros((len(waves), max(len(w) for w in waves)), np.float32)
        for row, wave in zip(batch, waves, strict=True):
            row[: len(wave)] = wave
        lengths = np.array([len(w) for w in waves], np.int64)
        return tuple(self.frontend.run(["feats", "lengths"], {"audio": batch, "audio_lengths": lengths}))

    def log_probs(self, waves: Sequence[np.ndarray]) -> list[np.ndarray]:
        """``(L_i, 29)`` CTC log-probabilities of each of ``waves`` (one batch)."""
        feats, frames = self.features(waves)
        log_probs, lengths = self.session.run(["log_probs", "output_lengths"], {"feats": feats, "lengths": frames})
        return [lp[: int(n)] for lp, n in zip(log_probs, lengths, strict=True)]

    def _segments(self, path: Path) -> tuple[float, list[tuple[np.ndarray, int, int, int]]]:
        """``path``'s seconds and segments ``(samples, start, lo, hi)`` (16 kHz sample offsets)."""
        from speech_assets.features import audio
        from speech_assets.features.vad import NoSpeech, classify_frames, detect_speech, to_pcm16

        if not path.is_file():
            raise RecogniserError(f"no such file: {path}")
        try:
            decoded, rate = audio.decode(path)
            wave = audio.to_16k_mono(decoded, rate, in_place=True)
        except (audio.DecodeError, ValueError) as error:
            raise RecogniserError(f"unreadable: {error}") from error
        seconds = decoded.shape[1] / rate
        del decoded
        span = detect_speech(wave, self.vad, peak_normalised=True)
        if isinstance(span, NoSpeech):
            raise RecogniserError(f"no_speech: {span.detail}")
        step = self.vad.frame_samples()
        flags = np.asarray(classify_frames(to_pcm16(wave, in_range=True), self.vad), bool)
        frames = plan_segments(
            flags,
            span.start_sample // step,
            -(-span.end_sample // step),
            int(self.max_segment_s * 1000) // self.vad.frame_ms,
            int(MIN_PAUSE_S * 1000) // self.vad.frame_ms,
            self.vad.padding_frames,
            int(OVERLAP_S * 1000) // self.vad.frame_ms,
        )
        cuts = [(max(a * step, span.start_sample), min(b * step, span.end_sample), lo, hi) for a, b, lo, hi in frames]
        segments = [(wave[a:b], a, lo * step, hi * step) for a, b, lo, hi in cuts if b - a >= MIN_SEGMENT_SAMPLES]
        if not segments:
            raise RecogniserError("too_short: less than 2 feature frames of speech")
        return seconds, segments

    def _segment(self, log_probs: np.ndarray, start: int, lo: int, hi: int, samples: int) -> Segment:
        """One segment's text (and, greedy, its words centred in ``[lo, hi)``), times in seconds."""
        rate = 16_000
        end = (start + samples) / rate
        if self.beam is not None:
            return Segment(round(start / rate, 3), round(end, 3), self.beam([log_probs])[0], None)
        ids, best = log_probs.argmax(axis=-1), np.exp(log_probs.max(axis=-1))
        runs = np.flatnonzero(np.diff(ids, prepend=-1))
        words: list[Word] = []
        chars, first, last, conf = "", 0, 0, []
        # a space token after the last run closes the last word
        for tok, a, b in zip([*ids[runs], 1], [*runs, len(ids)], [*runs[1:], len(ids), len(ids)], strict=True):
            if tok != BLANK and ALPHABET[tok - 1] != " ":
                chars, first, last = chars + ALPHABET[tok - 1], (a if not chars else first), b
                conf.extend(best[a:b])
            elif tok != BLANK and chars:
                t0, t1 = start / rate + first * self.frame_s, min(end, start / rate + last * self.frame_s)
                if lo <= (t0 + t1) / 2 * rate < hi:
                    words.append(Word(chars, round(float(t0), 3), round(float(t1), 3), round(float(np.mean(conf)), 4)))
                chars, conf = "", []
        return Segment(round(start / rate, 3), round(end, 3), " ".join(w.word for w in words), words)

    def transcribe(self, path: str | os.PathLike[str], utt_id: str | None = None) -> Transcript:
        return next(self.transcribe_all([(utt_id or os.fspath(path), Path(path))]))

    def transcribe_all(self, items: Iterable[str | os.PathLike[str] | tuple[str, Path]]) -> Iterator[Transcript]:
        """Each of ``items`` (a path or ``(id, path)``) transcribed, in order; segments batched by length."""
        group: list[tuple[str, Path, Any]] = []
        for item in items:
            name, path = item if isinstance(item, tuple) else (os.fspath(item), Path(item))
            try:
                group.append((name, path, self._segments(path)))
            except Exception as error:  # noqa: BLE001 - one bad file must not stop the others
                message = str(error) if isinstance(error, RecogniserError) else f"{type(error).__name__}: {error}"
                group.append((name, path, message))
            if sum(len(g[2][1]) for g in group if isinstance(g[2], tuple)) >= 4 * self.batch_size:
                yield from self._finish(group)
                group = []
        yield from self._finish(group)

    def _finish(self, group: list[tuple[str, Path, Any]]) -> Iterator[Transcript]:
        jobs = [seg for _, _, read in group if isinstance(read, tuple) for seg in read[1]]
        order = sorted(range(len(jobs)), key=lambda i: len(jobs[i][0]))
        done: dict[int, np.ndarray] = {}
        for at in range(0, len(order), self.batch_size):
            batch = order[at : at + self.batch_size]
            done.update(zip(batch, self.log_probs([jobs[i][0] for i in batch]), strict=True))
        scored = (done[i] for i in range(len(jobs)))  # in job order
        for name, path, read in group:
            if isinstance(read, str):
                yield Transcript(name, str(path), None, None, read)
                continue
            segments = [self._segment(next(scored), start, lo, hi, len(samples)) for samples, start, lo, hi in read[1]]
            text = " ".join(s.text for s in segments if s.text)
            yield Transcript(name, str(path), text, round(read[0], 3), None, segments)


def audio_parity(folder: Path, model: Any, cmvn: Any, paths: Sequence[str | os.PathLike[str]]) -> dict[str, Any]:
    """The exported ``folder`` against the pipeline (torch) on ``paths``: largest feature difference of
    ``frontend.onnx``, and files whose greedy text matches ``model``'s. What ``recogniser.json`` records."""
    import torch

    from speech_assets.evaluation.text import decode_greedy
    from speech_assets.features.build import process_variants
    from speech_assets.features.featurize import FeatureExtractor
    from speech_assets.features.jobs import UtteranceInput
    from speech_assets.features.shards import FeatureRecord
    from speech_assets.model.export import ExportableRecogniser

    recogniser = Recogniser(folder, max_segment_s=3600.0)
    extractor = FeatureExtractor()
    torch_model = ExportableRecogniser(model)
    same, diff, count = 0, 0.0, 0
    for path in paths:
        (record,) = process_variants(UtteranceInput("parity", "", "", str(path)), recogniser.vad, extractor)
        if not isinstance(record, FeatureRecord) or record.num_frames < 2:
            continue
        expected = cmvn.apply(record.logmel, "logmel")
        segments = recogniser._segments(Path(path))[1]
        feats, _ = recogniser.features([segments[0][0]])
        whole = len(segments) == 1 and feats.shape[1] == len(expected)
        diff = max(diff, float(np.abs(feats[0] - expected).max()) if whole else np.inf)
        with torch.no_grad():
            log_probs, _ = torch_model(torch.from_numpy(expected)[None], torch.tensor([len(expected)]))
        same += decode_greedy(log_probs[0].argmax(-1).tolist()) == recogniser.transcribe(path).text
        count += 1
    return {"utterances": count, "same_text": same, "feature_max_abs_diff": diff, "feature_atol": FEATURE_ATOL}
