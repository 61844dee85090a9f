"""Benchmark the kmeans_targets fit against the fairseq HuBERT recipe, and labelling speed.

    .venv/bin/python bench/kmeans.py [--frames 1000000] [--k 100 500] [--shards DIR] [--quick]

Frames: ``--frames`` 39-dim MFCC frames. With ``--shards DIR`` they are the ``mfcc`` columns of
the feature shards (``DIR/*.parquet``, docs/ARCHITECTURE.md schema), read in file and row order
until ``--frames`` are gathered; otherwise a deterministic synthetic MFCC-like stream (a
300-state Markov chain of segments with geometric durations, each state a 13-dim Gaussian with a
low-rank + diagonal covariance, smoothed over 3 frames, plus Δ and ΔΔ by the usual regression
window, so the 39 dims are correlated as in real MFCCs). Either way, global CMVN is applied.

For every K, on the same frames:

* ``fairseq recipe``: ``MiniBatchKMeans`` exactly as in fairseq
  ``examples/hubert/simple_kmeans/learn_kmeans.py`` (k-means++, batch_size 10000, n_init 20,
  max_iter 100, max_no_improvement 100, tol 0, reassignment_ratio 0, init_size None);
* ``project fit``: ``speech_assets.targets.kmeans.fit_kmeans`` with the ``KMeansConfig`` defaults (its
  time includes its own inertia estimate, which it returns);
* unless ``--no-compare``: the same Lloyd's iterations (same subsample, same initial centroids,
  same iteration count as the project fit) in scikit-learn ``KMeans`` and in a batched torch
  implementation, plus faiss on all frames without the subsample — the measurements behind the
  library choice.

Inertia per frame is computed identically for every codebook: each frame is assigned to its
nearest centroid (exact faiss search) and the squared distances are averaged. Fit times use all
cores (library defaults); labelling speed is ``CodebookIndex.assign`` on ``--label-frames`` frames with
one thread, best of three. The machine is shared in CI, so the load average is printed before
and after; compare ratios from one run, not absolute times.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Passive OpenMP waiting for every library in this process (faiss, scikit-learn): on a shared
# machine, spinning workers of a 2-thread OpenMP team collapse when another process holds a core.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import faiss  # noqa: E402
import numpy as np  # noqa: E402
import sklearn  # noqa: E402
from machine import cpu_model  # noqa: E402  (bench/machine.py)
from sklearn.cluster import KMeans, MiniBatchKMeans  # noqa: E402

from speech_assets.targets import kmeans  # noqa: E402

SPEED_TARGET = 10.0
INERTIA_TARGET = 1.02
LABEL_TARGET = 1_000_000


# ------------------------------------------------------------------------------------------
# frames


def synthetic_mfcc(num_frames: int, seed: int = 0, n_states: int = 300) -> np.ndarray:
    """Deterministic MFCC-like ``(num_frames, 39)`` float32 frames (see module docstring)."""
    rng = np.random.default_rng(seed)
    d, rank, mean_seg = 13, 4, 6.0
    scale = 1.0 / (1.0 + 0.35 * np.arange(d))  # c0 varies most, high cepstra least
    means = rng.normal(size=(n_states, d)) * scale * 6.0
    factors = (rng.normal(size=(n_states, d, rank)) * scale[None, :, None] * 0.8).astype(np.float32)
    diag = ((0.5 + rng.random((n_states, d))) * scale).astype(np.float32)
    lengths: list[int] = []  # utterances of 2-15 s at 100 Hz
    while sum(lengths) < num_frames:
        lengths.append(min(int(rng.integers(200, 1500)), num_frames - sum(lengths)))
    successors = rng.integers(0, n_states, size=(n_states, 8))
    n_segments = int(num_frames / mean_seg * 1.5) + 16
    durations = rng.geometric(1.0 / mean_seg, size=n_segments)
    picks = rng.integers(0, 8, size=n_segments)
    states = np.empty(num_frames, np.int64)
    pos, state, i = 0, int(rng.integers(n_states)), 0
    while pos < num_frames:
        run = min(int(durations[i]), num_frames - pos)
        states[pos : pos + run] = state
        pos += run
        state = int(successors[state, picks[i]])
        i += 1
    static = means[states].astype(np.float32)
    static += np.einsum("tdr,tr->td", factors[states], rng.normal(size=(num_frames, rank)).astype(np.float32))
    static += diag[states] * rng.normal(size=(num_frames, d)).astype(np.float32)
    out = np.empty((num_frames, 3 * d), np.float32)
    start = 0
    for length in lengths:
        u = static[start : start + length]
        p = np.pad(u, ((1, 1), (0, 0)), mode="edge")
        u = 0.25 * p[:-2] + 0.5 * p[1:-1] + 0.25 * p[2:]
        delta = _delta(u)
        out[start : start + length] = np.concatenate([u, delta, _delta(delta)], axis=1)
        start += length
    return _cmvn(out)


def _delta(u: np.ndarray, width: int = 2) -> np.ndarray:
    t = len(u)
    p = np.pad(u, ((width, width), (0, 0)), mode="edge")
    num = sum(n * (p[width + n : width + n + t] - p[width - n : width - n + t]) for n in range(1, width + 1))
    return num / (2 * sum(n * n for n in range(1, width + 1)))


def _cmvn(x: np.ndarray) -> np.ndarray:
    mean = x.mean(0, dtype=np.float64)
    std = x.std(0, dtype=np.float64)
    return np.ascontiguousarray((x - mean) / np.maximum(std, 1e-8), dtype=np.float32)


def shard_mfcc(directory: Path, num_frames: int) -> np.ndarray:
    """First ``num_frames`` MFCC frames of ``directory/*.parquet`` (raw), CMVN-normalised."""
    import pyarrow.parquet as pq

    from speech_assets.features.shards import MFCC_DIM, blob_matrices, feature_dtype

    paths = sorted(p for p in directory.glob("*.parquet") if not p.name.endswith(".rejects.parquet"))
    if not paths:
        raise SystemExit(f"no feature shards (*.parquet) in {directory}")
    parts: list[np.ndarray] = []
    have = 0
    for path in paths:
        dtype = feature_dtype(path)  # float16 (format 2) or float32 (format 1) blobs
        for matrix in blob_matrices(pq.read_table(path, columns=["mfcc"]).column("mfcc"), MFCC_DIM, dtype):
            mfcc = matrix.astype(np.float32)
            parts.append(mfcc)
            have += len(mfcc)
            if have >= num_frames:
                return _cmvn(np.concatenate(parts)[:num_frames])
    print(f"note: shards hold only {have} frames (< --frames {num_frames}); using them all")
    return _cmvn(np.concatenate(parts))


# ------------------------------------------------------------------------------------------
# methods


def inertia_per_frame(x: np.ndarray, codebook: np.ndarray) -> float:
    """Mean squared distance of each frame to its nearest centroid (exact, all threads)."""
    return float(kmeans.CodebookIndex(codebook).assign(x)[1].sum(dtype=np.float64)) / len(x)


def fairseq_recipe(x: np.ndarray, k: int, n_init: int, seed: int) -> np.ndarray:
    """fairseq examples/hubert/simple_kmeans/learn_kmeans.py ``get_km_model`` + ``fit``."""
    model = MiniBatchKMeans(
        n_clusters=k,
        init="k-means++",
        max_iter=100,
        batch_size=10000,
        tol=0.0,
        max_no_improvement=100,
        n_init=n_init,
        reassignment_ratio=0.0,
        verbose=0,
        compute_labels=False,
        init_size=None,
        random_state=seed,
    )
    model.fit(x)
    return np.asarray(model.cluster_centers_, dtype=np.float32)


def _project_subsample(x: np.ndarray, k: int, cfg: kmeans.KMeansConfig) -> np.ndarray:
    """The subsample ``fit_kmeans`` trains on (same RNG draws), for like-for-like comparisons."""
    rng = np.random.default_rng(cfg.seed)
    limit = cfg.max_points_per_centroid * k
    if cfg.max_points_per_centroid and len(x) > limit:
        return x[np.sort(rng.choice(len(x), size=limit, replace=False))]
    return x


def faiss_lloyd(x: np.ndarray, init: np.ndarray, niter: int) -> np.ndarray:
    k = len(init)
    km = faiss.Kmeans(
        x.shape[1], k, niter=niter, verbose=False, max_points_per_centroid=len(x), min_points_per_centroid=1
    )
    km.train(x, init_centroids=init)
    return np.asarray(km.centroids, dtype=np.float32)


def sklearn_lloyd(x: np.ndarray, init: np.ndarray, niter: int) -> np.ndarray:
    model = KMeans(len(init), init=init, n_init=1, max_iter=niter, tol=0.0, algorithm="lloyd")
    return np.asarray(model.fit(x).cluster_centers_, dtype=np.float32)


def torch_lloyd(x: np.ndarray, init: np.ndarray, niter: int, batch: int = 65536) -> np.ndarray:
    """Batched Lloyd's in torch (CPU): addmm distances + argmin per batch, index_add_ update."""
    import torch

    xt = torch.from_numpy(x)
    centroids = torch.from_numpy(init.copy())
    k = len(init)
    x64 = xt.double()
    labels = torch.empty(len(x), dtype=torch.long)
    for _ in range(niter):
        c_sq = (centroids * centroids).sum(1)
        for s in range(0, len(x), batch):
            dist = torch.addmm(c_sq, xt[s : s + batch], centroids.T, alpha=-2.0)
            labels[s : s + batch] = dist.argmin(1)
        sums = torch.zeros(k, x.shape[1], dtype=torch.float64).index_add_(0, labels, x64)
        counts = torch.bincount(labels, minlength=k)
        used = counts > 0
        centroids[used] = (sums[used] / counts[used, None]).float()
    return centroids.numpy()


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """(wall seconds, process CPU seconds, result) of ``fn()``."""
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - start, time.process_time() - cpu, out


def label_rate(x: np.ndarray, codebook: np.ndarray, repeats: int = 3) -> float:
    """Frames per second of ``CodebookIndex.assign`` with one thread (best of ``repeats``)."""
    index = kmeans.CodebookIndex(codebook, num_threads=1)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        index.assign(x)
        best = min(best, time.perf_counter() - start)
    return len(x) / best


# ------------------------------------------------------------------------------------------
# report


def machine() -> str:
    model = cpu_model()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}; {os.cpu_count()} logical cores ({usable} usable); faiss threads {faiss.omp_get_max_threads()}"


def load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=1_000_000)
    parser.add_argument("--k", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--shards", type=Path, help="folder of feature shards (*.parquet)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipe-n-init", type=int, default=20, help="fairseq recipe: 20")
    parser.add_argument("--repeats", type=int, default=3, help="project fit runs (median reported)")
    parser.add_argument("--label-frames", type=int, default=1_000_000)
    parser.add_argument("--no-compare", action="store_true", help="skip the sklearn/torch/faiss-all comparisons")
    parser.add_argument("--quick", action="store_true", help="smoke run: 200k frames, recipe n_init 3, no comparisons")
    args = parser.parse_args(argv)
    if args.quick:
        args.frames = min(args.frames, 200_000)
        args.label_frames = min(args.label_frames, 200_000)
        args.recipe_n_init = min(args.recipe_n_init, 3)
        args.no_compare = True
        args.repeats = 1

    cfg = kmeans.KMeansConfig(seed=args.seed)
    print(f"machine: {machine()}")
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, faiss {faiss.__version__}, scikit-learn "
        f"{sklearn.__version__}"
    )
    print(f"load average before: {load()}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    t0 = time.perf_counter()
    if args.shards:
        x = shard_mfcc(args.shards, args.frames)
        source = f"real MFCC from feature shards in {args.shards}"
    else:
        x = synthetic_mfcc(args.frames, seed=args.seed)
        source = "SYNTHETIC MFCC-like frames (300-state segment Markov chain + deltas; no shards given)"
    print(f"frames: {len(x):,} x {x.shape[1]} ({source}), global CMVN; built in {time.perf_counter() - t0:.1f} s")
    print(
        f"project config: niter={cfg.niter}, init={cfg.init} (sample {cfg.init_sample_per_centroid}/centroid), "
        f"train frames max({cfg.max_points_per_centroid}*K, {cfg.min_train_frames}), nredo={cfg.nredo}"
    )
    if args.recipe_n_init != 20:
        print(f"NOTE: recipe n_init cut to {args.recipe_n_init} (the fairseq recipe uses 20)")
    print()

    rows: list[dict[str, object]] = []
    verdicts: list[str] = []
    label_x = x[: args.label_frames]
    for k in args.k:
        print(f"K={k}: fairseq recipe (MiniBatchKMeans, n_init={args.recipe_n_init}) ...", flush=True)
        recipe_s, recipe_cpu, recipe_cb = timed(lambda: fairseq_recipe(x, k, args.recipe_n_init, args.seed))
        recipe_inertia = inertia_per_frame(x, recipe_cb)  # type: ignore[arg-type]
        rows.append(
            dict(
                method="fairseq recipe (sklearn MiniBatchKMeans)",
                k=k,
                secs=recipe_s,
                cpu=recipe_cpu,
                inertia=recipe_inertia,
            )
        )

        print(f"K={k}: project fit x{args.repeats} ...", flush=True)
        times: list[float] = []
        cpus: list[float] = []
        fit: kmeans.KMeansFit | None = None
        for _ in range(args.repeats):
            secs, cpu, fit = timed(lambda: kmeans.fit_kmeans(x, k, cfg))  # type: ignore[assignment]
            times.append(secs)
            cpus.append(cpu)
        assert fit is not None
        project_s = statistics.median(times)
        project_cpu = statistics.median(cpus)
        project_inertia = inertia_per_frame(x, fit.codebook)
        rate = label_rate(label_x, fit.codebook)
        rows.append(
            dict(
                method=f"project fit_kmeans (faiss, trains on {fit.frames_trained:,})",
                k=k,
                secs=project_s,
                cpu=project_cpu,
                inertia=project_inertia,
                label=rate,
                note="runs " + "/".join(f"{t:.2f}" for t in times) + " s; fit's own inertia estimate "
                f"{fit.inertia_per_frame:.4f} on {fit.inertia_frames:,} frames",
            )
        )
        speed = recipe_s / project_s
        ratio = project_inertia / recipe_inertia
        verdicts.append(
            f"K={k}: {speed:.1f}x faster in wall time (target >= {SPEED_TARGET:.0f}x) "
            f"{'PASS' if speed >= SPEED_TARGET else 'FAIL'}"
            f" ({recipe_cpu / project_cpu:.1f}x in CPU time); "
            f"inertia {ratio:.4f}x recipe (target <= {INERTIA_TARGET}) "
            f"{'PASS' if ratio <= INERTIA_TARGET else 'FAIL'}; "
            f"labelling {rate / 1e6:.2f} M frames/s/core"
            + (
                f" (target >= 1 M) {'PASS' if rate >= LABEL_TARGET else 'FAIL'}"
                if k == 100
                else " (no target at this K)"
            )
        )

        if not args.no_compare:
            sub = _project_subsample(x, k, cfg)
            init = np.ascontiguousarray(sub[np.random.default_rng(args.seed + 1).choice(len(sub), k, replace=False)])
            for name, fn, data in (
                (f"faiss Lloyd, same subsample+init, {cfg.niter} it", faiss_lloyd, sub),
                (f"sklearn KMeans lloyd, same subsample+init, {cfg.niter} it", sklearn_lloyd, sub),
                (f"torch batched Lloyd, same subsample+init, {cfg.niter} it", torch_lloyd, sub),
                (f"faiss Lloyd, all {len(x):,} frames, {cfg.niter} it", faiss_lloyd, x),
            ):
                print(f"K={k}: {name} ...", flush=True)
                secs, cpu, cb = timed(lambda fn=fn, data=data: fn(data, init, cfg.niter))
                rows.append(dict(method=name, k=k, secs=secs, cpu=cpu, inertia=inertia_per_frame(x, cb)))  # type: ignore[arg-type]

        recipe = {r["k"]: r for r in rows if str(r["method"]).startswith("fairseq")}
        for r in rows:
            if r["k"] == k:
                r["speed"] = recipe[k]["secs"] / r["secs"]  # type: ignore[operator]
                r["ratio"] = r["inertia"] / recipe[k]["inertia"]  # type: ignore[operator]

    print()
    header = (
        f"{'method':<58} {'K':>4} {'fit s':>8} {'cpu s':>8} {'inertia/frame':>13} {'speed vs recipe':>15} "
        f"{'inertia vs recipe':>17} {'label frames/s/core':>19}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        label = f"{r['label']:,.0f}" if "label" in r else ""
        print(
            f"{r['method']!s:<58} {r['k']:>4} {r['secs']:>8.2f} {r['cpu']:>8.2f} {r['inertia']:>13.4f} "
            f"{r['speed']:>14.1f}x {r['ratio']:>16.4f}x {label:>19}" + (f"  ({r['note']})" if "note" in r else "")
        )
    print()
    for v in verdicts:
        print(v)
    print(f"load average after: {load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
