"""Stage 4: HuBERT-style pretraining launched as a torchrun DDP job through Dagster Pipes."""

import dagster as dg

from speech_assets.defs.cluster import training_op_tags
from speech_assets.defs.conditions import retrain_on_cron
from speech_assets.defs.partitions import TRAINING_INPUTS
from speech_assets.defs.resources import PipelineSettings, StoragePaths, TrainingSettings
from speech_assets.defs.torchrun import run_pretraining, torchrun_asset

CODE_VERSION = "train-v3"  # v2: the loss on unmasked frames too; v3: batches cropped to their shortest, heads batched
# read once as the code location loads: these op tags and the `settings` resource (definitions.py)
SETTINGS = PipelineSettings.load()


@torchrun_asset(
    "training",
    group_name="training",
    deps=TRAINING_INPUTS,
    code_version=CODE_VERSION,
    # GPUs for a pod per step: fixed with the definition, as the code location loads (defs/cluster.py)
    op_tags=training_op_tags(SETTINGS.training),
    automation_condition=retrain_on_cron(),
)
def pretrained_checkpoint(context, options: TrainingSettings, paths: StoragePaths, pipes) -> dg.MaterializeResult:
    """HuBERT-style masked prediction (shared encoder, one head per client) trained by a torchrun DDP
    job; resumes from its last checkpoint; tracked in MLflow."""
    return run_pretraining(context, options, paths, pipes, 1, CODE_VERSION)
