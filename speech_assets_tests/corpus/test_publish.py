"""Write, audit, publish on real files: nothing is published unless every audit passes, the rows
are renamed last, the publish lock is held to the end of the caller's block, and no staging folder
outlives a publish (its own or a killed run's)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from speech_assets import layout
from speech_assets.corpus import manifest as m
from speech_assets.corpus.audit import AUDITS
from speech_assets.corpus.publish import publish_manifest
from speech_assets.runtime.locks import flock, unlock
from speech_assets_tests.support.corpora import LibriCorpus

CONFIG = m.ValidationConfig(min_duration_s=0.5, max_duration_s=35.0)
OUTPUTS = ("manifest", "rejects", "speakers")


def scan(root: Path, speakers: tuple[str, ...], unreadable: int = 0) -> m.ScanResult:
    """A real scan of a tiny LibriSpeech-layout corpus: three utterances per speaker, and
    ``unreadable`` files of speaker 9 that become rejects."""
    corpus = LibriCorpus(root)
    for speaker in speakers:
        for utt in range(3):
            corpus.add(speaker, "10", utt)
    for utt in range(unreadable):
        corpus.add("9", "90", utt).write_text("not audio")
    return m.scan_corpus(root, CONFIG)


def publish(result: m.ScanResult, files: layout.ManifestFiles, root: Path, run: str, max_ratio: float = 0.2):
    return publish_manifest(result.rows, result.rejects, files, m.corpus_root_of(root), CONFIG, max_ratio, run)


def lock_is_free(files: layout.ManifestFiles) -> bool:
    try:
        handle = flock(files.publish_lock, wait=False)
    except BlockingIOError:
        return False
    unlock(handle)
    return True


def speakers_of(path: Path) -> list[str]:
    return sorted(set(pq.read_table(path, columns=["speaker_id"]).column("speaker_id").to_pylist()))


def test_a_publish_renames_every_file_into_place_and_holds_the_lock_to_the_end_of_the_block(tmp_path: Path) -> None:
    files = layout.ManifestFiles(tmp_path / "manifest")
    (files.staging / "killed-run").mkdir(parents=True)  # a run killed mid-way left its staging behind
    (files.staging / "killed-run" / "manifest.parquet").write_bytes(b"half a file")
    root = tmp_path / "corpus"
    result = scan(root, ("1", "2"), unreadable=1)
    with publish(result, files, root, "run-1") as publication:
        assert publication.published and not publication.failed
        assert [a.name for a in publication.audits] == list(AUDITS)
        # under the lock, all three files are this run's, and no other run can publish
        assert not lock_is_free(files)
        assert (
            speakers_of(files.manifest) == speakers_of(files.speakers) == sorted(publication.per_speaker) == ["1", "2"]
        )
        assert pq.read_table(files.rejects).num_rows == 1
        assert m.read_manifest(files.manifest) == result.rows
        assert not files.staging.exists()
    assert lock_is_free(files)
    assert {s: r.utterances for s, r in publication.per_speaker.items()} == {"1": 3, "2": 3}


def test_a_failed_audit_publishes_nothing_and_leaves_the_previous_files_byte_identical(tmp_path: Path) -> None:
    files = layout.ManifestFiles(tmp_path / "manifest")
    good = tmp_path / "good"
    with publish(scan(good, ("1", "2")), files, good, "run-1") as first:
        assert first.published
    before = {name: getattr(files, name).read_bytes() for name in OUTPUTS}

    bad = tmp_path / "bad"  # three good files, three unreadable: reject ratio 3/6 > 0.2
    with publish(scan(bad, ("3",), unreadable=3), files, bad, "run-2") as second:
        assert not second.published
        assert [a.name for a in second.failed] == ["reject_ratio"]
        assert not lock_is_free(files)
        assert {name: getattr(files, name).read_bytes() for name in OUTPUTS} == before
        assert not files.staging.exists()
    assert {name: getattr(files, name).read_bytes() for name in OUTPUTS} == before
    assert lock_is_free(files)


def test_rows_are_renamed_last_so_a_publish_that_breaks_midway_never_shows_new_rows_with_old_sidecars(
    tmp_path: Path,
) -> None:
    files = layout.ManifestFiles(tmp_path / "manifest")
    old = tmp_path / "old"
    with publish(scan(old, ("1",)), files, old, "run-1"):
        pass
    new = tmp_path / "new"
    result = scan(new, ("2",))
    # the rows' rename fails (a folder squats the name the sidecars' renames never touch):
    # every rename before it is a sidecar's, so the old rows stay
    files.manifest.unlink()
    (files.manifest / "squatter").mkdir(parents=True)
    with pytest.raises(IsADirectoryError), publish(result, files, new, "run-2"):
        pytest.fail("the block runs only after a publish that completed")
    assert speakers_of(files.speakers) == ["2"]  # the sidecars are the new ones
    assert files.manifest.is_dir()  # the rows' rename, the last, is the one that failed
    assert not files.staging.exists()
    assert lock_is_free(files)
