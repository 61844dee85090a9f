"""What a checkpoint was trained from: inputs' data versions, config, git commit, MLflow run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from speech_assets.evaluation.finetune import CHECKPOINT_KIND as FINETUNED_KIND
from speech_assets.layout import RunRecord
from speech_assets.locations import redact_uri
from speech_assets.model.encoders import weights_sha256
from speech_assets.train.checkpoint import load_checkpoint
from speech_assets.train.tracking import run_inputs


def checkpoint_lineage(path: Path) -> dict[str, Any]:
    """Read a checkpoint (``weights_only=True``) and report the chain back to the manifest:
    ``data_versions`` are every input version the training run consumed, as the asset passed them in."""
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    state = load_checkpoint(path)
    config = dict(state.get("config") or {})
    weights = state.get("model") if state.get("model") is not None else state.get("encoder")
    result = _beside(path, RunRecord.result.name)
    provenance = _beside(path, RunRecord.provenance.name)
    url = result.get("mlflow_run_url") or provenance.get("mlflow_run_url")
    if config.get("mlflow_tracking_uri"):  # checkpoints written before credentials were left out
        config["mlflow_tracking_uri"] = redact_uri(config["mlflow_tracking_uri"])
    data_versions = dict(state.get("data_versions") or config.get("data_versions") or {})
    kind = checkpoint_kind(state, data_versions)
    init = state.get("init") if kind == "finetuned" else None
    extra: dict[str, Any] = {}
    if kind == "finetuned":
        extra = {
            "init": init,
            "labelled_minutes": result.get("labelled_minutes", config.get("budget_minutes")),
            "seed": state.get("seed", config.get("seed")),
        }
        if init == "scratch":  # random weights: the encoder named only its architecture and normalisation
            extra["architecture_of"] = state.get("encoder_checkpoint") or config.get("encoder")
    return {
        "checkpoint": str(path.resolve()),
        "kind": kind,
        # a federated checkpoint counts rounds of the global encoder, not optimiser steps
        "step": state.get("round") if kind == "federated" else state.get("step"),
        "step_unit": "round" if kind == "federated" else "step",
        "weights_sha256": state.get("weights_sha256") or (weights_sha256(weights) if weights else None),
        "data_versions": run_inputs(data_versions, init),
        **extra,
        "git_sha": config.get("git_sha") or provenance.get("git_sha"),
        "mlflow_run_id": state.get("mlflow_run_id") or result.get("mlflow_run_id") or provenance.get("mlflow_run_id"),
        "mlflow_run_url": redact_uri(url) if url else url,
        "dagster_run_id": provenance.get("dagster_run_id"),
        "config": config,
    }


def checkpoint_kind(state: dict[str, Any], data_versions: dict[str, str]) -> str:
    """``centralised``, ``federated``, ``distilled``, ``iteration2`` or ``finetuned``, from the checkpoint."""
    if state.get("kind") == "distilled":
        return "distilled"
    if state.get("kind") == FINETUNED_KIND:
        return "finetuned"
    if "round" in state and "encoder" in state:
        return "federated"
    if any(key.startswith("kmeans_targets_iter2/") for key in data_versions):
        return "iteration2"
    return "centralised"


def _beside(checkpoint: Path, name: str) -> dict[str, Any]:
    """The JSON file ``name`` of the checkpoint's run folder (``final.pt`` or ``checkpoints/*.pt``), if any."""
    candidates = (checkpoint.parent / name, checkpoint.parent.parent / name)
    return next((json.loads(path.read_text()) for path in candidates if path.is_file()), {})
