"""The DuckDB database of dataset statistics: views over the Parquet outputs plus summary tables.

Built in a temp file and renamed into place under an exclusive lock: one writer at a time, and
readers (read-only) never see a half-built database.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from speech_assets.layout import RunFiles, lock_beside
from speech_assets.runtime.locks import exclusive_lock
from speech_assets.train.accuracy import ACCURACY, LABEL, MAJORITY
from speech_assets.train.tracking import recorded_run_id
from speech_assets.utils import atomic_path, read_json


@dataclass
class StatsInputs:
    """Where the graph's outputs are; missing ones give empty tables rather than errors."""

    manifest: Path
    manifest_rejects: Path
    shards: list[Path]
    shard_rejects: list[Path]
    clients: Path
    kmeans_quality: list[Path]
    training_results: list[Path] = field(default_factory=list)
    federated_rounds: Path | None = None  # the rounds.parquet of the federated run to show, if any
    probe_results: Path | None = None  # downstream_probe's results.parquet
    finetune_results: Path | None = None  # finetuned_asr's results.parquet
    # result.json of each model's runs by kind (``CHECKPOINT_KINDS``); ``training_results`` are centralised
    model_results: dict[str, list[Path]] = field(default_factory=dict)
    exports: list[Path] = field(default_factory=list)  # encoder_export's encoder.json files


# Every kind of checkpoint the graph trains; a federated checkpoint's ``step`` counts rounds;
# ``finetuned``: each CTC fine-tuning run of finetuned_asr (pretrained and scratch, every budget and seed).
CHECKPOINT_KINDS = ("centralised", "federated", "distilled", "iteration2", "finetuned")


def _sql_str(value: str | os.PathLike[str]) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def _sql_list(paths: Sequence[Path]) -> str:
    return "[" + ", ".join(_sql_str(p) for p in paths) + "]"


# the split client_partitions chose (and recorded) once; speakers not in a client are 'unassigned'
SPEAKER_SPLIT_SQL = (
    "SELECT speaker_id, client_id, CASE WHEN heldout THEN 'heldout' ELSE 'train' END AS split FROM clients"
)


PROBE_COLUMNS = (
    "model VARCHAR, checkpoint_sha256 VARCHAR, probe VARCHAR, layer_weights DOUBLE[], split VARCHAR, cer DOUBLE, wer "
    "DOUBLE, utterances BIGINT, steps BIGINT, seed BIGINT, normalisation VARCHAR, speakers BIGINT, lr DOUBLE"
)


FINETUNE_COLUMNS = (
    "model VARCHAR, labelled_minutes DOUBLE, seed BIGINT, decoder VARCHAR, split VARCHAR, cer DOUBLE, wer DOUBLE, "
    "utterances BIGINT, steps BIGINT, dev_cer DOUBLE, labelled_seconds DOUBLE, checkpoint_sha256 VARCHAR, lr DOUBLE, "
    "heldout_speakers BIGINT, text_overlap BIGINT, oov_rate DOUBLE"
)

# one row per (round, client) of the federated run: exactly the columns of its rounds.parquet
FEDERATED_COLUMNS = (
    "round BIGINT, client_id VARCHAR, num_examples BIGINT, train_loss DOUBLE, masked_accuracy DOUBLE, bytes_up BIGINT, "
    "bytes_down BIGINT, seconds DOUBLE"
)


