"""A feature run's shard jobs, planned from manifest rows: one per speaker with its own rows, an
inputs key that stays byte-identical for the same inputs (a changed key rebuilds every shard), and
the totals the run reports over its published outcomes."""

from __future__ import annotations

from pathlib import Path

import pytest

from speech_assets.corpus.manifest import ManifestRow
from speech_assets.features.jobs import (
    FEATURES_CODE_VERSION,
    ShardOutcome,
    ShardTotals,
    shard_inputs_key,
    shard_jobs,
)
from speech_assets.features.shards import ShardFiles
from speech_assets.features.vad import VadConfig


def row(utt_id: str, speaker: str, sha: str, transcript: str = "hello", duration_s: float = 1.0) -> ManifestRow:
    return ManifestRow(utt_id, speaker, "c1", f"/corpus/{utt_id}.flac", transcript, 16000, 1, 16000, duration_s, sha)


ROWS = [
    row("s1-c1-0001", "s1", "a" * 64),
    row("s2-c1-0001", "s2", "c" * 64, duration_s=2.5),
    row("s1-c1-0002", "s1", "b" * 64, "world", duration_s=1.5),
]
# Computed by the code that built the shards on disk today: a different key for the same inputs
# would make every existing shard rebuild.
S1_HASH = "c9a7a4bd1cf91431e105a7711d93e2ab1acbd92fd62aef863614ba6a31206c10"
S1_KEY = "57f1eacd519e49a48146675176b921defb8b9e8c09d6d9e07e6aea7ff3e6aeb9"
S1_KEY_SPEED = "13995c0adebcd9a40c8521b08ddc5d4c3289540a4e4812b4f4f3289e59c05d6d"  # aggressiveness 3, (0.9, 1.1)
NO_ROWS_KEY = "90299e5094b652540d047b31d8e3568fb5ffe5296a738faa1f8f1a1e76b09547"
ZERO_HASH_KEY = "5a284871100ed9a96622d377e33cd72bbecaddd173e1605c0b4acffecc321d73"


def files_in(folder: Path):
    return lambda speaker: ShardFiles.of(folder, speaker)


@pytest.mark.parametrize(
    ("speaker_hash", "vad", "speed_factors", "key"),
    [
        ("0" * 64, VadConfig(), (), ZERO_HASH_KEY),
        (S1_HASH, VadConfig(), (), S1_KEY),
        (S1_HASH, VadConfig(aggressiveness=3), (0.9, 1.1), S1_KEY_SPEED),
        ("", VadConfig(), (), NO_ROWS_KEY),
    ],
)
def test_the_inputs_key_is_pinned(speaker_hash: str, vad: VadConfig, speed_factors: tuple, key: str) -> None:
    assert shard_inputs_key(speaker_hash, vad, speed_factors) == key


def test_one_job_per_speaker_with_its_own_rows_in_manifest_order(tmp_path: Path) -> None:
    jobs = shard_jobs(ROWS, ["s1", "s3"], files_in(tmp_path), VadConfig(), manifest_version="v7", force=True)
    assert [job.speaker_id for job in jobs] == ["s1", "s3"]  # s2's row is not this run's
    s1, s3 = jobs
    assert [u.utt_id for u in s1.utterances] == ["s1-c1-0001", "s1-c1-0002"]
    assert s1.utterances[1].path == "/corpus/s1-c1-0002.flac" and s1.audio_seconds == 2.5
    assert s1.files == ShardFiles.of(tmp_path, "s1") and s1.force and s1.speed_factors == ()
    assert s1.inputs_key == S1_KEY
    assert dict(s1.meta_extra) == {
        "speaker_manifest_hash": S1_HASH,
        "manifest_version": "v7",
        "code_version": FEATURES_CODE_VERSION,
    }
    # a speaker without rows: an empty job keyed as such (its shard holds nothing)
    assert s3.utterances == () and s3.inputs_key == NO_ROWS_KEY and s3.meta_extra["speaker_manifest_hash"] == ""


def test_another_speakers_rows_leave_a_jobs_key_unchanged(tmp_path: Path) -> None:
    alone = shard_jobs([r for r in ROWS if r.speaker_id == "s1"], ["s1"], files_in(tmp_path), VadConfig())
    beside = shard_jobs([*ROWS, row("s2-c1-0009", "s2", "d" * 64)], ["s1", "s2"], files_in(tmp_path), VadConfig())
    assert alone[0].inputs_key == beside[0].inputs_key == S1_KEY


@pytest.mark.parametrize(
    "change",
    [
        lambda rows: [*rows, row("s1-c1-0003", "s1", "e" * 64)],  # a row added
        lambda rows: [row("s1-c1-0001", "s1", "f" * 64), *rows[1:]],  # a file's content changed
        lambda rows: [*rows[:2], row("s1-c1-0002", "s1", "b" * 64, "word")],  # a transcript changed
    ],
)
def test_a_change_to_a_speakers_rows_changes_its_key(tmp_path: Path, change) -> None:
    (job,) = shard_jobs(change(ROWS), ["s1"], files_in(tmp_path), VadConfig())
    assert job.inputs_key != S1_KEY


def test_speed_factors_reach_the_job_and_its_key(tmp_path: Path) -> None:
    (job,) = shard_jobs(ROWS, ["s1"], files_in(tmp_path), VadConfig(aggressiveness=3), (0.9, 1.1))
    assert job.speed_factors == (0.9, 1.1) and job.inputs_key == S1_KEY_SPEED


def test_totals_count_published_outcomes_and_say_so() -> None:
    totals = ShardTotals()
    meta = {"utterances": 3, "audio_seconds": 1800.0, "trimmed_seconds": 900.0}
    totals.add(ShardOutcome("s1", meta, rebuilt=True))
    totals.add(ShardOutcome("s2", {**meta, "utterances": 2, "audio_seconds": 5400.0}, rebuilt=False))
    assert (totals.published, totals.rebuilt, totals.utterances) == (2, 1, 5)
    assert totals.summary() == ("2 shard(s) published (1 rebuilt): 5 utterances, 2.000 h of audio, 0.500 h after VAD")
    assert (
        ShardTotals().summary() == "0 shard(s) published (0 rebuilt): 0 utterances, 0.000 h of audio, 0.000 h after VAD"
    )


def test_a_failed_outcome_is_not_counted() -> None:
    totals = ShardTotals()
    with pytest.raises(ValueError, match="shard s1 was not published: boom"):
        totals.add(ShardOutcome("s1", None, rebuilt=False, error="boom"))
    assert totals == ShardTotals()
