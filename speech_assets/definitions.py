"""The one place the code location is assembled: `dagster ... -m speech_assets.definitions`."""

import dagster as dg

from speech_assets.defs import (
    automation,
    clients,
    distillation,
    export,
    features,
    federated,
    finetune,
    iteration2,
    manifest,
    model_checks,
    probe,
    staleness,
    stats,
    targets,
    training,
)
from speech_assets.defs.resources import PipelineSettings, StoragePaths
from speech_assets.defs.runs import reaping_multiprocess_executor

CHECKS = [
    manifest.rows_match_manifest,
    features.shards_are_consistent,
    features.no_speech_share,
    features.cmvn_is_not_degenerate,
    clients.every_speaker_in_one_client,
    targets.labels_match_shards,
    targets.clusters_are_used,
    stats.row_counts_match_sources,
    *staleness.CHECKS,
    probe.pretrained_beats_fbank,
    export.onnx_matches_pytorch,
    model_checks.finetuning_is_sound,
    *model_checks.CHECKS,
]

ASSETS = [
    manifest.manifest,
    manifest.speaker_manifest,
    features.vad_features,
    features.cmvn_stats,
    clients.client_partitions,
    targets.kmeans_targets,
    training.pretrained_checkpoint,
    federated.federated_checkpoint,
    *iteration2.ASSETS,
    probe.downstream_probe,
    export.encoder_export,
    distillation.distilled_checkpoint,
    finetune.finetuned_asr,
    stats.dataset_stats,
]


def build_definitions(
    paths: StoragePaths | None = None,
    settings: PipelineSettings | None = None,
    executor: dg.ExecutorDefinition | None = None,
) -> dg.Definitions:
    """The code location; ``paths`` defaults to the environment (variables in docs/REFERENCE.md),
    ``settings`` to `pipeline.toml` (or ``$SPEECH_ASSETS_SETTINGS``), ``executor`` to the local
    multiprocess one (a cluster's code location passes its own: `speech_assets/deploy/`)."""
    return dg.Definitions(
        assets=ASSETS,
        asset_checks=CHECKS,
        executor=executor or reaping_multiprocess_executor,
        sensors=[automation.corpus_sensor, automation.automation_sensor],
        schedules=[automation.revalidate_corpus],
        resources={
            "paths": paths or StoragePaths.from_environment(),
            "settings": settings or PipelineSettings.load(),
            "pipes_subprocess_client": dg.PipesSubprocessClient(),
        },
    )


defs = build_definitions()
