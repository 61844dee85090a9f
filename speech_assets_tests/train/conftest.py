from pathlib import Path

import pytest

from speech_assets_tests.support.training_data import SyntheticCorpus, write_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCorpus:
    """2 clients (k = 8, 12) x 2 speakers x 12 labelled utterances of 1.5-4 s (+1 unlabelled each)."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCorpus:
    """Same layout with 4 labelled utterances per speaker: a few batches per epoch."""
    return write_corpus(tmp_path_factory.mktemp("small_corpus"), utterances_per_speaker=4, seed=1)


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
