"""Stage 4: HuBERT-style pretraining launched as a torchrun DDP job through Dagster Pipes."""

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import dagster as dg

from speech_assets import locations
from speech_assets.corpus.clients import read_clients
from speech_assets.defs.cluster import training_op_tags
from speech_assets.defs.conditions import retrain_on_cron
from speech_assets.defs.lineage import bounded_versions, git_commit, input_versions
from speech_assets.defs.partitions import ALL_SHARDS, ALL_TARGETS
from speech_assets.defs.resources import PipelineSettings, StoragePaths, TrainingSettings, effective, overrides_of
from speech_assets.defs.runs import record_run_process
from speech_assets.runtime.processes import command_lines
from speech_assets.utils import atomic_write_text, sha256_strings

CODE_VERSION = "train-v1"


class TrainingOverrides(overrides_of(TrainingSettings)):
    """Run-config overrides of the `[training]` settings for one manual run."""


# Everything a training run reads (and the stats database summarises).
TRAINING_INPUTS = ["manifest", "cmvn_stats", "client_partitions", ALL_SHARDS, ALL_TARGETS]


@dg.asset(
    group_name="training",
    deps=TRAINING_INPUTS,
    code_version=CODE_VERSION,
    pool="training",
    op_tags=training_op_tags(PipelineSettings.load().training),  # GPUs for a pod per step ([training] gpus_per_node)
    kinds={"pytorch", "mlflow"},
    automation_condition=retrain_on_cron(),
    description=(
        "HuBERT-style masked prediction (shared encoder, one head per client) trained by a torchrun "
        "DDP job; resumes from its last checkpoint; tracked in MLflow."
    ),
)
def pretrained_checkpoint(
    context: dg.AssetExecutionContext,
    config: TrainingOverrides,
    paths: StoragePaths,
    settings: PipelineSettings,
    pipes_subprocess_client: dg.PipesSubprocessClient,
) -> dg.MaterializeResult:
    record_run_process(context)
    return run_training(
        context, effective(settings.training, config), paths, pipes_subprocess_client,
        targets_dir=paths.kmeans_dir, targets_asset="kmeans_targets", run_root=paths.training_dir,
        code_version=CODE_VERSION, asset_name="pretrained_checkpoint", run_label="pretrain",
    )  # fmt: skip


def run_training(
    context: dg.AssetExecutionContext,
    options: TrainingSettings,
    paths: StoragePaths,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    *,
    targets_dir: Callable[[str], Path],
    targets_asset: str,
    run_root: Path,
    code_version: str,
    asset_name: str,
    run_label: str,
    extra_versions: dict[str, str] | None = None,
) -> dg.MaterializeResult:
    """Launch the torchrun trainer on the shards and one client's targets per client (read from
    ``targets_dir(client)``), in a run folder under ``run_root`` named by inputs and settings."""
    from speech_assets.train import launch  # torch: lazily, the code location stays light
    from speech_assets.train.config import ClientTargets, TrainConfig

    clients: dict[str, list[str]] = {}
    for row in read_clients(paths.clients_file):
        clients.setdefault(row.client_id, []).append(row.speaker_id)
    data_versions = {**(extra_versions or {}), **input_versions(context, paths, clients, targets_dir, targets_asset)}
    client_targets = {
        client: ClientTargets(
            labels=str(targets_dir(client) / "labels.parquet"),
            k=json.loads((targets_dir(client) / "quality.json").read_text())["k"],
        )
        for client in sorted(clients)
    }
    shards = [str(paths.shard_file(s)) for s in sorted(s for speakers in clients.values() for s in speakers)]
    # Same inputs and settings -> same run folder, so a re-run resumes instead of starting over.
    run_name = sha256_strings([json.dumps(data_versions, sort_keys=True), options.model_dump_json(), code_version])[:16]
    run_dir = run_root / run_name

    train_config = TrainConfig(
        run_dir=str(run_dir),
        shards=shards,
        cmvn=str(paths.cmvn_dir / "cmvn.npz"),
        clients=client_targets,
        preset=options.preset,
        max_steps=options.max_steps,
        batch_seconds=options.batch_seconds or None,
        target_batch_seconds=options.target_batch_seconds,
        lr=options.lr,
        warmup_steps=options.warmup_steps,
        seed=options.seed,
        checkpoint_every=options.checkpoint_every,
        log_every=options.log_every,
        precision=options.precision,
        heldout_fraction=options.heldout_fraction,
        max_frames=options.max_frames,
        data_versions=data_versions,
        git_sha=git_commit(),
        mlflow_tracking_uri=paths.mlflow_tracking_uri,
        mlflow_artifact_location=paths.mlflow_artifact_location,
        mlflow_run_name=f"{run_label}-{run_name}",
        max_restarts=options.max_restarts,
        nproc=options.nproc or "auto",
        threads=options.threads or None,
        noise=str(locations.resolve(options.noise_dir)) if options.noise == "folder" else options.noise,
        noise_prob=options.noise_prob,
        noise_snr_db=list(options.noise_snr_db),
        specaugment=options.specaugment,
    )
    nnodes = _fixed_node_count(options)
    if nnodes > 1:
        if not options.nproc or not options.rdzv_endpoint:
            raise dg.Failure(description="multi-node training needs [training] nproc (processes per node) and rdzv_endpoint")
        # batch and accumulation are decided for every process of every node
        plan = launch.plan_for(train_config, nproc=options.nproc * nnodes)
        train_config = replace(launch.resolve(train_config, plan), nproc=options.nproc)
    else:
        plan = launch.plan_for(train_config)
        train_config = launch.resolve(train_config, plan)
    context.log.info(f"auto-configuration: {plan.reason}")
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"

    def attempt(attempt_config, retry: int) -> dg.PipesClientCompletedInvocation:
        atomic_write_text(config_path, attempt_config.to_json())

        def torchrun(node_rank: int | None) -> list[str]:
            return launch.build_torchrun_command(
                config_path, nproc=attempt_config.nproc, max_restarts=options.max_restarts, nnodes=options.nnodes,
                rdzv_endpoint=options.rdzv_endpoint or None, python=sys.executable,
                node_rank=node_rank if nnodes > 1 else None,
            )

        command = torchrun(0)
        context.log.info("launching: " + " ".join(command))
        env = launch.torchrun_env(nproc=int(attempt_config.nproc), tracking_uri=paths.mlflow_tracking_uri)
        with other_nodes(context, run_dir, nnodes, options, torchrun, env):
            with warnings.catch_warnings():  # Pipes' own preview API, used as documented
                warnings.simplefilter("ignore", dg.PreviewWarning)
                return pipes_subprocess_client.run(
                    context=context, command=launch.guarded(command), cwd=str(locations.repo_root()), env=env
                )

    with launch.launching(run_dir, dagster_run_id=context.run.run_id, command=f"dagster asset {asset_name}"):
        try:
            invocation, retries = launch.retrying_oom(run_dir, train_config, attempt, warn=context.log.warning)
        except Exception as error:
            raise training_failure(error, run_dir) from error
        result = invocation.get_materialize_result()
        return dg.MaterializeResult(
            data_version=result.data_version,
            metadata={
                **(result.metadata or {}),
                **training_curve_metadata(run_dir),
                "run_dir": dg.MetadataValue.path(str(run_dir)),
                "input_versions": dg.MetadataValue.json(bounded_versions(data_versions)),
                "oom_retries": retries,
            },
        )


