"""The server's round records read back without torch: which rounds are complete, the round
tables (``rounds.parquet``, ``evaluation.parquet``) and one summary line per round. A round is
complete when its checkpoint and its record both exist (:mod:`rounds` writes them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from speech_assets.federated.config import FederatedConfig, settings_changes
from speech_assets.layout import FederatedPaths
from speech_assets.utils import atomic_path, atomic_write_text


def _per_client(**columns: pa.DataType) -> pa.Schema:
    return pa.schema([("round", pa.int64()), ("client_id", pa.string()), *columns.items()])


# rounds.parquet: one row per (round, client) that trained in the round
ROUNDS_SCHEMA = _per_client(
    num_examples=pa.int64(),
    train_loss=pa.float64(),
    masked_accuracy=pa.float64(),
    bytes_up=pa.int64(),
    bytes_down=pa.int64(),
    seconds=pa.float64(),
)
# evaluation.parquet: the new encoder with each client's own head on its held-out utterances
EVALUATION_METRICS = {  # {column: (the evaluation reply's metric, its type)}
    "utterances": ("utterances", int),
    "masked_frames": ("num-examples", int),
    "heldout_loss": ("heldout-loss", float),
    "heldout_masked_accuracy": ("heldout-masked-accuracy", float),
    "majority_accuracy": ("majority-accuracy", float),
    "leak_free_frames": ("leak-free-frames", int),
    "heldout_leak_free_masked_accuracy": ("heldout-leak-free-masked-accuracy", float),
    "leak_free_majority_accuracy": ("leak-free-majority-accuracy", float),
}
EVALUATION_SCHEMA = _per_client(
    **{column: {int: pa.int64(), float: pa.float64()}[kind] for column, (_, kind) in EVALUATION_METRICS.items()}
)


def record_rounds(paths: FederatedPaths) -> list[int]:
    """Rounds that have a record, whether or not their checkpoint is kept."""
    return paths.round_records.numbers(paths.rounds_dir)


def complete_rounds(paths: FederatedPaths) -> list[int]:
    """Rounds whose checkpoint and record both exist (only the last ``keep_rounds`` keep a checkpoint)."""
    checkpoints = set(paths.round_checkpoints.numbers(paths.rounds_dir))
    return [r for r in record_rounds(paths) if r in checkpoints]


class SettingsChanged(ValueError):
    """A run folder asked to resume with settings other than those it was started with."""


def check_settings(paths: FederatedPaths, config: FederatedConfig) -> None:
    """Refuse to resume ``paths`` with other settings than its ``settings.json`` (naming each change),
    or a folder with rounds but no settings; record them (the rounds asked for may grow)."""
    now = config.settings()
    try:
        before = json.loads(paths.settings.read_text())
    except FileNotFoundError:
        if record_rounds(paths) or paths.result.is_file():
            raise SettingsChanged(
                f"{paths.root} holds rounds but no settings.json: its settings are unknown, use another run folder"
            ) from None
        before = None
    if before is not None and (changes := settings_changes(before, now, resuming=True)):
        raise SettingsChanged(
            f"{paths.root} was started with other settings ({'; '.join(changes)}): resume it with the same "
            "settings, or use another run folder"
        )
    if before != now:
        atomic_write_text(paths.settings, json.dumps(now, indent=1, sort_keys=True) + "\n")


def read_records(paths: FederatedPaths, up_to: int) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for r in range(1, up_to + 1) if (path := paths.round_record(r)).is_file()]


def write_tables(paths: FederatedPaths, records: Sequence[Mapping[str, Any]]) -> None:
    rows = [row for record in records for row in record["rows"]]
    evaluation = [row for record in records for row in record["evaluation"]]
    for target, schema, data in (
        (paths.rounds_table, ROUNDS_SCHEMA, rows),
        (paths.evaluation_table, EVALUATION_SCHEMA, evaluation),
    ):
        # rows recorded before a column existed (a resumed run) hold null there
        table = pa.Table.from_pylist([{name: row.get(name) for name in schema.names} for row in data], schema=schema)
        with atomic_path(target) as tmp:
            pq.write_table(table, tmp)


def evaluation_summary(evaluation: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The federation's result of one round's held-out rows, weighted by (leak-free) masked frames;
    None where no frame was scored. A client without held-out frames counts for nothing."""
    scored = [e for e in evaluation if e.get("masked_frames")]

    def mean(column: str, weight: str) -> float | None:
        rows = [e for e in scored if e.get(weight)]
        total = sum(e[weight] for e in rows)
        if not total or any(e.get(column) is None for e in rows):
            return None  # a record written before the column existed
        return sum(e[column] * e[weight] for e in rows) / total

    return {
        "clients": len(scored),
        "masked_frames": sum(e["masked_frames"] for e in scored),
        "heldout_loss": mean("heldout_loss", "masked_frames"),
        "heldout_masked_accuracy": mean("heldout_masked_accuracy", "masked_frames"),
        "majority_accuracy": mean("majority_accuracy", "masked_frames"),
        "leak_free_frames": sum(e.get("leak_free_frames") or 0 for e in scored),
        "heldout_leak_free_masked_accuracy": mean("heldout_leak_free_masked_accuracy", "leak_free_frames"),
        "heldout_leak_free_majority_accuracy": mean("leak_free_majority_accuracy", "leak_free_frames"),
    }


