"""Stage 5: the DuckDB database of dataset statistics that anyone can query in SQL."""

import json

import dagster as dg
import duckdb
import pyarrow.parquet as pq

from speech_assets.defs.conditions import after_upstream_settles
from speech_assets.defs.lineage import latest_versions, partition_versions
from speech_assets.defs.partitions import CHECKPOINT_ASSETS, TRAINING_INPUTS, clients_partitions, speakers_partitions
from speech_assets.defs.resources import PipelineSettings, StoragePaths, vad_config
from speech_assets.layout import ExportFiles, FederatedPaths, RunFiles, TargetFiles
from speech_assets.locations import git_commit
from speech_assets.stats import database as stats_db
from speech_assets.utils import atomic_write_text, markdown_table, read_jsonl, sha256_file, sha256_strings

CODE_VERSION = "stats-v3"  # v3: fine-tuning runs in checkpoints/training_runs (kind finetuned, init, budget, seed)
# the unpartitioned models and results the database summarises, beside TRAINING_INPUTS
MODEL_ASSETS = (*CHECKPOINT_ASSETS.values(), "encoder_export", "downstream_probe", "finetuned_asr")


def _inputs(paths: StoragePaths) -> stats_db.StatsInputs:
    published = [paths.shard_files(s) for s in paths.published_shards()]
    return stats_db.StatsInputs(
        manifest=paths.layout.manifest.manifest,
        manifest_rejects=paths.layout.manifest.rejects,
        shards=[files.shard for files in published],
        shard_rejects=[files.rejects for files in published],
        clients=paths.layout.clients_file,
        kmeans_quality=[targets.quality for targets in paths.layout.all_targets()],
        training_results=paths.layout.results_of(paths.layout.training_dir),
        federated_rounds=_newest_federated_rounds(paths),
        probe_results=paths.layout.probe.results,
        finetune_results=paths.layout.finetune.results,
        model_results={
            "federated": paths.layout.results_of(paths.layout.federated_dir),
            "distilled": paths.layout.results_of(paths.layout.distill_dir),
            "iteration2": paths.layout.results_of(paths.layout.training_iter2_dir),
            "finetuned": paths.layout.results_of(paths.layout.finetune.runs),
        },
        exports=sorted(paths.layout.export_dir.glob(f"*/{ExportFiles.card.name}")),
    )


def _newest_federated_rounds(paths: StoragePaths):
    """rounds.parquet of the federated run that finished last (``None`` before any)."""
    tables = sorted(paths.layout.federated_dir.glob(f"*/{FederatedPaths.rounds_table.name}"))
    finished = [table for table in tables if FederatedPaths(table.parent).result.is_file()]
    return max(finished or tables, key=lambda p: p.stat().st_mtime, default=None)


def _content_hash(db_path, inputs: stats_db.StatsInputs, paths: StoragePaths) -> str:
    """Hash of what the database holds: its tables' rows and the files its views read."""
    with duckdb.connect(str(db_path), read_only=True) as con:
        tables = con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE' "
            "AND table_name <> 'utterances' ORDER BY 1"  # utterances is a copy of the shards, hashed below
        ).fetchall()
        parts = [f"{table}:{con.execute(f'SELECT * FROM {table} ORDER BY ALL').fetchall()!r}" for (table,) in tables]
    sources = [inputs.manifest, inputs.manifest_rejects, *inputs.shard_rejects]
    if inputs.clients.exists():
        sources.append(inputs.clients)
    parts += [f"{p}:{sha256_file(p)}" for p in sources]
    # shards are large: use the sha256 their meta recorded (verified by size and mtime)
    for shard in inputs.shards:
        meta = paths.shard_files(shard.stem).read_meta()
        parts.append(f"{shard}:{meta['shard_sha256'] if meta else sha256_file(shard)}")
    return sha256_strings(parts)


