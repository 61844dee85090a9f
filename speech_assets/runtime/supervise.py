"""``python -m speech_assets.federated.supervise -- COMMAND...``: run COMMAND and take every
process it starts down with it (standard library only, so it starts in milliseconds).

Flower's daemons start helpers of their own (the SuperLink's SuperExec in a session of its own,
the ServerApp and ClientApp processes), and those only watch their parent's pid: when a daemon is
SIGKILLed, a helper whose parent lingers as a zombie (or whose parent is re-parented to an init
that does not reap) never notices. This supervisor closes the gap:

- it is a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): whatever COMMAND starts stays
  in its care when its parent dies, instead of going to init;
- it dies with its own parent (``PR_SET_PDEATHSIG`` set by :func:`~speech_assets.federated.processes.spawn`)
  by catching the SIGTERM that brings: it then SIGTERMs COMMAND and every descendant, waits up to
  ``--grace`` seconds, SIGKILLs the rest and reaps them all;
- when COMMAND exits on its own, the same happens to whatever it left behind.

Its exit code is COMMAND's (or 128 + the signal that stopped it). Both ``prctl`` calls are
Linux's: on any other OS it refuses at once with one line (exit code 2).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


class _Stop(Exception):
    pass


def _descendants() -> set[int]:
    """Live processes below this one (by walking /proc parent links)."""
    me = os.getpid()
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: set[int] = set()
    stack = [me]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def shutdown(grace: float) -> None:
    """SIGTERM every descendant, wait up to ``grace`` s, SIGKILL the rest, reap everything."""
    _signal(_descendants(), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _descendants() and time.monotonic() < deadline:
        _reap()
        time.sleep(0.1)
    deadline = time.monotonic() + 5.0
    while (remaining := _descendants()) and time.monotonic() < deadline:
        _signal(remaining, signal.SIGKILL)
        time.sleep(0.05)
        _reap()
    # reap every child left (zombies included): an init that does not reap would keep them
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.02)


def main(argv: list[str]) -> int:
    grace = 10.0
    if argv[:1] == ["--grace"]:
        grace, argv = float(argv[1]), argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m speech_assets.federated.supervise [--grace S] -- COMMAND...", file=sys.stderr)
        return 2
    if not sys.platform.startswith("linux"):
        print(f"speech_assets.federated.supervise needs Linux (a child subreaper), not {sys.platform}", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)
        raise _Stop  # out of a blocking waitpid (PEP 475 would retry it)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    parent = os.getpid()

    def child_setup() -> None:  # the command dies if this supervisor is SIGKILLed
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    code: int | None = None
    try:
        child = subprocess.Popen(argv, preexec_fn=child_setup)  # noqa: S603, PLW1509
        while code is None and not stopping:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == child.pid:
                code = os.waitstatus_to_exitcode(status)
                child.returncode = code
    except _Stop:
        pass
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a second signal must not interrupt the cleanup
    shutdown(grace)
    if code is None:
        code = 128 + (stopping[0] if stopping else signal.SIGTERM)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
