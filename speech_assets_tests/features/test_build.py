"""Publishing many speakers' shards (``iter_publish_shards``), in this process alone or with
helper processes: the same bytes as one process, a failing shard (or a killed helper) keeps the
others, and a caller that stops early leaves no process building behind."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pytest
import soundfile as sf
import torch

from speech_assets.features.build import iter_publish_shards, plan_shards, publish_planned
from speech_assets.features.jobs import ShardJob, UtteranceInput
from speech_assets.features.shards import ShardFiles
from speech_assets.features.vad import VadConfig
from speech_assets.runtime.locks import exclusive_lock
from speech_assets_tests.support.corpora import with_silence

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


def jobs(corpus, shards_dir: Path) -> list[ShardJob]:
    return [
        ShardJob(speaker, utterances, ShardFiles.of(shards_dir, speaker), inputs_key=f"key-{speaker}")
        for speaker, utterances in corpus.items()
    ]


def published_bytes(shards_dir: Path) -> dict[str, bytes]:
    return {
        path.name: path.read_bytes() for path in sorted(shards_dir.iterdir()) if path.suffix in (".parquet", ".npz")
    }


def test_jobs_are_validated(tmp_path, corpus) -> None:
    (job,) = jobs({"s00": corpus["s00"]}, tmp_path)
    with pytest.raises(ValueError, match="one job per speaker"):
        list(iter_publish_shards([job, job], VadConfig(), workers=1))
    with pytest.raises(ValueError, match="workers"):
        list(iter_publish_shards([job], VadConfig(), workers=0))
    assert list(iter_publish_shards([], VadConfig(), workers=1)) == []


def test_in_process_run_restores_torch_threads(tmp_path, corpus) -> None:
    before = torch.get_num_threads()
    (outcome,) = iter_publish_shards(jobs({"s00": corpus["s00"]}, tmp_path), VadConfig(), workers=1)
    assert outcome.error is None and outcome.meta is not None
    assert torch.get_num_threads() == before


def test_a_second_pass_builds_nothing(tmp_path, corpus) -> None:
    one = list(iter_publish_shards(jobs(corpus, tmp_path), VadConfig(), workers=1))
    assert all(outcome.error is None and outcome.rebuilt for outcome in one)
    assert [o.speaker_id for o in one] == [j.speaker_id for j in plan_shards(jobs(corpus, tmp_path), 1).ordered]
    assert len(published_bytes(tmp_path)) == 3 * len(corpus)  # shard, rejects, CMVN sums per speaker
    # published for the same inputs: a second pass builds nothing
    again = list(iter_publish_shards(jobs(corpus, tmp_path), VadConfig(), workers=1))
    assert not any(outcome.rebuilt for outcome in again)


def test_a_failing_shard_keeps_the_others(tmp_path, corpus) -> None:
    broken = ShardJob("bad", corpus["s00"] * 2, ShardFiles.of(tmp_path, "bad"), inputs_key="key-bad")  # duplicate ids
    outcomes = {o.speaker_id: o for o in iter_publish_shards([broken, *jobs(corpus, tmp_path)], VadConfig(), 1)}
    assert "duplicate utt_id" in outcomes["bad"].error and outcomes["bad"].meta is None
    assert all(outcomes[speaker].meta is not None for speaker in corpus)
    assert ShardFiles.of(tmp_path, "bad").read_meta() is None


def test_a_caller_that_stops_early_leaves_no_process_building(tmp_path, corpus) -> None:
    outcomes = iter_publish_shards(jobs(corpus, tmp_path), VadConfig(), workers=2)
    first = next(outcomes)
    outcomes.close()  # waits for the helper's shard in flight, cancels the rest
    assert not helper_processes()
    built = [speaker for speaker in corpus if ShardFiles.of(tmp_path, speaker).read_meta() is not None]
    # the first and at most a few the helper picked up meanwhile: not all 12
    assert first.speaker_id in built and len(built) <= len(corpus) // 2
    assert not list(Path(tmp_path).glob("*.tmp*"))  # nothing half-written


def test_a_single_shard_starts_no_helper(tmp_path, corpus) -> None:
    """Kills: helpers sized by ``workers`` alone, not by the shards to build (a helper for none)."""
    single = {"s00": corpus["s00"]}
    assert plan_shards(jobs(single, tmp_path), 8).helpers == 0
    (outcome,) = iter_publish_shards(jobs(single, tmp_path), VadConfig(), workers=8)
    assert outcome.error is None and outcome.rebuilt
    assert np.isfinite(outcome.meta["audio_seconds"])


def helper_processes() -> list[psutil.Process]:
    """This process's shard helpers (spawned interpreters; not multiprocessing's resource tracker)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "spawn_main" in command and "resource_tracker" not in command:
            found.append(child)
    return found


