"""Running a command as another, unprivileged user of this machine (the tests' local attacker).

Needs root (to switch) and util-linux's ``setpriv``; :func:`why_not` says what is missing. The
other user's interpreter is the system's ``python3`` when it has this one's version (with this
environment's packages on ``PYTHONPATH`` for a test that needs them), else this one if that user
may run it, else none.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

NOBODY = 65534


def why_not() -> str | None:
    """Why commands cannot run as another user here (``None``: they can)."""
    if not sys.platform.startswith("linux"):
        return "switching users is done with Linux's setpriv"
    if os.geteuid() != 0:
        return "switching to another user needs root"
    if shutil.which("setpriv") is None:
        return "util-linux's setpriv is not installed"
    return None


def spare_uid() -> int:
    """A uid no account uses (a second unprivileged user besides ``nobody``)."""
    taken = {entry.pw_uid for entry in pwd.getpwall()}
    return next(uid for uid in range(64000, 65000) if uid not in taken)


@contextlib.contextmanager
def shared_folder() -> Iterator[Path]:
    """A temporary folder every user may read (pytest's own are the owner's only)."""
    with tempfile.TemporaryDirectory(prefix="speech-assets-shared-") as folder:
        os.chmod(folder, 0o755)
        yield Path(folder)


def as_user(uid: int, command: Sequence[str]) -> list[str]:
    """``command`` run as ``uid`` (its own group, no supplementary groups, no capabilities)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--", *command]


def python_for(uid: int, *, packages: bool = False) -> tuple[list[str], dict[str, str]] | None:
    """An interpreter ``uid`` may run, and the environment it needs: ``(argv prefix, env)``;
    ``packages``: this environment's packages and this checkout importable too."""
    repo = str(Path(__file__).resolve().parents[2])
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1"}
    if packages:
        env["PYTHONPATH"] = repo
    # the system's first: installed for every user (a virtual environment may point into root's home)
    system = shutil.which("python3", path="/usr/bin:/bin")
    candidates = [system, sys.executable] if uid != 0 and system else [sys.executable]
    for python in candidates:
        extra = dict(env)
        if packages and python != sys.executable:
            extra["PYTHONPATH"] = os.pathsep.join(
                [repo, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
            )
        version = f"import sys; sys.exit(sys.version_info[:2] != {tuple(sys.version_info[:2])})"
        probe = ["-c", version + ("; import psutil, speech_assets" if packages else "")]
        done = subprocess.run(as_user(uid, [python, *probe]), env=extra, capture_output=True, timeout=60, cwd="/")
        if done.returncode == 0:
            return [python], extra
    return None
