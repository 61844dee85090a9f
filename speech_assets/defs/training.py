"""Stage 4: HuBERT-style pretraining launched as a torchrun DDP job through Dagster Pipes."""

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import dagster as dg

from speech_assets import locations
from speech_assets.corpus.clients import ClientsTable, read_clients
from speech_assets.layout import TargetFiles
from speech_assets.defs.cluster import training_op_tags
from speech_assets.defs.conditions import retrain_on_cron
from speech_assets.defs.lineage import git_commit, input_versions
from speech_assets.defs.partitions import ALL_SHARDS, ALL_TARGETS
from speech_assets.defs.resources import PipelineSettings, StoragePaths, TrainingSettings, effective, overrides_of
from speech_assets.defs.runs import record_run_process
from speech_assets.defs.torchrun import fixed_node_count, run_torchrun
from speech_assets.utils import from_fields, sha256_strings

CODE_VERSION = "train-v2"  # v2: the loss on unmasked frames too (unmasked_weight 1.0)


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
)
def pretrained_checkpoint(
    context: dg.AssetExecutionContext,
    config: TrainingOverrides,
    paths: StoragePaths,
    settings: PipelineSettings,
    pipes_subprocess_client: dg.PipesSubprocessClient,
) -> dg.MaterializeResult:
    """HuBERT-style masked prediction (shared encoder, one head per client) trained by a torchrun DDP
    job; resumes from its last checkpoint; tracked in MLflow."""
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
    from speech_assets.train.config import TrainConfig

    table = read_clients(paths.clients_file)
    data_versions = {**(extra_versions or {}), **input_versions(context, paths, table.speakers, targets_dir, targets_asset)}
    run_dir = run_folder(run_root, data_versions, options, code_version)
    train_config = from_fields(
        TrainConfig, options, **run_inputs(paths, table, targets_dir, data_versions, run_dir, run_label),
        batch_seconds=options.batch_seconds or None, nproc=options.nproc or "auto", threads=options.threads or None,
        noise=str(locations.resolve(options.noise_dir)) if options.noise == "folder" else options.noise,
    )  # fmt: skip
    nnodes = fixed_node_count(options)
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
    return run_torchrun(
        context, pipes_subprocess_client, paths, run_dir, train_config, data_versions, asset_name=asset_name,
        nproc=int(train_config.nproc), max_restarts=options.max_restarts, nodes=options,
    )  # fmt: skip


def run_folder(root: Path, data_versions: dict[str, str], options: dg.Config, code_version: str) -> Path:
    """Same inputs and settings -> same run folder, so a re-run resumes instead of starting over."""
    return root / sha256_strings([json.dumps(data_versions, sort_keys=True), options.model_dump_json(), code_version])[:16]


def run_inputs(
    paths: StoragePaths, table: ClientsTable, targets_dir: Callable[[str], Path], data_versions: dict[str, str],
    run_dir: Path, label: str,
) -> dict[str, object]:
    """What a training run's config says of its inputs and tracking (RunConfig's fields): every
    client's shards and targets (``targets_dir(client)``), CMVN, the pipeline's held-out speakers,
    lineage and the MLflow run (its name and ``mode`` tag from ``label``: a key of :data:`RUN_MODES`)."""
    from speech_assets.train.config import ClientTargets

    clients = table.speakers
    return {
        "run_dir": str(run_dir), "shards": [str(paths.shard_file(s)) for s in sorted(s for group in clients.values() for s in group)],
        "cmvn": str(paths.cmvn.cmvn), "data_versions": data_versions, "git_sha": git_commit(),
        "heldout_speakers": table.heldout,
        "clients": {c: ClientTargets(str(TargetFiles(targets_dir(c)).labels), json.loads(TargetFiles(targets_dir(c)).quality.read_text())["k"]) for c in sorted(clients)},
        "mlflow_tracking_uri": paths.mlflow_tracking_uri, "mlflow_artifact_location": paths.mlflow_artifact_location,
        "mlflow_run_name": f"{label}-{run_dir.name}", "mode": RUN_MODES[label],
    }  # fmt: skip


# each run label's MLflow ``mode`` tag (speech_assets.train.tracking.MODES)
RUN_MODES = {"pretrain": "centralised", "pretrain-iter2": "iteration2", "distill": "distilled"}
