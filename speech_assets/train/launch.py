"""Launching: auto-configure on this machine, build the torchrun command, and the CUDA
out-of-memory retry policy (halve the per-device batch, double accumulation, up to 3 times).

A rank that hits ``torch.cuda.OutOfMemoryError`` writes ``run_dir/oom.json`` and exits with
:data:`OOM_EXIT_CODE`; the launcher (``python -m speech_assets.train --launch`` or the Dagster
asset) sees the marker via :func:`detect_oom`, adjusts the config and launches again. Each
attempt resumes from the run's latest checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from speech_assets.features.shards import FRAME_RATE_HZ
from speech_assets.train.autoconfig import (
    LaunchPlan,
    decide,
    profile_dataset,
    profile_hardware,
    profile_model,
)
from speech_assets.train.config import TrainConfig
from speech_assets.runtime.locks import RunFolderLock, wait_for_old_workers
from speech_assets.runtime.processes import launcher_env
from speech_assets.utils import atomic_write_text

log = logging.getLogger(__name__)

RUN_LOCK_HELD_ENV = "SPEECH_ASSETS_RUN_LOCK_HELD"
OOM_EXIT_CODE = 75
OOM_MARKER = "oom.json"
MAX_OOM_RETRIES = 3
# Environment for the torchrun process. By default torchrun's workers share the rendezvous
# TCPStore across restarts, and a restarted worker group can read the previous attempt's
# addresses and fail or hang in init_process_group (pytorch/pytorch#135712); a store per
# attempt makes --max-restarts reliable.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def plan_for(config: TrainConfig, nproc: int | str | None = None) -> LaunchPlan:
    """Profile this machine, the shards and the model, and decide (``nproc`` overrides the config's)."""
    dataset = profile_dataset(config.shards)
    return decide(
        profile_hardware(),
        dataset,
        profile_model(config.preset, len(config.clients), [c.k for c in config.clients.values()], dataset.mean_seconds),
        config.target_batch_seconds,
        nproc=config.nproc if nproc is None else nproc,
        batch_seconds=config.batch_seconds,
        grad_accum=config.grad_accum,
        precision=config.precision,
        device=config.device,
        max_utterance_seconds=config.max_frames / FRAME_RATE_HZ,
    )


def resolve(config: TrainConfig, plan: LaunchPlan) -> TrainConfig:
    """``config`` with the plan's concrete nproc, batch, accumulation, precision and device."""
    return replace(
        config,
        nproc=plan.nproc,
        batch_seconds=plan.batch_seconds,
        grad_accum=plan.grad_accum,
        precision=plan.precision,
        device=plan.device,
    )


def build_torchrun_command(
    config_path: str | os.PathLike[str],
    nproc: int,
    max_restarts: int,
    nnodes: str = "1",
    rdzv_endpoint: str | None = None,
    python: str = sys.executable,
    rdzv_id: str = "speech_assets",
    node_rank: int | None = None,
    module: str = "speech_assets.train",
) -> list[str]:
    """``python -m torch.distributed.run ... -m speech_assets.train --config PATH``.

    One node uses ``--standalone`` (local rendezvous on a free port). Several nodes with a
    ``node_rank`` use the static rendezvous at ``rdzv_endpoint`` (``host:port`` of node 0), so
    global rank 0, the one that reports to Dagster, is always on node 0: the Dagster host. Without
    a ``node_rank`` they rendezvous elastically with c10d (``nnodes`` like ``"1:4"``), ranks in
    order of arrival. ``module`` is the entry point each worker runs (the distillation job reuses
    this launcher). Run it with :func:`torchrun_env` so that restarts work.
    """
    command = [
        python,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
    ]
    if nnodes == "1" and rdzv_endpoint is None:
        command.append("--standalone")
    elif rdzv_endpoint is None:
        raise ValueError("multi-node launch needs rdzv_endpoint")
    elif node_rank is not None:
        host, _, port = rdzv_endpoint.rpartition(":")
        command += ["--nnodes", nnodes, "--node-rank", str(node_rank), "--master-addr", host, "--master-port", port]
    else:
        command += ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    return [*command, "-m", module, "--config", str(config_path)]


def other_node_commands(
    torchrun: Callable[[int], list[str]], nnodes: int, node_command: str, node_hosts: Sequence[str], python: str = sys.executable
) -> list[list[str]]:
    """The shell commands that start nodes 1..nnodes-1 (node 0 is this host).

    ``node_command`` is a template with ``{command}`` (that node's guarded torchrun command, shell
    quoted), ``{host}`` (``node_hosts[rank - 1]``) and ``{node_rank}``: e.g.
    ``ssh {host} 'cd /srv/speech_assets && {command}'``, or ``{command}`` to run the nodes here.
    """
    if nnodes > 1 and "{command}" not in node_command:
        raise ValueError("node_command must contain {command}")
    if "{host}" in node_command and len(node_hosts) < nnodes - 1:
        raise ValueError(f"node_command uses {{host}}: need {nnodes - 1} node_hosts, got {len(node_hosts)}")
    commands = []
    for rank in range(1, nnodes):
        text = node_command.format(
            command=shlex.join(guarded(torchrun(rank), python)),
            host=node_hosts[rank - 1] if len(node_hosts) >= rank else "",
            node_rank=rank,
        )
        commands.append(["/bin/sh", "-c", text])
    return commands


def torchrun_env(base: Mapping[str, str] | None = None, nproc: int = 1) -> dict[str, str]:
    """``base`` (default: this process's environment) plus :data:`TORCHRUN_ENV`, naming this
    process as the launcher whose death ends the job, and saying it holds the run folder's lock.

    ``OMP_NUM_THREADS`` is set (unless given) to this node's cores shared among ``nproc``
    processes, which each worker also sets for torch: torchrun then has no default to announce.
    """
    env = {**(os.environ if base is None else base), **TORCHRUN_ENV, **launcher_env(), RUN_LOCK_HELD_ENV: "1"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc))))
    return env


