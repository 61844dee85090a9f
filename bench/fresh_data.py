"""Fresh-data benchmark: time to absorb ~5 % new audio vs a full build of the same graph.

    python bench/fresh_data.py [--speakers 96] [--new-fraction 0.05]
    python bench/fresh_data.py --corpus /big/disk/ls100      # an existing corpus (hard-linked copy)

Builds a corpus of ``--speakers`` speakers (the committed sample replicated under new ids),
materializes manifest -> vad_features -> cmvn_stats -> client_partitions -> kmeans_targets ->
dataset_stats on a fresh SQLite instance (in process, like a run worker does), then adds the
held-back ``--new-fraction`` of the speakers and absorbs them the way the sensor and
declarative automation do: manifest (decode cache), only the new speaker's shard, then whatever
automation requests. Training is left out of both: it is cron-gated and its cost is set by its
config, not by the data. Target (issue 6): absorbing 5 % costs under 10 % of a full build.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from manifest import build_corpus  # noqa: E402  (the manifest benchmark's corpus builder)

from speech_assets.defs.automation import corpus_sensor  # noqa: E402
from speech_assets.testing.local_runs import follow_automation, materialize_data_stages, materialize_in_process, run_requested  # noqa: E402
from speech_assets.defs.resources import StoragePaths  # noqa: E402
from speech_assets.definitions import build_definitions  # noqa: E402

DOWNSTREAM = ("cmvn_stats", "client_partitions", "kmeans_targets", "dataset_stats")


def full_build(defs: dg.Definitions, instance: dg.DagsterInstance) -> None:
    materialize_data_stages(defs, instance)
    materialize_in_process(defs, instance, "dataset_stats")


def absorb(defs: dg.Definitions, instance: dg.DagsterInstance, paths: StoragePaths, cursor: object) -> list[str]:
    """Do what corpus_sensor + the automation sensor would request, until nothing is left; each
    entry of the returned list is a run with its wall time."""
    done: list[str] = []
    for _ in range(5):
        with dg.build_sensor_context(instance=instance, resources={"paths": paths}) as context:
            result = corpus_sensor(context)
        requests = getattr(result, "run_requests", None) or []
        if not requests:
            break
        if result.dynamic_partitions_requests:
            for add in result.dynamic_partitions_requests:
                instance.add_dynamic_partitions(add.partitions_def_name, list(add.partition_keys))
        for request in requests:
            started = time.perf_counter()
            name = run_requested(defs, instance, request)
            done.append(f"{name} {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    _, automated = follow_automation(defs, instance, cursor, DOWNSTREAM)
    done.append(f"automation ({', '.join(automated)}) {time.perf_counter() - started:.1f} s")
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speakers", type=int, default=96, help="speakers in the final corpus (multiple of 8)")
    parser.add_argument("--new-fraction", type=float, default=0.05, help="share of speakers that arrive as fresh data")
    parser.add_argument("--corpus", type=Path, default=None, help="use this LibriSpeech-layout corpus instead")
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
    print(f"machine: {cpu}, {os.cpu_count()} logical CPUs")
    with tempfile.TemporaryDirectory(dir=args.corpus.parent if args.corpus else None) as tmp:
        root = Path(tmp)
        staging, corpus = root / "staging", root / "corpus"
        if args.corpus:
            shutil.copytree(args.corpus, staging, copy_function=os.link)
        else:
            build_corpus(staging, args.speakers * 8)  # 8 files per sample speaker
        speakers = sorted(p.name for p in staging.iterdir() if p.is_dir())
        newcomers = speakers[-max(1, round(args.new_fraction * len(speakers))):]
        shutil.copytree(staging, corpus, ignore=shutil.ignore_patterns(*newcomers))
        home = root / "dagster_home"
        home.mkdir()
        shutil.copy(Path(__file__).resolve().parents[1] / "dagster.yaml", home)
        os.environ["DAGSTER_HOME"] = str(home)
        instance = dg.DagsterInstance.get()
        paths = StoragePaths(corpus=str(corpus), data_dir=str(root / "out"), mlflow_tracking_uri=f"sqlite:///{root}/mlflow.db")
        defs = build_definitions(paths)

        started = time.perf_counter()
        full_build(defs, instance)
        full = time.perf_counter() - started
        cursor, _ = follow_automation(defs, instance, None, DOWNSTREAM)  # the automation sensor's first tick

        for newcomer in newcomers:
            shutil.copytree(staging / newcomer, corpus / newcomer)
        started = time.perf_counter()
        runs = absorb(defs, instance, paths, cursor)
        incremental = time.perf_counter() - started
        instance.dispose()
    share = len(newcomers) / len(speakers)
    print(f"corpus: {len(speakers) - len(newcomers)} speakers, then {len(newcomers)} new ({share:.1%} of the audio)")
    print(f"full build (manifest .. kmeans_targets, dataset_stats): {full:7.1f} s")
    print(f"absorbing the new speakers: {incremental:7.1f} s via:")
    for run in runs:
        print(f"  {run}")
    ratio = incremental / full
    print(f"incremental / full = {ratio:.3f}  (target < 0.10: {'PASS' if ratio < 0.1 else 'FAIL'})")


if __name__ == "__main__":
    main()
