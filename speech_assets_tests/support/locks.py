"""A lock held by another real process, for tests of bounded waits on `flock` locks."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

HOLDER = """
import fcntl, sys, time
handle = open(sys.argv[1], "a+")
fcntl.flock(handle, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def wait_while_held_elsewhere(lock: Path, wait: Callable[[], None], limit_s: float = 20.0) -> None:
    """Run ``wait`` in a thread while a second process holds ``lock`` exclusively; fails when
    ``wait`` is still blocked after ``limit_s``. The holder is killed (its lock freed) either way."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        waiting = threading.Thread(target=wait, daemon=True)
        waiting.start()
        waiting.join(limit_s)
        assert not waiting.is_alive(), f"still waiting on {lock.name} after {limit_s:g} s"
    finally:
        holder.kill()
        holder.wait(30)
