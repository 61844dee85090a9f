"""Metadata for people: numbers rounded with their unit in the key (``_mb``, ``_s``, ``_h``), lists
of records as Dagster tables with a column schema, the MLflow run as a link."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from speech_assets.corpus.clients import read_clients
from speech_assets.defs.partitions import TARGETS_ASSETS
from speech_assets.defs.resources import StoragePaths
from speech_assets.layout import TargetFiles
from speech_assets.stats import plots
from speech_assets.targets.checks import label_problems
from speech_assets.train import accuracy

COLUMN_TYPES = {bool: "bool", int: "int", float: "float", str: "string"}


def megabytes(size: float | None) -> float | None:
    """Bytes as MB (10^6), two decimals."""
    return None if size is None else round(size / 1e6, 2)


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(float(value), digits)


def table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str]) -> dg.TableMetadataValue:
    """``rows`` as a Dagster table of ``columns`` (``{name: description}``, in order): floats to 4
    significant digits, lists joined with commas."""

    def cell(value: Any) -> Any:
        if isinstance(value, float):
            return float(f"{value:.4g}")
        if isinstance(value, list | tuple):
            return ", ".join(map(str, value))
        return value

    records = [{name: cell(row.get(name)) for name in columns} for row in rows]
    schema = []
    for name, description in columns.items():
        kinds = {type(record[name]) for record in records if record[name] is not None}
        kinds = {float} if kinds == {int, float} else kinds
        kind = COLUMN_TYPES.get(kinds.pop(), "string") if len(kinds) == 1 else "string"
        schema.append(dg.TableColumn(name, kind, description=description))
    return dg.MetadataValue.table(records=[dg.TableRecord(r) for r in records], schema=dg.TableSchema(columns=schema))


def per_client_table(heldout_per_client: Mapping[str, Mapping[str, Any]]) -> dg.TableMetadataValue:
    """The held-out results of each client as a table."""
    rows = [accuracy.per_client_row(client, scores) for client, scores in sorted(heldout_per_client.items())]
    return table(rows, accuracy.PER_CLIENT_COLUMNS)


def mlflow_links(run_id: str | None, url: str | None, ui_command: str | None = None) -> dict[str, Any]:
    """The MLflow run as a link and its id; for a local store, the command that serves the UI."""
    if not run_id:
        return {}
    links: dict[str, Any] = {"mlflow_run_id": dg.MetadataValue.text(run_id)}
    if url:
        links["mlflow_run_url"] = dg.MetadataValue.url(url)
    if ui_command:
        links["mlflow_ui"] = dg.MetadataValue.text(f"make mlflow (or: {ui_command})")
    return links


def client_metadata(quality: dict, out_dir) -> dict[str, object]:
    """One client's page: its own quality figures (plotted across partitions) and a bounded speaker list."""
    import numpy as np

    with np.load(TargetFiles(out_dir).state) as state:
        counts = state["counts"]
    client, alt = quality["client_id"], f"{quality['client_id']} cluster sizes"
    speakers = quality["speakers"]
    shown = speakers[:MAX_LISTED]
    listing = ", ".join(shown) + (f" ... and {len(speakers) - len(shown)} more" if len(speakers) > len(shown) else "")
    return {
        "k": quality["k"],
        "frames_fit": quality["frames_fit"],
        "frames_labelled": quality["frames_labelled"],
        "inertia_per_frame": round(quality["inertia_per_frame"], 3),
        "perplexity": round(quality["perplexity"], 1),
        "perplexity_share_of_k": round(quality["perplexity"] / max(quality["k"], 1), 3),
        "empty_clusters": quality["empty_clusters"],
        "mean_segment_length": round(quality["mean_segment_length"], 2),
        "mode": quality.get("mode", "refit"),
        "speakers": len(speakers),
        "speaker_ids": dg.MetadataValue.md(listing),
        "codebook_speakers": len(quality.get("codebook_speakers", speakers)),
        "label_rate_hz": 50,
        "cluster_sizes": dg.MetadataValue.md(plots.markdown_image(plots.cluster_sizes({client: counts}), alt)),
        "path": dg.MetadataValue.path(str(out_dir)),
    }


MAX_LISTED = 50


def problems_result(problems: list[str], description: str | None = None, **metadata: Any) -> dg.AssetCheckResult:
    """A blocking check's result: failed (an error) with the first 20 ``problems`` listed, or passed."""
    return dg.AssetCheckResult(
        passed=not problems,
        severity=dg.AssetCheckSeverity.ERROR,
        description=description,
        metadata={
            **metadata,
            "problems": len(problems),
            "first_problems": dg.MetadataValue.md("\n".join(f"- {p}" for p in problems[:20]) or "none"),
        },
    )


def labels_match_shards_check(iteration: int) -> dg.AssetChecksDefinition:
    """The blocking check ``labels_match_shards`` of HuBERT ``iteration``'s targets."""
    which = "" if iteration == 1 else f"iteration-{iteration} "

    @dg.asset_check(
        asset=TARGETS_ASSETS[iteration],
        name="labels_match_shards",
        blocking=True,
        description=(
            f"Every client's {which}labels cover exactly its speakers' utterances, one label per 50 Hz frame "
            "((num_frames + 1) // 2), every label a valid cluster id of its codebook."
        ),
    )
    def check(paths: StoragePaths) -> dg.AssetCheckResult:
        clients = read_clients(paths.layout.clients_file)
        return problems_result(label_problems(clients, paths.shard_file, lambda c: paths.targets(c, iteration).root))

    return check
