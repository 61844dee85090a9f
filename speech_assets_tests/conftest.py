"""Shared fixtures: tiny corpora generated in tmp_path, and the committed sample corpus."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

REPO = Path(__file__).resolve().parents[1]
SAMPLE_CORPUS = REPO / "data" / "sample"


def tone(seconds: float, sample_rate: int = 16_000, channels: int = 1, seed: int = 0) -> np.ndarray:
    """A voiced-like signal (harmonics + a little noise), ``(N,)`` or ``(N, channels)`` float32."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    f0 = 140 + 20 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 8)) * 0.2 + rng.normal(0, 0.005, t.shape)
    wave = wave.astype(np.float32)
    return np.stack([wave] * channels, axis=1) if channels > 1 else wave


def write_flac(path: Path, seconds: float = 1.0, sample_rate: int = 16_000, channels: int = 1,
               subtype: str = "PCM_16", seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, tone(seconds, sample_rate, channels, seed), sample_rate, format="FLAC", subtype=subtype)
    return path


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

    def add(self, speaker: str, chapter: str, utt: int, text: str = "HELLO WORLD", seconds: float = 1.0,
            **audio) -> Path:
        utt_id = f"{speaker}-{chapter}-{utt:04d}"
        self.add_line(speaker, chapter, utt_id, text)
        return write_flac(self.chapter_dir(speaker, chapter) / f"{utt_id}.flac", seconds, seed=utt, **audio)


@pytest.fixture
def libri(tmp_path: Path) -> LibriCorpus:
    return LibriCorpus(tmp_path / "corpus")


@pytest.fixture
def sample_corpus() -> Path:
    if not SAMPLE_CORPUS.is_dir():
        pytest.fail(f"the committed sample corpus is missing at {SAMPLE_CORPUS}")
    return SAMPLE_CORPUS
