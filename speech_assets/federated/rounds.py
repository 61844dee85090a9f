"""The server's records: one checkpoint and one record per completed round, the round tables,
and the final checkpoint. Everything is written atomically (``speech_assets.utils.atomic_path``)
and every ``.pt`` loads with ``torch.load(weights_only=True)``.

A round ``r`` is complete when ``rounds/round_r.pt`` (global encoder ``{name: tensor}`` after the
round, the strategy's state: FedAdam's first and second moments ``m_t``/``v_t`` per encoder
tensor, same shapes) *and* ``rounds/round_r.json`` (its rows, missing clients, hashes) exist; the
``.pt`` is written first, so a kill between the two leaves round ``r`` incomplete and the run
resumes from ``r - 1``. ``rounds.parquet`` and ``evaluation.parquet`` are rebuilt from the
records of complete rounds after each round.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from speech_assets.federated.config import FederatedConfig, FederatedPaths
from speech_assets.model.presets import get_preset
from speech_assets.train.checkpoint import load_checkpoint, save_checkpoint, weights_sha256
from speech_assets.utils import atomic_path, atomic_write_text

ROUND_FORMAT = 1
_ROUND_FILE = re.compile(r"^round_(\d{5})\.(pt|json)$")

# rounds.parquet: one row per (round, client) that trained in the round
ROUNDS_SCHEMA = pa.schema(
    [
        ("round", pa.int64()),
        ("client_id", pa.string()),
        ("num_examples", pa.int64()),
        ("train_loss", pa.float64()),
        ("masked_accuracy", pa.float64()),
        ("bytes_up", pa.int64()),
        ("bytes_down", pa.int64()),
        ("seconds", pa.float64()),
    ]
)
ROUNDS_COLUMNS = tuple(ROUNDS_SCHEMA.names)
# evaluation.parquet: the global encoder after the round, on each client's held-out utterances
# with that client's own head (kept on the client), beside the client's majority-class rate
EVALUATION_SCHEMA = pa.schema(
    [
        ("round", pa.int64()),
        ("client_id", pa.string()),
        ("utterances", pa.int64()),
        ("masked_frames", pa.int64()),
        ("heldout_loss", pa.float64()),
        ("heldout_masked_accuracy", pa.float64()),
        ("majority_accuracy", pa.float64()),
    ]
)

NDArrays = dict[str, np.ndarray]


def to_tensors(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.array(value, copy=True)) for name, value in arrays.items()}


def to_numpy(tensors: Mapping[str, torch.Tensor]) -> NDArrays:
    return {name: tensor.detach().cpu().numpy().copy() for name, tensor in tensors.items()}


def encoder_sha256(encoder: Mapping[str, np.ndarray]) -> str:
    """:func:`~speech_assets.train.checkpoint.weights_sha256` of the encoder (the data version)."""
    return weights_sha256(to_tensors(encoder))


@dataclass
class RoundState:
    """Where a (resumed) run stands after round ``round``: the global encoder and the strategy's
    state (``{"m_t": {...}, "v_t": {...}}`` for FedAdam, empty for FedAvg), plus every complete
    round's record (oldest first)."""

    round: int
    encoder: NDArrays
    strategy: dict[str, NDArrays]
    records: list[dict[str, Any]]


def complete_rounds(paths: FederatedPaths) -> list[int]:
    """Rounds whose checkpoint and record both exist (only the last ``keep_rounds`` keep a checkpoint)."""
    if not paths.rounds_dir.is_dir():
        return []
    found: dict[int, set[str]] = {}
    for path in paths.rounds_dir.iterdir():
        if match := _ROUND_FILE.match(path.name):
            found.setdefault(int(match.group(1)), set()).add(match.group(2))
    return sorted(r for r, kinds in found.items() if kinds == {"pt", "json"})


def read_records(paths: FederatedPaths, up_to: int) -> list[dict[str, Any]]:
    records = []
    for round_number in range(1, up_to + 1):
        path = paths.round_record(round_number)
        if path.is_file():
            records.append(json.loads(path.read_text()))
    return records


def load_latest(paths: FederatedPaths, config: FederatedConfig) -> RoundState | None:
    """The newest complete round, or ``None`` for a fresh run. Leftovers of a round that did not
    complete (a checkpoint without its record, records after the newest checkpoint) are removed."""
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
    if not paths.rounds_dir.is_dir():
        return
    for path in paths.rounds_dir.iterdir():
        if (match := _ROUND_FILE.match(path.name)) and int(match.group(1)) > round_number:
            path.unlink(missing_ok=True)


def save_round(
    paths: FederatedPaths,
    config: FederatedConfig,
    round_number: int,
    encoder: NDArrays,
    strategy_state: Mapping[str, NDArrays],
    record: dict[str, Any],
) -> list[dict[str, Any]]:
    """Write round ``round_number`` (checkpoint, then record), prune old checkpoints and rebuild
    the tables; returns every complete round's record."""
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
    record = {**record, "round": round_number, "weights_sha256": sha}
    atomic_write_text(paths.round_record(round_number), json.dumps(record, indent=1, sort_keys=True) + "\n")
    kept = complete_rounds(paths)
    for old in kept[: max(len(kept) - config.keep_rounds, 0)]:
        paths.round_checkpoint(old).unlink(missing_ok=True)
    records = read_records(paths, round_number)
    write_tables(paths, records)
    return records


def write_tables(paths: FederatedPaths, records: Sequence[Mapping[str, Any]]) -> None:
    rows = [row for record in records for row in record["rows"]]
    evaluation = [row for record in records for row in record["evaluation"]]
    for target, schema, data in (
        (paths.rounds_table, ROUNDS_SCHEMA, rows),
        (paths.evaluation_table, EVALUATION_SCHEMA, evaluation),
    ):
        table = pa.Table.from_pylist([{name: row[name] for name in schema.names} for row in data], schema=schema)
        with atomic_path(target) as tmp:
            pq.write_table(table, tmp)


def save_final(
    paths: FederatedPaths, config: FederatedConfig, round_number: int, encoder: NDArrays
) -> str:
    """``final.pt``: the global encoder only (no head: those stay on the clients); returns its sha256."""
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
        },
    )
    return sha


def summarize_rounds(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One line per round: clients, missing, mean train loss, held-out accuracy (weighted by
    masked frames) beside the majority-class rate, bytes, wall time."""
    lines = []
    for record in records:
        rows, evaluation = record["rows"], record["evaluation"]
        frames = sum(e["masked_frames"] for e in evaluation)
        examples = sum(r["num_examples"] for r in rows)
        lines.append(
            {
                "round": record["round"],
                "clients": len(rows),
                "missing": list(record.get("missing", [])),
                "train_loss": sum(r["train_loss"] * r["num_examples"] for r in rows) / max(examples, 1),
                "heldout_masked_accuracy": (
                    sum(e["heldout_masked_accuracy"] * e["masked_frames"] for e in evaluation) / frames if frames else None
                ),
                "majority_accuracy": (
                    sum(e["majority_accuracy"] * e["masked_frames"] for e in evaluation) / frames if frames else None
                ),
                "bytes_up": sum(r["bytes_up"] for r in rows),
                "bytes_down": sum(r["bytes_down"] for r in rows),
                "round_seconds": record["round_seconds"],
            }
        )
    return lines
