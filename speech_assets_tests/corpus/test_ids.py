"""Safe ids: the rule's reasons, and unsafe ids in the LibriSpeech layout becoming invalid_id rejects
(the CSV/JSONL forms are in test_manifest.py, the asset on a real instance in defs/test_manifest_ids.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from speech_assets.corpus import manifest as m
from speech_assets.corpus.ids import why_unsafe
from speech_assets_tests.support.corpora import LibriCorpus, write_flac


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("../../x", "contains '.', '/'"),
        ("a.rejects", "contains '.'"),
        ("", "is empty"),
        ("s" * 300, "is 300 characters long (at most 64)"),
        ("spk_é", "contains 'é'"),
        ("a b", "contains ' '"),
        ("ok_ID-9", None),
    ],
    ids=["parent", "sidecar", "empty", "300-chars", "non-ascii", "space", "safe"],
)
def test_why_an_id_is_unsafe(value: str, reason: str | None) -> None:
    found = why_unsafe(value)
    assert found == reason if reason is None else found.startswith(reason)


def _audio(libri: LibriCorpus, speaker_dir: str, chapter_dir: str, stem: str) -> None:
    write_flac(libri.chapter_dir(speaker_dir, chapter_dir) / f"{stem}.flac", seed=len(stem))
    libri.add_line(speaker_dir, chapter_dir, stem, "BAD ID")


# In the LibriSpeech layout ids come from folder and file names (<spk>-<chap>-<utt>.flac), so an id
# can be put there only where the file system allows: ids over 255 bytes or with '/' exist only as
# transcript lines without audio.
LIBRI_CASES = {
    "speaker-sidecar": (
        lambda c: _audio(c, "a.rejects", "10", "a.rejects-10-0001"),
        "a.rejects-10-0001",
        "speaker_id 'a.rejects'",
    ),
    "speaker-dot": (lambda c: _audio(c, "spk.1", "10", "spk.1-10-0001"), "spk.1-10-0001", "speaker_id 'spk.1'"),
    "speaker-non-ascii": (lambda c: _audio(c, "spk_é", "10", "spk_é-10-0001"), "spk_é-10-0001", "speaker_id 'spk_é'"),
    "speaker-empty": (lambda c: _audio(c, "7", "10", "-10-0001"), "-10-0001", "speaker_id '' is empty"),
    "chapter-dot": (lambda c: _audio(c, "7", "10.x", "7-10.x-0001"), "7-10.x-0001", "chapter_id '10.x'"),
    "chapter-non-ascii": (lambda c: _audio(c, "7", "c_é", "7-c_é-0001"), "7-c_é-0001", "chapter_id 'c_é'"),
    "chapter-empty": (lambda c: _audio(c, "7", "10", "7--0001"), "7--0001", "chapter_id '' is empty"),
    "utt-dot": (lambda c: _audio(c, "7", "10", "7-10-0001.rejects"), "7-10-0001.rejects", "utt_id '7-10-0001.rejects'"),
    "utt-non-ascii": (lambda c: _audio(c, "7", "10", "7-10-é"), "7-10-é", "utt_id '7-10-é'"),
    "utt-parent-line": (lambda c: c.add_line("7", "10", "../../x", "NO FILE"), "../../x", "utt_id '../../x'"),
    "utt-300-line": (lambda c: c.add_line("7", "10", "u" * 300, "NO FILE"), "u" * 300, "is 300 characters long"),
}


@pytest.mark.parametrize(("make", "utt_id", "detail"), LIBRI_CASES.values(), ids=LIBRI_CASES.keys())
def test_unsafe_ids_in_the_librispeech_layout_are_invalid_id_rejects(
    libri: LibriCorpus, make, utt_id: str, detail: str
) -> None:
    libri.add("7", "10", 0)
    make(libri)
    result = m.scan_corpus(libri.root)
    assert [(r.utt_id, r.speaker_id, r.chapter_id) for r in result.rows] == [("7-10-0000", "7", "10")]
    (reject,) = result.rejects
    assert (reject.utt_id, reject.stage, reject.reason) == (utt_id, "manifest", "invalid_id")
    assert detail in reject.detail


def test_every_unsafe_id_of_a_row_is_named(libri: LibriCorpus) -> None:
    libri.add("7", "10", 0)
    _audio(libri, "spk.1", "c.2", "spk.1-c.2-é")
    (reject,) = m.scan_corpus(libri.root).rejects
    assert reject.reason == "invalid_id"
    assert [part.split(" ")[0] for part in reject.detail.split("; ")] == ["speaker_id", "chapter_id", "utt_id"]


def test_an_empty_speaker_id_in_a_manifest_file_is_a_reject_not_a_failed_run(tmp_path: Path) -> None:
    write_flac(tmp_path / "a.flac")
    write_flac(tmp_path / "b.flac", seed=1)
    (tmp_path / "corpus.jsonl").write_text(
        '{"path": "a.flac", "transcript": "one", "speaker_id": "s1"}\n{"path": "b.flac", "transcript": "two"}\n'
    )
    result = m.scan_corpus(tmp_path / "corpus.jsonl")
    assert [r.utt_id for r in result.rows] == ["a"]
    assert [(r.utt_id, r.reason, r.detail) for r in result.rejects] == [("b", "invalid_id", "speaker_id '' is empty")]
