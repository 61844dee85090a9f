"""Tiny real audio made in code: voiced tones, vowel-like speech, LibriSpeech-layout corpora.

Shared by the tests and the benchmarks (nothing here is mocked: it writes real FLAC files).
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np
import soundfile as sf

SR = 16_000


def tone(seconds: float, sample_rate: int = 16_000, channels: int = 1, seed: int = 0) -> np.ndarray:
    """A voiced-like signal (harmonics + a little noise), ``(N,)`` or ``(N, channels)`` float32."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    f0 = 140 + 20 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 8)) * 0.2 + rng.normal(0, 0.005, t.shape)
    wave = wave.astype(np.float32)
    return np.stack([wave] * channels, axis=1) if channels > 1 else wave


def write_flac(
    path: Path,
    seconds: float = 1.0,
    sample_rate: int = 16_000,
    channels: int = 1,
    subtype: str = "PCM_16",
    seed: int | None = None,
) -> Path:
    """A tone as FLAC; without a ``seed``, one taken from the file's name, so that two files hold
    different audio (the manifest keeps one recording under two ids only once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if seed is None:
        seed = zlib.crc32(path.name.encode())
    sf.write(path, tone(seconds, sample_rate, channels, seed), sample_rate, format="FLAC", subtype=subtype)
    return path


def copy_recording(source: Path, target: Path, nudge: int) -> Path:
    """``source`` (16-bit audio) written to ``target`` as FLAC with its first sample moved by
    ``nudge`` steps (``nudge`` > 0): a copy that is a recording of its own, which the manifest keeps
    (it rejects one recording under two ids as ``duplicate_audio``)."""
    samples, rate = sf.read(source, dtype="int16", always_2d=True)  # (frames, channels)
    first = int(samples[0, 0])
    samples[0, 0] = first - nudge if first >= 0 else first + nudge
    target.parent.mkdir(parents=True, exist_ok=True)
    sf.write(target, samples, rate, format="FLAC", subtype="PCM_16")
    return target


class LibriCorpus:
    """Builds a LibriSpeech-layout corpus: ``add(spk, chap, utt, text)`` writes audio + transcript."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def chapter_dir(self, speaker: str, chapter: str) -> Path:
        folder = self.root / speaker / chapter
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def add_line(self, speaker: str, chapter: str, utt_id: str, text: str) -> None:
        trans = self.chapter_dir(speaker, chapter) / f"{speaker}-{chapter}.trans.txt"
        with open(trans, "a", encoding="utf-8") as handle:
            handle.write(f"{utt_id} {text}\n")

    def add(
        self, speaker: str, chapter: str, utt: int, text: str = "HELLO WORLD", seconds: float = 1.0, **audio
    ) -> Path:
        utt_id = f"{speaker}-{chapter}-{utt:04d}"
        self.add_line(speaker, chapter, utt_id, text)
        return write_flac(self.chapter_dir(speaker, chapter) / f"{utt_id}.flac", seconds, **audio)  # a seed per utt_id


def vowel(seconds: float, sample_rate: int = SR, f0: float = 140.0, fmax: float = 7000.0) -> np.ndarray:
    """A sustained, vowel-like voiced sound (formants at 700/1200/2600 Hz, vibrato, 4 Hz
    amplitude modulation) that WebRTC VAD classifies as speech. Harmonics stay below ``fmax``.
    The phase is analytic, so the same signal can be sampled at any rate."""
    t = np.arange(int(round(seconds * sample_rate))) / sample_rate
    phase = 2 * np.pi * (f0 * t - f0 * 0.1 * np.cos(2 * np.pi * 3 * t) / (2 * np.pi * 3))
    x = np.zeros_like(t)
    for k in range(1, 80):
        if k * f0 * 1.1 > fmax:
            break
        amp = sum(math.exp(-((((k * f0) - formant) / 200.0) ** 2)) for formant in (700, 1200, 2600)) + 0.05
        x += amp * np.sin(k * phase)
    x *= 0.6 + 0.4 * np.sin(2 * np.pi * 4 * t) ** 2
    return (0.5 * x / np.abs(x).max()).astype(np.float32)


def with_silence(lead_s: float, speech_s: float, trail_s: float, noise: float = 1e-3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.concatenate(
        [np.zeros(int(lead_s * SR), np.float32), vowel(speech_s), np.zeros(int(trail_s * SR), np.float32)]
    )
    return (x + noise * rng.standard_normal(x.shape[0])).astype(np.float32)