def first_job(todo: list[ShardJob]) -> ShardJob:
    return min(todo, key=lambda job: (-job.audio_seconds, job.speaker_id))  # the one this process takes first


def hold_lock_while(job: ShardJob, until, timeout_s: float = 120.0) -> tuple[threading.Thread, threading.Event, dict]:
    """Another run holding ``job``'s shard lock (a real flock) until ``until()`` is true."""
    held, seen = threading.Event(), {"met": False}

    def hold() -> None:
        with exclusive_lock(job.files.lock):
            held.set()
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and not seen["met"]:
                seen["met"] = bool(until())
                time.sleep(0.05)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10)
    return thread, held, seen


def test_helpers_build_while_this_process_is_busy_and_publish_the_same_bytes(tmp_path, corpus) -> None:
    """This process takes a shard at once (here one whose lock another run holds) while a helper
    starts and builds the others; the bytes are those of one thread."""
    list(iter_publish_shards(jobs(corpus, tmp_path / "one"), VadConfig(), workers=1))
    todo = jobs(corpus, tmp_path / "two")
    first = first_job(todo)
    others = [job for job in todo if job is not first]
    thread, _, seen = hold_lock_while(first, lambda: all(job.files.read_meta() for job in others))
    outcomes = list(iter_publish_shards(todo, VadConfig(), workers=2))
    thread.join()
    assert seen["met"], "the helper did not build the other shards while this process waited"
    assert outcomes[0].speaker_id == first.speaker_id  # built here, once the lock was free
    assert sorted(o.speaker_id for o in outcomes) == sorted(corpus)
    assert all(o.error is None and o.rebuilt for o in outcomes)
    assert published_bytes(tmp_path / "two") == published_bytes(tmp_path / "one")
    assert not helper_processes()


def test_a_killed_helper_loses_no_shard(tmp_path, corpus) -> None:
    """SIGKILL the helper while it waits for its first shard (whose lock another run holds): that
    shard comes back as an error, this process builds every other one, no helper is left, and a
    re-run rebuilds only the failed shard."""
    todo = jobs(corpus, tmp_path)
    ordered = sorted(todo, key=lambda job: (-job.audio_seconds, job.speaker_id))
    first, second = ordered[0], ordered[1]  # this process takes the first, the helper the second
    killed: list[int] = []

    def kill_the_helper_once_it_waits_for_its_shard() -> bool:
        for helper in helper_processes():
            try:
                waiting = any(Path(f.path) == second.files.lock for f in helper.open_files())
            except psutil.Error:
                continue
            if waiting:
                os.kill(helper.pid, signal.SIGKILL)
                killed.append(helper.pid)
        return bool(killed)

    with exclusive_lock(second.files.lock):  # held until the helper is dead
        thread, _, seen = hold_lock_while(first, kill_the_helper_once_it_waits_for_its_shard)
        outcomes = iter_publish_shards(todo, VadConfig(), workers=2)
        results = [next(outcomes)]  # the first shard, built here once the holder lets go
        thread.join()
    results += list(outcomes)
    assert seen["met"] and killed
    assert sorted(o.speaker_id for o in results) == sorted(corpus)  # one outcome each, none lost
    failed = [o for o in results if o.error is not None]
    assert [o.speaker_id for o in failed] == [second.speaker_id]
    assert "BrokenProcessPool" in failed[0].error
    assert all(o.meta is not None for o in results if o.error is None)
    assert not helper_processes()
    assert [job.speaker_id for job in todo if job.files.read_meta() is None] == [second.speaker_id]
    again = list(iter_publish_shards(todo, VadConfig(), workers=1))
    assert all(o.error is None for o in again)
    assert [o.speaker_id for o in again if o.rebuilt] == [second.speaker_id]


