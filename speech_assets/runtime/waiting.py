"""Waiting for something to become true, with a timeout that says what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(TimeoutError):
    """What was awaited did not happen in time."""


def wait_until(check: Callable[[], T], timeout: float, what: str, *, interval: float = 0.1) -> T:
    """Call ``check`` every ``interval`` seconds until it returns something truthy, and return that.

    ``WaitTimeout`` naming ``what`` after ``timeout`` seconds. ``check`` may raise to give up early
    (for example when the process it waits on has exited).
    """
    deadline = time.monotonic() + timeout
    while True:
        if result := check():
            return result
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