def _create_views(con: duckdb.DuckDBPyConnection, inputs: StatsInputs) -> None:
    con.execute(f"CREATE VIEW manifest AS SELECT * FROM read_parquet({_sql_str(inputs.manifest)})")
    reject_files = [inputs.manifest_rejects, *[p for p in inputs.shard_rejects if p.exists()]]
    con.execute(
        "CREATE VIEW rejects AS SELECT utt_id, path, stage, reason, detail "
        f"FROM read_parquet({_sql_list(reject_files)}, union_by_name = true)"
    )
    if inputs.shards:
        # A table, read once: every summary below scans it, and opening every shard file for
        # each of them cost seconds on a thousand shards. Only scalar columns are copied.
        con.execute(
            "CREATE TABLE utterances AS SELECT utt_id, speaker_id, regexp_extract(filename, '([^/]+)\\.parquet$', 1) "
            "AS shard, num_frames, CAST(duration_s AS DOUBLE) AS duration_s, CAST(trimmed_duration_s AS DOUBLE) AS "
            "trimmed_duration_s, CAST(speech_ratio AS DOUBLE) AS speech_ratio "
            f"FROM read_parquet({_sql_list(inputs.shards)}, filename = true) ORDER BY utt_id"
        )
    else:
        con.execute(
            "CREATE VIEW utterances AS SELECT NULL::VARCHAR AS utt_id, NULL::VARCHAR AS speaker_id, "
            "NULL::VARCHAR AS shard, NULL::INTEGER AS num_frames, NULL::DOUBLE AS duration_s, "
            "NULL::DOUBLE AS trimmed_duration_s, NULL::DOUBLE AS speech_ratio WHERE false"
        )
    if inputs.clients.exists():
        con.execute(f"CREATE VIEW clients AS SELECT * FROM read_parquet({_sql_str(inputs.clients)})")
    else:
        con.execute(
            "CREATE VIEW clients AS SELECT NULL::VARCHAR AS speaker_id, NULL::VARCHAR AS client_id, "
            "NULL::DOUBLE AS hours, NULL::BIGINT AS utterances, NULL::BOOLEAN AS heldout WHERE false"
        )


def _numeric(value: object) -> float | int | None:
    """``value`` when it is a number (a run folder's JSON may hold anything), else None."""
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def run_record(kind: str, result_file: Path) -> dict:
    """One model run's ``result.json`` in the shape every kind shares (``step`` counts rounds for a
    federated run; ``labelled_minutes`` is None for a fine-tuning run recorded before it was)."""
    r = read_json(result_file)
    folder = RunFiles(result_file.parent)
    config = read_json(folder.config)
    provenance = read_json(folder.provenance)
    if kind == "federated":
        rounds = [line.get("round") for line in r.get("round_summaries") or [] if line.get("round") is not None]
        r = {**r, "step": max(rounds) if rounds else r.get("rounds"), "final_loss": r.get("final_train_loss")}
    if kind == "finetuned":
        r = {**r, "preset": f"ctc-{r.get('init') or config.get('init')}"}
    return {
        **r,
        "init": r.get("init") if kind == "finetuned" else None,
        "labelled_minutes": _numeric(r.get("labelled_minutes", config.get("budget_minutes"))),
        "seed": _numeric(r.get("seed", config.get("seed"))),
        "lr": _numeric(r.get("lr", config.get("lr"))),
        "preset": r.get("preset")
        or r.get("student")
        or config.get("preset")
        or read_json(folder.settings).get("preset"),
        "mlflow_run_id": r.get("mlflow_run_id") or provenance.get("mlflow_run_id") or recorded_run_id(folder.root),
        "manifest_hash": (r.get("data_versions") or {}).get("manifest"),
        "git_commit": config.get("git_sha") or provenance.get("git_sha"),
        "dagster_run_id": provenance.get("dagster_run_id"),
    }


def _insert(con: duckdb.DuckDBPyConnection, table: str, row: dict) -> None:
    """One row of ``table`` from ``row``'s values of its columns (NULL where ``row`` has none)."""
    columns = [column for column, *_ in con.execute(f"DESCRIBE {table}").fetchall()]
    con.execute(f"INSERT INTO {table} VALUES ({', '.join('?' for _ in columns)})", [row.get(c) for c in columns])


