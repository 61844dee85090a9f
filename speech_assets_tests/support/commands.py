"""Processes the tests start: a command run the way the tests run documented commands
(:func:`run_group`), and the servers they start for a ``with`` block (:class:`LocalServer`).

:func:`run_group` runs a command in its own process group, so that a timeout or a failing test
takes the whole tree down (a `dagster asset materialize` under a shell script, its step processes,
torchrun and Flower), never leaving an orphan behind. The group is led by the subreaper supervisor
(``speech_assets.runtime.supervise``), which gets SIGTERM when the test process dies
(``PR_SET_PDEATHSIG``, even on kill -9 of pytest) and then terminates every descendant, including
those that left the group or were re-parented."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

from speech_assets.runtime.processes import die_with_parent


class LocalServer:
    """A server for a ``with`` block: :meth:`start` on entry (how long it took in ``start_seconds``;
    stopped again if it fails), :meth:`stop` on exit. Subclasses define ``launch`` and ``stop``."""

    start_seconds = 0.0

    def launch(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        began = time.monotonic()
        try:
            self.launch()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_group(
    command: Sequence[str], env: Mapping[str, str], cwd: str | os.PathLike[str], timeout: float
) -> subprocess.CompletedProcess:
    supervised = [sys.executable, "-m", "speech_assets.runtime.supervise", "--", *command]
    process = subprocess.Popen(
        supervised,
        env=dict(env),
        cwd=Path(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: die_with_parent(signal.SIGTERM),  # noqa: PLW1509
    )
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
