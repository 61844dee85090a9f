"""The whole graph at LibriSpeech size: per stage wall and CPU time, peak RSS, disk and files.

    speech-assets corpus replicate --out /big/disk/ls100 --scale 0.25
    python bench/scale.py --corpus /big/disk/ls100 --out /big/disk/scale_run --train-steps 2500

Runs the documented commands (the stages of scripts/materialize_all.sh) one by one on a fresh
Dagster instance and data dir, with the settings in ``--settings`` (default: the repository's
pipeline.toml with ``[training] max_steps`` from ``--train-steps``). Each command's resource use
comes from ``wait4`` (CPU = user + system of the command and every process it waited for; peak
RSS = the largest of them). Disk and file counts are measured on the data dir after each stage.
Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

STAGES = [
    ("manifest", ["--select", "manifest"], None),
    ("vad_features", ["--select", "vad_features"], "speakers"),
    ("cmvn_stats + client_partitions", ["--select", "cmvn_stats,client_partitions"], None),
    ("kmeans_targets", ["--select", "kmeans_targets"], "clients"),
    ("pretrained_checkpoint", ["--select", "pretrained_checkpoint"], None),
    ("dataset_stats", ["--select", "dataset_stats"], None),
]


def disk(folder: Path) -> tuple[int, int]:
    total, files = 0, 0
    for root, _dirs, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                pass
    return total, files


def run(command: list[str], env: dict, log) -> tuple[float, float, float]:
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(command)} (see the log)")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="fresh folder: data dir, Dagster home, log")
    parser.add_argument("--settings", type=Path, default=REPO / "pipeline.toml")
    parser.add_argument("--train-steps", type=int, default=2500)
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} is not empty")
    data, home = args.out / "data", args.out / "dagster_home"
    home.mkdir(parents=True)
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    settings = tomllib.loads(args.settings.read_text())
    settings.setdefault("training", {})["max_steps"] = args.train_steps
    settings_file = args.out / "settings.toml"
    settings_file.write_text(
        "".join(
            f"[{section}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
            for section, values in settings.items()
        )
    )
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "DAGSTER_HOME": str(home),
        "SPEECH_ASSETS_DATA_DIR": str(data),
        "SPEECH_ASSETS_CORPUS": str(args.corpus),
        "SPEECH_ASSETS_SETTINGS": str(settings_file),
        "MLFLOW_TRACKING_URI": f"sqlite:///{data}/mlflow.db",
    }
    rows = []
    with open(args.out / "log.txt", "w") as log:
        for name, selection, partitions in STAGES:
            command = [str(BIN / "dagster"), "asset", "materialize", "-m", "speech_assets.definitions", *selection]
            if partitions:
                keys = subprocess.run(
                    [str(BIN / "speech-assets"), "partitions", partitions, "--range"],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.strip()
                command += ["--partition-range", keys]
            before = disk(data) if data.exists() else (0, 0)
            wall, cpu, rss = run(command, env, log)
            after = disk(data)
            rows.append(
                {
                    "stage": name,
                    "wall_s": round(wall, 1),
                    "cpu_s": round(cpu, 1),
                    "peak_rss_mb": round(rss),
                    "disk_mb": round((after[0] - before[0]) / 1e6, 1),
                    "files": after[1] - before[1],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    import pyarrow.parquet as pq

    hours = (
        sum(pq.read_table(data / "manifest" / "manifest.parquet", columns=["duration_s"]).column(0).to_pylist()) / 3600
    )
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; corpus {hours:.2f} h\n")
    print("| stage | wall s | CPU s | peak RSS MB | disk MB | MB per hour of audio | files |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['stage']} | {row['wall_s']} | {row['cpu_s']} | {row['peak_rss_mb']} | {row['disk_mb']} | "
            f"{row['disk_mb'] / hours:.1f} | {row['files']} |"
        )
    total = {k: sum(r[k] for r in rows) for k in ("wall_s", "cpu_s", "disk_mb", "files")}
    print(
        f"| total | {total['wall_s']:.0f} | {total['cpu_s']:.0f} | | {total['disk_mb']:.0f} | "
        f"{total['disk_mb'] / hours:.1f} | {total['files']} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
