"""File locks with a bounded wait, against a real second process holding the lock."""

from __future__ import annotations

from pathlib import Path

import pytest

from speech_assets.runtime.locks import LockTimeout, exclusive_lock
from speech_assets_tests.support.locks import wait_while_held_elsewhere


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
    wait_while_held_elsewhere(lock, take)
    (timed_out,) = outcome
    assert isinstance(timed_out, LockTimeout) and "more than 0.3 s" in str(timed_out)
    take()
    assert outcome[-1] == "held"
    with pytest.raises(LockTimeout), exclusive_lock(lock), exclusive_lock(lock, timeout_s=0):
        pass  # a second open file of this process is another holder: flock does not nest
