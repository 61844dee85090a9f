"""The one launcher of every training loop: a torchrun job (nodes 1..N-1 too, for a fixed number of
nodes) reporting through Dagster Pipes, a CUDA out-of-memory failure retried with half the batch;
and what a training run reads (:func:`run_inputs`) and where (:func:`run_folder`). torch is
imported when a job starts.
"""

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import dagster as dg

from speech_assets import locations
from speech_assets.corpus.clients import ClientsTable, read_clients
from speech_assets.defs import readable
from speech_assets.defs.lineage import bounded_versions, input_versions
from speech_assets.defs.resources import PipelineSettings, StoragePaths, TrainingSettings, effective, overrides_of
from speech_assets.defs.runs import record_run_process
from speech_assets.layout import RunFiles
from speech_assets.locations import git_commit
from speech_assets.runtime.processes import command_lines
from speech_assets.train import accuracy, oom
from speech_assets.train.provenance import record_provenance
from speech_assets.utils import atomic_write_text, from_fields, read_json, read_jsonl, sha256_strings

ONE_NODE = TrainingSettings(max_restarts=0)  # how distillation and fine-tuning run: on this host alone


def run_torchrun(
    context: dg.AssetExecutionContext,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    paths: StoragePaths,
    run_dir: Path,
    config: Any,
    data_versions: dict[str, str],
    *,
    nproc: int | None = None,
    module: str = "speech_assets.train",
    nodes: TrainingSettings = ONE_NODE,
) -> dg.MaterializeResult:
    """Run ``module`` under torchrun on ``config`` (written to ``run_dir/config.json``) with ``nproc``
    processes per node, on the nodes ``nodes`` (the `[training]` settings) starts, restarted at most
    its ``max_restarts`` times. Without ``nproc`` the ``TrainConfig`` is auto-configured here, once
    for every node's processes."""
    from speech_assets.train import launch  # torch: lazily, the code location stays light

    nnodes = fixed_node_count(nodes)
    config = dataclasses.replace(config, dagster_run_id=context.run.run_id)  # the MLflow run's link back
    plan = None
    if nproc is None:
        config, plan = launch.planned(config, nnodes)
        context.log.info(f"auto-configuration: {plan.reason}")
        nproc = int(config.nproc)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = RunFiles(run_dir).config

    def attempt(attempt_config: Any, retry: int) -> dg.PipesClientCompletedInvocation:
        atomic_write_text(config_path, attempt_config.to_json())
        if plan:
            launch.hand_plan(attempt_config, plan)

        def torchrun(node_rank: int | None) -> list[str]:
            return launch.build_torchrun_command(
                config_path,
                nproc=nproc,
                max_restarts=nodes.max_restarts,
                nnodes=nodes.nnodes,
                rdzv_endpoint=nodes.rdzv_endpoint or None,
                python=sys.executable,
                node_rank=node_rank if nnodes > 1 else None,
                module=module,
            )

        command = torchrun(0)
        context.log.info("launching: " + " ".join(command))
        env = launch.torchrun_env(nproc=nproc, tracking_uri=paths.mlflow_tracking_uri)
        with other_nodes(context, run_dir, nnodes, nodes, torchrun, env):
            with warnings.catch_warnings():  # Pipes' own preview API, used as documented
                warnings.simplefilter("ignore", dg.PreviewWarning)
                return pipes_subprocess_client.run(
                    context=context, command=launch.guarded(command), cwd=str(locations.repo_root()), env=env
                )

    with launch.launching(
        run_dir, dagster_run_id=context.run.run_id, command=f"dagster asset {context.asset_key.to_user_string()}"
    ):
        try:
            invocation, retries = oom.retrying_oom(run_dir, config, attempt, warn=context.log.warning)
        except Exception as error:
            raise training_failure(error, run_dir) from error
        result = invocation.get_materialize_result()
    finished = record_finished(run_dir, getattr(config, "git_sha", None), context.run.run_id)
    return dg.MaterializeResult(
        data_version=result.data_version,
        metadata={
            **run_metadata(run_dir, result.metadata or {}, finished),
            "run_dir": dg.MetadataValue.path(str(run_dir)),
            "input_versions": dg.MetadataValue.json(bounded_versions(data_versions)),
            "oom_retries": retries,
        },
    )


def record_finished(run_dir: Path, git_sha: str | None, dagster_run_id: str) -> dict:
    """``result.json`` of ``run_dir``; a run that finished its checkpoint gets its provenance recorded."""
    finished = read_json(RunFiles(run_dir).result)
    if finished.get("checkpoint_sha256"):
        record_provenance(
            run_dir,
            finished["checkpoint_sha256"],
            git_sha=git_sha,
            mlflow_run_id=finished.get("mlflow_run_id"),
            dagster_run_id=dagster_run_id,
        )
    return finished


# the trainer's own held-out keys, replaced by heldout_metadata's (one name per number)
RECORDED_HELDOUT = (accuracy.ACCURACY, accuracy.MAJORITY, *accuracy.ALL_FRAMES_RECORDED)


