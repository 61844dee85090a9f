"""The federated tests' inputs, built once per session (speech_assets_tests/conftest.py) from the
committed sample corpus (8 speakers x 8 utterances) on a real Dagster instance in a temp
DAGSTER_HOME: manifest -> shards -> CMVN -> 4 clients -> per-client k-means, each a Dagster run executed in
this process (`sample_build`)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from speech_assets.federated.processes import SIMULATION, SUPERVISOR
from speech_assets.runtime.waiting import WaitTimeout, wait_until
from speech_assets_tests.conftest import REPO, SAMPLE_CORPUS

FLOWER_NAMES = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr-serverapp", "flwr-clientapp", "flwr")


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
    with contextlib.suppress(WaitTimeout):
        wait_until(lambda: not flower_processes(root), timeout, "Flower's processes to exit", interval=0.5)
    return flower_processes(root)


def is_ray(argv: Sequence[str]) -> bool:
    return bool(argv) and (argv[0].startswith("ray::") or any(f"{os.sep}ray{os.sep}" in part for part in argv[:3]))


def flower_processes(root: str | os.PathLike[str] | None = None) -> list[tuple[int, str]]:
    """``(pid, command line)`` of running Flower, Ray and supervisor processes (those whose command
    line or environment mentions ``root``): the tests prove nothing was left behind (the simulation's
    tree names its run in ``SPEECH_ASSETS_FEDERATED_RUN``)."""
    found = []
    with contextlib.suppress(psutil.Error, OSError, IndexError):
        for process in psutil.process_iter(["cmdline", "status"]):
            if process.pid == os.getpid() or process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            argv = process.info["cmdline"] or []
            flower = {Path(part).name for part in argv[:6]} & set(FLOWER_NAMES)
            if not (flower or SUPERVISOR in argv[:3] or is_ray(argv) or SIMULATION in argv[:4]):
                continue
            if root is not None:
                environ = {}
                with contextlib.suppress(psutil.Error, OSError):
                    environ = process.environ()
                if str(root) not in " ".join([*argv, *(f"{k}={v}" for k, v in environ.items())]):
                    continue
            found.append((process.pid, " ".join(argv)))
    return found