def _create_tables(con: duckdb.DuckDBPyConnection, inputs: StatsInputs) -> None:
    # by name: older probe results (without seed, normalisation, speakers, lr) give NULLs there
    for table, columns, path, order in (
        ("probe_results", PROBE_COLUMNS, inputs.probe_results, "model, split"),
        (
            "finetune_results",
            FINETUNE_COLUMNS,
            inputs.finetune_results,
            "labelled_minutes, decoder, split, model, seed",
        ),
        ("federated_rounds", FEDERATED_COLUMNS, inputs.federated_rounds, "round, client_id"),
    ):
        con.execute(f"CREATE TABLE {table} ({columns})")
        if path is not None and path.is_file():
            con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM read_parquet({_sql_str(path)}) ORDER BY {order}")
    con.execute(
        "CREATE TABLE kmeans_quality (client_id VARCHAR, k INTEGER, frames_fit BIGINT, inertia_per_frame DOUBLE, "
        "perplexity DOUBLE, empty_clusters INTEGER, mean_segment_length DOUBLE, frames_labelled BIGINT)"
    )
    for path in sorted(inputs.kmeans_quality):
        _insert(con, "kmeans_quality", json.loads(path.read_text()))
    con.execute(
        "CREATE TABLE checkpoints (path VARCHAR, step BIGINT, sha256 VARCHAR, mlflow_run_id VARCHAR, "
        "manifest_hash VARCHAR, kind VARCHAR, step_unit VARCHAR, git_commit VARCHAR, dagster_run_id VARCHAR, "
        "run_dir VARCHAR, init VARCHAR)"
    )
    con.execute(
        "CREATE TABLE training_runs (run_dir VARCHAR, preset VARCHAR, steps BIGINT, final_loss DOUBLE, "
        "heldout_all_frames_masked_accuracy DOUBLE, heldout_all_frames_majority_accuracy DOUBLE, heldout_loss DOUBLE, "
        "chance_accuracy DOUBLE, audio_seconds_per_second DOUBLE, mlflow_run_id VARCHAR, checkpoint VARCHAR, "
        "heldout_interior_masked_accuracy DOUBLE, heldout_interior_majority_accuracy DOUBLE, "
        "heldout_leak_free_masked_accuracy DOUBLE, heldout_leak_free_majority_accuracy DOUBLE, kind VARCHAR, init "
        "VARCHAR, labelled_minutes DOUBLE, seed BIGINT, lr DOUBLE, dev_cer DOUBLE, heldout_cer DOUBLE, heldout_wer "
        "DOUBLE)"
    )
    con.execute(
        "CREATE TABLE distillation (run_dir VARCHAR, student_parameters BIGINT, teacher_parameters BIGINT, "
        "student_audio_s_per_s DOUBLE, teacher_audio_s_per_s DOUBLE, speedup DOUBLE)"
    )
    # {checkpoint sha256: labelled minutes}, for fine-tuning runs whose result.json predates them
    known = "SELECT checkpoint_sha256, labelled_minutes FROM finetune_results WHERE checkpoint_sha256 IS NOT NULL"
    budgets = dict(con.execute(known).fetchall())
    runs = [("centralised", p) for p in inputs.training_results]
    runs += [(kind, p) for kind in CHECKPOINT_KINDS for p in inputs.model_results.get(kind, [])]
    for kind, path in sorted(set(runs), key=lambda run: (CHECKPOINT_KINDS.index(run[0]), str(run[1]))):
        r = run_record(kind, path)
        if kind == "finetuned" and r["labelled_minutes"] is None:
            r["labelled_minutes"] = budgets.get(r.get("checkpoint_sha256"))
        # the checkpoints and training_runs tables take the columns they have from one row; result.json
        # keeps the all-frames figures under their old names, the tables name them apart from the
        # held-out masked accuracy (leak-free) every view shows
        row = {
            **r,
            "path": r.get("checkpoint"),
            "steps": r.get("step"),
            "sha256": r.get("checkpoint_sha256"),
            "kind": kind,
            "step_unit": "round" if kind == "federated" else "step",
            "run_dir": str(path.parent),
            "heldout_all_frames_masked_accuracy": r.get("heldout_masked_accuracy"),
            "heldout_all_frames_majority_accuracy": r.get("heldout_majority_accuracy"),
        }
        _insert(con, "checkpoints", row)
        _insert(con, "training_runs", row)
        if kind == "distilled" and r.get("speedup") is not None:  # the worker timed both models into result.json
            _insert(con, "distillation", row)
    con.execute(
        "CREATE TABLE exports (folder VARCHAR, checkpoint_sha256 VARCHAR, layer BIGINT, max_abs_diff DOUBLE, "
        "torchscript_max_abs_diff DOUBLE, parity_utterances BIGINT, parity_frames BIGINT)"
    )
    for path in sorted(inputs.exports):
        description = read_json(path)
        parity = description.get("parity") or {}
        row = {**parity, "parity_utterances": parity.get("utterances"), "parity_frames": parity.get("frames")}
        row |= {"folder": str(path.parent), "checkpoint_sha256": description.get("checkpoint_sha256")}
        _insert(con, "exports", {**row, "layer": (description.get("output") or {}).get("layer")})
    # Summaries are materialised: they are small and the CLI should answer instantly.
    con.execute(f"CREATE TABLE speaker_split AS {SPEAKER_SPLIT_SQL}")
    con.execute(
        "CREATE TABLE hours_per_speaker AS SELECT u.speaker_id, count(*) AS utterances, "
        "sum(u.duration_s) / 3600 AS hours, sum(u.trimmed_duration_s) / 3600 AS trimmed_hours, "
        "any_value(s.client_id) AS client_id, coalesce(any_value(s.split), 'unassigned') AS split "
        "FROM utterances u LEFT JOIN speaker_split s USING (speaker_id) GROUP BY ALL ORDER BY u.speaker_id"
    )
    con.execute(
        "CREATE TABLE hours_per_client AS SELECT c.client_id, count(DISTINCT u.speaker_id) AS speakers, "
        "count(*) AS utterances, sum(u.trimmed_duration_s) / 3600 AS trimmed_hours "
        "FROM utterances u JOIN clients c USING (speaker_id) GROUP BY ALL ORDER BY c.client_id"
    )
    con.execute(
        "CREATE TABLE hours_per_split AS SELECT coalesce(s.split, 'unassigned') AS split, count(DISTINCT u.speaker_id) "
        "AS speakers, count(*) AS utterances, sum(u.trimmed_duration_s) / 3600 AS trimmed_hours FROM utterances u LEFT "
        "JOIN speaker_split s USING (speaker_id) GROUP BY ALL ORDER BY split"
    )
    con.execute(
        "CREATE TABLE duration_histogram AS SELECT floor(duration_s) AS bucket_start_s, floor(duration_s) + 1 AS "
        "bucket_end_s, count(*) AS utterances FROM manifest GROUP BY ALL ORDER BY bucket_start_s"
    )
    con.execute(
        "CREATE TABLE speech_ratio_distribution AS SELECT floor(speech_ratio * 10) / 10 AS bucket_start, "
        "count(*) AS utterances FROM utterances GROUP BY ALL ORDER BY bucket_start"
    )
    con.execute(
        "CREATE TABLE rejects_by_reason AS SELECT stage, reason, count(*) AS rejects "
        "FROM rejects GROUP BY ALL ORDER BY stage, reason"
    )


