"""Checkpoint files: atomic writes, retention, RNG state capture, and a background writer.

A checkpoint holds tensors and plain Python values only (no pickled classes), so that it loads
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable, Collection, Mapping
from copy import deepcopy
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from speech_assets.layout import RunFiles
from speech_assets.model.encoders import weights_sha256
from speech_assets.runtime.faults import inject
from speech_assets.utils import atomic_path, temp_target

log = logging.getLogger("speech_assets.train")

CHECKPOINT_FORMAT = 1


def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any]) -> Path:
    """Write ``state`` atomically; through a file object, so that the archive's inner folder is not
    the (random) temp file's name and the same state gives the same bytes."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as handle:
            torch.save(dict(state), handle)
        inject("checkpoint.write", name=path.name)  # tests: a kill with the file written, not yet renamed
    return path


def host_copy(value: Any) -> Any:
    """``value`` with every tensor copied to (pinned, for GPU tensors) host memory, asynchronously
    then synchronised once. Through ``copy.deepcopy`` with the copies in its memo, so that it
    pickles to the same bytes: layouts, container attributes and object sharing are kept."""
    memo: dict[int, Any] = {}
    pending = False

    def collect(item: Any) -> None:
        nonlocal pending
        if isinstance(item, torch.Tensor):
            if id(item) not in memo:
                source = item.detach()
                if source.device.type == "cuda":
                    pending = True
                    target = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, pin_memory=True)
                    memo[id(item)] = target.copy_(source, non_blocking=True)
                else:
                    memo[id(item)] = source.clone(memory_format=torch.preserve_format)
        elif isinstance(item, dict | list | tuple):
            for entry in item.values() if isinstance(item, dict) else item:
                collect(entry)

    collect(value)
    copied = deepcopy(value, memo)
    if pending:
        torch.cuda.current_stream().synchronize()
    return copied


def finish_and_write(path: Path, state: dict[str, Any]) -> Path:
    """Fill ``state["weights_sha256"]`` from ``state["model"]`` and write it atomically."""
    state["weights_sha256"] = weights_sha256(state["model"])
    return save_checkpoint(path, state)


class CheckpointWriter:
    """Writes checkpoints off the training loop: :meth:`submit` copies the state to host memory and a
    thread hashes and writes it, then runs ``after``. One write at a time, so host memory holds at
    most one snapshot; a failed write is raised by the next :meth:`submit` or :meth:`wait`."""

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, path: Path, state: Mapping[str, Any], after: Callable[[], object] | None = None) -> None:
        self.wait()
        if not self.background:  # the live tensors, written before training goes on
            self._write(path, dict(state), after)
            self.wait()
            return
        snapshot = host_copy(dict(state))
        self._thread = threading.Thread(
            target=self._write, args=(path, snapshot, after), name="checkpoint-writer", daemon=False
        )
        self._thread.start()

    def _write(self, path: Path, state: dict[str, Any], after: Callable[[], object] | None) -> None:
        try:
            finish_and_write(path, state)
            if after is not None:
                after()
            log.info("checkpoint %s", path)
        except BaseException as error:  # handed to the training thread by wait()
            self._error = error

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("writing a checkpoint failed") from error


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of the run's step checkpoints, oldest first."""
    files = RunFiles(Path(run_dir))
    return [(step, files.checkpoint(step)) for step in files.checkpoint_steps.numbers(files.checkpoints)]


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def prune_checkpoints(run_dir: str | os.PathLike[str], keep: int, keep_steps: Collection[int] = ()) -> list[Path]:
    """Delete all but the ``keep`` newest step checkpoints and those of ``keep_steps``, and the temp
    files a killed write left (each as large as a checkpoint); returns the deleted paths. Only
    the run folder's one writer calls it, after a write, so no write of its own is in flight."""
    found = list_checkpoints(run_dir)
    doomed = [path for step, path in found[: max(len(found) - keep, 0)] if step not in keep_steps]
    folder = RunFiles(Path(run_dir)).checkpoints
    steps = RunFiles(Path(run_dir)).checkpoint_steps
    doomed += sorted(
        p
        for p in (folder.iterdir() if folder.is_dir() else ())
        if (target := temp_target(p.name)) is not None and steps.number(target) is not None
    )
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """torch, CUDA, numpy and Python ``random`` states as tensors and plain values."""
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
    saved = state["numpy"]
    keys = saved["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
