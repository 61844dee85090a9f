"""The federated tests' inputs: the demo build of the committed sample corpus (8 speakers x 8
utterances: manifest -> shards -> CMVN -> 4 clients -> per-client k-means -> federated_checkpoint)
on a real Dagster instance in a temp DAGSTER_HOME, once per session (speech_assets_tests/conftest.py)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from speech_assets_tests.conftest import REPO, SAMPLE_CORPUS


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: end-to-end training (tens of seconds); still part of `make test`")


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
def sample_pipeline(demo_build: dict) -> SamplePipeline:
    """The demo build's outputs (the shared session fixture): its federated_checkpoint ran with
    DEMO_FEDERATED through `dagster asset materialize`, SuperLink, 4 SuperNodes and `flwr run`."""
    import dagster as dg

    previous = os.environ.get("DAGSTER_HOME")
    os.environ["DAGSTER_HOME"] = str(demo_build["home"])
    try:
        with dg.DagsterInstance.get() as instance:
            clients = list(instance.get_dynamic_partitions("clients"))
    finally:
        if previous is None:
            os.environ.pop("DAGSTER_HOME", None)
        else:
            os.environ["DAGSTER_HOME"] = previous
    return SamplePipeline(root=demo_build["root"], home=demo_build["home"], out=demo_build["out"], clients=sorted(clients))


def wait_until_gone(root: Path, timeout: float = 60.0) -> list[tuple[int, str]]:
    """Flower processes (and our supervisors) that mention ``root``, after waiting up to
    ``timeout`` s for them to exit: a test asserts the list is empty (a stop takes seconds)."""
    from speech_assets.federated.processes import flower_processes

    deadline = time.monotonic() + timeout
    while (left := flower_processes(root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
