"""``python -m speech_assets.runtime.tether -- COMMAND...``: run COMMAND for as long as this
process's standard input stays open.

What starts the other nodes of a multi-node run (``ssh`` for instance) leaves processes on other
hosts, where neither the parent-death signal nor the launcher watchdog can see the launcher. Their
standard input can: the launcher holds a pipe to each node's command open for the node's whole
life; it closes when the launcher ends or is killed (``kill -9`` included), and ``ssh`` then ends
the remote command's input too. At end of input, or on SIGTERM, SIGINT or SIGHUP, COMMAND's
process group gets SIGTERM (torchrun stops its workers), then SIGKILL after a grace period.
COMMAND's own input is ``/dev/null``; this process exits with COMMAND's status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

GRACE_S = 30.0


def stop(child: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM to ``child``'s process group, SIGKILL to it after ``grace_s`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # not reaped yet: the group id is still its own
            os.killpg(child.pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    command = argv[1:] if argv and argv[0] == "--" else argv
    if not command:
        sys.exit("usage: python -m speech_assets.runtime.tether -- COMMAND [ARGS...]")
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
    stopping = threading.Lock()

    def stop_once(reason: str) -> None:
        if child.poll() is None and stopping.acquire(blocking=False):
            print(f"tether: {reason}: stopping {command[0]} (pid {child.pid})", file=sys.stderr, flush=True)
            stop(child)

    def watch_input() -> None:
        with contextlib.suppress(OSError):
            while os.read(sys.stdin.fileno(), 65536):
                pass
        stop_once("standard input closed (the launcher is gone)")

    threading.Thread(target=watch_input, name="tether-stdin", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(
            sig, lambda number, _: threading.Thread(target=stop_once, args=(signal.Signals(number).name,)).start()
        )
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