def guarded(command: list[str], python: str = sys.executable) -> list[str]:
    """``command`` started through the orphan guard: it dies with the process that starts it."""
    return [python, "-m", "speech_assets.runtime.orphan_guard", "--", *command]


@contextlib.contextmanager
def launching(run_dir: str | os.PathLike[str], **holder: object) -> Iterator[RunFolderLock]:
    """Hold the run folder for a launch: fail at once if another trainer has it, then wait
    (bounded) until workers left by an earlier, killed launch are gone."""
    with RunFolderLock(run_dir).acquire(**holder) as lock:
        wait_for_old_workers(run_dir)
        yield lock


def next_attempt_after_oom(batch_seconds: float, grad_accum: int) -> tuple[float, int]:
    """Same effective batch with half the memory: ``(batch / 2, accum * 2)``."""
    return batch_seconds / 2, grad_accum * 2


def write_oom_marker(
    run_dir: str | os.PathLike[str], rank: int, batch_seconds: float, grad_accum: int, error: str
) -> None:
    payload = {"rank": rank, "batch_seconds": batch_seconds, "grad_accum": grad_accum, "error": error[:2000]}
    atomic_write_text(Path(run_dir) / OOM_MARKER, json.dumps(payload, indent=2) + "\n")


def read_oom_marker(run_dir: str | os.PathLike[str]) -> dict[str, object] | None:
    path = Path(run_dir) / OOM_MARKER
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def detect_oom(run_dir: str | os.PathLike[str]) -> bool:
    """Whether a rank of the last attempt ran out of CUDA memory."""
    return (Path(run_dir) / OOM_MARKER).is_file()


def clear_oom(run_dir: str | os.PathLike[str]) -> None:
    (Path(run_dir) / OOM_MARKER).unlink(missing_ok=True)


def launch(config: TrainConfig, config_dir: str | os.PathLike[str] | None = None) -> int:
    """Auto-configure, then train here (one process) or under torchrun, retrying CUDA OOM.

    Writes the resolved config of each attempt to ``<run_dir>/launch_config.json`` (or under
    ``config_dir``) and returns the exit code of the last attempt.
    """
    plan = plan_for(config)
    log.info("autoconfig: %s", plan.reason)
    attempt_config = resolve(config, plan)
    config_path = Path(config_dir or config.run_dir) / "launch_config.json"
    with launching(config.run_dir, command="python -m speech_assets.train --launch"):
        return _launch_attempts(config, plan, attempt_config, config_path)


def _launch_attempts(config: TrainConfig, plan: LaunchPlan, attempt_config: TrainConfig, config_path: Path) -> int:
    attempt = 0
    while True:
        clear_oom(config.run_dir)
        attempt_config.to_json(config_path)
        if plan.nproc == 1:
            command = [sys.executable, "-m", "speech_assets.train", "--config", str(config_path)]
        else:
            command = build_torchrun_command(config_path, plan.nproc, config.max_restarts)
        log.info("attempt %d: %s", attempt + 1, " ".join(command))
        code = subprocess.call(guarded(command), env=torchrun_env(nproc=plan.nproc))
        if code == 0 or not detect_oom(config.run_dir) or attempt == MAX_OOM_RETRIES:
            return code
        batch, accum = next_attempt_after_oom(float(attempt_config.batch_seconds or 0), int(attempt_config.grad_accum))
        log.warning("CUDA out of memory: retrying with batch %.1f s and grad_accum %d", batch, accum)
        attempt_config = replace(attempt_config, batch_seconds=batch, grad_accum=accum)
        attempt += 1
