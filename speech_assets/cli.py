"""`speech-assets`: corpus synthesis, dataset statistics, SQL, lineage and partition helpers."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from speech_assets import layout, locations
from speech_assets.layout import DataLayout

if TYPE_CHECKING:  # imported where used: `transcribe` loads neither DuckDB nor pyarrow
    import duckdb


def _cmd_stats(args: argparse.Namespace) -> int:
    from speech_assets.stats import database as stats_db

    print(stats_db.summary(_db(args)))
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    """The probe's leaderboard, each encoder's standing and how to read it; ``--details``: per-model figures."""
    from speech_assets.evaluation import compare

    path = Path(args.results) if args.results else DataLayout(locations.data_dir()).probe.results
    if not path.is_file():
        return _fail(f"no probe results at {path}: materialize downstream_probe")
    try:  # judged with the run's own minimum of held-out speakers (the [probe] setting then)
        board, min_speakers = compare.load_leaderboard(path)
        results = compare.read_results(path)
    except ValueError as err:
        return _fail(f"{path}: {err}")
    standing = "\n".join(compare.standing(results, min_speakers))
    print(f"{compare.leaderboard_markdown(board)}\n\n{standing}\n\n{compare.reading_note(board, min_speakers)}")
    if args.details:
        print()
        print(compare.markdown_table(results))
    return 0


def _cmd_finetune(args: argparse.Namespace) -> int:
    """The fine-tuning results per labelled budget and each encoder's verdict against scratch (judged
    as the ``finetuning_is_sound`` check judges), then the text overlap and held-out OOV rate."""
    from speech_assets.defs.resources import PipelineSettings
    from speech_assets.evaluation import finetune_results as results

    data = DataLayout(locations.data_dir())
    path = Path(args.results) if args.results else data.finetune.results
    if not path.is_file():
        return _fail(f"no fine-tuning results at {path}: materialize finetuned_asr")
    try:
        rows = results.read_rows(path)
    except ValueError as err:
        return _fail(f"{path}: {err}")
    try:  # the settings finetuned_asr and its check judge with
        min_speakers = PipelineSettings.load().probe.min_heldout_speakers
    except (OSError, ValueError) as err:
        return _fail(f"settings: {err}")
    print(results.markdown_tables(rows, results.probe_reference(args.probe_results or data.probe.results)))
    print("\n".join(results.verdicts(rows, min_heldout_speakers=min_speakers)))
    if notes := results.text_notes(rows) + results.overlap_problems(rows):
        print("\n" + "\n".join(notes))
    return 0


def _cmd_transcribe(args: argparse.Namespace) -> int:
    """One line per audio file (id, text, seconds of audio), or an error line; exit 1 if any failed."""
    import tempfile

    from speech_assets.evaluation.recognise import Recogniser, RecogniserError, fetch_recogniser, labelled_files

    data = locations.data_dir()
    model = args.model or DataLayout(data).finetune.recogniser
    options = {"threads": args.threads, "batch_size": args.batch_size, "max_segment_s": args.max_segment_s}
    try:
        # an MLflow model is downloaded, loaded, then the download is removed
        with tempfile.TemporaryDirectory(prefix="speech-assets-model.") as folder:
            if urlparse(str(model)).scheme in locations.MODEL_URI_SCHEMES:
                model = fetch_recogniser(model, Path(folder), locations.mlflow_tracking_uri(data))
            recogniser = Recogniser(model, args.decoder, **options)
    except RecogniserError as err:
        return _fail(str(err))
    files = labelled_files(args.inputs)
    if not files:
        return _fail(f"no audio files in {' '.join(args.inputs)}")
    failed = 0
    form = "json" if args.json else args.format
    for transcript in recogniser.transcribe_all(files):
        failed += transcript.error is not None
        if form == "json":
            print(json.dumps(asdict(transcript)), flush=True)
        elif form == "text" or transcript.error is not None:
            print(transcript.line(), flush=True, file=sys.stdout if form == "text" else sys.stderr)
        else:
            print(transcript.subtitles(form), flush=True)
    return 1 if failed else 0


def _cmd_sql(args: argparse.Namespace) -> int:
    import duckdb

    from speech_assets.stats import database as stats_db

    con = stats_db.connect_read_only(_db(args), allow_external_access=args.allow_external_access)
    try:
        stats_db.check_read_only(con, args.query)
        relation = con.sql(args.query)
        if relation is not None:  # a statement with a result
            (relation if args.raw else rounded(relation)).show(max_rows=args.max_rows, max_width=10_000)
    except (duckdb.Error, stats_db.NotReadOnly) as err:
        return _fail(str(err))
    finally:
        con.close()
    return 0


def rounded(relation: duckdb.DuckDBPyRelation) -> duckdb.DuckDBPyRelation:
    """FLOAT and DOUBLE columns rounded to 2 decimals, more where a value needs them for 3 significant
    digits (never a misleading ``0.00``); columns by position, so duplicate names are fine."""
    if not any(str(kind) in ("FLOAT", "DOUBLE") for kind in relation.types):
        return relation
    columns = []
    for i, (name, kind) in enumerate(zip(relation.columns, relation.types), start=1):
        alias = '"' + name.replace('"', '""') + '"'
        if str(kind) in ("FLOAT", "DOUBLE"):
            digits = f"greatest(2, 2 - floor(log10(abs(#{i})))::INTEGER)"
            columns.append(
                f"CASE WHEN isfinite(#{i}) AND #{i} <> 0 THEN round(#{i}, {digits}) ELSE #{i} END AS {alias}"
            )
        else:
            columns.append(f"#{i} AS {alias}")
    return relation.project(", ".join(columns))


def _cmd_lineage(args: argparse.Namespace) -> int:
    from speech_assets.stats.lineage import checkpoint_lineage

    if args.stale:
        from speech_assets.defs.resources import StoragePaths
        from speech_assets.defs.staleness import format_report, stale_report

        report = stale_report(StoragePaths.from_environment())
        print(json.dumps(report, indent=2, sort_keys=True) if args.json else format_report(report))
        return 3 if report else 0
    if not args.checkpoint:
        return _fail("give a checkpoint, or --stale", 2)
    report = checkpoint_lineage(Path(args.checkpoint))
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    print(f"checkpoint        {report['checkpoint']}")
    print(f"kind              {report['kind']}")
    if report.get("init"):  # a fine-tuning run: from which start, on which budget and seed
        minutes = report.get("labelled_minutes")
        budget = "(not recorded)" if minutes is None else f"{minutes:g} min"
        print(f"init              {report['init']}")
        print(f"labelled          {budget}, seed {report.get('seed')}")
    if report.get("architecture_of"):
        print(f"architecture of   {report['architecture_of']} (random weights: no encoder input)")
    print(f"weights sha256    {report['weights_sha256']}")
    print(f"{report['step_unit']:18s}{report['step'] if report['step'] is not None else '(none recorded)'}")
    print(f"git commit        {report.get('git_sha') or '(none recorded)'}")
    url = f" ({report['mlflow_run_url']})" if report.get("mlflow_run_url") else ""
    print(f"mlflow run        {report.get('mlflow_run_id') or '(none)'}{url}")
    print(f"dagster run       {report.get('dagster_run_id') or '(none recorded)'}")
    print("inputs (data versions):")
    for key, value in sorted(report["data_versions"].items()):
        print(f"  {key:32s} {value}")
    print("config:")
    for key, value in sorted(report["config"].items()):
        if key not in ("data_versions", "shards", "clients"):
            print(f"  {key:32s} {value}")
    return 0


def _cmd_partitions(args: argparse.Namespace) -> int:
    """Print a partition set's keys, or the `first...last` range `dagster asset materialize` takes."""
    import dagster as dg

    keys = list(dg.DagsterInstance.get().get_dynamic_partitions(args.name))
    if not keys:
        print(f"no partitions registered for {args.name!r} in {locations.dagster_home()}", file=sys.stderr)
        return 1
    print(f"{keys[0]}...{keys[-1]}" if args.range else "\n".join(keys))
    return 0


