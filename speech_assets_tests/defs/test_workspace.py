"""workspace.yaml: the webserver and the daemon as two separate services on 127.0.0.1; a run
launched through the webserver's GraphQL API is dequeued and executed under the daemon."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import dagster as dg
import pytest

from speech_assets.definitions import build_definitions
from speech_assets.defs.resources import PipelineSettings, StoragePaths
from speech_assets.runtime.waiting import wait_until
from speech_assets_tests.conftest import REPO, SAMPLE_CORPUS
from speech_assets_tests.support.local_runs import materialize_in_process
from speech_assets_tests.support.ports import free_port

BIN = Path(sys.executable).parent
LAUNCH = """
mutation Launch($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
    ... on InvalidSubsetError { message }
    ... on RunConfigValidationInvalid { errors { message } }
  }
}"""
STATUS = "query Status($id: ID!) { runOrError(runId: $id) { __typename ... on Run { status } } }"


def graphql(url: str, query: str, variables: dict | None = None) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps({"query": query, "variables": variables or {}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_webserver_and_daemon_from_workspace_yaml_run_a_launched_run(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    out = tmp_path / "out"
    paths = StoragePaths(corpus=str(SAMPLE_CORPUS), data_dir=str(out), mlflow_tracking_uri=f"sqlite:///{tmp_path}/m.db")
    materialize_in_process(build_definitions(paths, PipelineSettings()), instance, "manifest")

    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "SPEECH_ASSETS_DATA_DIR": str(out),
        "SPEECH_ASSETS_CORPUS": str(SAMPLE_CORPUS),
    }
    port = free_port()
    services = [
        subprocess.Popen(
            [str(BIN / "dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
            env=env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        ),
        subprocess.Popen(
            [str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"],
            env=env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        ),
    ]
    url = f"http://127.0.0.1:{port}/graphql"
    try:

        def answers() -> dict | None:
            assert all(s.poll() is None for s in services), "a service exited"
            with contextlib.suppress(OSError):
                return graphql(url, "{ version }")
            return None

        wait_until(answers, 180, "the webserver to answer", interval=1)
        params = {
            "selector": {
                "repositoryLocationName": "speech_assets",
                "repositoryName": "__repository__",
                "jobName": "__ASSET_JOB",
                "assetSelection": [{"path": ["dataset_stats"]}],
            },
            "runConfigData": {},
        }
        launched = graphql(url, LAUNCH, {"params": params})["data"]["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        run_id = launched["run"]["runId"]

        def finished() -> str | None:
            status = graphql(url, STATUS, {"id": run_id})["data"]["runOrError"]["status"]
            return status if status in ("SUCCESS", "FAILURE", "CANCELED") else None

        status = wait_until(finished, 300, "the launched run to finish", interval=2)
        assert status == "SUCCESS"
        assert (out / "stats.duckdb").is_file() and (out / "report" / "index.html").is_file()
    finally:
        for service in services:
            if service.poll() is None:
                os.killpg(service.pid, signal.SIGTERM)
        for service in services:
            try:
                service.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(service.pid, signal.SIGKILL)
                service.wait()
        instance.dispose()
