"""Stage 5: the DuckDB database of dataset statistics that anyone can query in SQL."""

import json

import dagster as dg
import duckdb

from speech_assets.stats import database as stats_db
from speech_assets.defs.conditions import follow_upstream
from speech_assets.defs.lineage import latest_data_version, markdown_table, partition_versions
from speech_assets.defs.partitions import clients_partitions, speakers_partitions
from speech_assets.defs.resources import StoragePaths
from speech_assets.defs.training import TRAINING_INPUTS
from speech_assets.utils import sha256_file, sha256_strings

CODE_VERSION = "stats-v1"


def _inputs(paths: StoragePaths) -> stats_db.StatsInputs:
    shards = sorted(p for p in paths.shards_dir.glob("*.parquet") if p.name.count(".") == 1)
    results = sorted(paths.training_dir.glob("*/result.json"))
    return stats_db.StatsInputs(
        manifest=paths.manifest_file,
        manifest_rejects=paths.rejects_file,
        shards=shards,
        shard_rejects=sorted(paths.shards_dir.glob("*.rejects.parquet")),
        clients=paths.clients_file,
        kmeans_quality=sorted((paths.root / "kmeans").glob("*/quality.json")),
        training_results=results,
        heldout_fraction=_heldout_fraction(results),
        federated_rounds=_newest_federated_rounds(paths),
    )


def _newest_federated_rounds(paths: StoragePaths):
    """rounds.parquet of the federated run that finished last (``None`` before any)."""
    finished = [p.parent / "rounds.parquet" for p in (paths.root / "federated").glob("*/result.json")]
    found = [p for p in finished if p.is_file()] or sorted((paths.root / "federated").glob("*/rounds.parquet"))
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _heldout_fraction(results: list) -> float:
    """The held-out fraction the newest training run used (the default when none ran)."""
    if not results:
        return stats_db.HELDOUT_FRACTION
    newest = max(results, key=lambda p: p.stat().st_mtime)
    try:
        return float(json.loads((newest.parent / "config.json").read_text())["heldout_fraction"])
    except (OSError, KeyError, ValueError):
        return stats_db.HELDOUT_FRACTION


def _content_hash(db_path, inputs: stats_db.StatsInputs, paths: StoragePaths) -> str:
    """Hash of what the database holds: its tables' rows and the files its views read."""
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        tables = [r[0] for r in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE' "
            "AND table_name <> 'utterances' ORDER BY 1"  # utterances is a copy of the shards, hashed below
        ).fetchall()]
        parts = [f"{table}:{con.execute(f'SELECT * FROM {table} ORDER BY ALL').fetchall()!r}" for table in tables]
    finally:
        con.close()
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
    deps=[*TRAINING_INPUTS, "pretrained_checkpoint", "federated_checkpoint"],
    code_version=CODE_VERSION,
    kinds={"duckdb"},
    automation_condition=follow_upstream(require_all_deps=False),
    description="stats.duckdb: views over every Parquet output plus summary tables; query with `speech-assets sql`.",
)
def dataset_stats(context: dg.AssetExecutionContext, paths: StoragePaths) -> dg.MaterializeResult:
    inputs = _inputs(paths)
    counts = stats_db.build_database(paths.stats_db, inputs)
    instance = context.instance
    input_versions = {
        key: latest_data_version(instance, key) or ""
        for key in ("manifest", "cmvn_stats", "client_partitions", "pretrained_checkpoint", "federated_checkpoint")
    }
    input_versions["vad_features"] = partition_versions(instance, "vad_features", instance.get_dynamic_partitions(speakers_partitions.name))
    input_versions["kmeans_targets"] = partition_versions(instance, "kmeans_targets", instance.get_dynamic_partitions(clients_partitions.name))
    return dg.MaterializeResult(
        data_version=dg.DataVersion(_content_hash(paths.stats_db, inputs, paths)),
        metadata={
            "tables": dg.MetadataValue.md(markdown_table(("view / table", "rows"), sorted(counts.items()))),
            "input_versions": dg.MetadataValue.json(input_versions),
            "summary": dg.MetadataValue.md("```\n" + stats_db.summary(paths.stats_db) + "\n```"),
            "path": dg.MetadataValue.path(str(paths.stats_db)),
            "example": 'speech-assets sql "SELECT reason, count(*) FROM rejects GROUP BY reason"',
        },
    )
