"""Progress of long work in the Dagster run log, at a bounded rate: done/total, rate and ETA."""

from __future__ import annotations

import logging
import time


class ProgressLog:
    """Callable ``(item, done, total)`` that logs at most every ``interval_s`` seconds (and at the end)."""

    def __init__(self, log: logging.Logger | logging.LoggerAdapter, what: str, interval_s: float = 10.0) -> None:
        self.log, self.what, self.interval_s = log, what, interval_s
        self.started = time.monotonic()
        self._last = self.started

    def __call__(self, _item: object, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < self.interval_s:
            return
        self._last = now
        elapsed = now - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else float("nan")
        self.log.info(f"{self.what}: {done}/{total} done, {rate:.2f}/s, ETA {eta:.0f} s")
