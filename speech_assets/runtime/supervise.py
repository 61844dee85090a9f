"""``python -m speech_assets.runtime.supervise -- COMMAND...``: run COMMAND and take every process
it starts down with it.

Flower's daemons start helpers of their own (the SuperLink's SuperExec in a session of its own,
the ServerApp and ClientApp processes), and those only watch their parent's pid: when a daemon is
SIGKILLed, a helper whose parent lingers as a zombie (or whose parent is re-parented to an init
that does not reap) never notices. The tests' documented commands leave such trees too. This
supervisor closes the gap:

- it is a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): whatever COMMAND starts stays
  in its care when its parent dies, instead of going to init;
- it dies with its own parent (its starter arms :func:`~speech_assets.runtime.processes.die_with_parent`
  with SIGTERM) by catching that SIGTERM: it then SIGTERMs COMMAND and every descendant, waits up
  to ``--grace`` seconds, SIGKILLs the rest and reaps them all; COMMAND itself gets SIGKILL should
  this supervisor be SIGKILLed;
- when COMMAND exits on its own, the same happens to whatever it left behind.

Its exit code is COMMAND's (or 128 + the signal that stopped it). Both ``prctl`` calls are
Linux's: on any other OS it refuses at once with one line (exit code 2).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys

from speech_assets.runtime.waiting import WaitTimeout, wait_until

PR_SET_CHILD_SUBREAPER = 36


class _Stop(Exception):
    pass


def _reap() -> bool:
    """Reap every child that has exited; whether none is left at all."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return False


def shutdown(grace: float) -> None:
    """SIGTERM every descendant, wait up to ``grace`` s, SIGKILL the rest, reap everything."""
    from speech_assets.runtime.processes import descendants, send  # psutil: once main() found Linux

    def below_me() -> set[int]:
        return descendants([os.getpid()])

    send(below_me(), signal.SIGTERM)

    def gone() -> bool:
        _reap()
        return not below_me()

    def killed() -> bool:
        send(below_me(), signal.SIGKILL)
        return gone()

    with contextlib.suppress(WaitTimeout):
        wait_until(gone, grace, "the supervised processes to exit")
    with contextlib.suppress(WaitTimeout):
        wait_until(killed, 5.0, "the supervised processes to die", interval=0.05)
    # reap every child left (zombies included): an init that does not reap would keep them
    with contextlib.suppress(WaitTimeout):
        wait_until(_reap, 2.0, "the supervised processes to be reaped", interval=0.02)


def main(argv: list[str]) -> int:
    grace = 10.0
    if argv[:1] == ["--grace"]:
        grace, argv = float(argv[1]), argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m speech_assets.runtime.supervise [--grace S] -- COMMAND...", file=sys.stderr)
        return 2
    if not sys.platform.startswith("linux"):  # before psutil is imported: the subreaper needs Linux
        print(f"speech_assets.runtime.supervise needs Linux (a child subreaper), not {sys.platform}", file=sys.stderr)
        return 2
    from speech_assets.runtime.processes import die_with_parent

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)
        raise _Stop  # out of a blocking waitpid (PEP 475 would retry it)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    code: int | None = None
    try:
        # the command dies if this supervisor is SIGKILLed
        child = subprocess.Popen(argv, preexec_fn=functools.partial(die_with_parent, signal.SIGKILL))  # noqa: S603, PLW1509
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
