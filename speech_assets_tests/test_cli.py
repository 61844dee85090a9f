"""The CLI for people: help for every argument with examples and the environment variables,
numbers rounded for reading (every digit on request), and no traceback when piped into `head`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speech_assets.cli import build_parser, main
from speech_assets_tests.conftest import REPO

ENVIRONMENT = ("SPEECH_ASSETS_DATA_DIR", "SPEECH_ASSETS_CORPUS", "DAGSTER_HOME", "MLFLOW_TRACKING_URI")


def _parsers(parser: argparse.ArgumentParser, name: str = "speech-assets"):
    """``(name, parser)`` for the parser and every subcommand's, depth first."""
    yield name, parser
    for action in parser._actions:  # argparse keeps its subcommands nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


PARSERS = dict(_parsers(build_parser()))


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_explains_every_argument_with_examples_and_the_environment(name: str) -> None:
    parser = PARSERS[name]
    undocumented = [
        action.dest
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
        and not (action.help or "").strip()
    ]
    assert not undocumented, f"{name}: arguments without help: {undocumented}"
    text = parser.format_help()
    has_subcommands = any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
    if not has_subcommands:
        assert "examples:\n  " in text and "speech-assets" in text.split("examples:")[1], text
    for variable in ENVIRONMENT:
        assert variable in text, f"{name} --help does not name {variable}"


@pytest.fixture(scope="module")
def stats_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from speech_assets.stats.database import StatsInputs, build_database

    data = tmp_path_factory.mktemp("cli")
    pq.write_table(
        pa.table({"utt_id": ["u1"], "path": ["a"], "transcript": ["A"], "duration_s": [1.0]}), data / "manifest.parquet"
    )
    pq.write_table(
        pa.table({n: pa.array([], pa.string()) for n in ("utt_id", "path", "stage", "reason", "detail")}),
        data / "rejects.parquet",
    )
    pq.write_table(
        pa.table(
            {
                "speaker_id": ["1", "2", "3", "4"],
                "client_id": ["c0", "c0", "c1", "c1"],
                "hours": [0.41234567891234, 25.123456789, 0.0034567123, 0.0],
                "utterances": [3, 4, 5, 0],
                "heldout": [False, False, True, False],
            }
        ),
        data / "clients.parquet",
    )
    db = data / "stats.duckdb"
    build_database(
        db,
        StatsInputs(
            manifest=data / "manifest.parquet",
            manifest_rejects=data / "rejects.parquet",
            shards=[],
            shard_rejects=[],
            clients=data / "clients.parquet",
            kmeans_quality=[],
        ),
    )
    return db


@pytest.mark.parametrize(
    ("flags", "shown", "hidden"),
    [
        ([], ["0.412", "25.12", "0.00346", "0.0 "], ["0.41234567891234", "25.123456789", "0.0034567123"]),
        (["--raw"], ["0.41234567891234", "25.123456789", "0.0034567123"], []),
    ],
    ids=["rounded", "raw"],
)
def test_sql_rounds_floats_for_reading_unless_raw(
    flags: list[str], shown: list[str], hidden: list[str], stats_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    query = "SELECT speaker_id, hours, hours AS hours, utterances FROM clients ORDER BY speaker_id"
    assert main(["sql", query, "--db", str(stats_db), *flags]) == 0
    out = capsys.readouterr().out
    for text in shown:
        assert text in out, out
    for text in hidden:
        assert text not in out, out
    assert "int64" in out and "double" in out  # column types as queried: only the display is rounded


def _piped_into_head(args: list[str], cwd: Path) -> tuple[bytes, bytes, int]:
    """``python -m speech_assets.cli ARGS | head -1``, through a real pipe: head's output, the
    CLI's stderr and exit status."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    cli = subprocess.Popen(
        [sys.executable, "-m", "speech_assets.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
    )
    head = subprocess.Popen(["head", "-1"], stdin=cli.stdout, stdout=subprocess.PIPE)
    cli.stdout.close()  # head holds the only read end: when it exits, the CLI's next write fails
    first, _ = head.communicate(timeout=120)
    err = cli.stderr.read()
    cli.stderr.close()
    return first, err, cli.wait(timeout=120)


def test_lineage_piped_into_head_ends_without_a_traceback(tmp_path: Path) -> None:
    import torch

    from speech_assets.train.checkpoint import save_checkpoint

    # far more output than a pipe holds, so the CLI is still writing when head leaves
    versions = {f"vad_features/{i:05d}": "ab" * 32 for i in range(3_000)}
    checkpoint = save_checkpoint(
        tmp_path / "final.pt",
        {"model": {"w": torch.zeros(2)}, "step": 7, "config": {"lr": 0.001}, "data_versions": versions},
    )
    first, err, status = _piped_into_head(["lineage", str(checkpoint)], tmp_path)
    assert first.decode().startswith("checkpoint ")
    assert err == b"", err.decode()
    assert status == 0  # head read what it wanted: no failure, also under `set -o pipefail`


@pytest.mark.parametrize(
    ("args", "unbuffered"),
    [(["probe"], False), (["probe"], True), (["--help"], False)],
    ids=["probe", "probe-unbuffered", "help"],
)
def test_stdout_closed_before_the_cli_writes_is_no_failure(args: list[str], unbuffered: bool, tmp_path: Path) -> None:
    """`speech-assets probe | head` when the reader is gone before the first write: with stdout
    buffered (a shell's default) the CLI's flush meets the closed pipe, unbuffered (PYTHONUNBUFFERED,
    as on this machine) its first print does; argparse's --help only at the flush. Kills: `return 1`
    in main's BrokenPipeError branch (probe: exit 1), and parsing the arguments outside the
    flushing try (help: "Exception ignored ... BrokenPipeError" on stderr, exit 120)."""
    from speech_assets_tests.test_cli_probe import rows, write

    write(
        rows("fbank", [0.7, 0.7], "global") + rows("random", [0.9, 0.9]) + rows("pretrained", [0.6, 0.6]),
        tmp_path / "probe",
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env |= {"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "SPEECH_ASSETS_DATA_DIR": str(tmp_path)}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    cli = subprocess.Popen(
        [sys.executable, "-m", "speech_assets.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=env,
    )
    cli.stdout.close()  # nobody reads: the CLI's first write to the pipe fails with EPIPE
    err = cli.stderr.read()
    cli.stderr.close()
    assert cli.wait(timeout=120) == 0, err.decode()
    assert err == b"", err.decode()


def test_sql_piped_into_head_ends_without_a_traceback(stats_db: Path, tmp_path: Path) -> None:
    first, err, status = _piped_into_head(
        [
            "sql",
            "SELECT range AS n, 'padding to fill the pipe' AS s FROM range(100000)",
            "--max-rows",
            "100000",
            "--db",
            str(stats_db),
        ],
        tmp_path,
    )
    assert first.strip()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert status in (0, 1)
