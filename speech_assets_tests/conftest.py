"""Shared fixtures: tiny corpora generated in tmp_path, and the committed sample corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from speech_assets.testing.corpora import LibriCorpus, tone, write_flac  # noqa: F401 (re-exported for tests)

REPO = Path(__file__).resolve().parents[1]
SAMPLE_CORPUS = REPO / "data" / "sample"


@pytest.fixture
def libri(tmp_path: Path) -> LibriCorpus:
    return LibriCorpus(tmp_path / "corpus")


@pytest.fixture
def sample_corpus() -> Path:
    if not SAMPLE_CORPUS.is_dir():
        pytest.fail(f"the committed sample corpus is missing at {SAMPLE_CORPUS}")
    return SAMPLE_CORPUS
