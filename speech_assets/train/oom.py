"""The CUDA out-of-memory protocol: a rank out of memory writes ``run_dir/oom.json`` and exits with
:data:`OOM_EXIT_CODE`; the launcher launches again with half the per-device batch and twice the
accumulation, up to :data:`MAX_OOM_RETRIES` times, each attempt resuming from the latest checkpoint."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from speech_assets.layout import RunFiles
from speech_assets.utils import atomic_write_text

if TYPE_CHECKING:
    from speech_assets.train.engine import Distributed

log = logging.getLogger(__name__)
Config = TypeVar("Config", bound=Any)  # a dataclass with batch_seconds and grad_accum
Outcome = TypeVar("Outcome")

OOM_EXIT_CODE = 75
MAX_OOM_RETRIES = 3


def next_attempt_after_oom(batch_seconds: float, grad_accum: int) -> tuple[float, int]:
    """Same effective batch with half the memory: ``(batch / 2, accum * 2)``."""
    return batch_seconds / 2, grad_accum * 2


def write_oom_marker(
    run_dir: str | os.PathLike[str], rank: int, batch_seconds: float, grad_accum: int, error: str
) -> None:
    payload = {"rank": rank, "batch_seconds": batch_seconds, "grad_accum": grad_accum, "error": error[:2000]}
    atomic_write_text(RunFiles(Path(run_dir)).oom, json.dumps(payload, indent=2) + "\n")


def read_oom_marker(run_dir: str | os.PathLike[str]) -> dict[str, object] | None:
    path = RunFiles(Path(run_dir)).oom
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def detect_oom(run_dir: str | os.PathLike[str]) -> bool:
    """Whether a rank of the last attempt ran out of CUDA memory."""
    return RunFiles(Path(run_dir)).oom.is_file()


def clear_oom(run_dir: str | os.PathLike[str]) -> None:
    RunFiles(Path(run_dir)).oom.unlink(missing_ok=True)


def retrying_oom(
    run_dir: str | os.PathLike[str],
    config: Config,
    attempt: Callable[[Config, int], Outcome],
    failed: Callable[[Outcome], bool] = lambda _: False,
    warn: Callable[[str], None] = log.warning,
) -> tuple[Outcome, int]:
    """Run ``attempt(config, n)``, retrying out-of-memory failures (raised, or an outcome ``failed``
    says is one, with the marker left); returns the outcome and the number of retries."""
    for retry in range(MAX_OOM_RETRIES + 1):
        clear_oom(run_dir)
        try:
            outcome = attempt(config, retry)
        except Exception:
            if retry == MAX_OOM_RETRIES or not detect_oom(run_dir):
                raise
        else:
            if not failed(outcome) or retry == MAX_OOM_RETRIES or not detect_oom(run_dir):
                return outcome, retry
        batch, accum = next_attempt_after_oom(float(config.batch_seconds or 0), int(config.grad_accum))
        warn(f"CUDA out of memory: retrying with batch {batch:.1f} s and grad_accum {accum}")
        config = replace(config, batch_seconds=batch, grad_accum=accum)
    raise AssertionError("unreachable")


@contextlib.contextmanager
def exit_on_oom(run_dir: str | os.PathLike[str], job: Distributed) -> Iterator[None]:
    """A CUDA out-of-memory error once ``job.batch`` is known writes the marker and exits with :data:`OOM_EXIT_CODE`."""
    import torch

    try:
        yield
    except torch.cuda.OutOfMemoryError as error:
        if job.batch is None:
            raise
        batch_seconds, grad_accum = job.batch
        write_oom_marker(run_dir, job.rank, batch_seconds, grad_accum, str(error))
        log.error("CUDA out of memory (batch %.1f s, grad_accum %d): %s", batch_seconds, grad_accum, error)
        raise SystemExit(OOM_EXIT_CODE) from error


def refuse_known_oom(run_dir: str | os.PathLike[str], batch_seconds: float) -> None:
    """Exit with :data:`OOM_EXIT_CODE` if a previous attempt ran out of memory with this batch."""
    marker = read_oom_marker(run_dir)
    if marker is not None and marker.get("batch_seconds") == batch_seconds:
        log.error("a previous attempt ran out of memory with batch %.1f s; not retrying it", batch_seconds)
        raise SystemExit(OOM_EXIT_CODE)
