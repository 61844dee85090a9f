"""What the header alone may decide: a FLAC that declares no length is unreadable, not too long."""

from __future__ import annotations

from pathlib import Path

import pytest

from speech_assets.corpus import manifest as m
from speech_assets_tests.support.corpora import LibriCorpus


def _forget_length(path: Path) -> None:
    """Zero STREAMINFO's 36-bit total-samples field, as a streaming FLAC encoder leaves it."""
    data = bytearray(path.read_bytes())
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # first metadata block is STREAMINFO
    data[21] &= 0xF0  # its byte 13: 4 bits of bits-per-sample, then the top 4 bits of the total
    data[22:26] = bytes(4)
    path.write_bytes(data)


@pytest.mark.parametrize("max_duration_s", [35.0, 1.0], ids=["default-bounds", "tight-bounds"])
def test_a_flac_without_a_declared_length_is_unreadable_not_too_long(libri: LibriCorpus, max_duration_s: float) -> None:
    libri.add("14", "140", 0, seconds=2.0)
    _forget_length(libri.add("14", "140", 1, seconds=2.0))
    result = m.scan_corpus(libri.root, m.ValidationConfig(min_duration_s=0.5, max_duration_s=max_duration_s))
    reasons = {r.utt_id: (r.reason, r.detail) for r in result.rejects}
    assert reasons["14-140-0001"] == (
        "unreadable",
        "header does not declare the number of samples (a streamed FLAC?), so it cannot be validated",
    )
    assert ("14-140-0000" in {r.utt_id for r in result.rows}) == (max_duration_s > 2.0)
