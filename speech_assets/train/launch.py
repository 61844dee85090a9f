"""Launching: auto-configure, build the torchrun command, launch with the out-of-memory retries."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import IO

from speech_assets.features.shards import FRAME_RATE_HZ
from speech_assets.hosts import check_endpoint, check_host
from speech_assets.layout import RunFiles
from speech_assets.locations import TRACKING_URI_ENV, redact_uri
from speech_assets.model.speed import ModelProfile, profile_model
from speech_assets.runtime.locks import RunFolderLock, wait_for_old_workers
from speech_assets.runtime.processes import launcher_env
from speech_assets.train import local_torchrun
from speech_assets.train.autoconfig import DatasetProfile, LaunchPlan, decide, profile_dataset, profile_hardware
from speech_assets.train.config import TrainConfig
from speech_assets.train.oom import retrying_oom
from speech_assets.utils import atomic_write_text

log = logging.getLogger(__name__)

RUN_LOCK_HELD_ENV = "SPEECH_ASSETS_RUN_LOCK_HELD"
# A rendezvous store per attempt: a restarted worker group can read a shared store's stale addresses
# and hang in init_process_group (pytorch/pytorch#135712).
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def plan_for(
    config: TrainConfig, dataset: DatasetProfile, model: ModelProfile, nproc: int | str | None = None
) -> LaunchPlan:
    """Decide for this machine, the shards and the model (``nproc`` overrides the config's)."""
    return decide(
        profile_hardware(),
        dataset,
        model,
        config.target_batch_seconds,
        nproc=config.nproc if nproc is None else nproc,
        batch_seconds=config.batch_seconds,
        grad_accum=config.grad_accum,
        precision=config.precision,
        device=config.device,
        max_utterance_seconds=config.max_frames / FRAME_RATE_HZ,
    )


def planned(config: TrainConfig, nnodes: int = 1) -> tuple[TrainConfig, LaunchPlan]:
    """``config`` resolved by this machine's plan, and the plan; with ``nnodes`` nodes the batch is
    decided for every process of every node, and the config keeps the per-node count."""
    dataset = profile_dataset(config.shards)
    clients = [c.k for c in config.clients.values()]
    model = profile_model(config.preset, len(clients), clients, dataset.mean_seconds)
    plan = plan_for(config, dataset, model, nproc=config.nproc if nnodes == 1 else int(config.nproc) * nnodes)
    decided = {"batch_seconds": plan.batch_seconds, "grad_accum": plan.grad_accum, "precision": plan.precision}
    return replace(config, nproc=plan.nproc // nnodes, device=plan.device, **decided), plan


def hand_plan(config: TrainConfig, plan: LaunchPlan) -> None:
    """Write ``plan`` for the workers with this attempt's batch and accumulation (an OOM retry changes them)."""
    if (config.batch_seconds, config.grad_accum) != (plan.batch_seconds, plan.grad_accum):
        note = f"after CUDA out of memory: batch {config.batch_seconds:g} s per device, grad_accum {config.grad_accum}"
        plan = replace(plan, reason=f"{plan.reason}; {note}")
    plan = replace(plan, batch_seconds=config.batch_seconds, grad_accum=config.grad_accum)
    atomic_write_text(RunFiles(Path(config.run_dir)).plan, json.dumps(asdict(plan), indent=1, sort_keys=True) + "\n")


def handed_plan(config: TrainConfig) -> LaunchPlan | None:
    """The plan the launcher wrote, or ``None`` when there is none or it was made for another config."""
    try:
        plan = LaunchPlan(**json.loads(RunFiles(Path(config.run_dir)).plan.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    decided = (plan.batch_seconds, plan.grad_accum, plan.precision, plan.device)
    return plan if decided == (config.batch_seconds, config.grad_accum, config.precision, config.device) else None


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
    """torchrun's command line: ``python -m ... -m speech_assets.train --config PATH``.

    One node listens on 127.0.0.1 only (:mod:`speech_assets.train.local_torchrun`). Several nodes
    with a ``node_rank`` use the static rendezvous at node 0's ``rdzv_endpoint``, so global rank 0,
    which reports to Dagster, is on the Dagster host; without one they rendezvous elastically with
    c10d. Run it with :func:`torchrun_env` so that restarts work.
    """
    options = ["--nproc-per-node", str(int(nproc)), "--max-restarts", str(int(max_restarts))]
    if nnodes == "1" and rdzv_endpoint is None:
        endpoint = f"{local_torchrun.LOOPBACK}:0"  # the port is the one the store's socket gets
        command = [python, "-m", local_torchrun.__name__, *options, "--nnodes", "1"]
        command += ["--rdzv-backend", local_torchrun.BACKEND, "--rdzv-endpoint", endpoint]
        return [*command, "-m", module, "--config", str(config_path)]
    if rdzv_endpoint is None:
        raise ValueError("multi-node launch needs rdzv_endpoint")
    host, port = check_endpoint(rdzv_endpoint, "rdzv_endpoint")
    command = [python, "-m", "torch.distributed.run", *options]
    if node_rank is not None:
        command += ["--nnodes", str(int(nnodes)), "--node-rank", str(int(node_rank))]
        command += ["--master-addr", host, "--master-port", str(port)]
    else:
        if not re.fullmatch(r"\d+(:\d+)?", nnodes) or not re.fullmatch(r"[A-Za-z0-9_-]+", rdzv_id):
            raise ValueError(f"nnodes {nnodes!r} must be N or MIN:MAX, and rdzv_id letters, digits, '_' or '-'")
        command += ["--nnodes", nnodes, "--rdzv-backend", "c10d"]
        command += ["--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    return [*command, "-m", module, "--config", str(config_path)]


PLACEHOLDER = re.compile(r"\{(command|host|node_rank)\}")


def other_node_commands(
    torchrun: Callable[[int], list[str]],
    nnodes: int,
    node_command: str,
    node_hosts: Sequence[str],
    python: str = sys.executable,
) -> list[list[str]]:
    """The argument lists that start nodes 1..nnodes-1 (node 0 is this host); no shell runs them.

    ``{command}``, ``{host}`` and ``{node_rank}`` are filled into the words of ``node_command``; a
    whole-word ``{command}`` becomes the node's torchrun command, run through
    :mod:`speech_assets.runtime.tether` (it stops when this launcher ends); inside a longer word (a
    remote shell's command line, ``ssh {host} 'cd /srv && {command}'``) every value is shell-quoted.
    """
    words = shlex.split(node_command)
    if nnodes > 1 and not any("{command}" in word for word in words):
        raise ValueError("node_command must contain {command}")
    uses_host = any("{host}" in word for word in words)
    if uses_host and len(node_hosts) < nnodes - 1:
        raise ValueError(f"node_command uses {{host}}: need {nnodes - 1} node_hosts, got {len(node_hosts)}")
    commands = []
    for rank in range(1, nnodes):
        values = {
            "command": [python, "-m", "speech_assets.runtime.tether", "--", *torchrun(rank)],
            "host": [check_host(node_hosts[rank - 1], "node_hosts entry")] if uses_host else [""],
            "node_rank": [str(rank)],
        }
        argv: list[str] = []
        for word in words:
            whole = PLACEHOLDER.fullmatch(word)
            if whole:
                argv += values[whole.group(1)]
            else:
                argv.append(PLACEHOLDER.sub(lambda match: shlex.join(values[match.group(1)]), word))
        commands.append(argv)
    return commands


def start_node(
    command: list[str], log: IO[bytes], env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None
) -> subprocess.Popen:
    """Start a node command; its standard input is a pipe this process holds: the node stops when
    this process ends or the caller closes ``process.stdin``."""
    return subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)


def torchrun_env(
    base: Mapping[str, str] | None = None, nproc: int = 1, tracking_uri: str | None = None
) -> dict[str, str]:
    """``base`` plus :data:`TORCHRUN_ENV`, naming this process as the launcher whose death ends the
    job and as the run folder lock's holder. ``OMP_NUM_THREADS`` set so torchrun has no default to
    announce; a ``tracking_uri`` with credentials travels in the environment, never in config files."""
    env = {**(os.environ if base is None else base), **TORCHRUN_ENV, **launcher_env(), RUN_LOCK_HELD_ENV: "1"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc))))
    if tracking_uri and redact_uri(tracking_uri) != tracking_uri:
        env[TRACKING_URI_ENV] = tracking_uri
    return env


def guarded(command: list[str], python: str = sys.executable) -> list[str]:
    """``command`` started through the orphan guard: it dies with the process that starts it."""
    return [python, "-m", "speech_assets.runtime.orphan_guard", "--", *command]


@contextlib.contextmanager
def launching(run_dir: str | os.PathLike[str], **holder: object) -> Iterator[RunFolderLock]:
    """Hold the run folder: fail if another trainer has it, then wait for an earlier launch's workers to end."""
    with RunFolderLock(run_dir).acquire(**holder) as lock:
        wait_for_old_workers(run_dir)
        yield lock


def launch(config: TrainConfig, config_dir: str | os.PathLike[str] | None = None) -> int:
    """Auto-configure, then train here or under torchrun, retrying CUDA OOM; the last attempt's exit code."""
    config, plan = planned(config)
    log.info("autoconfig: %s", plan.reason)
    config_path = RunFiles(Path(config_dir or config.run_dir)).launch_config

    def attempt(attempt_config: TrainConfig, retry: int) -> int:
        attempt_config.to_json(config_path)
        hand_plan(attempt_config, plan)
        if plan.nproc == 1:
            command = [sys.executable, "-m", "speech_assets.train", "--config", str(config_path)]
        else:
            command = build_torchrun_command(config_path, plan.nproc, config.max_restarts)
        log.info("attempt %d: %s", retry + 1, " ".join(command))
        env = torchrun_env(nproc=plan.nproc, tracking_uri=config.mlflow_tracking_uri)
        return subprocess.call(guarded(command), env=env)

    with launching(config.run_dir, command="python -m speech_assets.train --launch"):
        return retrying_oom(config.run_dir, config, attempt, failed=lambda code: code != 0)[0]
