"""A real ``mlflow server`` (or the ``mlflow ui`` command a run records) on 127.0.0.1, for tests.

Started in its own process group, armed with ``PR_SET_PDEATHSIG`` (SIGTERM, which the ``mlflow``
command forwards to its uvicorn server) and stopped with the whole group by :meth:`stop`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from speech_assets.runtime.processes import die_with_parent
from speech_assets.runtime.waiting import WaitTimeout, wait_until
from speech_assets_tests.support.commands import LocalServer
from speech_assets_tests.support.ports import free_port

MLFLOW = str(Path(sys.executable).parent / "mlflow")


class MlflowServer(LocalServer):
    """``mlflow server --backend-store-uri STORE --artifacts-destination DIR --serve-artifacts``,
    or any ``mlflow`` command line given as ``command`` (``--port`` is appended)."""

    def __init__(
        self,
        log_file: Path,
        backend_store_uri: str | None = None,
        artifacts_destination: Path | None = None,
        command: list[str] | None = None,
        startup_timeout_s: float = 120.0,
    ) -> None:
        self.port = free_port()
        self.artifacts_destination = artifacts_destination
        if command is None:
            assert backend_store_uri and artifacts_destination
            command = [
                MLFLOW,
                "server",
                "--backend-store-uri",
                backend_store_uri,
                "--artifacts-destination",
                str(artifacts_destination),
                "--serve-artifacts",
                "--host",
                "127.0.0.1",
                "--workers",
                "1",
            ]
        self.command = [*command, "--port", str(self.port)]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = log_file
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    def launch(self) -> None:
        env = {
            **os.environ,
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # no background job runner to stop
        }
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(signal.SIGTERM),
            )
        process = self.process

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return True
            except OSError:
                pass
            if process.poll() is not None:
                raise RuntimeError(f"{' '.join(self.command)} exited with code {process.returncode}: {self.log_tail()}")
            return False

        try:
            wait_until(healthy, self.startup_timeout_s, f"{' '.join(self.command)} to come up", interval=0.5)
        except WaitTimeout as error:
            raise RuntimeError(f"{error}: {self.log_tail()}") from None

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as response:
            return json.loads(response.read())

    def get_bytes(self, path: str) -> bytes:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=60) as response:
            return response.read()

    def stop(self) -> None:
        """SIGTERM to the process group (graceful), SIGKILL to it after 20 s."""
        process, self.process = self.process, None
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        try:  # the uvicorn server and anything it started, also when the mlflow command is gone
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if process.poll() is None:
            process.wait(timeout=10)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_file.read_text(errors="replace")[-chars:] if self.log_file.is_file() else "(no log)"
