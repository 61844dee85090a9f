"""Publishing many speakers' shards in this process over threads (``iter_publish_shards``): the
same bytes as one thread, a failing shard keeps the others, and a caller that stops early leaves
no thread building behind."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from speech_assets.features.build import ShardJob, UtteranceInput, iter_publish_shards
from speech_assets.features.shards import ShardFiles
from speech_assets.features.vad import VadConfig
from speech_assets.testing.corpora import with_silence

SR = 16_000


def speaker_utterances(folder: Path, speaker: str, count: int, seed: int) -> tuple[UtteranceInput, ...]:
    folder.mkdir(parents=True, exist_ok=True)
    utterances = []
    for index in range(count):
        wave = with_silence(0.3, 1.0 + 0.2 * index, 0.3, seed=seed + index)
        path = folder / f"{speaker}-c-{index:04d}.flac"
        sf.write(path, wave, SR, subtype="PCM_16", format="FLAC")
        utterances.append(UtteranceInput(path.stem, speaker, "c", str(path), wave.shape[0] / SR))
    return tuple(utterances)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, tuple[UtteranceInput, ...]]:
    audio = tmp_path_factory.mktemp("audio")
    return {f"s{n:02d}": speaker_utterances(audio / f"s{n}", f"s{n:02d}", 2 + n % 2, seed=10 * n) for n in range(12)}


def shard_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith("shards")]


def jobs(corpus, shards_dir: Path) -> list[ShardJob]:
    return [
        ShardJob(speaker, utterances, ShardFiles.of(shards_dir, speaker), inputs_key=f"key-{speaker}")
        for speaker, utterances in corpus.items()
    ]


def published_bytes(shards_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(shards_dir.iterdir()) if path.suffix in (".parquet", ".npz")}


def test_threads_publish_the_bytes_one_thread_publishes(tmp_path, corpus) -> None:
    one = list(iter_publish_shards(jobs(corpus, tmp_path / "one"), VadConfig(), workers=1, threads=1))
    two, seen = [], set()
    for outcome in iter_publish_shards(jobs(corpus, tmp_path / "two"), VadConfig(), workers=1, threads=2):
        two.append(outcome)
        seen.update(shard_threads())
    assert len(seen) == 2  # the jobs really ran on two threads
    assert not shard_threads()  # and they are gone
    assert all(outcome.error is None and outcome.rebuilt for outcome in one + two)
    assert sorted(o.speaker_id for o in two) == sorted(corpus)
    expected = published_bytes(tmp_path / "one")
    assert len(expected) == 3 * len(corpus)  # shard, rejects, CMVN sums per speaker
    assert published_bytes(tmp_path / "two") == expected
    # published for the same inputs: a second pass builds nothing
    again = list(iter_publish_shards(jobs(corpus, tmp_path / "two"), VadConfig(), workers=1, threads=2))
    assert not any(outcome.rebuilt for outcome in again)


def test_a_failing_shard_in_a_thread_keeps_the_others(tmp_path, corpus) -> None:
    broken = ShardJob("bad", corpus["s00"] * 2, ShardFiles.of(tmp_path, "bad"), inputs_key="key-bad")  # duplicate ids
    outcomes = {o.speaker_id: o for o in iter_publish_shards([broken, *jobs(corpus, tmp_path)], VadConfig(), 1, threads=2)}
    assert "duplicate utt_id" in outcomes["bad"].error and outcomes["bad"].meta is None
    assert all(outcomes[speaker].meta is not None for speaker in corpus)
    assert ShardFiles.of(tmp_path, "bad").read_meta() is None


def test_a_caller_that_stops_early_leaves_no_thread_building(tmp_path, corpus) -> None:
    outcomes = iter_publish_shards(jobs(corpus, tmp_path), VadConfig(), workers=1, threads=2)
    first = next(outcomes)
    outcomes.close()  # waits for the shards in flight, cancels the rest
    assert not shard_threads()
    built = [speaker for speaker in corpus if ShardFiles.of(tmp_path, speaker).read_meta() is not None]
    # the first, the one beside it and at most a few the threads picked up meanwhile: not all 12
    assert first.speaker_id in built and len(built) <= len(corpus) // 2
    assert not list(Path(tmp_path).glob("*.tmp*"))  # nothing half-written


def test_thread_count_is_checked(tmp_path, corpus) -> None:
    with pytest.raises(ValueError, match="threads"):
        list(iter_publish_shards(jobs(corpus, tmp_path), VadConfig(), workers=1, threads=0))


def test_one_thread_per_shard_at_most(tmp_path, corpus) -> None:
    """More threads than shards is fine (and a single shard never starts a pool)."""
    single = {"s00": corpus["s00"]}
    (outcome,) = iter_publish_shards(jobs(single, tmp_path), VadConfig(), workers=1, threads=8)
    assert outcome.error is None and outcome.rebuilt
    assert np.isfinite(outcome.meta["audio_seconds"])