def run_metadata(run_dir: Path, reported: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, object]:
    """A torchrun job's metadata from rank 0's ``result``: the training curve first (Dagster lists
    metadata in insertion order, and a curve below twenty rows goes unseen), the held-out masked
    accuracy (leak-free; the all-frames figure that measures the leak named apart), then the rest."""
    metadata = training_curve_metadata(run_dir)
    if any(key in result for key in RECORDED_HELDOUT):
        metadata |= accuracy.metadata(result)
        for recorded, name in zip(accuracy.ALL_FRAMES_RECORDED, accuracy.ALL_FRAMES_SHOWN, strict=True):
            if result.get(recorded) is not None:
                metadata[name] = round(float(result[recorded]), 4)
    metadata |= {k: v for k, v in reported.items() if k not in RECORDED_HELDOUT}
    if not result:
        return metadata
    checkpoint = Path(result.get("checkpoint") or RunFiles(run_dir).final)
    if checkpoint.is_file():
        metadata["checkpoint_mb"] = readable.megabytes(checkpoint.stat().st_size)
    if result.get("train_audio_seconds") is not None:
        metadata["train_audio_h"] = round(result["train_audio_seconds"] / 3600, 2)
    if result.get("heldout_per_client"):
        metadata["heldout_per_client"] = readable.per_client_table(result["heldout_per_client"])
    return metadata | readable.mlflow_links(
        result.get("mlflow_run_id"), result.get("mlflow_run_url"), result.get("mlflow_ui")
    )


def training_curve_metadata(run_dir) -> dict[str, object]:
    """The training curve: held-out accuracy against the majority-class rate (else the loss) drawn
    inline, and the full PNG (loss, accuracies, learning rate) behind "Show Markdown"."""
    rows = read_jsonl(RunFiles(run_dir).metrics)
    if not rows:
        return {}
    from speech_assets.stats import plots

    if held := accuracy.curve_points(rows):
        series = {
            accuracy.LABEL: [(step, value) for step, value, _ in held],
            "majority class": [(step, majority) for step, _, majority in held],
        }
        chart = plots.inline_chart(f"{accuracy.LABEL} by step", series)
    else:
        loss = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
        chart = plots.inline_chart("loss by step", {"loss": loss})
    return {
        "curve": dg.MetadataValue.md(chart),
        "training_curve": dg.MetadataValue.md(plots.markdown_image(plots.training_curve(rows), "training curve")),
    }


def training_failure(error: Exception, run_dir: Path, lines: int = 20) -> dg.Failure:
    """The failure of a torchrun job as the run shows it: torchrun's own error and the end of
    rank 0's log (the workers' tracebacks are in the step's stderr)."""
    log = RunFiles(run_dir).log
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:] if log.is_file() else []
    out_of_memory = " (CUDA out of memory on every retry)" if oom.detect_oom(run_dir) else ""
    return dg.Failure(
        description=f"training failed{out_of_memory}: {type(error).__name__}: {error}",
        metadata={
            "run_dir": dg.MetadataValue.path(str(run_dir)),
            "train_log_tail": dg.MetadataValue.md("```\n" + "\n".join(tail) + "\n```"),
        },
    )


def fixed_node_count(options: TrainingSettings) -> int:
    """Nodes this asset starts itself; an elastic range ("1:4") means the user starts them."""
    return 1 if ":" in options.nnodes else int(options.nnodes)


@contextlib.contextmanager
def other_nodes(context, run_dir, nnodes: int, options: TrainingSettings, torchrun, env: dict) -> Iterator[None]:
    """Nodes 1..nnodes-1, started with the configured command for the length of node 0's run.

    Each runs under :mod:`speech_assets.runtime.tether`, reading a pipe this process holds: when
    this process ends, the pipe closes (through ssh too) and the node stops its torchrun. A node
    that fails while node 0 runs would leave it waiting in a collective until a timeout: node 0 is
    stopped then, so the run fails at once and says which node ended."""
    from speech_assets.train import launch

    processes, finished = [], threading.Event()
    try:
        commands = launch.other_node_commands(torchrun, nnodes, options.node_command, options.node_hosts)
        for rank, command in enumerate(commands, start=1):
            log = open(RunFiles(run_dir).node_log(rank), "ab")  # noqa: SIM115 - closed below
            context.log.info(f"starting node {rank}: {shlex.join(command)}")
            processes.append((launch.start_node(command, log, env=env, cwd=locations.repo_root()), log))
        if processes:
            threading.Thread(
                target=_stop_node_0_when_a_node_fails, args=(context, run_dir, processes, finished), daemon=True
            ).start()
        yield
    finally:
        clean = not sys.exc_info()[0]
        finished.set()
        for process, log in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=120 if clean else 0.1)  # node 0 failed: no reason to wait
            if process.stdin and not process.stdin.closed:
                process.stdin.close()  # the node's tether stops its torchrun
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()


