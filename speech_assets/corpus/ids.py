"""The one rule for identifiers that become file names and partition keys.

Speaker, chapter and utterance ids (from folder names, file names or manifest fields) and the
ids the graph derives itself are 1-64 ASCII letters, digits, ``_`` or ``-``: they can never
name a parent folder (``..``), a hidden file, a sidecar of another id (``a.rejects``) or
anything outside the data dir.
"""

from __future__ import annotations

import re

MAX_LENGTH = 64
_SAFE = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_LENGTH}}}")


def is_safe_id(value: str) -> bool:
    return isinstance(value, str) and _SAFE.fullmatch(value) is not None


def why_unsafe(value: str) -> str | None:
    """``None`` for a safe id, else a human-readable reason."""
    if isinstance(value, str) and _SAFE.fullmatch(value) is not None:
        return None  # the common case, one match (the manifest asks for every id of every file)
    if not isinstance(value, str) or value == "":
        return "is empty"
    if len(value) > MAX_LENGTH:
        return f"is {len(value)} characters long (at most {MAX_LENGTH})"
    # 1-64 characters that do not match: at least one of them is not allowed
    shown = ", ".join(repr(c) for c in sorted({c for c in value if not _SAFE.fullmatch(c)})[:5])
    return f"contains {shown} (only ASCII letters, digits, '_' and '-' are allowed)"


def check_safe_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it is safe; raise ``ValueError`` naming ``what`` otherwise."""
    if (reason := why_unsafe(value)) is not None:
        raise ValueError(f"{what} {value!r} {reason}")
    return value
