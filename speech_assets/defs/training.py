"""Stage 4: HuBERT-style pretraining launched as a torchrun DDP job through Dagster Pipes."""

import json
import sys
from dataclasses import replace

import dagster as dg
import pyarrow.parquet as pq

from speech_assets import settings
from speech_assets.defs.conditions import retrain_on_cron
from speech_assets.defs.lineage import git_commit, latest_data_version
from speech_assets.defs.partitions import ALL_SHARDS, ALL_TARGETS
from speech_assets.defs.resources import StoragePaths
from speech_assets.train import launch
from speech_assets.train.config import ClientTargets, TrainConfig
from speech_assets.utils import atomic_write_text, sha256_strings

CODE_VERSION = "train-v1"
MAX_OOM_RETRIES = 3


class TrainingConfig(dg.Config):
    preset: str = "tiny"
    max_steps: int = 300
    batch_seconds: float = 0.0  # per device; 0 = chosen by the auto-configuration
    target_batch_seconds: float = 60.0  # effective batch, reached with gradient accumulation
    lr: float = 2e-3
    warmup_steps: int = 30
    seed: int = 0
    checkpoint_every: int = 100
    log_every: int = 10
    precision: str = "auto"
    nproc: int = 0  # 0 = auto
    nnodes: str = "1"
    rdzv_endpoint: str = ""  # host:port for multi-node runs
    max_restarts: int = 2
    heldout_fraction: float = 0.05
    max_frames: int = 1500


def _input_versions(context: dg.AssetExecutionContext, paths: StoragePaths, clients: dict[str, list[str]]) -> dict[str, str]:
    versions = {
        "manifest": latest_data_version(context.instance, "manifest") or "",
        "cmvn_stats": latest_data_version(context.instance, "cmvn_stats") or "",
        "client_partitions": latest_data_version(context.instance, "client_partitions") or "",
    }
    for client, speakers in sorted(clients.items()):
        quality = json.loads((paths.kmeans_dir(client) / "quality.json").read_text())
        versions[f"kmeans_targets/{client}"] = quality["data_version"]
        for speaker in speakers:
            meta = paths.shard_files(speaker).read_meta()
            if meta is None:
                raise dg.Failure(description=f"shard for speaker {speaker} is missing: materialize vad_features")
            versions[f"vad_features/{speaker}"] = meta["shard_sha256"]
    return versions


# Everything a training run reads (and the stats database summarises).
TRAINING_INPUTS = ["manifest", "cmvn_stats", "client_partitions", ALL_SHARDS, ALL_TARGETS]


@dg.asset(
    group_name="training",
    deps=TRAINING_INPUTS,
    code_version=CODE_VERSION,
    pool="training",
    kinds={"pytorch", "mlflow"},
    automation_condition=retrain_on_cron(),
    description=(
        "HuBERT-style masked prediction (shared encoder, one head per client) trained by a torchrun "
        "DDP job; resumes from its last checkpoint; tracked in MLflow."
    ),
)
def pretrained_checkpoint(
    context: dg.AssetExecutionContext,
    config: TrainingConfig,
    paths: StoragePaths,
    pipes_subprocess_client: dg.PipesSubprocessClient,
) -> dg.MaterializeResult:
    assignments = pq.read_table(paths.clients_file).to_pylist()
    clients: dict[str, list[str]] = {}
    for row in assignments:
        clients.setdefault(row["client_id"], []).append(row["speaker_id"])
    data_versions = _input_versions(context, paths, clients)
    client_targets = {
        client: ClientTargets(
            labels=str(paths.kmeans_dir(client) / "labels.parquet"),
            k=json.loads((paths.kmeans_dir(client) / "quality.json").read_text())["k"],
        )
        for client in sorted(clients)
    }
    shards = [str(paths.shard_file(s)) for s in sorted(s for speakers in clients.values() for s in speakers)]
    # Same inputs and config -> same run folder, so a re-run resumes instead of starting over.
    run_name = sha256_strings([json.dumps(data_versions, sort_keys=True), config.model_dump_json(), CODE_VERSION])[:16]
    run_dir = paths.training_dir / run_name

    train_config = TrainConfig(
        run_dir=str(run_dir),
        shards=shards,
        cmvn=str(paths.cmvn_dir / "cmvn.npz"),
        clients=client_targets,
        preset=config.preset,
        max_steps=config.max_steps,
        batch_seconds=config.batch_seconds or None,
        target_batch_seconds=config.target_batch_seconds,
        lr=config.lr,
        warmup_steps=config.warmup_steps,
        seed=config.seed,
        checkpoint_every=config.checkpoint_every,
        log_every=config.log_every,
        precision=config.precision,
        heldout_fraction=config.heldout_fraction,
        max_frames=config.max_frames,
        data_versions=data_versions,
        git_sha=git_commit(),
        mlflow_tracking_uri=paths.mlflow_tracking_uri,
        mlflow_artifact_location=str(paths.root / "mlartifacts"),
        mlflow_run_name=f"pretrain-{run_name}",
        max_restarts=config.max_restarts,
        nproc=config.nproc or "auto",
    )
    plan = launch.plan_for(train_config)
    context.log.info(f"auto-configuration: {plan.reason}")
    train_config = launch.resolve(train_config, plan)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"

    for attempt in range(MAX_OOM_RETRIES + 1):
        launch.clear_oom(run_dir)
        atomic_write_text(config_path, train_config.to_json())
        command = launch.build_torchrun_command(
            config_path, nproc=train_config.nproc, max_restarts=config.max_restarts, nnodes=config.nnodes,
            rdzv_endpoint=config.rdzv_endpoint or None, python=sys.executable,
        )
        context.log.info("launching: " + " ".join(command))
        try:
            invocation = pipes_subprocess_client.run(
                context=context, command=command, cwd=str(settings.repo_root()), env=launch.torchrun_env()
            )
        except dg.DagsterPipesExecutionError:
            if attempt < MAX_OOM_RETRIES and launch.detect_oom(run_dir):
                batch, accum = launch.next_attempt_after_oom(train_config.batch_seconds, train_config.grad_accum)
                train_config = replace(train_config, batch_seconds=batch, grad_accum=accum)
                context.log.warning(f"CUDA out of memory: retrying with batch={batch:.1f}s, accum={accum}")
                continue
            raise
        result = invocation.get_materialize_result()
        return dg.MaterializeResult(
            data_version=result.data_version,
            metadata={
                **(result.metadata or {}),
                "run_dir": dg.MetadataValue.path(str(run_dir)),
                "input_versions": dg.MetadataValue.json(data_versions),
                "oom_retries": attempt,
            },
        )
    raise dg.Failure(description="training ran out of memory on every retry")