def _cmd_replicate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from speech_assets.corpus.replicate import replicate_corpus

    # shown only on a terminal: logs and CI stay clean
    with tqdm(total=args.speakers, unit="speaker", dynamic_ncols=True, disable=not sys.stderr.isatty()) as bar:
        try:
            report = replicate_corpus(
                args.source,
                args.out,
                scale=args.scale,
                speakers=args.speakers,
                seed=args.seed,
                workers=args.workers or None,
                progress=lambda done, total: bar.update(1),
            )
        except ValueError as err:
            return _fail(str(err), 2)
    print(
        f"wrote {report.utterances} utterances ({report.hours:.2f} h) from {report.speakers} speakers to "
        f"{report.out_dir}"
    )
    return 0


def _cmd_runs_reap(args: argparse.Namespace) -> int:
    """Fail runs whose processes are gone and free the concurrency slots they hold."""
    import dagster as dg

    from speech_assets.defs.runs import reap_dead_runs

    if not reap_dead_runs(dg.DagsterInstance.get(), say=print):
        print("no concurrency slot is held by a dead or finished run")
    return 0


def _fail(message: str, status: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


def _db(args: argparse.Namespace) -> Path:
    return Path(args.db) if args.db else DataLayout(locations.data_dir()).stats_db


ENVIRONMENT = """\
environment variables (all optional; relative paths resolve against the repository root):
  SPEECH_ASSETS_DATA_DIR  root of every output: stats.duckdb, the probe results, the training
                          runs and what `lineage --stale` compares (default: data/out)
  SPEECH_ASSETS_CORPUS    corpus root in LibriSpeech layout, or a .csv/.jsonl manifest file
                          (default: data/sample)
  DAGSTER_HOME            the Dagster instance `partitions` and `runs reap` read
                          (default: data/dagster_home)
  MLFLOW_TRACKING_URI     the MLflow tracking store the training runs log to
                          (default: sqlite:///<data dir>/mlflow.db)"""

EXAMPLES = {
    "speech-assets": """\
  speech-assets stats
  speech-assets sql "SELECT client_id, sum(hours) AS hours FROM clients GROUP BY ALL"
  speech-assets probe
  speech-assets transcribe data/sample/1001/100101/1001-100101-0000.flac
  speech-assets lineage data/out/training/<run>/final.pt
  speech-assets lineage --stale
  speech-assets partitions clients --range
  speech-assets corpus synth --out /tmp/corpus --speakers 8 --utterances 8""",
    "synth": "  speech-assets corpus synth --out /tmp/corpus --speakers 8 --utterances 8 --seed 0",
    "replicate": "  speech-assets corpus replicate --out /tmp/libri25h --scale 0.25 --workers 2",
    "stats": "  speech-assets stats\n  speech-assets stats --db /tmp/other/stats.duckdb",
    "probe": "  speech-assets probe\n  speech-assets probe --details\n  speech-assets probe --results "
    "/tmp/run/probe/results.parquet",
    "sql": """\
  speech-assets sql "SHOW TABLES"
  speech-assets sql "DESCRIBE clients"
  speech-assets sql "SELECT reason, stage, count(*) AS n FROM rejects GROUP BY ALL ORDER BY n DESC"
  speech-assets sql "SELECT client_id, sum(hours) AS hours FROM clients GROUP BY ALL" --raw
only one read-only statement runs (SELECT, WITH, FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN);
anything else is refused with exit 1 and nothing on disk changes.""",
    "lineage": """\
  speech-assets lineage data/out/training/<run>/final.pt
  speech-assets lineage data/out/training/<run>/final.pt --json | jq .data_versions
  speech-assets lineage --stale""",
    "partitions": (
        "  speech-assets partitions speakers\n"
        "  dagster asset materialize -m speech_assets.definitions --select kmeans_targets \\\n"
        '      --partition-range "$(speech-assets partitions clients --range)"'
    ),
    "reap": "  speech-assets runs reap",
    "finetune": "  speech-assets finetune\n  speech-assets finetune --results /tmp/run/finetune/results.parquet",
    "transcribe": """\
  speech-assets transcribe data/sample/1001/100101/1001-100101-0000.flac
  speech-assets transcribe /tmp/recordings --json
  speech-assets transcribe call.wav --model data/out/finetune/recogniser
  speech-assets transcribe call.wav --model models:/speech_assets_recogniser/latest
  speech-assets transcribe /tmp/recordings --decoder beam
  find /tmp/calls -name '*.mp3' | speech-assets transcribe - --format srt --threads 2
prints "id<TAB>text<TAB>seconds" per file (id: the path relative to the folder given, or the
file as given), or "id<TAB>error: ..." for a file that cannot be transcribed (the others still
are; the exit status is then 1). Long recordings are cut at pauses into segments of at most
--max-segment-s; --json gives each segment's start, end and text, and each word's start, end and
confidence (greedy decoding).""",
}


# each subcommand's --help summary
SUMMARIES = {
    "corpus": "corpus tools: synth, replicate",
    "synth": "build a LibriSpeech-layout corpus offline from local TTS voices",
    "replicate": "a corpus shaped like LibriSpeech train-clean-100 (251 speakers), made from a small real one",
    "stats": "summary of the dataset from the DuckDB database",
    "probe": "the downstream probe's leaderboard: CER/WER over seeds and the verdict against fbank and random",
    "finetune": "CTC fine-tuning's results per labelled budget, and whether each encoder beat the "
    "from-scratch baseline",
    "transcribe": "turn audio files into text with the fine-tuned recogniser",
    "sql": "run one read-only SQL statement (SELECT, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN) against the DuckDB database",
    "lineage": "what a checkpoint was trained from; --stale: what no longer matches its inputs",
    "partitions": "registered dynamic partitions (speakers, clients)",
    "runs": "Dagster runs",
    "reap": "fail runs whose processes are gone and free their concurrency slots",
}


def _epilog(name: str) -> str:
    return f"examples:\n{EXAMPLES[name]}\n\n{ENVIRONMENT}" if name in EXAMPLES else ENVIRONMENT


def _command(commands, name: str, func: Callable[[argparse.Namespace], int] | None = None) -> argparse.ArgumentParser:
    """A subcommand whose --help shows its summary, its examples and the environment variables."""
    command = commands.add_parser(
        name,
        help=SUMMARIES[name],
        description=SUMMARIES[name],
        epilog=_epilog(name),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.set_defaults(func=func)
    return command


def _data_file_option(command: argparse.ArgumentParser, option: str, *where: str, what: str = "") -> None:
    command.add_argument(option, help=f"{what or where[-1]} (default: $SPEECH_ASSETS_DATA_DIR/{'/'.join(where)})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speech-assets",
        description=__doc__,
        epilog=_epilog("speech-assets"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    corpus = _command(commands, "corpus").add_subparsers(dest="corpus_command", required=True, metavar="TOOL")
    from speech_assets.corpus import synth as synth_module

    synth = _command(corpus, "synth", synth_module.run_from_args)
    synth_module.add_arguments(synth)

    replicate = _command(corpus, "replicate", _cmd_replicate)
    replicate.add_argument(
        "--from",
        dest="source",
        type=Path,
        default=locations.sample_corpus(),
        help="source corpus (default: the sample)",
    )
    replicate.add_argument("--out", type=Path, required=True, help="output directory (must be empty or absent)")
    replicate.add_argument(
        "--scale",
        type=float,
        default=0.25,
        help="share of train-clean-100's ~113 utterances per speaker (1.0 = ~100 h)",
    )
    replicate.add_argument(
        "--speakers", type=int, default=251, help="number of speakers (default 251, as train-clean-100)"
    )
    replicate.add_argument(
        "--seed", type=int, default=0, help="random seed: the same seed gives the same corpus (default 0)"
    )
    replicate.add_argument("--workers", type=int, default=0, help="processes (0: one per core)")

    stats = _command(commands, "stats", _cmd_stats)
    _data_file_option(stats, "--db", layout.DataLayout.stats_db.name, what="DuckDB file")

    probe = _command(commands, "probe", _cmd_probe)
    _data_file_option(probe, "--results", layout.PROBE_DIR, layout.ProbeFiles.results.name)
    probe.add_argument(
        "--details",
        action="store_true",
        help="also print each model's probe lr, CER on its own training utterances and top layer weight",
    )

    finetune = _command(commands, "finetune", _cmd_finetune)
    _data_file_option(finetune, "--results", layout.FINETUNE_DIR, layout.FinetuneFiles.results.name)
    _data_file_option(
        finetune,
        "--probe-results",
        layout.PROBE_DIR,
        layout.ProbeFiles.results.name,
        what="the frozen probe's results, shown beside the fine-tuned CERs",
    )

    transcribe = _command(commands, "transcribe", _cmd_transcribe)
    transcribe.add_argument(
        "inputs",
        nargs="+",
        metavar="FILES_OR_FOLDER",
        help="audio files, folders (every file libsndfile decodes, by suffix) or - (paths on stdin, one a line)",
    )
    transcribe.add_argument(
        "--model",
        help="a recogniser folder, its .onnx or .json, or an MLflow model URI (models:/speech_assets_recogniser/latest,"
        " runs:/<run id>/recogniser) from $MLFLOW_TRACKING_URI (default: $SPEECH_ASSETS_DATA_DIR/finetune/recogniser)",
    )
    transcribe.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per file: id, path, text, seconds, error, segments (start, end, text, words)",
    )
    transcribe.add_argument(
        "--format",
        choices=["text", "json", "srt", "vtt"],
        default="text",
        help="text: a line per file; json: as --json; srt/vtt: a subtitle cue per segment (errors on stderr)",
    )
    transcribe.add_argument("--threads", type=int, default=0, help="onnxruntime CPU threads (0: its default)")
    transcribe.add_argument("--batch-size", type=int, default=8, help="segments per onnxruntime run")
    transcribe.add_argument(
        "--max-segment-s", type=float, default=20.0, help="longest segment (seconds) a recording is cut into"
    )
    transcribe.add_argument(
        "--decoder",
        choices=["greedy", "beam"],
        default="greedy",
        help="greedy: best path; beam: lexicon beam search with the n-gram LM beside the ONNX model",
    )

    sql = _command(commands, "sql", _cmd_sql)
    sql.add_argument("query", help='one SQL statement over the views and tables (list them with "SHOW TABLES")')
    _data_file_option(sql, "--db", layout.DataLayout.stats_db.name, what="DuckDB file")
    sql.add_argument("--max-rows", type=int, default=200, help="rows to print at most (default 200)")
    sql.add_argument(
        "--raw",
        action="store_true",
        help="print every digit of floating-point values (by default they are rounded for reading: 2 decimals, "
        "3 significant digits for small values)",
    )
    sql.add_argument(
        "--allow-external-access",
        action="store_true",
        help="let the query read any file or URL you can read and load installed extensions (DuckDB's "
        "enable_external_access); it still writes nothing",
    )

    lineage = _command(commands, "lineage", _cmd_lineage)
    lineage.add_argument("checkpoint", nargs="?", help="a checkpoint file (.pt) written by a training run")
    lineage.add_argument(
        "--stale",
        action="store_true",
        help="list outputs built from other shards/targets than those published now (exit 3 if any)",
    )
    lineage.add_argument("--json", action="store_true", help="print the whole report as JSON (for scripts)")

    partitions = _command(commands, "partitions", _cmd_partitions)
    partitions.add_argument("name", choices=["speakers", "clients"], help="which partition set: speakers or clients")
    partitions.add_argument("--range", action="store_true", help="print FIRST...LAST for --partition-range")

    runs = _command(commands, "runs").add_subparsers(dest="runs_command", required=True, metavar="ACTION")
    _command(runs, "reap", _cmd_runs_reap)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            args = build_parser().parse_args(argv)  # its --help, too, may meet a closed pipe
            return int(args.func(args) or 0)
        finally:  # on return and on argparse's exit: here, where a closed pipe can be handled
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader (`| head`, a pager) left having read what it wanted: not a failure, and no
        # traceback (a script under `set -o pipefail` would stop). As the Python docs advise,
        # stdout goes to devnull so that the flush at exit cannot raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except FileNotFoundError as err:
        return _fail(str(err))


if __name__ == "__main__":
    sys.exit(main())
