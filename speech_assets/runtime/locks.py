"""File locks (``flock``): :func:`flock` is the one place a lock is taken; :func:`exclusive_lock`
holds one for a ``with`` block (writers of one shard, client folder or database take turns).

A run folder's locks: ``.run.lock``, held exclusively by whoever runs in the folder (a second
run fails at once with the holder's record), and ``.workers.lock``, held shared by every worker,
which a new launcher waits to hold exclusively so that workers of a dead launcher are gone first.
The kernel drops an ``flock`` when its holder dies, also on ``kill -9``: no stale locks (NFS:
docs/OPERATIONS.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from speech_assets.layout import RUN_LOCK, WORKERS_LOCK
from speech_assets.runtime.waiting import WaitTimeout, wait_until


def flock(path: str | os.PathLike[str], *, shared: bool = False, wait: bool = True) -> IO[str]:
    """Open ``path`` (created, with its folder) and lock it until :func:`unlock` or this process ends;
    ``wait=False``: ``BlockingIOError`` at once when it is taken."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held until unlock()
    try:
        fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
    except BaseException:
        handle.close()
        raise
    return handle


def unlock(handle: IO[str]) -> None:
    fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()


class LockTimeout(TimeoutError):
    """A lock was not obtained within the time given."""


# how often a bounded wait tries a taken lock again
LOCK_POLL_S = 0.05


@contextlib.contextmanager
def exclusive_lock(lock_file: str | os.PathLike[str], timeout_s: float | None = None) -> Iterator[IO[str]]:
    """Hold an exclusive lock on ``lock_file`` for a ``with`` block; with ``timeout_s``,
    :class:`LockTimeout` after that long (``flock`` has no timeout: the lock is polled)."""
    if timeout_s is None:
        handle = flock(lock_file)
    else:

        def taken() -> IO[str] | None:
            try:
                return flock(lock_file, wait=False)
            except BlockingIOError:
                return None

        try:
            handle = wait_until(taken, timeout_s, f"the lock {lock_file}", interval=LOCK_POLL_S)
        except WaitTimeout:
            raise LockTimeout(f"{lock_file} is held by another process for more than {timeout_s:g} s") from None
    try:
        yield handle
    finally:
        unlock(handle)


class RunFolderBusy(RuntimeError):
    """Another run holds the run folder."""


class RunFolderLock:
    """Exclusive, non-blocking lock on a run folder, with a record of who holds it."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / RUN_LOCK
        self._handle: IO[str] | None = None

    def acquire(self, **holder: Any) -> RunFolderLock:
        try:
            handle = flock(self.path, wait=False)
        except BlockingIOError:
            holder = describe_holder(self.path.read_text(encoding="utf-8").strip())
            raise RunFolderBusy(f"run folder {self.path.parent} is in use by another run: {holder}") from None
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.now(UTC).isoformat(timespec="seconds"),
            **holder,
        }
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(record, sort_keys=True))
        handle.flush()
        self._handle = handle
        return self

    def release(self) -> None:
        if self._handle is not None:
            unlock(self._handle)
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
    return flock(Path(run_dir) / WORKERS_LOCK, shared=True)


def wait_for_old_workers(run_dir: str | os.PathLike[str], timeout_s: float = 60.0) -> None:
    """Return once no worker of an earlier launch holds the folder (raise after ``timeout_s``)."""
    path = Path(run_dir) / WORKERS_LOCK

    def workers_gone() -> bool:
        try:
            unlock(flock(path, wait=False))
        except BlockingIOError:
            return False
        return True

    try:
        wait_until(workers_gone, timeout_s, f"the workers of an earlier launch in {Path(run_dir)}", interval=0.5)
    except WaitTimeout:
        raise RunFolderBusy(
            f"workers of an earlier launch still run in {Path(run_dir)} after {timeout_s:.0f} s (find them "
            f"with: fuser -v {path})"
        ) from None
