"""The offline data-quality report: one static HTML page (no CDN, no script) written beside the
DuckDB database by ``dataset_stats``.

Every table on the page shows the SQL that produced it, so a reader can re-run it with
``speech-assets sql``; plots are inlined PNGs (``stats.plots``).
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np

from speech_assets.stats import plots
from speech_assets.utils import atomic_write_text

MAX_ROWS = 50
PLOT_CACHE = ".plots"  # beside the report: its plots' PNGs by input hash, reused while unchanged

SECTIONS: list[tuple[str, str, str]] = [
    ("Corpus", "What was kept, in hours, before and after VAD.",
     "SELECT (SELECT count(*) FROM manifest) AS utterances_kept, round((SELECT coalesce(sum(duration_s), 0) FROM manifest) / 3600, 3) AS hours, "
     "(SELECT count(*) FROM utterances) AS after_vad, round((SELECT coalesce(sum(trimmed_duration_s), 0) FROM utterances) / 3600, 3) AS speech_hours, "
     "(SELECT count(*) FROM rejects) AS rejects, (SELECT count(DISTINCT speaker_id) FROM manifest) AS speakers"),
    ("Rejects by reason", "Every stage's quarantined files, counted by reason.",
     "SELECT stage, reason, rejects FROM rejects_by_reason ORDER BY rejects DESC"),
    ("Reject examples", "Up to three examples of each reason, with the human-readable detail.",
     "SELECT stage, reason, utt_id, path, detail FROM (SELECT *, row_number() OVER (PARTITION BY stage, reason ORDER BY utt_id) AS n FROM rejects) WHERE n <= 3 ORDER BY stage, reason, utt_id"),
    ("Clients", "Speakers per client (non-IID: a speaker never spans two clients) and their speech after VAD.",
     "SELECT client_id, speakers, utterances, round(trimmed_hours, 4) AS trimmed_hours FROM hours_per_client ORDER BY client_id"),
    ("Train / held-out split", "The trainer's held-out split, replicated in SQL.",
     "SELECT split, utterances, round(trimmed_hours, 4) AS trimmed_hours FROM hours_per_split"),
    ("k-means quality", "Per client: codebook size, frames fitted, inertia, perplexity (of K) and empty clusters.",
     "SELECT client_id, k, frames_fit, round(inertia_per_frame, 3) AS inertia_per_frame, round(perplexity, 1) AS perplexity, "
     "empty_clusters, round(mean_segment_length, 2) AS mean_segment_length FROM kmeans_quality ORDER BY client_id"),
    ("Training runs", "Each checkpoint: steps, final loss, held-out masked accuracy against the majority-class rate.",
     "SELECT preset, steps, round(final_loss, 3) AS final_loss, round(heldout_masked_accuracy, 3) AS heldout_acc, "
     "round(heldout_majority_accuracy, 3) AS majority_rate, round(chance_accuracy, 3) AS chance, mlflow_run_id, checkpoint FROM training_runs ORDER BY run_dir"),
    ("Checkpoints", "Lineage of each checkpoint: weights hash, MLflow run and the manifest it was trained from.",
     "SELECT path, step, sha256, mlflow_run_id, manifest_hash FROM checkpoints ORDER BY path"),
]
OPTIONAL_SECTIONS: list[tuple[str, str, str, str]] = [
    ("federated_rounds", "Federated rounds", "Per round and client: examples, local loss and accuracy, bytes exchanged.",
     "SELECT * FROM federated_rounds ORDER BY round, client_id"),
    ("probe_results", "Downstream probe", "Character CTC probe on frozen features: CER and WER per model and split.",
     "SELECT * FROM probe_results ORDER BY split, cer"),
]


@dataclass
class ReportInputs:
    """What the report shows beyond the database: cluster sizes per client and training curves."""

    cluster_counts: Mapping[str, np.ndarray] = field(default_factory=dict)
    training_metrics: Mapping[str, Sequence[Mapping[str, float]]] = field(default_factory=dict)


def _table(con: duckdb.DuckDBPyConnection, sql: str) -> str:
    relation = con.execute(sql)
    columns = [d[0] for d in relation.description]
    rows = relation.fetchmany(MAX_ROWS + 1)
    more = len(rows) > MAX_ROWS
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape('' if v is None else str(v))}</td>" for v in row) + "</tr>"
        for row in rows[:MAX_ROWS]
    )
    note = f'<p class="note">first {MAX_ROWS} rows shown; run the query for all of them</p>' if more else ""
    empty = '<p class="note">no rows</p>' if not rows else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}{empty}"


def _section(title: str, text: str, content: str, sql: str | None = None) -> str:
    query = (
        f"<details><summary>SQL</summary><pre>{html.escape(sql)}</pre>"
        f"<p class=\"note\">speech-assets sql {html.escape(json.dumps(sql))}</p></details>"
        if sql
        else ""
    )
    return f"<section><h2>{html.escape(title)}</h2><p>{html.escape(text)}</p>{content}{query}</section>"


def _has_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return bool(con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [name]).fetchone()[0])


def _plots(con: duckdb.DuckDBPyConnection, inputs: ReportInputs) -> list[str]:
    parts = []
    durations = [r[0] for r in con.execute("SELECT duration_s FROM manifest").fetchall()]
    if durations:
        sql = "SELECT duration_s FROM manifest"
        parts.append(_section("Utterance durations", "Kept utterances by duration (manifest).",
                              plots.html_image(plots.histogram(durations, "utterance durations", "seconds"), "duration histogram"), sql))
    ratios = [r[0] for r in con.execute("SELECT speech_ratio FROM utterances").fetchall()]
    if ratios:
        parts.append(_section("Speech ratio after VAD", "Share of each utterance the VAD kept.",
                              plots.html_image(plots.histogram(ratios, "speech ratio", "kept / original", bins=20), "speech ratio histogram"),
                              "SELECT speech_ratio FROM utterances"))
    speakers = con.execute("SELECT speaker_id, trimmed_hours FROM hours_per_speaker ORDER BY speaker_id").fetchall()
    if speakers:
        parts.append(_section("Hours per speaker", "Speech after VAD per speaker.",
                              plots.html_image(plots.bars([s for s, _ in speakers], [h for _, h in speakers], "hours per speaker", "hours"), "hours per speaker"),
                              "SELECT speaker_id, trimmed_hours FROM hours_per_speaker"))
    clients = con.execute("SELECT client_id, trimmed_hours FROM hours_per_client ORDER BY client_id").fetchall()
    if clients:
        parts.append(_section("Hours per client", "Speech after VAD per client.",
                              plots.html_image(plots.bars([c for c, _ in clients], [h for _, h in clients], "hours per client", "hours"), "hours per client"),
                              "SELECT client_id, trimmed_hours FROM hours_per_client"))
    if inputs.cluster_counts:
        parts.append(_section("Cluster sizes", "Per client, the share of frames in each cluster, largest first.",
                              plots.html_image(plots.cluster_sizes(inputs.cluster_counts), "cluster sizes")))
    for run, rows in sorted(inputs.training_metrics.items()):
        if rows:
            parts.append(_section(f"Training curve: {run}", "Loss, masked accuracy and learning rate against step.",
                                  plots.html_image(plots.training_curve(rows), f"training curve {run}")))
    return parts


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; } td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: left; }
th { background: #f2f2f2; } pre { background: #f7f7f7; padding: 6px; white-space: pre-wrap; }
.note { color: #666; font-size: 0.8em; } img { max-width: 100%; }
"""


def write_report(db_path: Path, out_path: Path, inputs: ReportInputs | None = None, title: str = "speech_assets data-quality report") -> Path:
    """Render the report from the database at ``db_path`` into ``out_path`` (atomically)."""
    inputs = inputs or ReportInputs()
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        sections = [_section(name, text, _table(con, sql), sql) for name, text, sql in SECTIONS]
        with plots.cached_in(out_path.parent / PLOT_CACHE):
            sections[1:1] = _plots(con, inputs)
        for table, name, text, sql in OPTIONAL_SECTIONS:
            if _has_table(con, table):
                sections.append(_section(name, text, _table(con, sql), sql))
    finally:
        con.close()
    page = (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p class=\"note\">Built from {html.escape(str(db_path))}; every table shows its SQL.</p>"
        + "".join(sections)
        + "</body></html>\n"
    )
    atomic_write_text(out_path, page)
    return out_path
