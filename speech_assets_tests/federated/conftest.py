"""The federated tests' inputs, built once per session (speech_assets_tests/conftest.py) from the
committed sample corpus (8 speakers x 8 utterances) on a real Dagster instance in a temp
DAGSTER_HOME: manifest -> shards -> CMVN -> 4 clients -> per-client k-means, each a Dagster run executed in
this process (`sample_build`)."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from speech_assets.runtime.waiting import WaitTimeout, wait_until
from speech_assets_tests.conftest import REPO, SAMPLE_CORPUS


@dataclass(frozen=True)
class SamplePipeline:
    root: Path
    home: Path  # DAGSTER_HOME
    out: Path  # the data dir
    clients: list[str]

    @property
    def mlflow_uri(self) -> str:
        return f"sqlite:///{self.out / 'mlflow.db'}"

    def env(self) -> dict[str, str]:
        """The environment of a `dagster` or `python -m speech_assets.federated` subprocess."""
        bin_dir = str(Path(sys.executable).parent)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_PIPES", "SPEECH_ASSETS_FEDERATED"))}
        env.pop("MLFLOW_TRACKING_URI", None)
        return env | {
            "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
            "DAGSTER_HOME": str(self.home),
            "SPEECH_ASSETS_DATA_DIR": str(self.out),
            "SPEECH_ASSETS_CORPUS": str(SAMPLE_CORPUS),
        }


@pytest.fixture(scope="session")
def sample_pipeline(sample_build: dict) -> SamplePipeline:
    """The sample's data stages up to kmeans_targets, built in process (4 clients)."""
    return SamplePipeline(
        root=sample_build["root"], home=sample_build["home"], out=sample_build["out"], clients=sample_build["clients"]
    )


def wait_until_gone(root: Path, timeout: float = 60.0) -> list[tuple[int, str]]:
    """Flower processes (and our supervisors) that mention ``root``, after waiting up to
    ``timeout`` s for them to exit: a test asserts the list is empty (a stop takes seconds)."""
    from speech_assets.federated.processes import flower_processes

    with contextlib.suppress(WaitTimeout):
        wait_until(lambda: not flower_processes(root), timeout, "Flower's processes to exit", interval=0.5)
    return flower_processes(root)