def _stop_node_0_when_a_node_fails(context, run_dir: Path, processes: list, finished: threading.Event) -> None:
    while not finished.wait(0.5):
        for rank, (process, _) in enumerate(processes, start=1):
            if process.poll() is None or process.returncode == 0:
                continue  # a node that finished its part may exit while node 0 still writes the outputs
            if finished.is_set():
                return
            context.log.error(
                f"node {rank} failed (exit code {process.returncode}) while node 0 was training: stopping "
                f"node 0 (see {RunFiles(run_dir).node_log(rank)})"
            )
            for pid in _node_0_agents(RunFiles(run_dir).config):
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


Launch = Callable[[dg.AssetExecutionContext, Any, StoragePaths, dg.PipesSubprocessClient], dg.MaterializeResult]


def torchrun_asset(section: str, **asset_args: Any) -> Callable[[Launch], dg.AssetsDefinition]:
    """``launch(context, options, paths, pipes_subprocess_client)`` as an asset of its name and docstring
    in the ``training`` pool, its options the ``[section]`` settings as the run's config changes them."""
    overrides = overrides_of(PipelineSettings.model_fields[section].annotation)

    def decorate(launch: Launch) -> dg.AssetsDefinition:
        @dg.asset(
            name=launch.__name__,
            description=launch.__doc__,
            pool="training",
            kinds={"pytorch", "mlflow"},
            **asset_args,
        )
        def trained(
            context: dg.AssetExecutionContext,
            config: overrides,
            paths: StoragePaths,
            settings: PipelineSettings,
            pipes_subprocess_client: dg.PipesSubprocessClient,
        ) -> dg.MaterializeResult:
            record_run_process(context)
            return launch(context, effective(getattr(settings, section), config), paths, pipes_subprocess_client)

        return trained

    return decorate


# a HuBERT iteration's pretraining: its run folders' label
PRETRAINING = {1: "pretrain", 2: "pretrain-iter2"}


def run_pretraining(
    context: dg.AssetExecutionContext,
    options: TrainingSettings,
    paths: StoragePaths,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    iteration: int,
    code_version: str,
) -> dg.MaterializeResult:
    """HuBERT pretraining on each client's targets of ``iteration`` (1: MFCC clusters, 2: an encoder layer's)."""
    from speech_assets.train.config import TrainConfig

    run_label = PRETRAINING[iteration]
    table = read_clients(paths.layout.clients_file)
    data_versions = input_versions(context, paths, table.speakers, iteration)
    root = paths.layout.training_dir if iteration == 1 else paths.layout.training_iter2_dir
    run_dir = run_folder(root, data_versions, options, code_version)
    train_config = from_fields(
        TrainConfig,
        options,
        **run_inputs(paths, table, data_versions, run_dir, run_label, iteration),
        batch_seconds=options.batch_seconds or None,
        nproc=options.nproc or "auto",
        threads=options.threads or None,
        noise=str(locations.resolve(options.noise_dir)) if options.noise == "folder" else options.noise,
    )
    if fixed_node_count(options) > 1 and (not options.nproc or not options.rdzv_endpoint):
        raise dg.Failure(
            description="multi-node training needs [training] nproc (processes per node) and rdzv_endpoint"
        )
    return run_torchrun(context, pipes_subprocess_client, paths, run_dir, train_config, data_versions, nodes=options)


def run_folder(root: Path, data_versions: dict[str, str], options: dg.Config, code_version: str) -> Path:
    """Same inputs and settings -> same run folder, so a re-run resumes instead of starting over."""
    return (
        root / sha256_strings([json.dumps(data_versions, sort_keys=True), options.model_dump_json(), code_version])[:16]
    )


def run_inputs(
    paths: StoragePaths,
    table: ClientsTable,
    data_versions: dict[str, str],
    run_dir: Path,
    label: str,
    iteration: int = 1,
) -> dict[str, object]:
    """RunConfig's fields: every client's shards and targets of ``iteration``, CMVN, held-out
    speakers, lineage and the MLflow run (named by ``label``, a key of :data:`RUN_MODES`)."""
    from speech_assets.train.config import ClientTargets

    clients = table.speakers
    targets = {c: paths.targets(c, iteration) for c in sorted(clients)}
    return {
        "run_dir": str(run_dir),
        "shards": [str(paths.shard_file(s)) for s in sorted(s for group in clients.values() for s in group)],
        "cmvn": str(paths.layout.cmvn.cmvn),
        "data_versions": data_versions,
        "git_sha": git_commit(),
        "heldout_speakers": table.heldout,
        "clients": {
            c: ClientTargets(str(files.labels), json.loads(files.quality.read_text())["k"])
            for c, files in targets.items()
        },
        "mlflow_tracking_uri": paths.mlflow_tracking_uri,
        "mlflow_artifact_location": paths.mlflow_artifact_location,
        "mlflow_run_name": f"{label}-{run_dir.name}",
        "mode": RUN_MODES[label],
    }


# each run label's MLflow ``mode`` tag
RUN_MODES = {"pretrain": "centralised", "pretrain-iter2": "iteration2", "distill": "distilled"}
