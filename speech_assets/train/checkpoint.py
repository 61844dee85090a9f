"""Checkpoint files: atomic writes, ``torch.load(weights_only=True)``-safe contents, retention,
RNG state capture (the hash of model weights: model/encoders.weights_sha256).

A training checkpoint is a dict of tensors and plain Python values only (no pickled classes):
``format, step, model, optimizer, scheduler, scaler, sampler, rng (one entry per rank), config,
data_versions, weights_sha256, progress, mlflow_run_id, plan``.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from speech_assets.layout import RunFiles
from speech_assets.utils import atomic_path

CHECKPOINT_FORMAT = 1
_STEP_FILE = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_dir(run_dir: str | os.PathLike[str]) -> Path:
    return RunFiles(Path(run_dir)).checkpoints


def checkpoint_path(run_dir: str | os.PathLike[str], step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step_{step:08d}.pt"


def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any]) -> Path:
    """Write ``state`` with ``torch.save`` atomically (temp file, fsync, rename)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        torch.save(dict(state), tmp)
    return path


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint on CPU with ``weights_only=True`` (no arbitrary unpickling)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of the run's step checkpoints, oldest first (temp files are ignored)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_FILE.match(p.name))]
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def prune_checkpoints(run_dir: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest step checkpoints; returns the deleted paths."""
    found = list_checkpoints(run_dir)
    doomed = [path for _, path in found[: max(len(found) - keep, 0)]]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """torch (CPU and ``device`` if CUDA), numpy and Python ``random`` states as tensors/plain values."""
    _, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    version, py_state, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": gauss},
    }


def restore_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
