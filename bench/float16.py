"""float16 (shard format 2) against float32 (format 1) shards, in one run: disk, read-back, k-means, training.

    python bench/float16.py --data /big/disk/scale_run32/data --speakers 40 --steps 150   # float32 shards
    python bench/float16.py --shards /some/float32/shards      # disk, read-back, k-means only

The source shards must be float32 (format 1: shards built before issue 24; the graph writes
float16 straight from the extractor, so no build makes float32 values now: the former
``$SPEECH_ASSETS_SHARD_FORMAT=1`` wrote float16 values into float32 blobs, byte for byte this
script's own format-1 rewrite of a format-2 shard); each is rewritten twice with ``write_shard`` (same settings: zstd
level 1, 32-row groups), as format 1 and as format 2, and every figure compares the two:

* disk: shard bytes per hour of audio (original duration, before VAD);
* read-back: ``iter_shard`` as float32 (what most consumers take: a view of format 1, one
  conversion of format 2) and as stored (``dtype=None``: a view either way), best of 3;
* k-means: K=``--k`` on the CMVN-normalised MFCC frames (CMVN of the float32 frames), fitted on
  each format's frames (same seed, same sample); both codebooks are scored on the float32 frames;
* training (``--data`` only): the tiny model, one process, ``--steps`` steps from the same seed
  with the data dir's newest training config on each format's shards; the mean loss of the last
  20 % of logged steps is compared.

The issue's bar for float16: k-means inertia and training loss within 0.5 %.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from speech_assets.features.cmvn import Cmvn, PartialSums  # noqa: E402
from speech_assets.features.shards import iter_shard, shard_format, write_shard  # noqa: E402
from speech_assets.targets.kmeans import fit_kmeans  # noqa: E402


def rewrite(shard: Path, out: Path, version: int) -> Path:
    """``shard``'s records written again as format ``version``."""
    return write_shard(out, list(iter_shard(shard)), version=version)


def read_back(shards: list[Path], dtype) -> tuple[float, float, float]:
    """(float32-equivalent MB/s, utterances/s, wall s) of iterating every record, best of 3."""
    best = None
    for _ in range(3):
        started, nbytes, count = time.perf_counter(), 0, 0
        for shard in shards:
            for record in iter_shard(shard, dtype=dtype):
                nbytes += 4 * (record.logmel.size + record.mfcc.size)
                count += 1
        wall = time.perf_counter() - started
        best = wall if best is None else min(best, wall)
    return nbytes / best / 1e6, count / best, best


def mfcc_frames(shards: list[Path]) -> np.ndarray:
    return np.concatenate([r.mfcc for s in shards for r in iter_shard(s, features=("mfcc",))])


def inertia(frames: np.ndarray, codebook: np.ndarray) -> float:
    import faiss

    index = faiss.IndexFlatL2(codebook.shape[1])
    index.add(codebook.astype(np.float32))
    distances, _ = index.search(frames, 1)
    return float(distances.mean())


