"""Audits of a written manifest: each reads the Parquet files back and tests what later stages
rely on, independently of the code that produced them (write, audit, then publish).

Every audit returns an :class:`Audit`; a manifest is published only if all of them pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from speech_assets.corpus.ids import is_safe_id
from speech_assets.corpus.manifest import MANIFEST_SCHEMA, REJECTS_SCHEMA, ValidationConfig

MAX_LISTED = 10


@dataclass(frozen=True)
class Audit:
    name: str
    passed: bool
    description: str
    metadata: dict[str, object] = field(default_factory=dict)


def _examples(values: list[str]) -> list[str]:
    return [str(v)[:120] for v in values[:MAX_LISTED]]


def schema(table: pa.Table) -> Audit:
    missing = [f.name for f in MANIFEST_SCHEMA if f.name not in table.column_names]
    wrong = [
        f"{f.name}: {table.schema.field(f.name).type} (expected {f.type})"
        for f in MANIFEST_SCHEMA
        if f.name in table.column_names and table.schema.field(f.name).type != f.type
    ]
    return Audit("schema", not missing and not wrong, "every documented column, with its type",
                 {"missing": missing, "wrong_types": wrong})


def no_nulls(table: pa.Table) -> Audit:
    nulls = {name: table.column(name).null_count for name in table.column_names if table.column(name).null_count}
    return Audit("no_nulls", not nulls, "no null in any column", {"nulls": nulls})


def unique_ids(table: pa.Table) -> Audit:
    ids = table.column("utt_id").to_pylist() if "utt_id" in table.column_names else []
    seen: set[str] = set()
    duplicates = [i for i in ids if i in seen or seen.add(i)]
    return Audit("unique_ids", not duplicates, "utt_id is unique", {"duplicates": len(duplicates), "examples": _examples(duplicates)})


def safe_ids(table: pa.Table) -> Audit:
    bad = [
        f"{column}={value!r}"
        for column in ("speaker_id", "chapter_id", "utt_id")
        if column in table.column_names
        for value in table.column(column).to_pylist()
        if not is_safe_id(value)
    ]
    return Audit("safe_ids", not bad, "speaker, chapter and utterance ids are 1-64 of [A-Za-z0-9_-]",
                 {"bad_ids": len(bad), "examples": _examples(bad)})


def paths_inside_root(table: pa.Table, root: Path) -> Audit:
    root = Path(os.path.realpath(root))
    bad = [
        path
        for path in (table.column("path").to_pylist() if "path" in table.column_names else [])
        if path is None or not Path(os.path.realpath(path)).is_relative_to(root) or not os.path.isfile(path)
    ]
    return Audit("paths_inside_root", not bad, f"every path is an existing file inside {root}",
                 {"bad_paths": len(bad), "examples": _examples(bad)})


def durations(table: pa.Table, config: ValidationConfig) -> Audit:
    bad = []
    needed = ("utt_id", "duration_s", "num_samples", "sample_rate", "channels")
    if all(c in table.column_names for c in needed):
        for utt, duration, samples, rate, channels in zip(*(table.column(c).to_pylist() for c in needed), strict=True):
            if not rate or rate <= 0 or not channels or channels < 1:
                bad.append(f"{utt}: sample_rate {rate}, channels {channels}")
            elif abs(duration - samples / rate) > 1e-6 or not config.min_duration_s <= duration <= config.max_duration_s:
                bad.append(f"{utt}: {duration} s for {samples} samples at {rate} Hz")
    return Audit("durations", not bad, f"durations equal num_samples / sample_rate and lie in [{config.min_duration_s}, {config.max_duration_s}] s",
                 {"bad_rows": len(bad), "examples": _examples(bad)})


def reject_ratio(kept: int, rejects: pa.Table, max_ratio: float) -> Audit:
    if rejects.schema != REJECTS_SCHEMA:
        return Audit("reject_ratio", False, "rejects.parquet has the wrong columns", {"columns": rejects.column_names})
    total = kept + rejects.num_rows
    ratio = rejects.num_rows / total if total else 0.0
    return Audit("reject_ratio", ratio <= max_ratio, f"{rejects.num_rows} of {total} utterances rejected",
                 {"reject_ratio": round(ratio, 4), "max_reject_ratio": max_ratio})


def audit_manifest(manifest_file: Path, rejects_file: Path, corpus_root: Path, config: ValidationConfig, max_ratio: float) -> list[Audit]:
    """Every audit of a manifest and its rejects, read back from the files."""
    table = pq.read_table(manifest_file)
    return [
        schema(table),
        no_nulls(table),
        unique_ids(table),
        safe_ids(table),
        paths_inside_root(table, corpus_root),
        durations(table, config),
        reject_ratio(table.num_rows, pq.read_table(rejects_file), max_ratio),
    ]


AUDITS = ("schema", "no_nulls", "unique_ids", "safe_ids", "paths_inside_root", "durations", "reject_ratio")
