"""The offline report: one static HTML page (no CDN, no script) beside the DuckDB database, its plots
inlined and its reject clips under ``audio/``. Verdicts come from the same functions as the assets'
metadata and the CLI; every table shows its SQL for ``speech-assets sql``.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from speech_assets.layout import ReportFiles
from speech_assets.stats import plots
from speech_assets.train import accuracy as held
from speech_assets.utils import atomic_write_text

MAX_ROWS = 50

SECTIONS: list[tuple[str, str, str]] = [
    (
        "Corpus",
        "What was kept, in hours, before and after VAD.",
        "SELECT (SELECT count(*) FROM manifest) AS utterances_kept, round((SELECT coalesce(sum(duration_s), 0) FROM "
        'manifest) / 3600, 3) AS "hours (h)", (SELECT count(*) FROM utterances) AS after_vad, round((SELECT '
        'coalesce(sum(trimmed_duration_s), 0) FROM utterances) / 3600, 3) AS "speech (h)", (SELECT count(*) FROM '
        "rejects) AS rejects, (SELECT count(DISTINCT speaker_id) FROM manifest) AS speakers",
    ),
    (
        "Rejects by reason",
        "Every stage's quarantined files, counted by reason.",
        "SELECT stage, reason, rejects FROM rejects_by_reason ORDER BY rejects DESC",
    ),
    (
        "Speakers",
        "Each speaker's client and split (held-out speakers are never trained on), hours before and after VAD.",
        'SELECT speaker_id, client_id, split, utterances, round(hours, 3) AS "hours (h)", round(trimmed_hours, 3) AS '
        '"speech (h)" FROM hours_per_speaker ORDER BY split DESC, client_id, speaker_id',
    ),
    (
        "Clients",
        "Speakers per client (non-IID: a speaker never spans two clients) and their speech after VAD.",
        'SELECT client_id, speakers, utterances, round(trimmed_hours, 3) AS "speech (h)" FROM '
        "hours_per_client ORDER BY client_id",
    ),
    (
        "Train / held-out split",
        "The trainer's held-out split, replicated in SQL.",
        'SELECT split, speakers, utterances, round(trimmed_hours, 3) AS "speech (h)" FROM hours_per_split',
    ),
    (
        "k-means quality",
        "Per client: codebook size, frames fitted, inertia, perplexity (of K) and empty clusters.",
        "SELECT client_id, k, frames_fit, round(inertia_per_frame, 3) AS inertia_per_frame, round(perplexity, 1) AS "
        'perplexity, empty_clusters, round(mean_segment_length, 2) AS "mean segment (frames)" FROM kmeans_quality '
        "ORDER BY client_id",
    ),
    (
        "Training runs",
        "Every model (centralised, federated, distilled, iteration 2): steps (rounds for federated), final loss, "
        "held-out masked accuracy (on leak-free frames, as everywhere) against the majority-class rate on the same "
        "frames.",
        "SELECT kind, preset, steps, round(final_loss, 3) AS final_loss, round(heldout_leak_free_masked_accuracy, 3) "
        "AS heldout_masked_accuracy, round(heldout_leak_free_majority_accuracy, 3) AS majority_rate, "
        'round(chance_accuracy, 3) AS chance, round(audio_seconds_per_second, 1) AS "audio s/s", mlflow_run_id, '
        "checkpoint FROM training_runs ORDER BY kind, run_dir",
    ),
    (
        "Checkpoints",
        "Lineage of each checkpoint: weights hash, git commit, MLflow and Dagster runs, and the manifest it "
        "was trained from.",
        "SELECT kind, step, step_unit, sha256, git_commit, mlflow_run_id, dagster_run_id, manifest_hash, "
        "path FROM checkpoints ORDER BY kind, path",
    ),
    (
        "Export parity",
        "The exported encoder (ONNX, TorchScript) against PyTorch on real shard utterances: largest absolute "
        "difference (fp32).",
        'SELECT checkpoint_sha256, layer, max_abs_diff AS "ONNX max |diff|", torchscript_max_abs_diff AS "TorchScript '
        'max |diff|", parity_utterances AS utterances, parity_frames AS frames, folder FROM exports ORDER BY folder',
    ),
    (
        "Distilled student",
        "The student against its teacher: encoder parameters and single-thread CPU forward speed on the same "
        "utterances.",
        'SELECT round(speedup, 2) AS "speed-up (x)", round(student_parameters / 1e6, 2) AS "student params (M)", '
        'round(teacher_parameters / 1e6, 2) AS "teacher params (M)", round(student_audio_s_per_s, 0) AS "student audio '
        's/s", round(teacher_audio_s_per_s, 0) AS "teacher audio s/s", run_dir FROM distillation ORDER BY run_dir',
    ),
    (
        "Federated rounds",
        "Per round and client: examples, local training loss and masked accuracy (on its own training batches, "
        "not held out), MB exchanged, seconds.",
        "SELECT round, client_id, num_examples, round(train_loss, 3) AS train_loss, round(masked_accuracy, 3) AS "
        'train_masked_accuracy, round(bytes_up / 1e6, 2) AS "MB up", round(bytes_down / 1e6, 2) AS "MB down", '
        'round(seconds, 1) AS "seconds (s)" FROM federated_rounds ORDER BY round, client_id',
    ),
]
PROBE_ROWS_SQL = "SELECT * FROM probe_results ORDER BY split, model, seed"
PROBE_TEXT = (
    "Character CTC probe on frozen features, per encoder: held-out CER and WER over probe seeds, the CER change "
    "against fbank and random on the same utterances, and the verdict (as downstream_probe and speech-assets probe)."
)
FINETUNE_ROWS_SQL = "SELECT * FROM finetune_results ORDER BY labelled_minutes, decoder, split, model, seed"
FINETUNE_TEXT = (
    "Each encoder fine-tuned with CTC against the same model from scratch, per labelled budget: the verdict, then "
    "the table (as finetuned_asr and speech-assets finetune)."
)
# the sections about models; the rest of SECTIONS is about the data
MODEL_SECTIONS = ("Training runs", "Checkpoints", "Export parity", "Distilled student", "Federated rounds")
REJECT_EXAMPLES_TEXT = (
    "Up to three examples of each reason, with the human-readable detail and a clip to listen to "
    "(for no_speech, the VAD's decision over the waveform)."
)
REJECT_EXAMPLES_SQL = (
    "SELECT stage, reason, utt_id, path, detail FROM (SELECT *, row_number() OVER (PARTITION BY stage, reason ORDER BY "
    "utt_id) AS n FROM rejects) WHERE n <= 3 ORDER BY stage, reason, utt_id"
)


@dataclass
class ReportInputs:
    """What the report shows beyond the database. ``vad`` (a
    :class:`~speech_assets.features.vad.VadConfig`) redraws the ``no_speech`` decisions."""

    cluster_counts: Mapping[str, np.ndarray] = field(default_factory=dict)
    training_metrics: Mapping[str, Sequence[Mapping[str, float]]] = field(default_factory=dict)
    header: Mapping[str, str | None] = field(default_factory=dict)
    corpus_root: Path | None = None
    vad: Any = None
    # below this many held-out speakers the fine-tuning verdict is "indicative only" ([probe])
    min_heldout_speakers: int = 3
    # downstream_probe's results.parquet (utterances.parquet and leaderboard.parquet beside it)
    probe_results: Path | None = None


HEADER_LABELS = {"dagster_run_id": "Dagster run", "settings_source": "settings file"}  # others: spaced key
SHA256 = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def format_value(value: object) -> str:
    """A cell as escaped HTML: floats to 4 significant digits (scientific below 0.001); a sha256 or a
    git commit cut to 12 characters with the full value in its ``title``."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if not math.isfinite(value):
            return html.escape(str(value))
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.2e}"
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    text = str(value)
    if SHA256.fullmatch(text):
        return f'<span class="hash" title="{text}">{text[:12]}</span>'
    return html.escape(text)


