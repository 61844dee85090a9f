"""The process-lifetime code off the beaten path: a container without a readable /proc (the
launcher watchdog must not end a worker whose launcher lives), and an OS without a parent-death
signal (macOS: no prctl in its libc). Real processes; /proc hidden by a mount namespace where
the machine allows one, or by pointing psutil at an absent process table."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from speech_assets.runtime import processes
from speech_assets.runtime.processes import ProcessIdentity, command_lines, die_with_parent, process_start_time
from speech_assets.runtime.waiting import wait_until
from speech_assets_tests.conftest import REPO

WORKER = (
    "import time\nfrom speech_assets.runtime.processes import watch_launcher\nassert watch_launcher()\ntime.sleep(300)"
)
# psutil's own knob for where the process table lives: an absent folder reads like no /proc
NO_PROCFS = "import psutil\npsutil.PROCFS_PATH = {path!r}\n"


def can_hide_proc() -> bool:
    try:
        probe = subprocess.run(
            ["unshare", "-rm", "sh", "-c", "mount -t tmpfs none /proc && test ! -e /proc/self"],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def start_launcher() -> tuple[subprocess.Popen, ProcessIdentity]:
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    return launcher, ProcessIdentity(launcher.pid, process_start_time(launcher.pid), socket.gethostname())


def survives_its_launcher_then_follows_it(worker: subprocess.Popen, launcher: subprocess.Popen) -> None:
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            worker.wait(timeout=5)  # five watchdog polls with the launcher alive: the worker lives on
        launcher.kill()
        launcher.wait()  # reaped: its pid is free, which needs no process table to see
        assert worker.wait(timeout=30) == 137
    finally:
        for process in (launcher, worker):
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.skipif(not can_hide_proc(), reason="no unprivileged mount namespace here to hide /proc in")
def test_a_worker_in_a_container_without_proc_outlives_no_live_launcher() -> None:
    launcher, identity = start_launcher()
    worker = subprocess.Popen(
        ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs none /proc && exec "$0" -c "$1"', sys.executable, WORKER],
        env={**os.environ, processes.LAUNCHER_ENV: identity.encode()},
        cwd=REPO,
    )
    survives_its_launcher_then_follows_it(worker, launcher)


def test_a_worker_that_cannot_read_the_process_table_keeps_running_while_its_launcher_does(tmp_path: Path) -> None:
    launcher, identity = start_launcher()
    worker = subprocess.Popen(
        [sys.executable, "-c", NO_PROCFS.format(path=str(tmp_path / "absent")) + WORKER],
        env={**os.environ, processes.LAUNCHER_ENV: identity.encode()},
        cwd=REPO,
    )
    survives_its_launcher_then_follows_it(worker, launcher)


def test_identity_tells_gone_only_when_it_can(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = socket.gethostname()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        start = process_start_time(child.pid)
        assert start is not None and ProcessIdentity(child.pid, start, host).alive()
        assert ProcessIdentity(child.pid, start + 1, host).gone()  # same pid, another process: reused
        assert ProcessIdentity(child.pid, start, "another-host").alive()  # cannot be told from here
        assert ProcessIdentity(child.pid, 0, host).alive()  # start unknown when recorded: the pid decides
        monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path / "absent"))
        assert ProcessIdentity(child.pid, start + 1, host).alive()  # no process table: no verdict
        assert process_start_time(child.pid) is None
        monkeypatch.undo()
        child.kill()
        wait_until(
            lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 30, "the child to exit, not yet reaped"
        )
        assert ProcessIdentity(child.pid, start, host).gone()
    finally:
        child.kill()
        child.wait()
    assert ProcessIdentity(child.pid, start, host).gone()


def test_processes_are_listed_through_psutil_and_not_at_all_without_a_process_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = f"marker-{os.getpid()}-{time.monotonic_ns()}"
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(300)", marker])
    try:
        assert (child.pid, [sys.executable, "-c", "import sys, time; time.sleep(300)", marker]) in list(command_lines())
        monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path / "absent"))
        assert list(command_lines()) == []  # a warning, not FileNotFoundError in a monitor thread
    finally:
        child.kill()
        child.wait()


class MacLibc:
    """What ``ctypes.CDLL(None)`` gives on macOS: a libc without ``prctl``."""

    def __init__(self, *_args: object, **_kwargs: object) -> None:
        pass

    def __getattr__(self, name: str) -> object:
        raise AttributeError(f"dlsym(RTLD_DEFAULT, {name}): symbol not found")


def test_without_linux_there_is_no_parent_death_signal_and_nothing_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(ctypes, "CDLL", MacLibc)
    assert die_with_parent() is False
    me = ProcessIdentity.current()
    assert me.start_time and me.alive() and not ProcessIdentity(me.pid, me.start_time + 1, me.host).alive()


def test_the_orphan_guard_runs_its_command_on_an_os_without_prctl() -> None:
    code = (
        "import ctypes, sys\n"
        "from speech_assets_tests.runtime.test_where_it_runs import MacLibc\n"
        "ctypes.CDLL = MacLibc\n"
        "sys.platform = 'darwin'\n"
        "from speech_assets.runtime.orphan_guard import main\n"
        "main(['--', sys.executable, '-c', 'print(\"ran\")'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ran"


def test_a_pool_worker_ends_without_tearing_its_interpreter_down(tmp_path: Path) -> None:
    """``exit_without_teardown``: what the worker printed still arrives (flushed), the exit code
    is 0, and the teardown (here an exit handler registered before it) never runs."""
    marker = tmp_path / "torn_down"
    code = (
        "import atexit, sys\n"
        "from pathlib import Path\n"
        f"atexit.register(lambda: Path({str(marker)!r}).write_text('teardown ran'))\n"
        "from speech_assets.runtime.processes import exit_without_teardown\n"
        "exit_without_teardown()\n"
        "sys.stdout.write('result handed back')  # no newline: still in the buffer at exit\n"
        "sys.stderr.write('and a warning')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "result handed back" and done.stderr.endswith("and a warning")
    assert not marker.exists()