def training_failure(error: Exception, run_dir: Path, lines: int = 20) -> dg.Failure:
    """The failure of a torchrun job as the run shows it: torchrun's own error and the end of
    rank 0's log (the workers' tracebacks are in the step's stderr)."""
    log = run_dir / "train.log"
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:] if log.is_file() else []
    out_of_memory = " (CUDA out of memory on every retry)" if (run_dir / "oom.json").is_file() else ""
    return dg.Failure(
        description=f"training failed{out_of_memory}: {type(error).__name__}: {error}",
        metadata={"run_dir": dg.MetadataValue.path(str(run_dir)), "train_log_tail": dg.MetadataValue.md("```\n" + "\n".join(tail) + "\n```")},
    )


def _fixed_node_count(options: TrainingSettings) -> int:
    """Nodes this asset starts itself; an elastic range ("1:4") means the user starts them."""
    return 1 if ":" in options.nnodes else int(options.nnodes)


@contextlib.contextmanager
def other_nodes(context, run_dir, nnodes: int, options: TrainingSettings, torchrun, env: dict) -> Iterator[None]:
    """Start nodes 1..nnodes-1 with the configured command (an argument list, no shell) for the
    length of node 0's run; stop whatever is left of them afterwards.

    Each node's torchrun runs under :mod:`speech_assets.runtime.tether`, whose input is a pipe
    this process holds open: when this process ends or is killed, the pipe closes (through ssh
    too) and the node stops its torchrun, on whatever host it runs.

    A node that fails while node 0 still runs (killed, failed to start, lost its host) would leave
    node 0 waiting at the rendezvous or in a collective until a timeout: node 0 is stopped then,
    so the run fails at once and says which node ended."""
    from speech_assets.train import launch

    processes, finished = [], threading.Event()
    try:
        for rank, command in enumerate(
            launch.other_node_commands(torchrun, nnodes, options.node_command, options.node_hosts), start=1
        ):
            log = open(run_dir / f"node{rank}.log", "ab")  # noqa: SIM115 - closed below
            context.log.info(f"starting node {rank}: {shlex.join(command)}")
            processes.append((launch.start_node(command, log, env=env, cwd=locations.repo_root()), log))
        if processes:
            threading.Thread(target=_stop_node_0_when_a_node_fails, args=(context, run_dir, processes, finished), daemon=True).start()
        yield
    finally:
        clean = not sys.exc_info()[0]
        finished.set()
        for process, log in processes:
            try:
                process.wait(timeout=120 if clean else 0.1)  # node 0 failed: no reason to wait
            except subprocess.TimeoutExpired:
                process.stdin.close()  # the node's tether stops its torchrun
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            if process.stdin and not process.stdin.closed:
                process.stdin.close()
            log.close()


def _stop_node_0_when_a_node_fails(context, run_dir: Path, processes: list, finished: threading.Event) -> None:
    while not finished.wait(0.5):
        for rank, (process, _) in enumerate(processes, start=1):
            if process.poll() is None or process.returncode == 0:
                continue  # a node that finished its part may exit while node 0 still writes the outputs
            if finished.is_set():
                return
            context.log.error(f"node {rank} failed (exit code {process.returncode}) while node 0 was training: stopping node 0 (see {run_dir}/node{rank}.log)")
            for pid in _node_0_agents(run_dir / "config.json"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)  # torchrun's agent stops its workers and exits non-zero
            return


def _node_0_agents(config_path: Path) -> list[int]:
    """The torchrun agents of this run's node 0 on this host (their command names the config file)."""
    agents = []
    for pid, words in command_lines():
        if "torch.distributed.run" in words and str(config_path) in words and "--node-rank" in words:
            if words[words.index("--node-rank") + 1] == "0":
                agents.append(pid)
    return agents


def training_curve_metadata(run_dir) -> dict[str, object]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return {}
    from speech_assets.stats import plots

    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"training_curve": dg.MetadataValue.md(plots.markdown_image(plots.training_curve(rows), "training curve"))} if rows else {}
