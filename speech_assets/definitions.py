"""The one place the code location is assembled: `dagster ... -m speech_assets.definitions`."""

import dagster as dg

from speech_assets.defs import manifest
from speech_assets.defs.resources import StoragePaths

defs = dg.Definitions(
    assets=[manifest.manifest],
    resources={"paths": StoragePaths.from_environment()},
)
