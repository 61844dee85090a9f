"""A corpus with LibriSpeech train-clean-100's shape, made from a small real corpus (offline).

251 speakers of 2-3 chapters, ~113 x ``scale`` utterances each, with train-clean-100's duration
distribution; each utterance strings real source utterances with pauses and a noise floor, under a
per-speaker speed/pitch factor and gain. For measuring cost at LibriSpeech size: phonetically it
repeats the source corpus, so learning figures on it say little about real speech.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

SAMPLE_RATE = 16_000
SPEAKERS = 251
UTTERANCES_PER_SPEAKER = 28_539 / SPEAKERS  # train-clean-100: 28,539 utterances
MAX_SECONDS = 24.5
MIN_SECONDS = 1.3
FIRST_SPEAKER = 6000


def sample_durations(rng: np.random.Generator, count: int) -> np.ndarray:
    """Utterance durations like train-clean-100's: 75 % near 14.6 s (10-17 s), 25 % a long
    lower tail (lognormal around 6 s); mean about 12.7 s, all within [1.3, 24.5] s."""
    main = np.clip(rng.normal(14.6, 1.6, count), 10.0, 17.0)
    tail = np.clip(rng.lognormal(math.log(6.0), 0.55, count), MIN_SECONDS, MAX_SECONDS)
    return np.where(rng.random(count) < 0.75, main, tail)


@dataclass(frozen=True)
class SourceUtterance:
    audio: np.ndarray  # (N,) float32 at 16 kHz
    transcript: str


def load_sources(root: Path) -> list[SourceUtterance]:
    """Every utterance of a LibriSpeech-layout corpus, decoded to 16 kHz mono float32."""
    import torch
    from torchaudio.transforms import Resample

    from speech_assets.corpus.manifest import scan_corpus

    result = scan_corpus(root)
    if not result.rows:
        raise ValueError(f"no valid utterance in {root}")
    sources = []
    for row in result.rows:
        audio, rate = sf.read(row.path, dtype="float32", always_2d=True)
        mono = audio.mean(axis=1, dtype=np.float32)  # the features stage's decoding: channels averaged, sinc resampling
        if rate != SAMPLE_RATE:
            mono = Resample(rate, SAMPLE_RATE, resampling_method="sinc_interp_hann")(torch.from_numpy(mono)).numpy()
        sources.append(SourceUtterance(mono, row.transcript))
    return sources


def _speak(sources: Sequence[SourceUtterance], target_s: float, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """Real utterances and pauses up to ``target_s`` seconds (at least one source utterance)."""
    target = int(target_s * SAMPLE_RATE)
    pieces, words, length = [], [], 0
    while True:
        source = sources[int(rng.integers(len(sources)))]
        if pieces and length + source.audio.shape[0] > target:
            break
        pause = np.zeros(int(rng.uniform(0.15, 0.6) * SAMPLE_RATE), np.float32)
        pieces += [pause, source.audio[: max(target - length - pause.shape[0], SAMPLE_RATE // 2)]]
        words.append(source.transcript)
        length = sum(p.shape[0] for p in pieces)
        if length >= target:
            break
    audio = np.concatenate(pieces)[:target]
    return np.pad(audio, (0, target - audio.shape[0])), " ".join(words)


def _write_speaker(job: tuple[int, int, float, int, str, str]) -> tuple[str, float, int]:
    """One speaker's chapters, audio and transcripts; returns (speaker id, seconds, utterances)."""
    import torch
    import torchaudio.functional as AF

    index, utterances, _scale, seed, source_dir, out_dir = job
    torch.set_num_threads(1)
    sources = _SOURCES or load_sources(Path(source_dir))
    rng = np.random.default_rng([seed, index])
    # the speaker's voice, tempo and pitch together; a multiple of 0.01 keeps the resampling ratio small
    speed = round(float(rng.uniform(0.85, 1.15)), 2)
    gain = float(10 ** (rng.uniform(-12, 0) / 20))
    speaker = str(FIRST_SPEAKER + index)
    chapters = [str(100 + index * 7 + c) for c in range(int(rng.integers(2, 4)))]
    durations = sample_durations(rng, utterances)
    seconds = 0.0
    for chapter_index, chapter in enumerate(chapters):
        folder = Path(out_dir) / speaker / chapter
        folder.mkdir(parents=True, exist_ok=True)
        lines = []
        for number in range(chapter_index, utterances, len(chapters)):
            audio, text = _speak(sources, durations[number] * speed, rng)
            # resampling by `speed` then reading at 16 kHz changes tempo and pitch together
            audio = AF.resample(torch.from_numpy(audio), int(SAMPLE_RATE * speed), SAMPLE_RATE).numpy()
            noise = rng.normal(0.0, 10 ** (rng.uniform(-65, -50) / 20), audio.shape[0]).astype(np.float32)
            audio = np.clip(audio * gain + noise, -1.0, 1.0)
            utt_id = f"{speaker}-{chapter}-{number:04d}"
            sf.write(folder / f"{utt_id}.flac", audio, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
            lines.append(f"{utt_id} {text}")
            seconds += audio.shape[0] / SAMPLE_RATE
        (folder / f"{speaker}-{chapter}.trans.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return speaker, seconds, utterances


_SOURCES: list[SourceUtterance] | None = None


def _init_worker(source_dir: str) -> None:
    global _SOURCES
    from speech_assets.runtime.processes import die_with_parent

    die_with_parent()
    _SOURCES = load_sources(Path(source_dir))


@dataclass(frozen=True)
class ReplicaReport:
    speakers: int
    utterances: int
    hours: float
    out_dir: Path


def replicate_corpus(
    source: Path,
    out_dir: Path,
    scale: float = 0.25,
    speakers: int = SPEAKERS,
    seed: int = 0,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplicaReport:
    """Write a train-clean-100-shaped corpus (``speakers`` x ~113 ``scale`` utterances) to ``out_dir``."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"output directory {out_dir} is not empty")
    if not 0 < scale <= 1 or speakers < 1:
        raise ValueError("need 0 < scale <= 1 and speakers >= 1")
    counts = np.random.default_rng([seed, 1]).poisson(UTTERANCES_PER_SPEAKER * scale, speakers).clip(min=1)
    jobs = [(i, int(counts[i]), scale, seed, str(source), str(out_dir)) for i in range(speakers)]
    out_dir.mkdir(parents=True, exist_ok=True)
    workers = workers or os.cpu_count() or 1
    total_seconds, total_utts = 0.0, 0
    with ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, initargs=(str(source),)) as pool:
        futures = [pool.submit(_write_speaker, job) for job in jobs]
        for done, future in enumerate(as_completed(futures), start=1):
            _speaker, seconds, utterances = future.result()
            total_seconds += seconds
            total_utts += utterances
            if progress is not None:
                progress(done, len(jobs))
    return ReplicaReport(speakers, total_utts, total_seconds / 3600, out_dir)
