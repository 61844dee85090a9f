"""Would float16 feature storage pay? Disk saved, k-means inertia and training loss, in one run.

    python bench/float16.py --data /big/disk/scale_run/data --speakers 40 --steps 150

On real shards of a built data dir (the first ``--speakers`` shards):

* disk: each shard rewritten with float16 feature blobs (same writer settings: zstd level 1,
  32-row groups) against the shard as built (float32 blobs);
* k-means: K=100 on the CMVN-normalised MFCC frames of those speakers, fitted on the float32
  frames and on the same frames rounded through float16 (same seed, same sample); both
  codebooks are scored on the float32 frames;
* training: the tiny model, one process, ``--steps`` steps from the same seed on the shards as
  built and on shards whose log-mel and MFCC were rounded through float16 (stored as float32,
  so the loader is unchanged and only the rounding differs); the mean loss of the last 20 %
  of steps is compared.

The issue's bar for adopting float16: k-means inertia and training loss within 0.5 %.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from speech_assets.features.cmvn import Cmvn  # noqa: E402
from speech_assets.features.shards import MFCC_DIM, N_MELS, ROW_GROUP_ROWS, blob_to_matrix  # noqa: E402
from speech_assets.targets.kmeans import fit_kmeans  # noqa: E402
from speech_assets.train.config import TrainConfig  # noqa: E402
from built_data import newest_training_config  # noqa: E402  (bench/)

DIMS = {"logmel": N_MELS, "mfcc": MFCC_DIM}


def rewrite(shard: Path, out: Path, dtype: str) -> Path:
    """``shard`` with its feature blobs rounded through float16, stored as ``dtype`` blobs."""
    table = pq.read_table(shard)
    columns = {}
    for name in table.column_names:
        if name in DIMS:
            blobs = []
            for blob in table.column(name).combine_chunks():
                rounded = blob_to_matrix(blob, DIMS[name]).astype(np.float16)
                blobs.append(np.ascontiguousarray(rounded, dtype="<f2" if dtype == "float16" else "<f4").tobytes())
            columns[name] = pa.array(blobs, type=pa.binary())
        else:
            columns[name] = table.column(name)
    pq.write_table(pa.table(columns, schema=table.schema), out, compression="zstd", compression_level=1,
                   use_dictionary=["speaker_id", "chapter_id"], row_group_size=ROW_GROUP_ROWS)  # fmt: skip
    return out


def mfcc_frames(shards: list[Path], cmvn: Cmvn) -> np.ndarray:
    mats = []
    for shard in shards:
        for blob in pq.read_table(shard, columns=["mfcc"]).column("mfcc").combine_chunks():
            mats.append(blob_to_matrix(blob, MFCC_DIM))
    frames = np.concatenate(mats)
    return ((frames - cmvn.mean["mfcc"]) / cmvn.std["mfcc"]).astype(np.float32)


def inertia(frames: np.ndarray, codebook: np.ndarray) -> float:
    import faiss

    index = faiss.IndexFlatL2(codebook.shape[1])
    index.add(codebook.astype(np.float32))
    distances, _ = index.search(frames, 1)
    return float(distances.mean())


def train(config: TrainConfig, run_dir: Path, shards: list[str], steps: int) -> list[float]:
    run = replace(config, run_dir=str(run_dir), shards=shards, nproc=1, threads=2, num_workers=0, mlflow_tracking_uri=None,
                  max_steps=steps, checkpoint_every=steps, log_every=5, warmup_steps=min(config.warmup_steps, steps // 5))  # fmt: skip
    run_dir.mkdir(parents=True)
    path = run_dir.parent / f"{run_dir.name}.json"
    path.write_text(run.to_json())
    subprocess.run([sys.executable, "-m", "speech_assets.train", "--config", str(path)], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["loss"] for row in rows if "loss" in row]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a data dir built by the graph (with a training run)")
    parser.add_argument("--speakers", type=int, default=40)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--k", type=int, default=100)
    args = parser.parse_args()

    config = newest_training_config(args.data)
    shards = sorted(Path(s) for s in config.shards)[: args.speakers]
    cmvn = Cmvn.load(config.cmvn)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, Python {platform.python_version()}; {len(shards)} shards of {args.data}")

    with tempfile.TemporaryDirectory(dir=args.data) as tmp:
        tmp = Path(tmp)
        (tmp / "f16").mkdir()
        (tmp / "rounded").mkdir()
        size32 = sum(s.stat().st_size for s in shards)
        size16 = sum(rewrite(s, tmp / "f16" / s.name, "float16").stat().st_size for s in shards)
        rounded = [rewrite(s, tmp / "rounded" / s.name, "float32") for s in shards]
        print(f"disk: float32 {size32 / 1e6:.1f} MB, float16 {size16 / 1e6:.1f} MB ({size16 / size32:.3f}x)")

        frames = mfcc_frames(shards, cmvn)
        frames16 = mfcc_frames(rounded, cmvn)
        error = np.abs(frames16 - frames)
        print(f"rounding through float16, on CMVN-normalised MFCC: mean |error| {error.mean():.2e}, max {error.max():.2e}")
        started = time.perf_counter()
        fit32 = fit_kmeans(frames, args.k, seed=0)
        fit16 = fit_kmeans(frames16, args.k, seed=0)
        i32, i16 = inertia(frames, fit32.codebook), inertia(frames, fit16.codebook)
        print(f"k-means K={args.k} on {len(frames):,} MFCC frames ({time.perf_counter() - started:.0f} s): "
              f"inertia float32 {i32:.4f}, float16-rounded {i16:.4f} ({i16 / i32:.4f}x)")  # fmt: skip

        loss32 = train(config, tmp / "train32", [str(s) for s in shards], args.steps)
        loss16 = train(config, tmp / "train16", [str(s) for s in rounded], args.steps)
        tail = max(1, len(loss32) // 5)
        m32, m16 = float(np.mean(loss32[-tail:])), float(np.mean(loss16[-tail:]))
        worst = max(abs(a - b) / a for a, b in zip(loss32, loss16, strict=True))
        print(f"training tiny, {args.steps} steps: mean loss of the last {tail} logged steps float32 {m32:.6f}, "
              f"float16-rounded {m16:.6f} ({m16 / m32:.5f}x); largest relative difference at any logged step {worst:.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
