"""Killing a run leaves nothing running and nothing stuck (real processes, real SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from speech_assets.definitions import build_definitions
from speech_assets.defs.resources import PipelineSettings, StoragePaths
from speech_assets.runtime.locks import RunFolderBusy, RunFolderLock
from speech_assets.runtime.processes import ProcessIdentity, process_start_time
from speech_assets.runtime.waiting import wait_until
from speech_assets_tests.conftest import REPO, SAMPLE_CORPUS
from speech_assets_tests.support.local_runs import materialize_in_process

BIN = Path(sys.executable).parent
SETTINGS = """
[kmeans]
k = 8
[training]
preset = "tiny"
max_steps = 150
checkpoint_every = 20
log_every = 5
nproc = 2
"""


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and process_start_time(int(entry.name)) is not None:
                found.append(int(entry.name))
    return found


@pytest.fixture
def built(tmp_path: Path, instance: dg.DagsterInstance):
    """The inputs of pretrained_checkpoint, built in process on a real instance; env for the CLI."""
    settings_file = tmp_path / "settings.toml"
    settings_file.write_text(SETTINGS)
    paths = StoragePaths(
        corpus=str(SAMPLE_CORPUS), data_dir=str(tmp_path / "out"), mlflow_tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"
    )
    defs = build_definitions(paths, PipelineSettings.load(settings_file))
    materialize_in_process(defs, instance, "manifest")
    materialize_in_process(defs, instance, "vad_features", list(instance.get_dynamic_partitions("speakers")))
    materialize_in_process(defs, instance, "cmvn_stats")
    materialize_in_process(defs, instance, "client_partitions")
    materialize_in_process(defs, instance, "kmeans_targets", list(instance.get_dynamic_partitions("clients")))
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "SPEECH_ASSETS_DATA_DIR": paths.data_dir,
        "SPEECH_ASSETS_CORPUS": paths.corpus,
        "SPEECH_ASSETS_SETTINGS": str(settings_file),
        "MLFLOW_TRACKING_URI": paths.mlflow_tracking_uri,
    }
    started: list[subprocess.Popen] = []
    yield paths, env, started, instance
    for process in started:  # whatever happens, leave nothing behind
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    for pid in processes_mentioning(paths.data_dir):
        os.kill(pid, signal.SIGKILL)
    instance.dispose()


def materialize_training(env: dict, started: list) -> subprocess.Popen:
    process = subprocess.Popen(
        [
            str(BIN / "dagster"),
            "asset",
            "materialize",
            "-m",
            "speech_assets.definitions",
            "--select",
            "pretrained_checkpoint",
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    started.append(process)
    return process


@pytest.mark.slow
def test_kill_9_of_a_training_run_leaves_no_process_and_no_stuck_pool(built) -> None:
    paths, env, started, instance = built
    first = materialize_training(env, started)
    wait_until(
        lambda: list(paths.layout.training_dir.glob("*/checkpoints/step_*.pt")) or first.poll() is not None,
        300,
        "a checkpoint",
    )
    assert first.poll() is None, first.stdout.read()[-3000:]
    (run_dir,) = paths.layout.training_dir.iterdir()
    assert len(processes_mentioning(str(run_dir))) >= 2  # torchrun and its workers train

    os.killpg(first.pid, signal.SIGKILL)  # the CLI, its step process and the torchrun agent
    wait_until(lambda: not processes_mentioning(str(run_dir)), 30, "every training process to exit")
    first.wait(timeout=10)
    frozen = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    time.sleep(3)
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == frozen  # nobody writes any more
    assert not (run_dir / "final.pt").exists()

    # The dead run still holds the training pool's only slot ...
    assert instance.event_log_storage.get_concurrency_run_ids()
    second = materialize_training(env, started)
    output, _ = second.communicate(timeout=600)
    assert second.returncode == 0, output[-4000:]  # ... and the next materialization was not blocked by it
    assert "freed the concurrency slots of run" in output
    result = json.loads((run_dir / "result.json").read_text())
    assert result["step"] == 150 and result["resumed_from_step"] >= 20  # same folder, resumed
    assert not processes_mentioning(str(run_dir))


def test_a_second_trainer_on_a_locked_run_folder_fails_at_once_naming_the_holder(tmp_path: Path) -> None:
    from speech_assets_tests.support.training_data import write_corpus

    corpus = write_corpus(tmp_path / "data", clients={"c": 8}, speakers_per_client=1, utterances_per_speaker=4)
    config = corpus.config(tmp_path / "run")
    config_file = tmp_path / "config.json"
    config.to_json(config_file)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom speech_assets.runtime.locks import RunFolderLock\n"
            f"lock = "
            f"RunFolderLock({str(tmp_path / 'run')!r}).acquire(dagster_run_id='run-1234')\nprint('held', "
            f"flush=True)\ntime.sleep(3600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.run(
            [sys.executable, "-m", "speech_assets.train", "--config", str(config_file)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert second.returncode != 0
        assert f"pid {holder.pid}" in second.stderr and "run-1234" in second.stderr
        assert not (tmp_path / "run" / "checkpoints").exists()
        # "at once": it gave up while the holder (which never lets go) still held the folder
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the dead holder's lock: the folder can be taken again
    with RunFolderLock(tmp_path / "run").acquire():
        with pytest.raises(RunFolderBusy, match=f"pid {os.getpid()}"):
            RunFolderLock(tmp_path / "run").acquire()


def test_a_worker_whose_launcher_dies_exits_even_without_a_parent_death_signal(tmp_path: Path) -> None:
    """The watchdog alone (a grandchild, so PDEATHSIG cannot help) ends a worker within seconds."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    identity = ProcessIdentity(launcher.pid, process_start_time(launcher.pid), ProcessIdentity.current().host)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nfrom speech_assets.runtime.processes import "
            "watch_launcher\nwatch_launcher()\ntime.sleep(300)",
        ],
        env={**os.environ, "SPEECH_ASSETS_LAUNCHER": identity.encode()},
        start_new_session=True,
    )
    try:
        time.sleep(2)
        assert worker.poll() is None  # alive while its launcher lives
        launcher.kill()
        launcher.wait()
        assert worker.wait(timeout=30) == 137
    finally:
        for process in (launcher, worker):
            if process.poll() is None:
                process.kill()


def test_a_killed_test_process_takes_its_documented_command_with_it(tmp_path: Path) -> None:
    """run_group (how the end-to-end tests run scripts/materialize_all.sh): kill -9 of the process
    that called it still ends the command and everything it started, also a double-forked child."""
    pids = tmp_path / "pids"
    script = f"sleep 300 & echo $! >> {pids}; (setsid sleep 301 & echo $! >> {pids}); sleep 302"
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys; from speech_assets_tests.support.commands import run_group; "
                f"run_group(['bash', '-c', {script!r}], dict(__import__('os').environ), '.', 600)"
            ),
        ],
        cwd=REPO,
    )

    def both_started() -> bool:
        assert caller.poll() is None
        return pids.exists() and len(pids.read_text().split()) == 2

    wait_until(both_started, 120, "both children to start")
    children = [int(p) for p in pids.read_text().split()]
    caller.kill()
    caller.wait()
    wait_until(lambda: not any(_alive(pid) for pid in children), 30, "the children to die with their caller")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