def build_database(db_path: Path, inputs: StatsInputs) -> dict[str, int]:
    """Returns the row count of every view and table."""
    with exclusive_lock(lock_beside(db_path)), atomic_path(db_path) as tmp:
        tmp.unlink()  # DuckDB wants to create the file itself
        con = duckdb.connect(str(tmp))
        try:
            _create_views(con, inputs)
            _create_tables(con, inputs)
            listed = "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' ORDER BY 1"
            names = [name for (name,) in con.execute(listed).fetchall()]
            counts = {name: con.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0] for name in names}
            con.execute("CHECKPOINT")
        finally:
            con.close()
    return counts


def view_sources(con: duckdb.DuckDBPyConnection) -> list[str]:
    """The files the database's views read: every string literal of their definitions (the views
    this module makes name nothing else), found with DuckDB's own tokenizer."""
    sources = set()
    for (sql,) in con.execute("SELECT sql FROM duckdb_views() WHERE NOT internal").fetchall():
        for position, kind in duckdb.tokenize(sql):
            if kind == duckdb.token_type.string_const and sql[position] == "'":
                sources.add(re.match(r"'((?:[^']|'')*)'", sql[position:]).group(1).replace("''", "'"))
    return sorted(sources)


def connect_read_only(db_path: Path, allow_external_access: bool = False) -> duckdb.DuckDBPyConnection:
    """The database, read-only, with its configuration locked: no extension is installed, nothing
    spills to disk and a query cannot change a setting. Unless ``allow_external_access``, DuckDB's
    external access is off and the only files a query may open are those the views read (no
    other file of the data dir, no URL, no extension), and of those only the ones under the
    database's own folder (its data dir): a database from elsewhere (``sql --db other.duckdb``)
    whose views name other files lets a query read none of them."""
    if not db_path.exists():
        raise FileNotFoundError(f"{db_path} does not exist: materialize the dataset_stats asset first")
    config = {
        "autoinstall_known_extensions": False,
        "autoload_known_extensions": allow_external_access,
        "temp_directory": "",  # a big query fails for memory rather than writing beside the database
    }
    con = duckdb.connect(str(db_path), read_only=True, config=config)
    try:
        if not allow_external_access:
            # a glob's real path is taken as written: ``*`` is a name here
            real_dir = os.path.realpath(db_path.parent)
            allowed = [path for path in view_sources(con) if Path(os.path.realpath(path)).is_relative_to(real_dir)]
            con.execute(f"SET allowed_paths = [{', '.join(_sql_str(path) for path in allowed)}]")
            con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except BaseException:
        con.close()
        raise
    return con


