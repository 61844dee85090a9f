"""A real, throw-away PostgreSQL server for tests and local trials: the server binaries of the
``pgserver`` wheel (PostgreSQL 16, from PyPI, so no system package is needed), a fresh data
directory, TCP on 127.0.0.1 only, password authentication over TCP.

The server is this process's child: it is armed with ``PR_SET_PDEATHSIG`` (immediate shutdown
when the thread that started it dies, also on ``kill -9``) and stopped (fast shutdown, then
SIGKILL) and its data directory removed by :meth:`PostgresServer.stop`. PostgreSQL refuses to run
as root, so under root the server runs as ``nobody`` with a data directory it owns.

    with PostgresServer() as pg:
        pg.create_database("dagster")
        engine_url = pg.url("dagster")   # postgresql+psycopg2://dagster:<password>@127.0.0.1:<port>/dagster
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from speech_assets.runtime.processes import die_with_parent, pid_exists
from speech_assets.runtime.waiting import WaitTimeout, wait_until
from speech_assets_tests.support.commands import LocalServer
from speech_assets_tests.support.ports import free_port

BIN_ENV = "SPEECH_ASSETS_PG_BIN"
USER = "dagster"
ROOT_PREFIX = "speech-assets-pg-"
STALE_AFTER_S = 600.0


def server_bin_dir() -> Path:
    """The folder holding ``initdb`` and ``postgres``: ``$SPEECH_ASSETS_PG_BIN`` or the pgserver wheel's."""
    explicit = os.environ.get(BIN_ENV)
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec("pgserver")  # located, not imported: its __init__ has side effects
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"no PostgreSQL server binaries: pip install pgserver (a dev dependency) or set ${BIN_ENV}")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def sweep_stale_roots() -> None:
    """Remove folders left by servers whose test process was killed before it could clean up
    (the server itself died with it): older than 10 minutes and no live postmaster."""
    for root in Path(tempfile.gettempdir()).glob(ROOT_PREFIX + "*"):
        try:
            if time.time() - root.stat().st_mtime < STALE_AFTER_S:
                continue
            pid_file = root / "data" / "postmaster.pid"
            if pid_file.is_file():
                pid = int(pid_file.read_text().split()[0])
                if pid_exists(pid):
                    continue
            shutil.rmtree(root, ignore_errors=True)
        except (OSError, ValueError, IndexError):
            continue


class PostgresServer(LocalServer):
    """One PostgreSQL server on 127.0.0.1; see the module docstring."""

    def __init__(self, bin_dir: Path | None = None, startup_timeout_s: float = 60.0) -> None:
        self.bin_dir = bin_dir or server_bin_dir()
        self.user = USER
        self.password = secrets.token_hex(12)
        self.host = "127.0.0.1"
        self.port = 0
        self.startup_timeout_s = startup_timeout_s
        self.root: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None
        # PostgreSQL will not run as root: run it as `nobody` then.
        self._run_as: pwd.struct_passwd | None = pwd.getpwnam("nobody") if os.geteuid() == 0 else None

    # -- lifecycle ----------------------------------------------------------------------------
    def launch(self) -> None:
        sweep_stale_roots()
        # A folder of its own in the system temp dir (pytest's tmp_path is private to root).
        self.root = Path(tempfile.mkdtemp(prefix=ROOT_PREFIX))
        data = self.root / "data"
        password_file = self.root / "pwfile"
        password_file.write_text(self.password + "\n")
        if self._run_as is not None:
            os.chown(self.root, self._run_as.pw_uid, self._run_as.pw_gid)
            os.chown(password_file, self._run_as.pw_uid, self._run_as.pw_gid)
        self._run(
            [
                str(self.bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                self.user,
                f"--pwfile={password_file}",
                "--auth-host=scram-sha-256",
                "--auth-local=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
        )
        password_file.unlink()
        for _ in range(5):  # the free port may be taken between our probe and the server's bind
            self.port = free_port()
            if self._start_server(data):
                return
        raise RuntimeError(f"PostgreSQL did not start: {self.log_tail()}")

    def _run(self, command: list[str]) -> None:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120, **self._as_server_user())
        if proc.returncode != 0:
            raise RuntimeError(f"{command[0]} failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")

    def _as_server_user(self) -> dict[str, Any]:
        if self._run_as is None:
            return {}
        return {"user": self._run_as.pw_uid, "group": self._run_as.pw_gid, "extra_groups": [], "cwd": str(self.root)}

    def _start_server(self, data: Path) -> bool:
        assert self.root is not None
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 - the server's stderr, closed below
        try:
            self.process = subprocess.Popen(
                [
                    str(self.bin_dir / "postgres"),
                    "-D",
                    str(data),
                    "-h",
                    self.host,
                    "-p",
                    str(self.port),
                    "-k",
                    str(data),  # the Unix socket stays inside the data dir
                    "-c",
                    "fsync=off",
                    "-c",
                    "synchronous_commit=off",
                    "-c",
                    "full_page_writes=off",
                    "-c",
                    "max_connections=200",
                    "-c",
                    "shared_buffers=32MB",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C in the terminal reaches us, and we stop it
                preexec_fn=lambda: die_with_parent(signal.SIGQUIT),  # immediate shutdown if we die
                **self._as_server_user(),
            )
        finally:
            log.close()
        process = self.process

        def answer() -> str:
            if process.poll() is not None:
                return "exited"
            try:
                self.connect("postgres").close()
            except Exception:  # noqa: BLE001 - not accepting connections yet
                return ""
            return "accepting connections"

        try:
            if wait_until(answer, self.startup_timeout_s, "PostgreSQL to accept connections") == "exited":
                self.process = None
                return False
        except WaitTimeout as error:
            raise RuntimeError(f"{error}: {self.log_tail()}") from None
        return True

    def stop(self) -> None:
        """Fast shutdown (SIGINT), SIGKILL after 30 s; then remove the data directory."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def log_tail(self, chars: int = 3000) -> str:
        if self.root is None or not (self.root / "server.log").is_file():
            return "(no server log)"
        return (self.root / "server.log").read_text(errors="replace")[-chars:]

    # -- use ----------------------------------------------------------------------------------
    def url(self, database: str, driver: str = "postgresql+psycopg2") -> str:
        """A SQLAlchemy URL. The driver is explicit: SQLAlchemy 2.1 defaults ``postgresql://`` to
        psycopg 3, while dagster-postgres and this project install psycopg2."""
        return f"{driver}://{self.user}:{self.password}@{self.host}:{self.port}/{database}"

    def env(self) -> dict[str, str]:
        """The variables `deploy/postgres/dagster.yaml` reads."""
        return {
            "DAGSTER_PG_HOST": self.host,
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USER": self.user,
            "DAGSTER_PG_PASSWORD": self.password,
            "DAGSTER_PG_DB": "dagster",
        }

    def connect(self, database: str) -> Any:
        import psycopg2

        return psycopg2.connect(
            host=self.host, port=self.port, user=self.user, password=self.password, dbname=database, connect_timeout=5
        )

    def create_database(self, name: str) -> str:
        connection = self.connect("postgres")
        try:
            connection.autocommit = True
            with connection.cursor() as cursor:
                cursor.execute(f'CREATE DATABASE "{name}"')
        finally:
            connection.close()
        return self.url(name)

    def query(self, database: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        connection = self.connect(database)
        try:
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                return cursor.fetchall()
        finally:
            connection.close()