def summarize_rounds(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One line per round; train loss weighted as the aggregation was (None when withheld), the
    held-out result from the record's summary (all there is under DP) or its rows."""
    lines = []
    for record in records:
        rows = record["rows"]
        evaluated = record.get("evaluation_summary") or evaluation_summary(record["evaluation"])
        weights = [r.get("weight", r["num_examples"]) for r in rows]
        withheld = any(r["train_loss"] is None for r in rows)
        lines.append(
            {
                "round": record["round"],
                "clients": len(rows),
                "missing": list(record.get("missing", [])),
                "train_loss": None
                if withheld
                else sum(r["train_loss"] * w for r, w in zip(rows, weights, strict=True)) / (sum(weights) or 1),
                **{k: v for k, v in evaluated.items() if k not in ("clients", "masked_frames")},
                "bytes_up": sum(r["bytes_up"] for r in rows),
                "bytes_down": sum(r["bytes_down"] for r in rows),
                "round_seconds": record["round_seconds"],
                # the share of the round not spent in the slowest client's training (None: withheld)
                "overhead": None
                if (slowest := record.get("slowest_client_seconds", 0.0)) is None
                else 1.0 - slowest / record["round_seconds"]
                if record["round_seconds"] > 0
                else 0.0,
                # records written before sampling: every client was asked (the trained and the missing)
                "sampled": len(record.get("sampled") or []) or len(rows) + len(record.get("missing", [])),
                "epsilon": (record.get("privacy") or {}).get("epsilon"),
            }
        )
    return lines


def round_log_line(record: Mapping[str, Any], rounds: int) -> str:
    """The progress line of one completed round; accuracies on leak-free frames, as every view."""
    line = summarize_rounds([record])[0]
    missing = f", missing {', '.join(line['missing'])}" if line["missing"] else ""
    accuracy, majority = line["heldout_leak_free_masked_accuracy"], line["heldout_leak_free_majority_accuracy"]
    return (
        f"round {line['round']}/{rounds}: {line['clients']} clients{missing}, train loss "
        f"{'n/a' if line['train_loss'] is None else format(line['train_loss'], '.4f')}, held-out masked accuracy "
        f"{'n/a' if accuracy is None else f'{accuracy:.3f}'} (majority class "
        f"{'n/a' if majority is None else format(majority, '.3f')}), "
        f"{line['round_seconds']:.0f} s"
    )
