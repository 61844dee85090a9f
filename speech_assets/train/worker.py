"""A training worker's process life around the engine's loop: logging, the process group, the
run folder's locks, the tie to the launcher's life and the out-of-memory exit."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from speech_assets.layout import RunFiles
from speech_assets.runtime.locks import RunFolderLock, hold_as_worker
from speech_assets.runtime.processes import LAUNCHER_ENV, die_with_parent, watch_launcher
from speech_assets.train.engine import Distributed, init_distributed
from speech_assets.train.launch import RUN_LOCK_HELD_ENV
from speech_assets.train.oom import exit_on_oom

log = logging.getLogger("speech_assets.train")


@contextlib.contextmanager
def worker(run_dir: str, device: str, command: str) -> Iterator[Distributed]:
    """This process as a training worker, alone or one rank of a torchrun job: its process group, its
    claim on the run folder (the run lock is the launcher's, else rank 0's) and, when launched, its
    tie to the launcher's life; a CUDA out-of-memory error exits as :mod:`speech_assets.train.oom` says."""
    from dagster_pipes import PipesEnvVarParamsLoader

    # rank 0 logs INFO to train.log and stderr, other ranks only warnings; under Pipes stderr gets
    # only warnings, since the Pipes session already carries the records
    rank = int(os.environ.get("RANK", "0"))
    formatter = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if PipesEnvVarParamsLoader().is_dagster_pipes_process():
        handlers[0].setLevel(logging.WARNING)
    if rank == 0:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(Path(run_dir) / RunFiles.log.name, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(formatter)
        log.addHandler(handler)
    if LAUNCHER_ENV in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
        watch_launcher()
    job: Distributed | None = None
    folder = contextlib.ExitStack()
    try:
        job = init_distributed(device)
        with exit_on_oom(run_dir, job):
            folder.callback(hold_as_worker(run_dir).close)
            if not os.environ.get(RUN_LOCK_HELD_ENV) and job.rank == 0:
                folder.enter_context(RunFolderLock(run_dir).acquire(command=command))
            yield job
    finally:
        for handler in handlers:
            log.removeHandler(handler)
            handler.close()
        if job is not None and job.enabled and dist.is_initialized():
            dist.destroy_process_group()
        folder.close()