@dg.asset(
    group_name="stats",
    deps=[*TRAINING_INPUTS, *MODEL_ASSETS],
    code_version=CODE_VERSION,
    kinds={"duckdb"},
    # once per fresh data, after kmeans_targets (which follows the shards, CMVN and clients), not
    # once per level; a manifest change alone (rejects) still runs it
    automation_condition=after_upstream_settles(
        ignore_updates_of=["vad_features", "cmvn_stats", "client_partitions"],
        requested_in_backfills=["kmeans_targets"],
        built_by_sensor=["vad_features"],
    ),
)
def dataset_stats(
    context: dg.AssetExecutionContext, paths: StoragePaths, settings: PipelineSettings
) -> dg.MaterializeResult:
    """stats.duckdb: views over every Parquet output plus summary tables; query with
    `speech-assets sql`."""
    from speech_assets.stats import plots, report

    inputs = _inputs(paths)
    counts = stats_db.build_database(paths.layout.stats_db, inputs)
    instance = context.instance
    input_versions: dict[str, object] = latest_versions(
        instance, ["manifest", "cmvn_stats", "client_partitions", *MODEL_ASSETS]
    )
    partitioned = {
        key: partition_versions(instance, key, instance.get_dynamic_partitions(partitions.name))
        for key, partitions in (("vad_features", speakers_partitions), ("kmeans_targets", clients_partitions))
    }
    lineage_file = paths.layout.report.input_versions
    atomic_write_text(lineage_file, json.dumps({**input_versions, **partitioned}, indent=1, sort_keys=True))
    for key, versions in partitioned.items():  # bounded in the UI: a count and a hash; all of them in the file
        input_versions[key] = (
            f"{len(versions)} partitions, combined {sha256_strings(f'{k}:{v}' for k, v in versions.items())[:16]}"
        )

    report_file = report.write_report(
        paths.layout.stats_db, paths.layout.report.index, _report_inputs(context, paths, settings)
    )
    with stats_db.connect_read_only(paths.layout.stats_db) as con:
        durations = [r[0] for r in con.execute("SELECT duration_s FROM manifest").fetchall()]
        per_client = con.execute("SELECT client_id, trimmed_hours FROM hours_per_client ORDER BY 1").fetchall()
    pictures = []
    if durations:
        pictures.append(plots.markdown_image(plots.histogram(durations, "utterance durations", "seconds"), "durations"))
    if per_client:
        pictures.append(
            plots.markdown_image(
                plots.bars([c for c, _ in per_client], [h for _, h in per_client], "hours per client", "hours"),
                "hours per client",
            )
        )
    return dg.MaterializeResult(
        data_version=dg.DataVersion(_content_hash(paths.layout.stats_db, inputs, paths)),
        metadata={
            "tables": dg.MetadataValue.md(markdown_table(("view / table", "rows"), sorted(counts.items()))),
            "input_versions": dg.MetadataValue.json(input_versions),
            "input_versions_path": dg.MetadataValue.path(str(lineage_file)),
            "summary": dg.MetadataValue.md("```\n" + stats_db.summary(paths.layout.stats_db) + "\n```"),
            "plots": dg.MetadataValue.md("\n\n".join(pictures) or "no data yet"),
            # a path, not a file:// link: a browser refuses file:// links from the UI's http page, and
            # the webserver serves no files of ours; the UI shows a path with a copy button
            "report": dg.MetadataValue.path(str(report_file.resolve())),
            "report_how_to_open": "copy the report path above into the browser's address bar; the page works offline "
            "(plots inline, audio clips in report/audio/ beside it)",
            "path": dg.MetadataValue.path(str(paths.layout.stats_db)),
            "example": 'speech-assets sql "SELECT reason, count(*) FROM rejects GROUP BY reason"',
        },
    )


def _report_inputs(context: dg.AssetExecutionContext, paths: StoragePaths, settings: PipelineSettings):
    """The report's header, cluster sizes, training curves and where reject audio may be read."""
    import datetime

    import numpy as np

    from speech_assets.corpus.manifest import corpus_root_of
    from speech_assets.stats.report import ReportInputs

    counts = {}
    for state in sorted(paths.layout.targets_root().glob(f"*/{TargetFiles.state.name}")):
        with np.load(state) as data:
            counts[state.parent.name] = data["counts"]
    logs = sorted(paths.layout.training_dir.glob(f"*/{RunFiles.metrics.name}"))
    metrics = {log.parent.name: read_jsonl(log) for log in logs}
    header = {
        "built_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "git_commit": git_commit(),
        "dagster_run_id": context.run.run_id,
        "corpus": str(paths.corpus_path),
        "settings_hash": settings.digest(),
        "settings_source": settings.source or "defaults (no pipeline.toml)",
    }
    return ReportInputs(
        cluster_counts=counts,
        training_metrics=metrics,
        header=header,
        corpus_root=corpus_root_of(paths.corpus_path),
        vad=vad_config(settings.features),
        min_heldout_speakers=settings.probe.min_heldout_speakers,
        probe_results=paths.layout.probe.results,
    )


@dg.asset_check(
    asset="dataset_stats",
    blocking=True,
    description=(
        "The database agrees with the files it describes: manifest, rejects (every stage), utterances "
        "(every shard's rows) and clients have exactly the row counts of their Parquet sources."
    ),
)
def row_counts_match_sources(paths: StoragePaths) -> dg.AssetCheckResult:
    inputs = _inputs(paths)
    rows = lambda files: sum(pq.read_metadata(f).num_rows for f in files if f.exists())  # noqa: E731
    expected = {
        "manifest": rows([inputs.manifest]),
        "rejects": rows([inputs.manifest_rejects, *inputs.shard_rejects]),
        "utterances": rows(inputs.shards),
        "clients": rows([inputs.clients]),
    }
    # our own queries, over views that may name the files of a data dir that was copied here
    with stats_db.connect_read_only(paths.layout.stats_db, allow_external_access=True) as con:
        found = {table: con.execute(f"SELECT count(*) FROM {table}").fetchone()[0] for table in expected}
    return dg.AssetCheckResult(
        passed=found == expected,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={
            "rows": dg.MetadataValue.md(
                markdown_table(("table", "in database", "in files"), ((t, found[t], expected[t]) for t in expected))
            )
        },
    )
