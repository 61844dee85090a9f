import ast
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from speech_assets.layout import RunFiles
from speech_assets.runtime.waiting import wait_until
from speech_assets.train import TrainConfig
from speech_assets.train import launch as launch_module
from speech_assets.train import trainer as trainer_module
from speech_assets.train.autoconfig import DatasetProfile, LaunchPlan, available_cores
from speech_assets.train.engine import Distributed
from speech_assets.train.launch import build_torchrun_command, launch, other_node_commands, start_node
from speech_assets.train.oom import (
    OOM_EXIT_CODE,
    clear_oom,
    detect_oom,
    exit_on_oom,
    next_attempt_after_oom,
    read_oom_marker,
    refuse_known_oom,
    write_oom_marker,
)
from speech_assets.train.trainer import Trainer
from speech_assets_tests.conftest import REPO
from speech_assets_tests.support.training_data import SyntheticCorpus


def test_single_node_command() -> None:
    command = build_torchrun_command("/r/config.json", nproc=4, max_restarts=2)
    assert command == [
        sys.executable,
        "-m",
        "speech_assets.train.local_torchrun",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "2",
        "--nnodes",
        "1",
        "--rdzv-backend",
        "loopback",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "-m",
        "speech_assets.train",
        "--config",
        "/r/config.json",
    ]


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


def test_a_worker_out_of_memory_with_a_known_batch_exits_for_a_retry(tmp_path: Path) -> None:
    """Before the batch is known the error stands; after, the marker is written and the exit code
    is the one the launcher retries on."""
    job = Distributed(1, 1, 2, 2, torch.device("cpu"))
    with pytest.raises(torch.cuda.OutOfMemoryError), exit_on_oom(tmp_path, job):
        raise torch.cuda.OutOfMemoryError("early")
    assert not detect_oom(tmp_path)
    job.batch = (8.0, 3)
    with pytest.raises(SystemExit) as exited, exit_on_oom(tmp_path, job):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    assert exited.value.code == OOM_EXIT_CODE
    assert read_oom_marker(tmp_path) == {
        "rank": 1,
        "batch_seconds": 8.0,
        "grad_accum": 3,
        "error": "CUDA out of memory",
    }
    refuse_known_oom(tmp_path, 4.0)  # the retry's halved batch goes on; the same batch again is refused
    with pytest.raises(SystemExit) as exited:
        refuse_known_oom(tmp_path, 8.0)
    assert exited.value.code == OOM_EXIT_CODE


def test_the_out_of_memory_protocol_and_a_workers_life_each_live_in_one_module() -> None:
    """The marker's name is spelled in the layout alone and its protocol is train/oom.py's (workers
    and launchers import it); the engine is the loop: logging, locks, the launcher watch and Pipes
    are train/worker.py's."""
    package = REPO / "speech_assets"
    trees = {path.relative_to(package).as_posix(): ast.parse(path.read_text()) for path in package.rglob("*.py")}
    spelled = sorted(
        name
        for name, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value == RunFiles.oom.name
    )
    assert spelled == ["layout.py"]
    engine = list(ast.walk(trees["train/engine.py"]))
    imported = {node.module for node in engine if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in engine if isinstance(node, ast.Import) for alias in node.names}
    worker_life = {
        "speech_assets.runtime.locks",
        "speech_assets.runtime.processes",
        "speech_assets.train.launch",
        "speech_assets.train.oom",
        "dagster_pipes",
    }
    assert not imported & worker_life


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
    assert all(
        "speech_assets.train.local_torchrun" in command and "--nproc-per-node" in command for command, _ in attempts
    )
    assert not detect_oom(config.run_dir)


