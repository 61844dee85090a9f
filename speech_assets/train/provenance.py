"""A run folder's ``provenance.json``: what made its checkpoint (git commit, MLflow run, Dagster
run), for ``speech-assets lineage`` and the stats database."""

from __future__ import annotations

import json
from pathlib import Path

from speech_assets.layout import RunFiles
from speech_assets.utils import atomic_write_text, read_json


def record_provenance(run_dir: Path, checkpoint_sha256: str, **fields: object) -> None:
    """Write ``provenance.json``, kept while the checkpoint is the same one (a later run that reuses a
    finished run did not make it)."""
    path = RunFiles(run_dir).provenance
    if read_json(path).get("checkpoint_sha256") == checkpoint_sha256:
        return
    record = {"checkpoint_sha256": checkpoint_sha256, **{k: v for k, v in fields.items() if v is not None}}
    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
