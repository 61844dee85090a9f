"""Stage 4: HuBERT-style pretraining launched as a torchrun DDP job through Dagster Pipes."""

import dagster as dg

from speech_assets.defs.cluster import training_op_tags
from speech_assets.defs.conditions import retrain_on_cron
from speech_assets.defs.partitions import TRAINING_INPUTS
from speech_assets.defs.resources import PipelineSettings, StoragePaths, effective
from speech_assets.defs.runs import record_run_process
from speech_assets.defs.torchrun import TrainingOverrides, run_training

CODE_VERSION = "train-v2"  # v2: the loss on unmasked frames too (unmasked_weight 1.0)


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
        context,
        effective(settings.training, config),
        paths,
        pipes_subprocess_client,
        targets_dir=paths.kmeans_dir,
        targets_asset="kmeans_targets",
        run_root=paths.training_dir,
        code_version=CODE_VERSION,
        asset_name="pretrained_checkpoint",
        run_label="pretrain",
    )
