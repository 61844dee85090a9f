"""Checkpoints written by the background writer: the same bytes as a synchronous write, a snapshot
taken before training goes on, exact resume, a cadence in minutes, and no trusted half file when
the process dies mid-write."""

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from speech_assets.runtime.faults import FAULTS_ENV, fault
from speech_assets.train import checkpoint
from speech_assets.train.checkpoint import CheckpointWriter, latest_checkpoint, list_checkpoints, load_checkpoint
from speech_assets.train.engine import Distributed
from speech_assets.train.trainer import Trainer, train
from speech_assets_tests.support.training_data import SyntheticCorpus

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {"max_steps": 6, "checkpoint_every": 2, "log_every": 2, "keep_checkpoints": 5, "max_frames": 200}


def test_async_checkpoint_snapshot_is_taken_before_the_step_goes_on(tmp_path: Path) -> None:
    weights = torch.arange(1000, dtype=torch.float32)
    writer = CheckpointWriter()
    writer.submit(tmp_path / "a.pt", {"model": {"w": weights}, "weights_sha256": None})
    weights.add_(1.0)  # the next optimizer step, while the writer may still be hashing and writing
    writer.wait()
    saved = load_checkpoint(tmp_path / "a.pt")
    assert torch.equal(saved["model"]["w"], torch.arange(1000, dtype=torch.float32))
    assert saved["weights_sha256"] and len(saved["weights_sha256"]) == 64


def test_async_checkpoint_write_errors_reach_the_training_thread(tmp_path: Path) -> None:
    (tmp_path / "blocked").write_text("a file where the checkpoint folder should be")
    writer = CheckpointWriter()
    writer.submit(tmp_path / "blocked" / "x.pt", {"model": {}, "weights_sha256": None})
    try:
        writer.wait()
    except RuntimeError as error:
        assert "writing a checkpoint failed" in str(error)
    else:
        raise AssertionError("a failed background write went unnoticed")


