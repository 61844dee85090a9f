"""What a checkpoint was trained from: inputs' data versions, config, git commit, MLflow run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from speech_assets.locations import redact_uri
from speech_assets.model.encoders import weights_sha256
from speech_assets.train.checkpoint import load_checkpoint


def checkpoint_lineage(path: Path) -> dict[str, Any]:
    """Read a checkpoint (``weights_only=True``) and report the chain back to the manifest.

    ``data_versions`` holds the manifest hash, the CMVN and client-assignment versions, every
    feature shard (``vad_features/<speaker>``) and every client's targets
    (``kmeans_targets/<client>``) the training run consumed, exactly as the Dagster asset passed
    them in; the same values appear on the ``pretrained_checkpoint`` materialization in the UI.
    """
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    state = load_checkpoint(path)
    config = dict(state.get("config") or {})
    weights = state.get("model")
    result = _run_result(path)
    url = result.get("mlflow_run_url")
    if config.get("mlflow_tracking_uri"):  # checkpoints written before credentials were left out
        config["mlflow_tracking_uri"] = redact_uri(config["mlflow_tracking_uri"])
    return {
        "checkpoint": str(path.resolve()),
        "step": state.get("step"),
        "weights_sha256": state.get("weights_sha256") or (weights_sha256(weights) if weights else None),
        "data_versions": dict(state.get("data_versions") or config.get("data_versions") or {}),
        "git_sha": config.get("git_sha"),
        "mlflow_run_id": state.get("mlflow_run_id") or result.get("mlflow_run_id"),
        "mlflow_run_url": redact_uri(url) if url else url,
        "config": config,
    }


def _run_result(checkpoint: Path) -> dict[str, Any]:
    """``result.json`` of the training run the checkpoint belongs to (``final.pt`` or ``checkpoints/*.pt``)."""
    for folder in (checkpoint.parent, checkpoint.parent.parent):
        candidate = folder / "result.json"
        if candidate.is_file():
            return json.loads(candidate.read_text())
    return {}