class NotReadOnly(ValueError):
    """A query that is not exactly one read-only statement."""


READ_ONLY_STATEMENTS = "SELECT, WITH ... SELECT, FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE or EXPLAIN of one of these"
# Query nodes that only read; DuckDB also parses INSERT, UPDATE, DELETE, MERGE and COPY inside a
# WITH clause of a SELECT, where the statement's type says nothing about them.
_READING_NODES = frozenset({"SELECT_NODE", "SET_OPERATION_NODE", "CTE_NODE", "RECURSIVE_CTE_NODE"})
_SQL_RUNNING_FUNCTIONS = frozenset({"query", "json_execute_serialized_sql"})  # they run SQL given as a string
_WRITING_OPERATORS = frozenset(
    (
        "COPY_TO_FILE BATCH_COPY_TO_FILE FIXED_BATCH_COPY_TO_FILE COPY_DATABASE INSERT BATCH_INSERT DELETE "
        "DELETE_OPERATOR UPDATE MERGE_INTO CREATE_TABLE CREATE_TABLE_AS BATCH_CREATE_TABLE_AS CREATE_INDEX "
        "CREATE_SEQUENCE CREATE_VIEW CREATE_SCHEMA CREATE_MACRO CREATE_TYPE CREATE_SECRET ALTER DROP PRAGMA "
        "TRANSACTION ATTACH DETACH EXECUTE PREPARE VACUUM EXPORT SET SET_VARIABLE RESET LOAD EXTENSION "
        "UPDATE_EXTENSIONS"
    ).split()
)


