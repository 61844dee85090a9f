"""One real PostgreSQL server and one real `mlflow server` (backend store on that PostgreSQL,
artifacts served through it) for every test under deploy/, both on 127.0.0.1 and both stopped
at the end of the session (and by PR_SET_PDEATHSIG if this process is killed)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from speech_assets_tests.support.mlflow_server import MlflowServer
from speech_assets_tests.support.postgres import PostgresServer

log = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        log.warning(
            "PostgreSQL %s started in %.1f s on 127.0.0.1:%d", server.bin_dir, server.start_seconds, server.port
        )
        yield server


@pytest.fixture(scope="session")
def mlflow_server(postgres: PostgresServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    root = tmp_path_factory.mktemp("mlflow_server")
    store = postgres.create_database("mlflow")
    with MlflowServer(root / "server.log", backend_store_uri=store, artifacts_destination=root / "artifacts") as server:
        log.warning("mlflow server started in %.1f s at %s", server.start_seconds, server.url)
        yield server


@pytest.fixture(scope="session")
def artifacts_destination(mlflow_server: MlflowServer) -> Path:
    assert mlflow_server.artifacts_destination is not None
    return mlflow_server.artifacts_destination