def test_helpers_are_started_only_for_shards_to_build(tmp_path, corpus) -> None:
    """Unchanged shards need no helper: a helper would start, import torch and find nothing."""
    todo = jobs(corpus, tmp_path)
    assert plan_shards(todo, 4).helpers == 3 and plan_shards(todo, 1).helpers == 0
    list(iter_publish_shards(todo, VadConfig(), workers=1))
    assert plan_shards(todo, 4).helpers == 0
    forced = [ShardJob(j.speaker_id, j.utterances, j.files, j.inputs_key, force=n < 3) for n, j in enumerate(todo)]
    assert plan_shards(forced, 4).helpers == 2 and plan_shards(forced, 2).helpers == 1
    changed = [
        ShardJob(j.speaker_id, j.utterances, j.files, "other" if n < 2 else j.inputs_key) for n, j in enumerate(todo)
    ]
    assert plan_shards(changed, 8).helpers == 1
    outcomes = list(iter_publish_shards(todo, VadConfig(), workers=4))  # nothing to build: no helper, no rebuild
    assert not any(o.rebuilt for o in outcomes) and not helper_processes()


def test_a_shard_job_is_planned_once_reading_each_meta_once(tmp_path, corpus) -> None:
    """The plan decides what to build and the helpers from one read of each meta; building
    from it reads no meta again outside the shard's lock."""
    reads: Counter[str] = Counter()

    class CountingFiles(ShardFiles):
        def read_meta(self):
            reads[self.shard.stem] += 1
            return super().read_meta()

    def counted(n_forced: int = 0) -> list[ShardJob]:
        return [
            ShardJob(
                j.speaker_id,
                j.utterances,
                CountingFiles(**dataclasses.asdict(j.files)),
                j.inputs_key,
                force=n < n_forced,
            )
            for n, j in enumerate(jobs(corpus, tmp_path))
        ]

    plan = plan_shards(counted(), workers=4)
    assert reads == {speaker: 1 for speaker in corpus}
    assert (plan.to_build, plan.helpers) == (len(corpus), 3)
    assert [j.speaker_id for j in plan.ordered] == sorted(
        corpus, key=lambda s: (-sum(u.duration_s for u in corpus[s]), s)
    )

    # automatic: a few seconds of audio is too small for a helper
    automatic = plan_shards(counted())
    assert automatic.helpers == 0
    assert automatic.describe() == f"{len(corpus)} shard(s) to build in this process, 0 unchanged"

    list(publish_planned(plan_shards(jobs(corpus, tmp_path), workers=1), VadConfig()))
    reads.clear()
    rebuilt = plan_shards(counted(n_forced=2), workers=4)
    assert (rebuilt.to_build, rebuilt.helpers) == (2, 1)
    assert reads == {speaker: 1 for speaker in sorted(corpus)[2:]}  # a forced shard's meta is not even read
    assert rebuilt.describe().endswith(f", {len(corpus) - 2} unchanged")


@pytest.mark.parametrize("workers", [0, -1])
def test_a_plan_refuses_no_process(tmp_path, corpus, workers: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_shards(jobs(corpus, tmp_path), workers=workers)
