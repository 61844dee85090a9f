"""The one seam for fault injection: tests make a real process fail at a named point.

``SPEECH_ASSETS_FAULTS`` (set only by tests) holds ``;``-separated faults written by :func:`fault`,
e.g. ``train.step rank=1 step=3 exit once=/tmp/x/marker``: the point, ``key=value`` words that must
equal what the point passes, and one action: ``exit`` (``code=N``, default 1), ``raise``, ``hold``
(write ``marker`` with this pid, sleep an hour) or ``preempt`` (:func:`inject` returns ``True``: the
engine checkpoints and the run ends; select no rank). ``once=PATH`` fires only while PATH does not
exist, so a restarted process does not fail again.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

FAULTS_ENV = "SPEECH_ASSETS_FAULTS"
ACTIONS = ("exit", "raise", "hold", "preempt")
_OPTIONS = ("once", "code", "marker")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fault:
    point: str
    action: str
    where: dict[str, str] = field(default_factory=dict)
    once: str | None = None
    code: int = 1
    marker: str | None = None

    def matches(self, point: str, where: dict[str, object]) -> bool:
        return self.point == point and all(k in where and str(where[k]) == v for k, v in self.where.items())


def fault(point: str, action: str, **fields: object) -> str:
    """One fault as the environment variable spells it (join several with ``;``)."""
    if action not in ACTIONS:
        raise ValueError(f"fault action {action!r} is not one of {ACTIONS}")
    words = [point, *(f"{key}={value}" for key, value in fields.items()), action]
    if any(not word or any(c.isspace() or c == ";" for c in word) for word in words):
        raise ValueError(f"fault words may not be empty or hold white space or ';': {words}")
    return " ".join(words)


def parse(spec: str) -> list[Fault]:
    """The faults of ``spec``; ``ValueError`` for a malformed one (a test's typo must not pass silently)."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        point, *words = item.split()
        where: dict[str, str] = {}
        options: dict[str, str] = {}
        actions = []
        for word in words:
            key, eq, value = word.partition("=")
            if not eq:
                actions.append(word)
            else:
                (options if key in _OPTIONS else where)[key] = value
        if len(actions) != 1 or actions[0] not in ACTIONS:
            raise ValueError(f"fault {item!r} needs exactly one action of {ACTIONS}")
        if actions[0] == "hold" and "marker" not in options:
            raise ValueError(f"fault {item!r}: hold needs marker=PATH")
        faults.append(
            Fault(point, actions[0], where, options.get("once"), int(options.get("code", 1)), options.get("marker"))
        )
    return faults


def inject(point: str, *, error: type[BaseException] = RuntimeError, **where: object) -> bool:
    """Fail here if a test asked for it (see the module doc); a no-op otherwise. True when a
    ``preempt`` fault fires: the caller stops as if preempted."""
    if not (spec := os.environ.get(FAULTS_ENV)):
        return False
    for item in parse(spec):
        if not item.matches(point, where):
            continue
        described = f"fault injection: {item.action} at {point} " + " ".join(f"{k}={v}" for k, v in where.items())
        if item.once is not None:
            once = Path(item.once)
            if once.exists():
                continue
            once.parent.mkdir(parents=True, exist_ok=True)
            once.write_text(described + "\n", encoding="utf-8")
        log.error(described)
        if item.action == "preempt":
            return True
        if item.action == "exit":
            os._exit(item.code)
        if item.action == "raise":
            raise error(described)
        marker = Path(item.marker or "")
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()), encoding="utf-8")
        time.sleep(3600)
    return False