def _html_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A table of cells that are already HTML."""
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{''.join(f'<th>{c}</th>' for c in head)}</tr></thead><tbody>{body}</tbody></table>"


def _table(con: duckdb.DuckDBPyConnection, sql: str) -> str:
    relation = con.execute(sql)
    rows = relation.fetchmany(MAX_ROWS + 1)
    table = _html_table(
        [html.escape(d[0]) for d in relation.description], [[format_value(v) for v in row] for row in rows[:MAX_ROWS]]
    )
    if len(rows) > MAX_ROWS:
        table += f'<p class="note">first {MAX_ROWS} rows shown; run the query for all of them</p>'
    return table + ('<p class="note">no rows</p>' if not rows else "")


def _header(inputs: ReportInputs, db_path: Path) -> str:
    rows = [(HEADER_LABELS.get(key, key.replace("_", " ")), value) for key, value in inputs.header.items()]
    rows.append(("database", str(db_path)))
    body = "".join(
        f"<tr><th>{html.escape(label)}</th><td>{format_value(value) or 'unknown'}</td></tr>" for label, value in rows
    )
    return f'<table class="header">{body}</table>'


def _summary(con: duckdb.DuckDBPyConnection) -> str:
    """The report in a few lines: data kept, split, rejects, each model, export and student."""
    one = lambda sql: con.execute(sql).fetchone()  # noqa: E731
    every = lambda sql: con.execute(sql).fetchall()  # noqa: E731
    kept, hours, speakers = one(
        "SELECT count(*), coalesce(sum(duration_s), 0) / 3600, count(DISTINCT speaker_id) FROM manifest"
    )
    speech = one("SELECT coalesce(sum(trimmed_duration_s), 0) / 3600 FROM utterances")[0]
    clients, heldout = one(
        "SELECT count(DISTINCT client_id), count(*) FILTER (WHERE split = 'heldout') FROM speaker_split"
    )
    items = [
        f"{kept:,} utterances kept ({hours:.2f} h) from {speakers} speakers; {speech:.2f} h of speech after VAD",
        f"{clients} clients; {heldout} held-out speaker(s), never trained on",
    ]
    rejects = every("SELECT reason, sum(rejects) FROM rejects_by_reason GROUP BY ALL ORDER BY 2 DESC, 1")
    total = sum(n for _, n in rejects)
    items.append(
        f"{total:,} rejects" + (": " + ", ".join(f"{reason} {n:,}" for reason, n in rejects) if rejects else "")
    )
    models = every(
        f"SELECT kind, steps, final_loss, {held.ACCURACY}, {held.MAJORITY} FROM training_runs ORDER BY kind, run_dir"
    )
    for kind, steps, loss, accuracy, majority in models:
        unit = "rounds" if kind == "federated" else "steps"
        measured = held.heldout_accuracy({held.ACCURACY: accuracy, held.MAJORITY: majority})
        held_out = f", {measured}" if measured else ""
        items.append(f"{kind} model: {steps} {unit}, final loss {format_value(loss)}{held_out}")
    for onnx, torchscript in every("SELECT max_abs_diff, torchscript_max_abs_diff FROM exports ORDER BY folder"):
        items.append(f"export parity: ONNX max |diff| {format_value(onnx)}, TorchScript {format_value(torchscript)}")
    for speedup, student, teacher in every("SELECT speedup, student_parameters, teacher_parameters FROM distillation"):
        size = f" with {student / 1e6:.2f} M vs {teacher / 1e6:.2f} M parameters" if student and teacher else ""
        items.append(f"distilled student: {format_value(speedup)}x the teacher's CPU forward speed{size}")
    if not models:
        items.append("no model trained yet")
    return '<ul class="summary">' + "".join(f"<li>{html.escape(item)}</li>" for item in items) + "</ul>"


def _reject_examples(con: duckdb.DuckDBPyConnection, inputs: ReportInputs, out_dir: Path) -> tuple[str, set[str]]:
    """The examples' table with an audio player per example that has a clip; the clips' names."""
    from speech_assets.stats.examples import reject_examples

    rows = con.execute(REJECT_EXAMPLES_SQL).fetchall()
    examples = reject_examples(rows, inputs.corpus_root, ReportFiles(out_dir).audio, inputs.vad)
    cells = []
    for e in examples:
        listen = (
            f'<audio controls preload="metadata" src="{ReportFiles.audio.name}/{e.clip}"></audio>' if e.clip else ""
        )
        picture = plots.html_image(e.vad_png, f"VAD decision for {html.escape(e.utt_id)}", "vad") if e.vad_png else ""
        texts = [html.escape(v) for v in (e.stage, e.reason, e.utt_id, e.detail)]
        path = f'<span class="path">{html.escape(e.path)}</span>'
        cells.append([*texts, f'{listen}{picture}<p class="note">{html.escape(e.note)}</p>', path])
    table = _html_table(["stage", "reason", "utt_id", "detail", "listen", "path"], cells)
    return table if rows else '<p class="note">no rejects</p>', {e.clip for e in examples if e.clip}


def _section(title: str, text: str, content: str, sql: str | None = None) -> str:
    query = (
        f"<details><summary>SQL</summary><pre>{html.escape(sql)}</pre>"
        f'<p class="note">speech-assets sql {html.escape(json.dumps(sql))}</p></details>'
        if sql
        else ""
    )
    return f"<section><h2>{html.escape(title)}</h2><p>{html.escape(text)}</p>{content}{query}</section>"


def _markdown_html(text: str) -> str:
    """The markdown of :func:`~speech_assets.evaluation.finetune_results.markdown_tables` (bold
    lines, pipe tables, plain lines) as HTML, so the report shows the asset's table as is."""
    out: list[str] = []
    table: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [html.escape(c.strip()) for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                table.append(cells)
            continue
        if table:
            out.append(_html_table(table[0], table[1:]))
            table = []
        if line.startswith("**") and line.endswith("**"):
            out.append(f"<h3>{html.escape(line.strip('*'))}</h3>")
        elif line.strip():
            out.append(f'<p class="note">{html.escape(line)}</p>')
    return "".join(out)


def _folded(summary: str, content: str) -> str:
    return f'<details class="raw"><summary>{html.escape(summary)}</summary>{content}</details>'


def _probe_verdicts(con: duckdb.DuckDBPyConnection, inputs: ReportInputs) -> str | None:
    """The probe's leaderboard as the asset's metadata and ``speech-assets probe`` show it, with
    the raw per-seed rows folded below; None where the probe has not run."""
    from speech_assets.evaluation.compare import LEADERBOARD_COLUMNS, leaderboard_rows, load_leaderboard, reading_note

    raw = con.execute("SELECT count(*) FROM probe_results").fetchone()[0]
    path = inputs.probe_results
    found = path is not None and path.is_file()
    if not raw and not found:
        return None
    if found:
        try:
            board, min_speakers = load_leaderboard(path, inputs.min_heldout_speakers)
        except ValueError as error:
            content = f'<p class="note">{html.escape(f"{path}: {error}")}</p>'
        else:
            names = [name for name, _, _ in LEADERBOARD_COLUMNS]
            head = "".join(f'<th title="{html.escape(tip)}">{html.escape(n)}</th>' for n, _, tip in LEADERBOARD_COLUMNS)
            body = "".join(
                "<tr>" + "".join(f'<td class="nowrap">{format_value(row[n])}</td>' for n in names) + "</tr>"
                for row in leaderboard_rows(board)
            )
            content = (
                f'<table class="verdicts"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
                f'<p class="caveat">{html.escape(reading_note(board, min_speakers))}</p>'
            )
    else:
        content = '<p class="note">no leaderboard beside the probe results: rematerialize downstream_probe</p>'
    if raw:
        content += _folded("per-seed rows (every model, seed and split)", _table(con, PROBE_ROWS_SQL))
    return _section("Probe leaderboard", PROBE_TEXT, content, PROBE_ROWS_SQL if raw else None)


def _finetune_section(con: duckdb.DuckDBPyConnection, inputs: ReportInputs) -> str | None:
    """The fine-tuning verdicts and per-budget table as ``speech-assets finetune`` shows them, the raw
    rows folded below; None without results."""
    from speech_assets.evaluation.finetune_results import markdown_tables, probe_reference, verdicts

    relation = con.execute("SELECT * FROM finetune_results")
    rows = [dict(zip([d[0] for d in relation.description], values, strict=True)) for values in relation.fetchall()]
    if not rows:
        return None
    probe = probe_reference(inputs.probe_results) if inputs.probe_results else {}
    lines = verdicts(rows, min_heldout_speakers=inputs.min_heldout_speakers)  # the text notes: under the table
    content = (
        "<ul>"
        + "".join(f"<li>{html.escape(line)}</li>" for line in lines)
        + "</ul>"
        + _markdown_html(markdown_tables(rows, probe))
        + _folded("per-seed rows (every model, budget, seed, decoder and split)", _table(con, FINETUNE_ROWS_SQL))
    )
    return _section("Fine-tuning against scratch", FINETUNE_TEXT, content, FINETUNE_ROWS_SQL)


def _plots(con: duckdb.DuckDBPyConnection, inputs: ReportInputs) -> list[str]:
    parts = []
    histograms = (
        ("Utterance durations", "Kept utterances by duration (manifest).", "duration_s FROM manifest", "seconds", 30),
        ("Speech ratio after VAD", "Share of each utterance the VAD kept.", "speech_ratio FROM utterances", "kept", 20),
    )
    for title, text, source, unit, bins in histograms:
        sql = f"SELECT {source}"
        if values := [r[0] for r in con.execute(sql).fetchall()]:
            image = plots.histogram(values, title.lower(), unit, bins=bins)
            parts.append(_section(title, text, plots.html_image(image, f"{title.lower()} histogram"), sql))
    for unit in ("speaker", "client"):
        sql = f"SELECT {unit}_id, trimmed_hours FROM hours_per_{unit}"
        if rows := con.execute(f"{sql} ORDER BY {unit}_id").fetchall():
            title = f"hours per {unit}"
            bars = plots.bars([name for name, _ in rows], [hours for _, hours in rows], title, "hours")
            parts.append(
                _section(title.capitalize(), f"Speech after VAD per {unit}.", plots.html_image(bars, title), sql)
            )
    if inputs.cluster_counts:
        parts.append(
            _section(
                "Cluster sizes",
                "Per client, the share of frames in each cluster, largest first.",
                plots.html_image(plots.cluster_sizes(inputs.cluster_counts), "cluster sizes"),
            )
        )
    return parts


def _training_curves(inputs: ReportInputs) -> list[str]:
    text = "Loss, masked accuracy (training batches; held-out on leak-free frames) and learning rate against step."
    return [
        _section(f"Training curve: {run}", text, plots.html_image(plots.training_curve(rows), f"training curve {run}"))
        for run, rows in sorted(inputs.training_metrics.items())
        if rows
    ]


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; display: block; max-width: 100%; overflow-x: auto; } td, th {
border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; } pre { background: #f7f7f7; padding: 6px; white-space: pre-wrap; }
.note { color: #666; font-size: 0.85em; margin: 2px 0; } img.plot { width: 100%; height: auto; }
img.vad { width: 480px; max-width: 100%; display: block; } span.path { font-size: 0.8em; color: #555; word-break:
break-all; }
table.header th { width: 10em; } td.nowrap { white-space: nowrap; } h1.part { margin-top: 1.6em; }
.caveat { background: #fff8e0; padding: 4px 8px; font-size: 0.9em; } details.raw { margin: 0.5em 0; }
ul.summary { font-size: 1.05em; line-height: 1.5; } .hash { font-family: monospace; }
"""


TITLE = "speech_assets report: probe and fine-tuning verdicts, models, data quality"


def write_report(db_path: Path, out_path: Path, inputs: ReportInputs | None = None, title: str = TITLE) -> Path:
    """Render the report into ``out_path`` (atomically), with reject examples' clips under ``audio/``
    beside it (clips no longer shown are removed)."""
    from speech_assets.stats.examples import remove_unused

    inputs = inputs or ReportInputs()
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        verdicts = [v for v in (_probe_verdicts(con, inputs), _finetune_section(con, inputs)) if v]
        examples, clips = _reject_examples(con, inputs, out_path.parent)
        tables = {name: _section(name, text, _table(con, sql), sql) for name, text, sql in SECTIONS}
        models = [tables.pop(name) for name in MODEL_SECTIONS]
        data = list(tables.values())
        data.insert(2, _section("Reject examples", REJECT_EXAMPLES_TEXT, examples, REJECT_EXAMPLES_SQL))
        with plots.cached_in(ReportFiles(out_path.parent).plots):
            data[1:1] = _plots(con, inputs)
            models[1:1] = _training_curves(inputs)
        summary = _summary(con)
    finally:
        con.close()
    if not verdicts:
        verdicts = ['<p class="note">no probe or fine-tuning results yet: materialize downstream_probe</p>']
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        + "".join(verdicts)
        + '<h1 class="part">Models</h1>'
        + f'<section><h2>Summary</h2>{summary}<p class="note">Every table below shows its SQL.</p></section>'
        + "".join(models)
        + '<h1 class="part">Data quality</h1>'
        + "".join(data)
        + f"<section><h2>About this report</h2>{_header(inputs, db_path)}</section>"
        + "</body></html>\n"
    )
    atomic_write_text(out_path, page)
    remove_unused(ReportFiles(out_path.parent).audio, clips)
    return out_path
