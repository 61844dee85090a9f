import sys
from pathlib import Path

import pytest

from speech_assets.train import TrainConfig
from speech_assets.train import launch as launch_module
from speech_assets.train.launch import (
    OOM_EXIT_CODE,
    build_torchrun_command,
    clear_oom,
    detect_oom,
    launch,
    next_attempt_after_oom,
    read_oom_marker,
    write_oom_marker,
)
from speech_assets.testing.training_data import SyntheticCorpus


def test_single_node_command() -> None:
    command = build_torchrun_command("/r/config.json", nproc=4, max_restarts=2)
    assert command == [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts", "2",
        "--standalone", "-m", "speech_assets.train", "--config", "/r/config.json",
    ]  # fmt: skip


def test_multi_node_command() -> None:
    command = build_torchrun_command("c.json", 8, 1, nnodes="2", rdzv_endpoint="head:29400", python="py")
    assert command[:3] == ["py", "-m", "torch.distributed.run"]
    assert "--standalone" not in command
    joined = " ".join(command)
    assert "--nnodes 2 --rdzv-backend c10d --rdzv-endpoint head:29400" in joined
    assert joined.endswith("-m speech_assets.train --config c.json")


def test_oom_policy_and_marker(tmp_path: Path) -> None:
    assert next_attempt_after_oom(64.0, 2) == (32.0, 4)
    assert not detect_oom(tmp_path)
    write_oom_marker(tmp_path, rank=1, batch_seconds=64.0, grad_accum=2, error="CUDA out of memory")
    assert detect_oom(tmp_path)
    assert read_oom_marker(tmp_path) == {
        "rank": 1,
        "batch_seconds": 64.0,
        "grad_accum": 2,
        "error": "CUDA out of memory",
    }
    clear_oom(tmp_path)
    assert not detect_oom(tmp_path) and read_oom_marker(tmp_path) is None


def test_launch_retries_out_of_memory_with_half_the_batch(
    small_corpus: SyntheticCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = small_corpus.config(tmp_path / "run", batch_seconds=16.0, grad_accum=1, nproc=2)
    attempts: list[tuple[list[str], TrainConfig]] = []

    def fake_call(command: list[str], env: dict[str, str]) -> int:
        assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        attempt = TrainConfig.from_json(command[-1])
        attempts.append((command, attempt))
        if len(attempts) < 3:  # the first two attempts run out of memory
            write_oom_marker(attempt.run_dir, 0, float(attempt.batch_seconds or 0), int(attempt.grad_accum), "OOM")
            return OOM_EXIT_CODE
        return 0

    monkeypatch.setattr(launch_module.subprocess, "call", fake_call)
    assert launch(config) == 0
    assert [(a.batch_seconds, a.grad_accum) for _, a in attempts] == [(16.0, 1), (8.0, 2), (4.0, 4)]
    assert all("torch.distributed.run" in command and "--nproc-per-node" in command for command, _ in attempts)
    assert not detect_oom(config.run_dir)


def test_launch_gives_up_after_three_retries_and_on_other_failures(
    small_corpus: SyntheticCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = small_corpus.config(tmp_path / "run", nproc=1)
    calls: list[list[str]] = []

    def always_oom(command: list[str], env: dict[str, str]) -> int:
        calls.append(command)
        write_oom_marker(config.run_dir, 0, 1.0, 1, "OOM")
        return OOM_EXIT_CODE

    monkeypatch.setattr(launch_module.subprocess, "call", always_oom)
    assert launch(config) == OOM_EXIT_CODE
    # one process (no torchrun), started through the orphan guard
    assert len(calls) == 4 and calls[0][calls[0].index("--") + 2 : calls[0].index("--") + 4] == ["-m", "speech_assets.train"]
    monkeypatch.setattr(launch_module.subprocess, "call", lambda command, env: calls.append(command) or 1)
    calls.clear()
    assert launch(config) == 1 and len(calls) == 1
