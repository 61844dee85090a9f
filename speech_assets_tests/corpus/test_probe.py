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


def test_a_refused_file_is_probed_by_its_own_stat(libri: LibriCorpus, tmp_path: Path) -> None:
    """A file refused before it is opened (a symlink out of the root) keeps its own size and mtime (the
    cache key), and a path with nothing there gets zeros."""
    outside = libri.add("15", "150", 0).rename(tmp_path / "outside.flac")
    link = libri.root / "link.flac"
    link.symlink_to(outside)
    probe = m.probe_audio(str(link), root=libri.root)
    assert probe.reason == "outside_root" and (probe.size, probe.mtime_ns) == (
        link.lstat().st_size,
        link.lstat().st_mtime_ns,
    )
    gone = m.probe_audio(str(libri.root / "gone.flac"), root=libri.root)
    assert gone.reason == "unreadable" and (gone.size, gone.mtime_ns) == (0, 0)
