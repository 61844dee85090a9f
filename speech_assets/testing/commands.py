"""Run a command the way the tests run documented commands: in its own process group, so that a
timeout or a failing test takes the whole tree down (a `dagster asset materialize` under a shell
script, its step processes, torchrun and Flower), never leaving an orphan behind."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def run_group(
    command: Sequence[str], env: Mapping[str, str], cwd: str | os.PathLike[str], timeout: float
) -> subprocess.CompletedProcess:
    process = subprocess.Popen(
        list(command), env=dict(env), cwd=Path(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    finally:
        try:  # whatever the command left running in its group goes with it
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)
