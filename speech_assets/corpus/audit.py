"""Audits of a written manifest, read back from its Parquet files independently of the code that
wrote them; it is published only if all pass. An audit that cannot evaluate fails, never passes."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from speech_assets import layout
from speech_assets.corpus.ids import is_safe_id
from speech_assets.corpus.manifest import MANIFEST_SCHEMA, RealPaths, ValidationConfig, hash_triples, is_inside
from speech_assets.corpus.rejects import REJECTS_SCHEMA, RejectReason

MAX_LISTED = 10

# name -> what it guarantees (the asset check's description)
AUDITS: dict[str, str] = {
    "schema": "manifest.parquet and rejects.parquet have every documented column with its type; reasons are documented "
    "ones.",
    "no_nulls": "No null in any column of manifest.parquet or rejects.parquet.",
    "unique_ids": "utt_id is unique in manifest.parquet.",
    "safe_ids": "Speaker, chapter and utterance ids are 1-64 ASCII letters, digits, _ or -.",
    "paths_inside_root": "Every path is an existing file inside the corpus root.",
    "durations": "sample_rate > 0, channels >= 1, num_samples > 0, duration_s = num_samples / sample_rate, within the "
    "configured bounds.",
    "speakers": "speakers.parquet lists exactly the manifest's speakers with their utterance counts and row hashes.",
    "reject_ratio": "Rejected / (kept + rejected) stays within max_reject_ratio.",
}


@dataclass(frozen=True)
class Audit:
    name: str
    passed: bool
    description: str
    metadata: dict[str, object] = field(default_factory=dict)


def _examples(values: list[str]) -> list[str]:
    return [str(v)[:120] for v in values[:MAX_LISTED]]


def _listing(name: str, bad: list[str], description: str, count_key: str) -> Audit:
    return Audit(name, not bad, description, {count_key: len(bad), "examples": _examples(bad)})


def _missing(
    name: str, table: pa.Table, columns: tuple[str, ...], file: str = layout.ManifestFiles.manifest.name
) -> Audit | None:
    if absent := [c for c in columns if c not in table.column_names]:
        return Audit(name, False, f"cannot check: {file} lacks column(s) {', '.join(absent)}", {"missing": absent})
    return None


def schema(table: pa.Table, rejects: pa.Table) -> Audit:
    problems = []
    for file, expected, actual in (
        (layout.ManifestFiles.manifest.name, MANIFEST_SCHEMA, table),
        (layout.ManifestFiles.rejects.name, REJECTS_SCHEMA, rejects),
    ):
        problems += [f"{file}: no column {f.name}" for f in expected if f.name not in actual.column_names]
        problems += [
            f"{file}: {f.name} is {actual.schema.field(f.name).type} (expected {f.type})"
            for f in expected
            if f.name in actual.column_names and actual.schema.field(f.name).type != f.type
        ]
    known = {str(reason) for reason in RejectReason}
    if "reason" in rejects.column_names:
        problems += [
            f"rejects.parquet: unknown reason {r!r}"
            for r in sorted(set(rejects.column("reason").to_pylist()) - known, key=str)
        ]
    description = (
        f"{len(problems)} schema problem(s): {problems[0]}" if problems else "every documented column, with its type"
    )
    return Audit("schema", not problems, description, {"problems": _examples(problems)})


def no_nulls(table: pa.Table, rejects: pa.Table) -> Audit:
    nulls = {
        f"{file}:{name}": t.column(name).null_count
        for file, t in (("manifest", table), ("rejects", rejects))
        for name in t.column_names
        if t.column(name).null_count
    }
    description = f"nulls in {', '.join(f'{k} ({v})' for k, v in nulls.items())}" if nulls else "no null in any column"
    return Audit("no_nulls", not nulls, description, {"nulls": nulls})


def unique_ids(table: pa.Table) -> Audit:
    if (missing := _missing("unique_ids", table, ("utt_id",))) is not None:
        return missing
    seen: set[object] = set()
    duplicates = [i for i in table.column("utt_id").to_pylist() if i in seen or seen.add(i)]
    return _listing(
        "unique_ids", duplicates, f"{len(duplicates)} duplicate utt_id(s) among {table.num_rows} rows", "duplicates"
    )


def safe_ids(table: pa.Table) -> Audit:
    columns = ("speaker_id", "chapter_id", "utt_id")
    if (missing := _missing("safe_ids", table, columns)) is not None:
        return missing
    bad = [f"{c}={v!r}" for c in columns for v in table.column(c).to_pylist() if not is_safe_id(v)]
    return _listing("safe_ids", bad, f"{len(bad)} unsafe id(s) among {table.num_rows} rows", "bad_ids")


def paths_inside_root(table: pa.Table, root: Path) -> Audit:
    if (missing := _missing("paths_inside_root", table, ("path",))) is not None:
        return missing
    root = Path(os.path.realpath(root))
    real = RealPaths()
    bad = [
        str(path)
        for path in table.column("path").to_pylist()
        if not isinstance(path, str) or not is_inside(real(path), root) or not os.path.isfile(path)
    ]
    return _listing(
        "paths_inside_root", bad, f"{len(bad)} of {table.num_rows} path(s) missing or outside {root}", "bad_paths"
    )


def durations(table: pa.Table, config: ValidationConfig) -> Audit:
    needed = ("utt_id", "duration_s", "num_samples", "sample_rate", "channels")
    if (missing := _missing("durations", table, needed)) is not None:
        return missing
    bad = []
    bounds = f"[{config.min_duration_s}, {config.max_duration_s}]"
    for utt, duration, samples, rate, channels in zip(*(table.column(c).to_pylist() for c in needed), strict=True):
        if not all(isinstance(v, int | float) for v in (duration, samples, rate, channels)):
            bad.append(f"{utt}: missing audio facts")
        elif rate <= 0 or channels < 1 or samples <= 0:
            bad.append(f"{utt}: sample_rate {rate}, channels {channels}, num_samples {samples}")
        elif not math.isclose(duration, samples / rate, rel_tol=1e-9, abs_tol=1e-9):
            bad.append(f"{utt}: duration_s {duration} but {samples} samples at {rate} Hz is {samples / rate}")
        elif not config.min_duration_s <= duration <= config.max_duration_s:
            bad.append(f"{utt}: {duration} s outside {bounds}")
    described = f"{len(bad)} of {table.num_rows} row(s) inconsistent or outside {bounds} s"
    return _listing("durations", bad, described, "bad_rows")


def speakers(table: pa.Table, listed: pa.Table) -> Audit:
    columns = ("utt_id", "speaker_id", "file_sha256", "transcript")
    listed_columns = ("speaker_id", "utterances", "manifest_hash")
    if (missing := _missing("speakers", table, columns)) is not None:
        return missing
    if (missing := _missing("speakers", listed, listed_columns, layout.ManifestFiles.speakers.name)) is not None:
        return missing
    triples: dict[str, list[tuple[str, str, str]]] = {}
    for utt, speaker, sha, text in zip(*(table.column(c).to_pylist() for c in columns), strict=True):
        triples.setdefault(speaker, []).append((utt, sha, text))
    expected = {s: (len(t), hash_triples(t)) for s, t in triples.items()}
    rows = listed.select(list(listed_columns)).to_pylist()
    actual = {r["speaker_id"]: (r["utterances"], r["manifest_hash"]) for r in rows}
    problems = [f"{s}: not listed" for s in sorted(set(expected) - set(actual), key=str)]
    problems += [f"{s}: listed but has no manifest rows" for s in sorted(set(actual) - set(expected), key=str)]
    problems += [
        f"{s}: {actual[s]} != {expected[s]}"
        for s in sorted(set(actual) & set(expected), key=str)
        if actual[s] != expected[s]
    ]
    if len(rows) != len(actual):
        problems.append(f"{len(rows) - len(actual)} speaker(s) listed twice")
    described = f"{len(problems)} mismatch(es) between speakers.parquet and the manifest's {len(expected)} speakers"
    return Audit("speakers", not problems, described, {"problems": _examples(problems)})


def reject_ratio(kept: int, rejects: pa.Table, max_ratio: float) -> Audit:
    total = kept + rejects.num_rows
    ratio = rejects.num_rows / total if total else 0.0
    passed = ratio <= max_ratio
    return Audit(
        "reject_ratio",
        passed,
        f"{rejects.num_rows} of {total} utterances rejected ({ratio:.4f} {'<=' if passed else '>'} "
        f"max_reject_ratio {max_ratio})",
        {"rejects": rejects.num_rows, "total": total, "reject_ratio": round(ratio, 4), "max_reject_ratio": max_ratio},
    )


def audit_manifest(
    files: layout.ManifestFiles, corpus_root: Path, config: ValidationConfig, max_ratio: float
) -> list[Audit]:
    """Every audit of a manifest, its rejects and its speaker list, read back from the files."""
    try:
        table, rejects, listed = (pq.read_table(path) for path in (files.manifest, files.rejects, files.speakers))
    except (OSError, pa.ArrowException) as err:
        return [Audit(name, False, f"cannot read the written files: {err}") for name in AUDITS]
    checks: dict[str, Callable[[], Audit]] = {
        "schema": lambda: schema(table, rejects),
        "no_nulls": lambda: no_nulls(table, rejects),
        "unique_ids": lambda: unique_ids(table),
        "safe_ids": lambda: safe_ids(table),
        "paths_inside_root": lambda: paths_inside_root(table, corpus_root),
        "durations": lambda: durations(table, config),
        "speakers": lambda: speakers(table, listed),
        "reject_ratio": lambda: reject_ratio(table.num_rows, rejects, max_ratio),
    }
    results = []
    for name, check in checks.items():
        try:
            results.append(check())
        except Exception as err:  # noqa: BLE001 - an audit that cannot run must fail, not pass or crash the run
            results.append(Audit(name, False, f"could not evaluate: {type(err).__name__}: {err}"))
    return results