def test_async_checkpoint_bytes_and_hash_equal_a_synchronous_one(
    small_corpus: SyntheticCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = small_corpus.config(tmp_path / "run", **SETTINGS)
    (tmp_path / "run").mkdir()
    job = Distributed(0, 0, 1, 1, torch.device("cpu"))
    trainer = Trainer(config, job)
    monkeypatch.setenv(FAULTS_ENV, fault("train.step", "preempt", step=3))  # preempted there
    assert trainer.run() is None
    monkeypatch.delenv(FAULTS_ENV)
    engine, name = trainer.engine, "checkpoints/step_00000003.pt"
    live = [p.detach().clone() for p in trainer.model.parameters()]
    # as the run's preempted step 3: its held-out evaluation is owed (scored on resume)
    engine.save_checkpoint(tmp_path / "background", trainer.stream, keep=5, owed=True)
    with torch.no_grad():  # the next steps change the weights while the writer works
        for p in trainer.model.parameters():
            p.add_(1.0)
    engine.checkpoints.wait()
    with torch.no_grad():
        for p, saved in zip(trainer.model.parameters(), live, strict=True):
            p.copy_(saved)
    engine.checkpoints = CheckpointWriter(background=False)
    engine.save_checkpoint(tmp_path / "synchronous", trainer.stream, keep=5, owed=True)
    written, expected = (tmp_path / "background" / name).read_bytes(), (tmp_path / "synchronous" / name).read_bytes()
    assert written == expected
    # and the same as the run's own checkpoint of step 3, written in the background during the run
    assert (tmp_path / "run" / name).read_bytes() == expected
    hashes = {load_checkpoint(tmp_path / run / name)["weights_sha256"] for run in ("background", "synchronous", "run")}
    assert len(hashes) == 1 and hashes != {None}


def test_async_checkpoint_resume_is_bit_exact(
    small_corpus: SyntheticCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synchronous = train(small_corpus.config(tmp_path / "sync", background_checkpoints=False, **SETTINGS))
    interrupted = small_corpus.config(tmp_path / "async", background_checkpoints=True, **SETTINGS)
    monkeypatch.setenv(FAULTS_ENV, fault("train.step", "preempt", step=4))  # preempted there
    assert train(interrupted) is None
    monkeypatch.delenv(FAULTS_ENV)
    for step in (2, 4):
        name = f"checkpoints/step_{step:08d}.pt"
        a, b = (load_checkpoint(tmp_path / run / name) for run in ("sync", "async"))
        assert a["weights_sha256"] == b["weights_sha256"] and a["optimizer"].keys() == b["optimizer"].keys()
    resumed = train(interrupted)
    assert synchronous is not None and resumed is not None and resumed["resumed_from_step"] == 4
    assert resumed["checkpoint_sha256"] == synchronous["checkpoint_sha256"]
    a, b = (load_checkpoint(tmp_path / run / "final.pt")["model"] for run in ("sync", "async"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_async_checkpoint_cadence_in_minutes(small_corpus: SyntheticCorpus, tmp_path: Path) -> None:
    # checkpoint_every beyond the run: only the clock (checked at log steps) and the end checkpoint
    config = small_corpus.config(
        tmp_path / "run", max_steps=4, checkpoint_every=100, log_every=1, keep_checkpoints=10, checkpoint_minutes=1e-9
    )
    train(config)
    assert [step for step, _ in list_checkpoints(tmp_path / "run")] == [1, 2, 3, 4]
    untimed = small_corpus.config(tmp_path / "untimed", max_steps=4, checkpoint_every=100, log_every=1)
    train(untimed)
    assert [step for step, _ in list_checkpoints(tmp_path / "untimed")] == [4]


def test_async_checkpoint_kill_during_the_background_write_leaves_no_trusted_file(
    small_corpus: SyntheticCorpus, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    config_path = tmp_path / "config.json"
    small_corpus.config(run_dir, **SETTINGS).to_json(config_path)
    marker = tmp_path / "holding"
    env = os.environ | {
        "PYTHONPATH": str(REPO),
        # the writer has written step 4's temp file in full and holds before the rename
        FAULTS_ENV: fault("checkpoint.write", "hold", name="step_00000004.pt", marker=marker),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "speech_assets.train", "--config", str(config_path)],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert process.poll() is None, process.stderr.read().decode()[-3000:] if process.stderr else ""
            assert time.monotonic() < deadline, "the write never reached the fault point"
            time.sleep(0.2)
        assert int(marker.read_text()) == process.pid
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr:
            process.stderr.close()
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert any(name.endswith(".tmp") and "step_00000004" in name for name in leftovers), leftovers
    assert [step for step, _ in list_checkpoints(run_dir)] == [2]
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step_00000002.pt"
    assert load_checkpoint(latest_checkpoint(run_dir))["step"] == 2
    # a new attempt continues from step 2 and ends where an uninterrupted run ends
    resumed = train(small_corpus.config(run_dir, **SETTINGS))
    straight = train(small_corpus.config(tmp_path / "straight", **SETTINGS))
    assert resumed is not None and straight is not None and resumed["resumed_from_step"] == 2
    assert resumed["checkpoint_sha256"] == straight["checkpoint_sha256"]
    # the killed write's temp file went with the next attempt's first prune
    assert not [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]


# how long a blocked write waits for the training thread before giving up (a writer the caller
# joins never sees it move: the test then fails after this long instead of hanging)
BLOCK_SECONDS = 5.0


def _blocking_write(monkeypatch: pytest.MonkeyPatch, released: Callable[[], bool]):  # type: ignore[no-untyped-def]
    """Make the writer's ``finish_and_write`` hold until ``released()`` (polled) or BLOCK_SECONDS
    pass; returns a list that gets ``(path name, whether released, seconds held)`` per write."""
    writes: list[tuple[str, bool, float]] = []
    real = checkpoint.finish_and_write

    def blocked(path: Path, state: dict) -> Path:  # type: ignore[type-arg]
        start = time.monotonic()
        while not (freed := released()) and time.monotonic() - start < BLOCK_SECONDS:
            time.sleep(0.01)
        writes.append((path.name, freed, time.monotonic() - start))
        return real(path, state)

    monkeypatch.setattr(checkpoint, "finish_and_write", blocked)
    return writes


def test_async_checkpoint_submit_returns_while_the_write_is_blocked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kills the mutation "join the writer's thread right after starting it" (every other async
    test passes with it): with the write held until the caller says so, ``submit`` returns while
    the write is still in flight, and the write completes only once released."""
    go = threading.Event()
    writes = _blocking_write(monkeypatch, go.is_set)
    writer = CheckpointWriter()
    writer.submit(tmp_path / "a.pt", {"model": {"w": torch.ones(10)}, "weights_sha256": None})
    in_flight = not (tmp_path / "a.pt").exists() and not writes
    go.set()
    writer.wait()
    assert in_flight, "submit returned only after the write finished"
    assert writes and writes[0][1], f"the write was never released while the caller went on: {writes}"
    assert load_checkpoint(tmp_path / "a.pt")["weights_sha256"]


def test_async_checkpoint_training_steps_go_on_while_a_write_is_blocked(
    small_corpus: SyntheticCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kills the mutation "join the writer's thread right after starting it" in the real engine:
    step 2's checkpoint write is held until the trainer has finished step 3, so the run only
    completes promptly if steps go on while the write is in flight."""
    config = small_corpus.config(
        tmp_path / "run", max_steps=4, checkpoint_every=2, log_every=2, keep_checkpoints=5, max_frames=200
    )
    (tmp_path / "run").mkdir()
    job = Distributed(0, 0, 1, 1, torch.device("cpu"))
    trainer = Trainer(config, job)
    assert trainer.engine.checkpoints.background
    writes = _blocking_write(monkeypatch, lambda: trainer.engine.step >= 3)
    assert trainer.run() is not None
    names = [name for name, _, _ in writes]
    assert names[:1] == ["step_00000002.pt"], names
    assert writes[0][1], f"step 3 never ran while step 2's checkpoint was being written ({writes[0][2]:.1f} s held)"
    assert [step for step, _ in list_checkpoints(tmp_path / "run")] == [2, 4]
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000002.pt")["step"] == 2
