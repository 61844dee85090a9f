"""``python -m speech_assets.runtime.supervise -- COMMAND...``: run COMMAND and take every process
it starts down with it.

Flower's daemons start helpers that only watch their parent's pid, so a SIGKILLed daemon can leave
them running. This supervisor is a child subreaper (whatever COMMAND starts stays in its care);
on the SIGTERM of its parent's death, or when COMMAND exits, it SIGTERMs every descendant, waits
``--grace`` seconds, SIGKILLs and reaps the rest. Its exit code is COMMAND's (or 128 + the signal).
Linux only (exit code 2 elsewhere).
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
