"""The training run folder's locks: one trainer per folder, and no new workers while old ones live.

* ``.run.lock``: held exclusively (``flock``) by whoever trains in the folder: the launcher (the
  Dagster asset, ``python -m speech_assets.train --launch``) or, without one, rank 0 itself. A
  second trainer fails at once with the holder's record (pid, host, Dagster run, start time).
* ``.workers.lock``: every worker holds it shared for its whole life. A launcher that just took
  the run lock waits (bounded) for an exclusive hold on it, i.e. until workers left behind by a
  launcher that died are gone, before it starts new ones.

``flock`` locks belong to open files, so the kernel drops them when their holder dies, also on
``kill -9``: a dead trainer never leaves a stale lock. (On NFS see README, "From a laptop to a cluster".)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

RUN_LOCK = ".run.lock"
WORKERS_LOCK = ".workers.lock"


class RunFolderBusy(RuntimeError):
    """Another trainer holds the run folder."""


class RunFolderLock:
    """Exclusive, non-blocking lock on a run folder, with a record of who holds it."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / RUN_LOCK
        self._handle: IO[str] | None = None

    def acquire(self, **holder: Any) -> RunFolderLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held until release()
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            record = handle.read().strip()
            handle.close()
            raise RunFolderBusy(f"run folder {self.path.parent} is in use by another trainer: {describe_holder(record)}") from None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": datetime.now(UTC).isoformat(timespec="seconds"), **holder}
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(record, sort_keys=True))
        handle.flush()
        self._handle = handle
        return self

    def release(self) -> None:
        if self._handle is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None

    def __enter__(self) -> RunFolderLock:
        return self if self._handle is not None else self.acquire()

    def __exit__(self, *_exc: object) -> None:
        self.release()


def describe_holder(record: str) -> str:
    try:
        holder = json.loads(record)
    except json.JSONDecodeError:
        return "holder unknown"
    parts = [f"pid {holder.get('pid')} on {holder.get('host')}", f"since {holder.get('since')}"]
    if holder.get("dagster_run_id"):
        parts.append(f"Dagster run {holder['dagster_run_id']}")
    if holder.get("command"):
        parts.append(f"({holder['command']})")
    return ", ".join(parts)


def hold_as_worker(run_dir: str | os.PathLike[str]) -> IO[str]:
    """Take the workers' shared lock for the life of this process (keep the returned file open)."""
    path = Path(run_dir) / WORKERS_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held until the process exits
    fcntl.flock(handle, fcntl.LOCK_SH)
    return handle


def wait_for_old_workers(run_dir: str | os.PathLike[str], timeout_s: float = 60.0) -> None:
    """Return once no worker of an earlier launch holds the folder (raise after ``timeout_s``)."""
    path = Path(run_dir) / WORKERS_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with open(path, "a+", encoding="utf-8") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(handle, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RunFolderBusy(
                        f"workers of an earlier launch still run in {Path(run_dir)} after {timeout_s:.0f} s "
                        f"(find them with: fuser -v {path})"
                    ) from None
                time.sleep(0.5)
