"""Every file and folder the graph writes gets the mode a plain write would (0666 / 0777 & ~umask).

The umask is process-wide, so the runs happen in a subprocess started with its own umask, on a real
instance and a tiny real corpus; the test then walks the whole data dir.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from speech_assets_tests.conftest import REPO

RUN_GRAPH = """
import sys
from pathlib import Path
import dagster as dg
import soundfile as sf
from speech_assets.definitions import build_definitions
from speech_assets.defs.resources import ClientSettings, KMeansSettings, PipelineSettings, StoragePaths
from speech_assets_tests.support.corpora import LibriCorpus, with_silence
from speech_assets_tests.support.local_runs import materialize_in_process

corpus, out = LibriCorpus(Path(sys.argv[1])), Path(sys.argv[2])
for speaker in ("1", "2"):
    for utt in range(2):
        utt_id = f"{speaker}-10-{utt:04d}"
        corpus.add_line(speaker, "10", utt_id, "HELLO")
        sf.write(corpus.chapter_dir(speaker, "10") / f"{utt_id}.flac", with_silence(0.3, 1.5, 0.3, seed=10 *
        int(speaker) + utt), 16000)
corpus.add_line("2", "10", "2-10-0009", "NO AUDIO")  # a reject, so rejects.parquet has rows
paths = StoragePaths(corpus=str(corpus.root), data_dir=str(out), mlflow_tracking_uri="sqlite://")
defs = build_definitions(paths, PipelineSettings(clients=ClientSettings(num_clients=1), kmeans=KMeansSettings(k=4)))
instance = dg.DagsterInstance.get()
materialize_in_process(defs, instance, "manifest", run_config={"ops": {"manifest": {"config": {"max_reject_ratio":
0.5}}}})
speakers = list(instance.get_dynamic_partitions("speakers"))
materialize_in_process(defs, instance, "vad_features", speakers)
for asset in ("cmvn_stats", "client_partitions"):
    materialize_in_process(defs, instance, asset)
materialize_in_process(defs, instance, "kmeans_targets", list(instance.get_dynamic_partitions("clients")))
materialize_in_process(defs, instance, "dataset_stats")
"""


def test_every_output_of_a_real_run_honours_the_umask(tmp_path: Path) -> None:
    umask = 0o027  # unlike the usual 022, so a default mode cannot pass by chance (utils tests cover 022/077/002)
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    out = tmp_path / "out"
    env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", RUN_GRAPH, str(tmp_path / "corpus"), str(out)],
        env=env,
        cwd=REPO,
        umask=umask,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    files = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    folders = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_dir()}
    # what the run must have written, one of each kind (parquet, npz, npy, json, duckdb, lock)
    for expected in (
        "manifest/manifest.parquet",
        "manifest/rejects.parquet",
        "manifest/speakers.parquet",
        "manifest/decode_cache.parquet",
        "features/shards/1.parquet",
        "features/shards/1.stats.npz",
        "features/shards/1.meta.json",
        "cmvn/cmvn.npz",
        "clients/clients.parquet",
        "kmeans/client_00/codebook.npy",
        "kmeans/client_00/labels.parquet",
        "stats.duckdb",
    ):
        assert expected in files, sorted(files)
    assert {name: mode for name, mode in files.items() if mode != 0o666 & ~umask} == {}
    assert {name: mode for name, mode in folders.items() if mode != 0o777 & ~umask} == {}
    assert not [name for name in files if name.endswith(".tmp")] and "manifest/.staging" not in folders