def check_read_only(con: duckdb.DuckDBPyConnection, query: str) -> None:
    """Raise :class:`NotReadOnly` unless ``query`` is exactly one statement that only reads.

    Checked with DuckDB's own parser, three ways: the statement's type (a SELECT, or an EXPLAIN
    of one: ``EXPLAIN ANALYZE`` runs what it explains), every query node of its syntax tree (no
    INSERT/COPY/... in a WITH clause, no function that runs SQL from a string) and every
    operator of its bound plan. Syntax errors raise DuckDB's own ``duckdb.Error``."""
    select = _explained(query)
    tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [select]).fetchone()[0])
    if tree.get("error"):
        raise NotReadOnly(f"refused: {tree.get('error_message')}")
    for node in _dicts(tree):
        if "cte_map" in node and "modifiers" in node and node.get("type") not in _READING_NODES:
            raise NotReadOnly(
                f"refused: a {str(node.get('type')).removesuffix('_QUERY_NODE')} inside the query; "
                f"only {READ_ONLY_STATEMENTS} may run"
            )
        if str(node.get("function_name", "")).lower() in _SQL_RUNNING_FUNCTIONS:
            raise NotReadOnly(f"refused: {node['function_name']}() runs SQL of its own")
    try:
        plan = json.loads(con.execute(f"EXPLAIN (FORMAT json) {select}").fetchall()[0][1])
    except duckdb.Error as err:  # without the context that quotes this EXPLAIN, not the user's query
        raise type(err)(str(err).split("\n\nLINE ")[0]) from None
    writing = sorted({str(op.get("name")) for op in _dicts(plan) if op.get("name") in _WRITING_OPERATORS})
    if writing:
        raise NotReadOnly(f"refused: the query's plan has {', '.join(writing)}; only {READ_ONLY_STATEMENTS} may run")


def _explained(query: str, explain_allowed: bool = True) -> str:
    """The one SELECT ``query`` is, or that it explains (after EXPLAIN, ANALYZE or an option list)."""
    statements = duckdb.extract_statements(query)  # a syntax error raises DuckDB's message, which says where
    if len(statements) != 1:
        raise NotReadOnly(f"refused: {len(statements)} statements; give exactly one ({READ_ONLY_STATEMENTS})")
    try:
        kind = statements[0].type
    except ValueError:  # a statement type this duckdb module cannot name (UPDATE EXTENSIONS)
        raise NotReadOnly(f"refused: a statement of no read-only type; only {READ_ONLY_STATEMENTS} may run") from None
    if kind == duckdb.StatementType.SELECT:
        return query
    if kind != duckdb.StatementType.EXPLAIN or not explain_allowed:
        raise NotReadOnly(f"refused: a {kind.name} statement; only {READ_ONLY_STATEMENTS} may run")
    every = duckdb.tokenize(query)
    ends = [pos for pos, _ in every[1:]] + [len(query)]
    kept = [(token, end) for token, end in zip(every, ends) if token[1] != duckdb.token_type.comment]
    tokens = [token for token, _ in kept]
    words = [query[pos:end].strip() for (pos, _), end in kept]
    i = 1  # after EXPLAIN
    if i < len(words) and words[i].upper() in ("ANALYZE", "ANALYSE"):
        i += 1
    elif i < len(words) and words[i].startswith("("):
        depth = 0
        while i < len(words):
            if tokens[i][1] == duckdb.token_type.operator:
                depth += words[i].count("(") - words[i].count(")")
            i += 1
            if depth <= 0:
                break
    if i >= len(words):
        raise NotReadOnly("refused: an EXPLAIN of nothing")
    return _explained(query[tokens[i][0] :], explain_allowed=False)


def _dicts(tree: object):
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


_KIND_ORDER = "list_position(" + "[" + ", ".join(f"'{kind}'" for kind in CHECKPOINT_KINDS) + "], kind)"


