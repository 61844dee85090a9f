"""Who is alive: process identities that survive pid reuse, parent-death signals, a watchdog.

A process started for a run must not outlive the process that launched it. Two mechanisms, because
neither covers every case alone:

* ``die_with_parent``: ``prctl(PR_SET_PDEATHSIG)``. The kernel signals the child when the *thread*
  that forked it exits, which is the launcher dying in the common case; it survives ``execve``,
  so a tiny wrapper can arm it before exec'ing ``torchrun``.
* ``LauncherWatchdog``: a daemon thread that polls, every second, whether the launcher named in
  ``$SPEECH_ASSETS_LAUNCHER`` (pid and kernel start time, so a reused pid cannot fool it) still
  exists, and ends this process if not: it covers launchers whose forking thread outlives them
  or that are not this process's parent at all (torchrun workers are grandchildren).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

LAUNCHER_ENV = "SPEECH_ASSETS_LAUNCHER"
PR_SET_PDEATHSIG = 1
log = logging.getLogger(__name__)


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after its last ')'
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields and fields[0] == "Z":  # a zombie has exited: only its exit status is left
        return None
    return int(fields[19]) if len(fields) > 19 else None


@dataclass(frozen=True)
class ProcessIdentity:
    """A process on a host, identified beyond its pid (pids are reused)."""

    pid: int
    start_time: int
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

    def alive(self) -> bool:
        """Whether this very process still runs (only answerable on its own host: elsewhere True)."""
        if self.host != socket.gethostname():
            return True
        return process_start_time(self.pid) == self.start_time


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) exits."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): relying on the watchdog", ctypes.get_errno())
        return
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os.kill(os.getpid(), sig)


def launcher_env() -> dict[str, str]:
    """Environment that names this process as the launcher of the processes it starts."""
    return {LAUNCHER_ENV: ProcessIdentity.current().encode()}


class LauncherWatchdog(threading.Thread):
    """Ends this process (exit code 137, like SIGKILL) once the launcher is gone."""

    def __init__(self, launcher: ProcessIdentity, interval_s: float = 1.0) -> None:
        super().__init__(name="launcher-watchdog", daemon=True)
        self.launcher, self.interval_s = launcher, interval_s

    def run(self) -> None:
        while self.launcher.alive():
            time.sleep(self.interval_s)
        log.error("launcher %s is gone: stopping this process", self.launcher.encode())
        logging.shutdown()
        os._exit(137)


def watch_launcher() -> LauncherWatchdog | None:
    """Start a watchdog on ``$SPEECH_ASSETS_LAUNCHER`` if it is set (None otherwise)."""
    value = os.environ.get(LAUNCHER_ENV)
    if not value:
        return None
    watchdog = LauncherWatchdog(ProcessIdentity.decode(value))
    watchdog.start()
    return watchdog
