"""The one place the code location is assembled: `dagster ... -m speech_assets.definitions`."""

import inspect
import warnings

import dagster as dg

from speech_assets.defs import (  # noqa: F401 - the stage modules, loaded below as MODULES
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

# the stage modules imported above: every asset, check, sensor and schedule at their top level is loaded
MODULES = [m for m in dict(globals()).values() if inspect.ismodule(m) and m.__name__.startswith("speech_assets.defs.")]


def build_definitions(
    paths: StoragePaths | None = None,
    settings: PipelineSettings | None = None,
    executor: dg.ExecutorDefinition | None = None,
) -> dg.Definitions:
    """The code location; ``paths`` defaults to the environment (variables in docs/REFERENCE.md),
    ``settings`` to `pipeline.toml` (or ``$SPEECH_ASSETS_SETTINGS``), ``executor`` to the local
    multiprocess one (a cluster's code location passes its own: `speech_assets/deploy/`)."""
    with warnings.catch_warnings():  # a preview API of the Dagster release the package pins
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return dg.load_definitions_from_modules(
            MODULES,
            executor=executor or reaping_multiprocess_executor,
            resources={
                "paths": paths or StoragePaths.from_environment(),
                "settings": settings or PipelineSettings.load(),
                "pipes_subprocess_client": dg.PipesSubprocessClient(),
            },
        )


defs = build_definitions(settings=training.SETTINGS)
