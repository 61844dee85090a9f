"""The subreaper supervisor and process trees (runtime/supervise.py, runtime/processes.py): a
kill -9 of the launcher leaves no process, exit codes pass through, off Linux it refuses in one
line, and a missing process table is "unknown", not a crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from speech_assets.runtime.processes import alive, descendants
from speech_assets.runtime.waiting import wait_until
from speech_assets_tests.conftest import REPO

LAUNCHER = """
import os, sys, time
from pathlib import Path
from speech_assets.federated.processes import spawn
# a "daemon" that starts a helper in a session of its own and then idles, like flower-superlink
daemon = ["bash", "-c", "setsid sleep 301 & echo $! > {pidfile}; exec sleep 302"]
spawn(daemon, Path("{log}"), dict(os.environ), supervised=True)
print("started", flush=True)
time.sleep(600)
"""


def _pids_of(marker: str) -> list[int]:
    return [
        p.pid for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or []) and alive(p.pid)
    ]


def test_kill_9_of_the_launcher_leaves_no_process(tmp_path: Path) -> None:
    """The supervisor is told by the kernel when its parent dies and takes down the daemon and
    the helper the daemon started in another session (which a process group would miss)."""
    pidfile = tmp_path / "helper.pid"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER.format(pidfile=pidfile, log=tmp_path / "daemon.log")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert launcher.stdout is not None and launcher.stdout.readline().strip() == "started"
        wait_until(lambda: pidfile.is_file() and pidfile.read_text().strip(), 30, "the daemon to start its helper")
        helper = int(pidfile.read_text())
        tree = descendants([launcher.pid])
        assert helper in _pids_of("sleep 301") and len(tree) >= 2  # supervisor + daemon (+ helper elsewhere)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        wait_until(
            lambda: not (_pids_of("sleep 301") + _pids_of("sleep 302") + [p for p in tree if alive(p)]),
            30,
            "the whole tree to die",
        )
    finally:
        for pid in _pids_of("sleep 301") + _pids_of("sleep 302"):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


def test_supervisor_reports_the_command_exit_code_and_reaps_what_it_left(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "speech_assets.runtime.supervise",
        "--grace",
        "1",
        "--",
        "bash",
        "-c",
        "setsid sleep 303 & exit 7",
    ]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert done.returncode == 7
    assert _pids_of("sleep 303") == []


def test_off_linux_the_supervisor_refuses_without_running_its_command(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code = (
        f"import sys; sys.platform = 'darwin'; from speech_assets.runtime import supervise; "
        f"sys.exit(supervise.main(['--', 'touch', {str(marker)!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2 and "needs Linux" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_process_trees_are_walked_through_psutil_and_survive_a_missing_process_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    try:
        found = wait_until(
            lambda: tree if len(tree := descendants([parent.pid])) >= 2 else None, 10, "both children", interval=0.05
        )
        assert all(alive(pid) for pid in found)
        monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path / "absent"))
        assert descendants([parent.pid]) == set()  # unknown, not a crash
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
