"""Characters for CTC: blank, space, apostrophe and A-Z, the alphabet of the manifest's transcripts
(upper case, punctuation stripped, apostrophes kept)."""

from __future__ import annotations

import itertools
import re
import string
from collections.abc import Iterable

BLANK = 0
ALPHABET = " '" + string.ascii_uppercase  # token i + 1 is ALPHABET[i]; 0 is the CTC blank
VOCAB_SIZE = len(ALPHABET) + 1
_INDEX = {char: i + 1 for i, char in enumerate(ALPHABET)}
_OUTSIDE = re.compile(f"[^{re.escape(ALPHABET)}]")
_SPACES = re.compile(" +")


def normalise(text: str) -> str:
    """Upper case, characters outside the alphabet dropped, runs of whitespace as one space."""
    return _SPACES.sub(" ", _OUTSIDE.sub("", re.sub(r"\s+", " ", text.upper()))).strip()


def encode(text: str) -> list[int]:
    """Token ids (1..28) of :func:`normalise` (``text``)."""
    return [_INDEX[char] for char in normalise(text)]


def decode_greedy(ids: Iterable[int]) -> str:
    """Best-path CTC decoding of per-frame argmax ``ids``: merge repeats, then drop blanks."""
    chars = "".join(ALPHABET[token - 1] for token, _ in itertools.groupby(ids) if token != BLANK)
    return _SPACES.sub(" ", chars).strip()