def _number(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else f"{value:{spec}}"


def _millions(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.2f} M"


def summary(db_path: Path) -> str:
    """A short human-readable report, for `speech-assets stats` and `make demo`."""
    con = connect_read_only(db_path)
    try:
        kept, hours = con.execute("SELECT count(*), coalesce(sum(duration_s), 0) / 3600 FROM manifest").fetchone()
        utts, trimmed = con.execute(
            "SELECT count(*), coalesce(sum(trimmed_duration_s), 0) / 3600 FROM utterances"
        ).fetchone()
        rejects = con.execute("SELECT stage, reason, rejects FROM rejects_by_reason").fetchall()
        lines = [
            f"manifest: {kept} utterances kept, {hours:.3f} h; after VAD: {utts} utterances, {trimmed:.3f} h of speech",
            "rejects: " + (", ".join(f"{r} ({s}) {n}" for s, r, n in rejects) if rejects else "none"),
        ]
        for client, speakers, n, h in con.execute("SELECT * FROM hours_per_client").fetchall():
            lines.append(f"  {client}: {speakers} speakers, {n} utterances, {h:.3f} h")
        for row in con.execute(
            "SELECT client_id, k, frames_fit, inertia_per_frame, perplexity, empty_clusters, mean_segment_length "
            "FROM kmeans_quality ORDER BY client_id"
        ).fetchall():
            lines.append(
                f"  k-means {row[0]}: K={row[1]} frames={row[2]} inertia/frame={row[3]:.3f} "
                f"perplexity={row[4]:.1f} empty={row[5]} mean segment={row[6]:.2f} frames"
            )
        for kind, steps, loss, accuracy, majority, chance, checkpoint, run_id, *tuned in con.execute(
            # the held-out masked accuracy every view shows: leak-free frames (train.accuracy)
            f"SELECT kind, steps, final_loss, {ACCURACY}, {MAJORITY}, chance_accuracy, "
            "checkpoint, mlflow_run_id, init, labelled_minutes, seed, lr, heldout_cer, heldout_wer FROM training_runs "
            f"ORDER BY {_KIND_ORDER}, labelled_minutes, init, seed, lr, run_dir"
        ).fetchall():
            unit = "rounds" if kind == "federated" else "steps"
            held_out = (
                f", {LABEL} {_number(accuracy)} (majority class {_number(majority)}"
                + (f", chance {_number(chance)})" if chance is not None else ")")
                if accuracy is not None or majority is not None
                else ""
            )
            name = f"{kind} model"
            if kind == "finetuned":
                init, minutes, seed, lr, cer, wer = tuned
                budget = "? min" if minutes is None else f"{minutes:g} min"
                name += f" ({init}, {budget} labelled, seed {seed}, lr {'n/a' if lr is None else f'{lr:g}'})"
                held_out = f", held-out CER {_number(cer)} WER {_number(wer)}"
            lines.append(
                f"{name}: {steps} {unit}, loss {_number(loss)}{held_out}, checkpoint {checkpoint}, "
                f"MLflow run {run_id or 'none'}"
            )
        for speedup, student, teacher, student_speed, teacher_speed in con.execute(
            "SELECT speedup, student_parameters, teacher_parameters, student_audio_s_per_s, "
            "teacher_audio_s_per_s FROM distillation"
        ).fetchall():
            lines.append(
                f"distilled student: {_number(speedup, '.2f')}x the teacher's CPU forward speed "
                f"({_number(student_speed, '.0f')} vs "
                f"{_number(teacher_speed, '.0f')} audio s/s), {_millions(student)} vs {_millions(teacher)} parameters"
            )
        for layer, onnx, torchscript, utterances in con.execute(
            "SELECT layer, max_abs_diff, torchscript_max_abs_diff, parity_utterances FROM exports ORDER BY folder"
        ).fetchall():
            lines.append(
                f"export (layer {layer}): ONNX max |diff| {_number(onnx, '.1e')}, "
                f"TorchScript {_number(torchscript, '.1e')} against PyTorch on {utterances} utterances"
            )
        return "\n".join(lines)
    finally:
        con.close()