def train(config, run_dir: Path, shards: list[str], steps: int) -> list[float]:
    run = replace(
        config,
        run_dir=str(run_dir),
        shards=shards,
        nproc=1,
        threads=2,
        num_workers=0,
        mlflow_tracking_uri=None,
        max_steps=steps,
        checkpoint_every=steps,
        log_every=5,
        warmup_steps=min(config.warmup_steps, steps // 5),
    )
    run_dir.mkdir(parents=True)
    path = run_dir.parent / f"{run_dir.name}.json"
    path.write_text(run.to_json())
    subprocess.run(
        [sys.executable, "-m", "speech_assets.train", "--config", str(path)],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["loss"] for row in rows if "loss" in row]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--data", type=Path, help="a data dir built by the graph (with a training run) from float32 shards"
    )
    source.add_argument("--shards", type=Path, help="a folder of float32 shards (*.parquet); no training comparison")
    parser.add_argument("--speakers", type=int, default=40, help="shards used (the first N)")
    parser.add_argument("--steps", type=int, default=150, help="training steps per format (--data); 0 skips training")
    parser.add_argument("--k", type=int, default=100)
    args = parser.parse_args()

    config = None
    if args.data is not None:
        from built_data import newest_training_config  # bench/

        config = newest_training_config(args.data)
        shards = sorted(Path(s) for s in config.shards)[: args.speakers]
        work_parent = args.data
    else:
        shards = sorted(p for p in args.shards.glob("*.parquet") if not p.name.endswith(".rejects.parquet"))[
            : args.speakers
        ]
        work_parent = None
    formats = {shard_format(s) for s in shards}
    if formats != {1}:
        raise SystemExit(
            f"source shards are format {sorted(formats)}: float32 (format 1) sources are needed, e.g. "
            f"built before issue 24"
        )
    hours = sum(r.duration_s for s in shards for r in iter_shard(s, features=())) / 3600
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
        f"{len(shards)} shards, {hours:.3f} h of audio"
    )

    results: dict[str, object] = {"shards": len(shards), "audio_hours": round(hours, 4)}
    with tempfile.TemporaryDirectory(dir=work_parent) as tmp:
        tmp = Path(tmp)
        rewritten: dict[int, list[Path]] = {}
        for version in (1, 2):
            (tmp / f"v{version}").mkdir()
            started = time.perf_counter()
            rewritten[version] = [rewrite(s, tmp / f"v{version}" / s.name, version) for s in shards]
            size = sum(p.stat().st_size for p in rewritten[version])
            results[f"v{version}_rewrite_s"] = round(time.perf_counter() - started, 2)
            results[f"v{version}_MB"] = round(size / 1e6, 2)
            results[f"v{version}_MB_per_audio_hour"] = round(size / 1e6 / hours, 1)
        print(
            f"disk: float32 {results['v1_MB']} MB ({results['v1_MB_per_audio_hour']} MB per hour of audio), "
            f"float16 {results['v2_MB']} MB ({results['v2_MB_per_audio_hour']} MB/h), "
            f"{results['v2_MB'] / results['v1_MB']:.3f}x"
        )

        for version in (1, 2):
            for name, dtype in (("float32", np.float32), ("stored", None)):
                mb_s, utt_s, wall = read_back(rewritten[version], dtype)
                results[f"v{version}_read_{name}_MB_s"] = round(mb_s, 1)
                print(
                    f"read-back format {version} as {name}: {mb_s:.0f} MB/s (float32-equivalent), {utt_s:.0f} "
                    f"utt/s, {wall:.2f} s"
                )

        raw32, raw16 = mfcc_frames(rewritten[1]), mfcc_frames(rewritten[2])
        cmvn = Cmvn.from_sums({"mfcc": PartialSums.of(raw32)})
        frames, frames16 = cmvn.apply(raw32, "mfcc"), cmvn.apply(raw16, "mfcc")
        error = np.abs(frames16 - frames)
        print(f"float16 rounding on CMVN-normalised MFCC: mean |error| {error.mean():.2e}, max {error.max():.2e}")
        started = time.perf_counter()
        fit32, fit16 = fit_kmeans(frames, args.k), fit_kmeans(frames16, args.k)
        i32, i16 = inertia(frames, fit32.codebook), inertia(frames, fit16.codebook)
        results.update(
            kmeans_frames=len(frames),
            inertia_v1=round(i32, 4),
            inertia_v2=round(i16, 4),
            inertia_ratio=round(i16 / i32, 4),
        )
        print(
            f"k-means K={args.k} on {len(frames):,} MFCC frames ({time.perf_counter() - started:.0f} s): "
            f"inertia float32 {i32:.4f}, float16 {i16:.4f} ({i16 / i32:.4f}x)"
        )

        if config is not None and args.steps > 0:
            loss32 = train(config, tmp / "train32", [str(s) for s in rewritten[1]], args.steps)
            loss16 = train(config, tmp / "train16", [str(s) for s in rewritten[2]], args.steps)
            tail = max(1, len(loss32) // 5)
            m32, m16 = float(np.mean(loss32[-tail:])), float(np.mean(loss16[-tail:]))
            worst = max(abs(a - b) / a for a, b in zip(loss32, loss16, strict=True))
            results.update(
                loss_v1=round(m32, 6),
                loss_v2=round(m16, 6),
                loss_ratio=round(m16 / m32, 5),
                loss_worst_rel=float(f"{worst:.2e}"),
            )
            print(
                f"training tiny, {args.steps} steps: mean loss of the last {tail} logged steps float32 {m32:.6f}, "
                f"float16 {m16:.6f} ({m16 / m32:.5f}x); largest relative difference at any logged step {worst:.2e}"
            )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
