"""File locks with a bounded wait, against a real second process holding the lock."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from speech_assets.runtime.locks import LockTimeout, exclusive_lock

HOLDER = """
import fcntl, sys, time
handle = open(sys.argv[1], "a+")
fcntl.flock(handle, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_a_bounded_exclusive_lock_gives_up_while_another_process_holds_it(tmp_path: Path) -> None:
    """With ``timeout_s`` the wait ends in LockTimeout while another process holds the lock, and
    the lock is had once that process is gone. Kills the mutation "exclusive_lock ignores
    timeout_s" (the wait was still going when the test gave up on it, 20 s later)."""
    lock = tmp_path / "state" / ".lock"
    outcome: list[object] = []

    def take() -> None:
        try:
            with exclusive_lock(lock, timeout_s=0.3):
                outcome.append("held")
        except LockTimeout as error:
            outcome.append(error)

    lock.parent.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        waiting = threading.Thread(target=take, daemon=True)
        waiting.start()
        waiting.join(20)
        assert not waiting.is_alive(), "the bounded wait did not end"
    finally:
        holder.kill()
        holder.wait(30)
    (timed_out,) = outcome
    assert isinstance(timed_out, LockTimeout) and "more than 0.3 s" in str(timed_out)
    take()
    assert outcome[-1] == "held"
    with pytest.raises(LockTimeout), exclusive_lock(lock), exclusive_lock(lock, timeout_s=0):
        pass  # a second open file of this process is another holder: flock does not nest