def test_the_launcher_plans_once_and_its_workers_take_the_plan(
    small_corpus: SyntheticCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One profiling of the shards per launch: both ranks of every attempt (the retry after an
    out-of-memory error too, with its halved batch) take the plan the launcher wrote."""
    config = small_corpus.config(tmp_path / "run", batch_seconds=None, grad_accum="auto", nproc=2)
    profiled: list[list[str]] = []
    profile = launch_module.profile_dataset

    def counted(shards: list[str]) -> DatasetProfile:
        profiled.append(shards)
        return profile(shards)

    for module in (launch_module, trainer_module):  # raising=False: a worker that profiled the shards is counted too
        monkeypatch.setattr(module, "profile_dataset", counted, raising=False)
    plans: list[LaunchPlan] = []

    def ranks(command: list[str], env: dict[str, str]) -> int:
        attempt = TrainConfig.from_json(command[-1])
        for rank in range(2):
            plans.append(Trainer(attempt, Distributed(rank, rank, 2, 2, torch.device("cpu"))).launch)
        if len(plans) == 2:
            write_oom_marker(attempt.run_dir, 0, float(attempt.batch_seconds or 0), int(attempt.grad_accum), "OOM")
            return OOM_EXIT_CODE
        return 0

    monkeypatch.setattr(launch_module.subprocess, "call", ranks)
    threads = torch.get_num_threads()
    try:
        assert launch(config) == 0
    finally:
        torch.set_num_threads(threads)
    assert len(profiled) == 1
    first, retry = plans[0], plans[2]
    assert plans[1] == first and plans[3] == retry and first.nproc == 2
    assert (retry.batch_seconds, retry.grad_accum) == (first.batch_seconds / 2, first.grad_accum * 2)
    assert retry.reason.startswith(first.reason + "; after CUDA out of memory: batch ")


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
    assert len(calls) == 4 and calls[0][calls[0].index("--") + 2 : calls[0].index("--") + 4] == [
        "-m",
        "speech_assets.train",
    ]
    monkeypatch.setattr(launch_module.subprocess, "call", lambda command, env: calls.append(command) or 1)
    calls.clear()
    assert launch(config) == 1 and len(calls) == 1


def _recorder(record: Path, value: str) -> Callable[[int], list[str]]:
    """A stand-in for a node's torchrun command: writes its arguments to ``record``."""
    script = "import json, sys; json.dump(sys.argv[1:], open(sys.argv[1], 'w'))"
    return lambda rank: [sys.executable, "-c", script, str(record), value, str(rank)]


@pytest.mark.parametrize(
    "template", ["{{command}}", "sh -c 'cd {folder} && {{command}}'", "env NODE={{node_rank}} {{command}}"]
)
def test_node_commands_run_without_a_shell_and_quote_every_value(template: str, tmp_path: Path) -> None:
    """No value reaches a shell unquoted: not locally (no shell at all), not in the command line a
    remote shell runs (a local `sh -c` stands in for ssh's)."""
    pwned, record = tmp_path / "pwned", tmp_path / "argv.json"
    value = f"x$(touch {pwned}); touch {pwned} #'\""
    (command,) = other_node_commands(
        _recorder(record, value), 2, template.format(folder=tmp_path), [], python=sys.executable
    )
    with open(tmp_path / "node.log", "wb") as log:
        process = start_node(command, log)
        assert process.wait(timeout=120) == 0, (tmp_path / "node.log").read_text()
    assert json.loads(record.read_text()) == [str(record), value, "1"]
    assert not pwned.exists()


def test_hosts_and_endpoints_are_checked() -> None:
    def torchrun(rank: int) -> list[str]:
        return build_torchrun_command("c.json", 1, 0, nnodes="2", rdzv_endpoint="head:29400", node_rank=rank)

    for host in ("-oProxyCommand=touch x", "a b", "x$(id)", "", "h;id"):
        with pytest.raises(ValueError, match="not a host name or IP address"):
            other_node_commands(torchrun, 2, "ssh {host} {command}", [host])
    (command,) = other_node_commands(torchrun, 2, "ssh {host} 'cd /srv && {command}'", ["node-1.example.com"])
    assert command[:2] == ["ssh", "node-1.example.com"] and "--master-addr head --master-port 29400" in command[2]
    for endpoint in ("x$(id):1", "head", "head:0", "head:port", "[::1]:", "a b:1"):
        with pytest.raises(ValueError, match="not host:port"):
            build_torchrun_command("c.json", 1, 0, nnodes="2", rdzv_endpoint=endpoint, node_rank=0)
    command = build_torchrun_command("c.json", 1, 0, nnodes="2", rdzv_endpoint="[::1]:29400", node_rank=0)
    assert command[command.index("--master-addr") + 1 : command.index("--master-port") + 2] == [
        "::1",
        "--master-port",
        "29400",
    ]


LAUNCHER = """
import sys, time
from speech_assets.train.launch import other_node_commands, start_node
fake_ssh, pid_file = sys.argv[1], sys.argv[2]
node = [sys.executable, "-c", f"import os, time; open({pid_file!r}, 'w').write(str(os.getpid())); time.sleep(600)"]
(command,) = other_node_commands(lambda rank: node, 2, fake_ssh + " {host} 'cd / && {command}'", ["node-1"])
process = start_node(command, open(pid_file + ".log", "ab"))  # its pipe lives as long as this process
time.sleep(600)
"""

# ssh as far as the processes it leaves are concerned: the remote command line runs in a shell in
# a session of its own (the kernel's parent-death signal cannot reach it), with ssh's input
FAKE_SSH = """#!{python}
import subprocess, sys
sys.exit(subprocess.call(["sh", "-c", sys.argv[2]], start_new_session=True))
"""


def test_a_killed_launcher_stops_its_other_nodes_wherever_they_run(tmp_path: Path) -> None:
    fake_ssh, pid_file = tmp_path / "ssh", tmp_path / "node.pid"
    fake_ssh.write_text(FAKE_SSH.format(python=sys.executable))
    fake_ssh.chmod(0o755)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(fake_ssh), str(pid_file)], cwd=REPO)
    try:
        wait_until(lambda: pid_file.is_file() and pid_file.read_text(), 120, "the remote node to start")
        node = psutil.Process(int(pid_file.read_text()))
        assert node.is_running() and os.getsid(node.pid) != os.getsid(launcher.pid)
    finally:
        launcher.kill()
        launcher.wait()
    node.wait(timeout=60)  # psutil.TimeoutExpired if the node outlived its launcher
    assert "standard input closed" in Path(str(pid_file) + ".log").read_text()


@pytest.mark.parametrize(("threads", "local_ranks"), [(None, 1), (None, 2), (1, 1)])
def test_a_cpu_rank_takes_its_share_of_the_cores_unless_the_config_sets_threads(
    small_corpus: SyntheticCorpus, tmp_path: Path, threads: int | None, local_ranks: int
) -> None:
    """On CPU with no `threads`, each of a node's ranks gets its share of the cores (the plan's
    count is for a GPU host); a configured count wins."""
    config = small_corpus.config(tmp_path / "run", threads=threads)
    expected = threads or max(1, available_cores() // local_ranks)
    before = torch.get_num_threads()
    try:
        trainer = Trainer(config, Distributed(0, 0, local_ranks, local_ranks, torch.device("cpu")))
        assert trainer.launch.threads_per_process == expected == torch.get_num_threads()
        assert trainer.launch.nproc == local_ranks
    finally:
        torch.set_num_threads(before)
