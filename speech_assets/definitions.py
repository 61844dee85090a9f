"""The one place the code location is assembled: `dagster ... -m speech_assets.definitions`."""

import dagster as dg

from speech_assets.defs import automation, features, federated, manifest, stats, targets, training
from speech_assets.defs.resources import PipelineSettings, StoragePaths

ASSETS = [
    manifest.manifest,
    manifest.speaker_manifest,
    features.vad_features,
    features.cmvn_stats,
    targets.client_partitions,
    targets.kmeans_targets,
    training.pretrained_checkpoint,
    federated.federated_checkpoint,
    stats.dataset_stats,
]


def build_definitions(paths: StoragePaths | None = None, settings: PipelineSettings | None = None) -> dg.Definitions:
    """The code location; ``paths`` defaults to the environment (variables in docs/REFERENCE.md),
    ``settings`` to `pipeline.toml` (or ``$SPEECH_ASSETS_SETTINGS``)."""
    return dg.Definitions(
        assets=ASSETS,
        sensors=[automation.corpus_sensor, automation.automation_sensor],
        schedules=[automation.revalidate_corpus],
        resources={
            "paths": paths or StoragePaths.from_environment(),
            "settings": settings or PipelineSettings.load(),
            "pipes_subprocess_client": dg.PipesSubprocessClient(),
        },
    )


defs = build_definitions()
