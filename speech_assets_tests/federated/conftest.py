"""The federated tests' inputs: the committed sample corpus (8 speakers x 8 utterances) built
through the real pipeline (manifest -> shards -> CMVN -> 4 clients -> per-client k-means) on a
real Dagster instance in a temp DAGSTER_HOME, once per session."""

from __future__ import annotations

import os
import shutil
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
def sample_pipeline(tmp_path_factory: pytest.TempPathFactory) -> SamplePipeline:
    import dagster as dg

    from speech_assets.definitions import build_definitions
    from speech_assets.defs.resources import StoragePaths
    from speech_assets.testing.local_runs import materialize_in_process

    root = tmp_path_factory.mktemp("federated")
    home, out = root / "dagster_home", root / "out"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    previous = os.environ.get("DAGSTER_HOME")
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        paths = StoragePaths(corpus=str(SAMPLE_CORPUS), data_dir=str(out), mlflow_tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
        defs = build_definitions(paths)
        with dg.DagsterInstance.get() as instance:
            materialize_in_process(defs, instance, "manifest")
            speakers = list(instance.get_dynamic_partitions("speakers"))
            materialize_in_process(defs, instance, "speaker_manifest", speakers)
            materialize_in_process(defs, instance, "vad_features", speakers)
            materialize_in_process(defs, instance, "cmvn_stats")
            materialize_in_process(defs, instance, "client_partitions")
            clients = list(instance.get_dynamic_partitions("clients"))
            materialize_in_process(defs, instance, "kmeans_targets", clients)
    finally:
        if previous is None:
            os.environ.pop("DAGSTER_HOME", None)
        else:
            os.environ["DAGSTER_HOME"] = previous
    return SamplePipeline(root=root, home=home, out=out, clients=sorted(clients))


def wait_until_gone(root: Path, timeout: float = 60.0) -> list[tuple[int, str]]:
    """Flower processes (and our supervisors) that mention ``root``, after waiting up to
    ``timeout`` s for them to exit: a test asserts the list is empty (a stop takes seconds)."""
    from speech_assets.federated.processes import flower_processes

    deadline = time.monotonic() + timeout
    while (left := flower_processes(root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
