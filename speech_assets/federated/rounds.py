"""The server's records: one checkpoint and one record per completed round, the round tables and
the final checkpoint, written atomically; every ``.pt`` loads with ``weights_only=True``.

A round's ``.pt`` (encoder, FedAdam's moments) is written before its ``.json`` record, so a kill
between the two leaves the round incomplete and the run resumes from the round before. An
evaluated round is saved before its evaluation (its encoder goes nowhere before it is durable)
with ``evaluation_pending``, and its record rewritten with the results (:func:`rewrite_record`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from speech_assets.federated.config import FederatedConfig
from speech_assets.federated.history import complete_rounds, read_records, write_tables
from speech_assets.layout import FederatedPaths
from speech_assets.model.encoders import weights_sha256
from speech_assets.model.presets import get_preset
from speech_assets.train.checkpoint import load_checkpoint, save_checkpoint
from speech_assets.utils import atomic_write_text

ROUND_FORMAT = 1

NDArrays = dict[str, np.ndarray]


def to_tensors(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.array(value, copy=True)) for name, value in arrays.items()}


def to_numpy(tensors: Mapping[str, torch.Tensor]) -> NDArrays:
    return {name: tensor.detach().cpu().numpy().copy() for name, tensor in tensors.items()}


def encoder_sha256(encoder: Mapping[str, np.ndarray]) -> str:
    """The encoder's data version."""
    return weights_sha256(to_tensors(encoder))


@dataclass
class RoundState:
    """Where a resumed run stands after round ``round``; ``records`` oldest first."""

    round: int
    encoder: NDArrays
    strategy: dict[str, NDArrays]
    records: list[dict[str, Any]]


def load_latest(paths: FederatedPaths, config: FederatedConfig) -> RoundState | None:
    """The newest complete round (``None``: a fresh run); leftovers of incomplete rounds are removed."""
    complete = complete_rounds(paths)
    if not complete:
        _remove_after(paths, 0)
        return None
    latest = complete[-1]
    _remove_after(paths, latest)
    state = load_checkpoint(paths.round_checkpoint(latest))
    if state["strategy_name"] != config.strategy or state["preset"] != config.preset:
        raise ValueError(
            f"{paths.round_checkpoint(latest)} was written by a {state['strategy_name']}/{state['preset']} run, "
            f"not {config.strategy}/{config.preset}: use another run folder"
        )
    return RoundState(
        round=latest,
        encoder=to_numpy(state["encoder"]),
        strategy={name: to_numpy(moments) for name, moments in state["strategy"].items()},
        records=read_records(paths, latest),
    )


def _remove_after(paths: FederatedPaths, round_number: int) -> None:
    for later in paths.round_checkpoints.numbers(paths.rounds_dir):
        if later > round_number:
            paths.round_checkpoint(later).unlink(missing_ok=True)
    for later in paths.round_records.numbers(paths.rounds_dir):
        if later > round_number:
            paths.round_record(later).unlink(missing_ok=True)


def save_round(
    paths: FederatedPaths,
    config: FederatedConfig,
    round_number: int,
    encoder: NDArrays,
    strategy_state: Mapping[str, NDArrays],
    record: dict[str, Any],
) -> list[dict[str, Any]]:
    """Write the round's checkpoint, then its record; prune old checkpoints; every round's record."""
    sha = encoder_sha256(encoder)
    save_checkpoint(
        paths.round_checkpoint(round_number),
        {
            "format": ROUND_FORMAT,
            "round": round_number,
            "encoder": to_tensors(encoder),
            "strategy_name": config.strategy,
            "strategy": {name: to_tensors(moments) for name, moments in strategy_state.items()},
            "preset": config.preset,
            "weights_sha256": sha,
        },
    )
    records = rewrite_record(paths, round_number, {**record, "round": round_number, "weights_sha256": sha})
    kept = complete_rounds(paths)
    for old in kept[: max(len(kept) - config.keep_rounds, 0)]:
        paths.round_checkpoint(old).unlink(missing_ok=True)
    return records


def rewrite_record(paths: FederatedPaths, round_number: int, record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Write the round's record and rebuild the tables; every round's record."""
    atomic_write_text(paths.round_record(round_number), json.dumps(dict(record), indent=1, sort_keys=True) + "\n")
    records = read_records(paths, round_number)
    write_tables(paths, records)
    return records


def save_final(paths: FederatedPaths, config: FederatedConfig, round_number: int, encoder: NDArrays) -> str:
    """``final.pt``: the global encoder only (the heads stay on the clients); returns its sha256."""
    sha = encoder_sha256(encoder)
    save_checkpoint(
        paths.final,
        {
            "format": ROUND_FORMAT,
            "round": round_number,
            "encoder": to_tensors(encoder),
            "preset": get_preset(config.preset).to_dict(),
            "strategy_name": config.strategy,
            "config": config.to_dict(),
            "data_versions": dict(config.data_versions),
            "weights_sha256": sha,
            "speakers": {"train": sorted(config.train_speakers), "heldout": sorted(config.heldout_speakers)},
            "normalisation": {"kind": "utterance"},
        },
    )
    return sha
