"""Who is alive: process identities that survive pid reuse, process trees, parent-death signals,
a watchdog (Linux and macOS, through psutil).

A process started for a run must not outlive its launcher, by two mechanisms because neither
covers every case: ``die_with_parent`` (``PR_SET_PDEATHSIG``, Linux only: fires when the *thread*
that forked it exits, and survives ``execve``) and ``LauncherWatchdog``, which polls whether the
launcher named in ``$SPEECH_ASSETS_LAUNCHER`` (pid and start time) still exists: it covers
grandchildren such as torchrun workers, and macOS. It ends a worker only when the launcher is
certainly gone; where the process table cannot be read the launcher counts as alive.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import psutil

from speech_assets.runtime.waiting import WaitTimeout, wait_until

LAUNCHER_ENV = "SPEECH_ASSETS_LAUNCHER"
PR_SET_PDEATHSIG = 1
log = logging.getLogger(__name__)


def on_linux() -> bool:
    return sys.platform.startswith("linux")


def pid_exists(pid: int) -> bool:
    """Whether some process (a zombie included) has ``pid``: ``kill(pid, 0)``, no ``/proc`` needed."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _start_of(process: psutil.Process) -> int:
    created = process.create_time()
    if on_linux():
        # clock ticks since boot, as the kernel records them: unlike the epoch time psutil derives
        # from them (boot time + ticks), they do not move when the wall clock is stepped
        return round((created - psutil.boot_time()) * os.sysconf("SC_CLK_TCK"))
    return round(created * 1_000_000)  # macOS records the creation time itself (microseconds)


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started (Linux: clock ticks since boot; elsewhere: microseconds since the epoch),
    or None if it does not run or its start cannot be read."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return _start_of(process)
    except (psutil.Error, OSError):
        return None


@dataclass(frozen=True)
class ProcessIdentity:
    """A process on a host, identified beyond its pid (pids are reused)."""

    pid: int
    start_time: int  # 0: unknown (the process table could not be read when it was recorded)
    host: str

    @classmethod
    def current(cls) -> ProcessIdentity:
        pid = os.getpid()
        return cls(pid, process_start_time(pid) or 0, socket.gethostname())

    def encode(self) -> str:
        return f"{self.pid}:{self.start_time}:{self.host}"

    @classmethod
    def decode(cls, text: str) -> ProcessIdentity:
        pid, start, host = text.split(":", 2)
        return cls(int(pid), int(start), host)

    def gone(self) -> bool:
        """Whether this process has certainly ended (False whenever that cannot be told)."""
        if self.host != socket.gethostname():
            return False
        if not pid_exists(self.pid):
            return True
        try:
            process = psutil.Process(self.pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
            started = _start_of(process)
        except psutil.ZombieProcess:
            return True
        except psutil.NoSuchProcess:
            # kill() saw the pid, the process table did not: it exited just now, or the table
            # cannot be read (no /proc); only the former is an answer
            return not pid_exists(self.pid)
        except (psutil.Error, OSError):
            return False
        return bool(self.start_time) and started != self.start_time

    def alive(self) -> bool:
        return not self.gone()


def command_lines() -> Iterator[tuple[int, list[str]]]:
    """``(pid, argv)`` of every process whose command line this user may read."""
    try:
        for process in psutil.process_iter(["cmdline"]):
            if process.info["cmdline"]:
                yield process.pid, process.info["cmdline"]
    except (psutil.Error, OSError, IndexError) as error:  # IndexError: psutil on an empty /proc
        log.warning("cannot list processes (%s: %s)", type(error).__name__, error)


def children_by_parent() -> dict[int, list[int]]:
    """``{ppid: [live children]}`` of every process this user can see (zombies left out)."""
    found: dict[int, list[int]] = {}
    with contextlib.suppress(psutil.Error, OSError, IndexError):  # no process table: nothing known
        for process in psutil.process_iter(["ppid", "status"]):
            if process.info["status"] != psutil.STATUS_ZOMBIE:
                found.setdefault(process.info["ppid"] or 0, []).append(process.pid)
    return found


def descendants(roots: Iterable[int]) -> set[int]:
    """Live processes under ``roots`` (not the roots themselves)."""
    found: set[int] = set()
    for root in roots:
        with contextlib.suppress(psutil.Error, OSError, IndexError):  # no process table: nothing known
            found.update(child.pid for child in psutil.Process(root).children(recursive=True) if alive(child.pid))
    return found


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


def send(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def terminate(processes: Sequence[subprocess.Popen], grace: float = 10.0) -> None:
    """Stop ``processes`` and everything they started: SIGTERM to the trees, ``grace`` seconds, SIGKILL, reap."""
    roots = [p.pid for p in processes if p.poll() is None]
    tree = descendants(roots) | set(roots)
    send(tree, signal.SIGTERM)

    def all_gone() -> bool:
        tree.update(descendants(roots))
        return not any(alive(pid) for pid in tree)

    with contextlib.suppress(WaitTimeout):
        wait_until(all_gone, grace, "the processes to exit", interval=0.2)
    tree.update(descendants(roots))
    send((pid for pid in tree if alive(pid)), signal.SIGKILL)
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) exits; whether it is armed (Linux)."""
    if not on_linux():
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): relying on the watchdog", ctypes.get_errno())
        return False
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os.kill(os.getpid(), sig)
    return True


def exit_without_teardown() -> None:
    """For a pool worker: at exit, flush the standard streams and end at once instead of tearing the
    interpreter down (0.5-2 s with torch, while the pool's owner waits). Its results are already in
    the pool's queue, and ``ProcessPoolExecutor`` never reads its workers' exit codes."""

    def end() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)

    atexit.register(end)


def launcher_env() -> dict[str, str]:
    return {LAUNCHER_ENV: ProcessIdentity.current().encode()}


class LauncherWatchdog(threading.Thread):
    """Ends this process (exit code 137, like SIGKILL) once the launcher is certainly gone."""

    def __init__(self, launcher: ProcessIdentity, interval_s: float = 1.0) -> None:
        super().__init__(name="launcher-watchdog", daemon=True)
        self.launcher, self.interval_s = launcher, interval_s
        # a parent that is the launcher is gone once this process is re-parented: no /proc needed
        self.parent = launcher.pid if os.getppid() == launcher.pid else None

    def launcher_gone(self) -> bool:
        return (self.parent is not None and os.getppid() != self.parent) or self.launcher.gone()

    def run(self) -> None:
        while not self.launcher_gone():
            time.sleep(self.interval_s)
        log.error("launcher %s is gone: stopping this process", self.launcher.encode())
        logging.shutdown()
        os._exit(137)


def watch_launcher() -> LauncherWatchdog | None:
    if not (value := os.environ.get(LAUNCHER_ENV)):
        return None
    launcher = ProcessIdentity.decode(value)
    if process_start_time(os.getpid()) is None:
        log.warning(
            "cannot read the process table: the launcher watchdog notices launcher %s's end only once its pid is free",
            launcher.encode(),
        )
    watchdog = LauncherWatchdog(launcher)
    watchdog.start()
    return watchdog
