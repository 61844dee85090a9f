"""k-means targets for HuBERT-style pretraining: fit, label, quality (pure numpy/faiss, no Dagster).

Each federated client clusters only its own frames: 39-dim MFCC (13 + Δ + ΔΔ) at 100 Hz after
global CMVN. The flow an orchestrator follows per client is::

    idx = sample_utterances(frame_counts, cfg.max_fit_frames, cfg.seed)  # whole utterances
    frames = np.concatenate([cmvn(mfcc[i]) for i in idx])                # (N, 39) float32
    k = effective_k(len(frames), cfg.k, cfg.min_frames_per_centroid)     # log describe_k_shrink(...)
    fit = fit_kmeans(frames, k, cfg.seed, **cfg.fit_kwargs())
    acc = QualityAccumulator(fit.k)
    for shard in shards:                                 # labelling streams shard by shard
        labels_100hz, sqdist = label_utterances_with_sqdist(utterance_frames, fit.codebook)
        for lab, d in zip(labels_100hz, sqdist):
            acc.add(lab, d)
            store(to_model_rate(lab))                    # int16, 50 Hz, length (T + 1) // 2
    quality = acc.result(client_id, fit)

Library choice (``bench/kmeans.py``, 1M x 39 MFCC-like frames, 2 shared cores, K=100 / K=500):
faiss-cpu ``faiss.Kmeans`` (Lloyd's) seeded with scikit-learn's ``kmeans_plusplus`` on a small
sample, trained on a seeded subsample of ``max(256 K, 65 536)`` frames for 15 iterations: 28-61x /
14-21x faster than the fairseq recipe (``MiniBatchKMeans``, n_init 20) at 1.002x / 1.001x its
inertia per frame. On the same subsample and init, scikit-learn's ``KMeans`` (lloyd) runs the same
iterations about as fast (within +-30%, either way round; both are BLAS-bound) and a batched torch
Lloyd's 3-18x slower; faiss wins on reproducibility: its codebooks are byte-identical for any
thread count (scikit-learn's OpenMP reduction changes the last bits between 1 and 2 threads), so
a re-materialisation on another machine gets the same content hash. Training on all 1M frames instead of the subsample
buys <0.5% inertia for 7x the time. Labelling is a faiss ``IndexFlatL2`` 1-NN search: 3-5 M
frames/s/core at K=100.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import faiss
import numpy as np

from speech_assets.targets.config import MAX_K, KMeansConfig

_ASSIGN_CHUNK = 1 << 18
"""Frames per faiss search call in labelling (bounds the (chunk, 1) int64/float32 temporaries)."""

LABEL_THREADS = 1
"""faiss threads for labelling a client's shards (``CodebookIndex(codebook, LABEL_THREADS)``).
One search of a shard's frames against a few hundred centroids is a few ms of work; with faiss'
OpenMP threads on a busy 2-core machine it took 10-20x longer (8 ms vs 150 ms for 36k frames,
K=100; docs/BENCHMARKS.md). Distances differ in the last float bits between thread
counts, so a near-tie may flip a label (1 frame in 3.3 million, measured)."""


@dataclass(frozen=True)
class KMeansFit:
    """Result of :func:`fit_kmeans`.

    Attributes:
        codebook: ``(k, 39)`` float32 centroids in the space of the fitted frames.
        k: number of centroids.
        frames_fit: frames passed to the fit (the sampled utterances).
        frames_trained: frames Lloyd's iterations ran on (``<= frames_fit``).
        inertia_per_frame: mean squared L2 distance of the fitted frames to their nearest
            centroid, averaged over ``inertia_frames`` of them (all, or a uniform sample).
        inertia_frames: frames the inertia was averaged over.
        niter: Lloyd iterations per run.
        seed: the seed used.
    """

    codebook: np.ndarray
    k: int
    frames_fit: int
    frames_trained: int
    inertia_per_frame: float
    inertia_frames: int
    niter: int
    seed: int


@dataclass(frozen=True)
class KMeansQuality:
    """Quality of one client's targets (metadata and a ``kmeans_quality`` table row).

    Attributes:
        client_id: the client.
        k: effective number of clusters.
        frames_fit: frames the codebook was fitted on (see :class:`KMeansFit`).
        inertia_per_frame: the fit's inertia per frame (:attr:`KMeansFit.inertia_per_frame`).
        perplexity: ``exp(entropy)`` of cluster usage over all labelled 100 Hz frames (``k`` when
            usage is uniform, 1 when one cluster takes everything).
        empty_clusters: clusters no labelled frame was assigned to.
        mean_segment_length: labelled 100 Hz frames per run of one label (runs never cross
            utterances); MFCC K=100 HuBERT targets average about 2.
        frames_labelled: 100 Hz frames labelled (every frame of every kept utterance).
        labelled_inertia_per_frame: mean squared distance over the labelled frames, when the
            distances were accumulated, else ``None``.
    """

    client_id: str
    k: int
    frames_fit: int
    inertia_per_frame: float
    perplexity: float
    empty_clusters: int
    mean_segment_length: float
    frames_labelled: int
    labelled_inertia_per_frame: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain-Python dict (JSON- and Arrow-friendly) of every field."""
        return asdict(self)


# --------------------------------------------------------------------------------------------
# K and sampling


def effective_k(num_frames: int, k: int, min_frames_per_centroid: int = 39) -> int:
    """Number of clusters a client with ``num_frames`` frames can support.

    ``min(k, num_frames // min_frames_per_centroid)``, at least 1. The caller logs a warning when
    the result is below ``k`` (:func:`describe_k_shrink` builds the message).

    Raises:
        ValueError: ``num_frames < 1``, ``k < 1`` or ``min_frames_per_centroid < 1``.
    """
    if num_frames < 1:
        raise ValueError(f"cannot cluster {num_frames} frames")
    if k < 1 or min_frames_per_centroid < 1:
        raise ValueError("k and min_frames_per_centroid must be >= 1")
    return max(1, min(k, num_frames // min_frames_per_centroid))


def describe_k_shrink(num_frames: int, k: int, k_effective: int, min_frames_per_centroid: int = 39) -> str | None:
    """A warning message when ``k_effective < k``, else ``None``.

    >>> describe_k_shrink(1000, 100, 25)
    'K shrunk from 100 to 25: only 1000 frames (< 39 per centroid for K=100)'
    """
    if k_effective >= k:
        return None
    return (
        f"K shrunk from {k} to {k_effective}: only {num_frames} frames "
        f"(< {min_frames_per_centroid} per centroid for K={k})"
    )


def sample_utterances(frame_counts: Sequence[int], max_frames: int, seed: int) -> np.ndarray:
    """Seeded sample of whole utterances holding at most ``max_frames`` frames in total.

    Utterances are visited in a seeded random order and taken whenever they still fit in the
    remaining budget, so the sample fills the budget closely. When everything fits, all indices
    are returned. When no single utterance fits, the first one in the seeded order is returned
    alone (the only case where the total exceeds ``max_frames``).

    Args:
        frame_counts: ``(U,)`` frames per utterance (non-negative).
        max_frames: frame budget (>= 1).
        seed: RNG seed; equal inputs give equal outputs.

    Returns:
        ``(S,)`` int64 utterance indices, sorted ascending (streaming-friendly).
    """
    counts = np.asarray(frame_counts, dtype=np.int64).reshape(-1)
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    if counts.size and counts.min() < 0:
        raise ValueError("frame counts must be non-negative")
    if counts.size == 0:
        return np.empty(0, dtype=np.int64)
    if int(counts.sum()) <= max_frames:
        return np.arange(counts.size, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(counts.size)
    # Greedy fill in seeded order, vectorised in rounds: take the longest prefix that fits, skip
    # the utterance that overflows, repeat on the rest.
    chosen: list[np.ndarray] = []
    remaining = int(max_frames)
    rest = order
    min_count = int(counts.min())
    while rest.size and remaining >= min_count:
        csum = np.cumsum(counts[rest])
        n_fit = int(np.searchsorted(csum, remaining, side="right"))
        if n_fit:
            chosen.append(rest[:n_fit])
            remaining -= int(csum[n_fit - 1])
        rest = rest[n_fit + 1 :]
        if rest.size:
            rest = rest[counts[rest] <= remaining]
    if not chosen:
        return order[:1].astype(np.int64)
    return np.sort(np.concatenate(chosen)).astype(np.int64)


# --------------------------------------------------------------------------------------------
# fit


@contextlib.contextmanager
def faiss_threads(num_threads: int | None) -> Iterator[None]:
    """Set faiss' OpenMP (and its BLAS') thread count inside the block and restore it after."""
    if num_threads is None:
        yield
        return
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    previous = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(int(num_threads))
    try:
        yield
    finally:
        faiss.omp_set_num_threads(previous)


def _as_frames(frames: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(frames, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"frames must be (N, D), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("frames contain NaN or inf")
    return x


def _kmeans_plusplus(x: np.ndarray, k: int, seed: int, sample_per_centroid: int) -> np.ndarray:
    # scikit-learn's greedy k-means++ (the recipe's init) on a seeded sample of the training
    # frames: its cost grows as sample * k * log k, so the sample is kept small.
    from sklearn.cluster import kmeans_plusplus

    rng = np.random.default_rng(seed)
    size = min(len(x), max(k, sample_per_centroid * k))
    sample = x if size == len(x) else x[np.sort(rng.choice(len(x), size=size, replace=False))]
    centers, _ = kmeans_plusplus(sample, k, random_state=int(rng.integers(0, 2**31 - 1)))
    return np.ascontiguousarray(centers, dtype=np.float32)


def train_frames(n: int, k: int, max_points_per_centroid: int, min_train_frames: int) -> int:
    """Frames Lloyd's iterations run on: ``min(n, max(max_points_per_centroid * k, min_train_frames))``.

    ``max_points_per_centroid == 0`` means all ``n`` frames.
    """
    if max_points_per_centroid <= 0:
        return n
    return min(n, max(max_points_per_centroid * k, min_train_frames, k))


def fit_kmeans(
    frames: np.ndarray,
    k: int,
    seed: int = 0,
    *,
    niter: int = KMeansConfig.niter,
    max_points_per_centroid: int = KMeansConfig.max_points_per_centroid,
    min_train_frames: int = KMeansConfig.min_train_frames,
    nredo: int = KMeansConfig.nredo,
    init: str = KMeansConfig.init,
    init_sample_per_centroid: int = KMeansConfig.init_sample_per_centroid,
    inertia_sample_frames: int = KMeansConfig.inertia_sample_frames,
    num_threads: int | None = None,
) -> KMeansFit:
    """Fit k-means (faiss Lloyd's) on ``frames``; deterministic for a seed and thread count.

    Args:
        frames: ``(N, D)`` float32 (``D = 39`` CMVN-normalised MFCC), ``N >= k``.
        k: clusters, ``1 <= k <= min(N, 32768)``.
        seed: seeds the frame subsample, the init and faiss.
        niter: Lloyd iterations.
        max_points_per_centroid, min_train_frames: Lloyd's runs on a seeded random subsample of
            ``max(max_points_per_centroid * k, min_train_frames)`` frames when ``N`` is larger
            (``max_points_per_centroid=0``: all frames).
        nredo: faiss restarts (best training objective kept).
        init: ``"k-means++"`` (on ``init_sample_per_centroid * k`` training frames) or
            ``"random"``.
        inertia_sample_frames: the returned inertia per frame is exact over all ``N`` frames when
            ``N`` is at most this (or it is ``0``), else an unbiased estimate from a seeded uniform
            sample of this many of the ``N`` frames.
        num_threads: faiss threads for the call (restored afterwards); ``None`` keeps the default.
            The small k-means++ init runs in numpy/scipy BLAS, whose threads follow
            ``threadpoolctl``/``OPENBLAS_NUM_THREADS``.

    Returns:
        :class:`KMeansFit` with a ``(k, D)`` float32 codebook and the inertia per frame.
    """
    x = _as_frames(frames)
    n, d = x.shape
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in [1, {MAX_K}], got {k}")
    if n < k:
        raise ValueError(f"{n} frames cannot make {k} clusters; use effective_k()")
    if niter < 1 or nredo < 1:
        raise ValueError("niter and nredo must be >= 1")
    if init not in ("k-means++", "random"):
        raise ValueError(f"init must be 'k-means++' or 'random', got {init!r}")
    if init == "k-means++" and nredo > 1:
        raise ValueError("nredo > 1 needs init='random' (one k-means++ init would seed every run)")

    rng = np.random.default_rng(seed)
    train = x
    n_train = train_frames(n, k, max_points_per_centroid, min_train_frames)
    if n_train < n:
        train = x[np.sort(rng.choice(n, size=n_train, replace=False))]
    faiss_seed = int(rng.integers(0, 2**31 - 1))

    with faiss_threads(num_threads):
        km = faiss.Kmeans(
            d,
            k,
            niter=niter,
            nredo=nredo,
            seed=faiss_seed,
            verbose=False,
            # we subsample ourselves (seeded, reported); silence faiss' own subsample/too-few warnings
            max_points_per_centroid=max(train.shape[0], 1),
            min_points_per_centroid=1,
        )
        if init == "k-means++":
            init_centroids = _kmeans_plusplus(train, k, faiss_seed, init_sample_per_centroid)
            km.train(train, init_centroids=init_centroids)
        else:
            km.train(train)
        codebook = np.ascontiguousarray(km.centroids, dtype=np.float32).reshape(k, d)
        del train
        evaluate = x
        if inertia_sample_frames and n > inertia_sample_frames:
            evaluate = x[np.sort(rng.choice(n, size=inertia_sample_frames, replace=False))]
        _, sqdist = assign_labels_with_sqdist(evaluate, codebook)
    return KMeansFit(
        codebook=codebook,
        k=k,
        frames_fit=n,
        frames_trained=n_train,
        inertia_per_frame=sqdist / evaluate.shape[0],
        inertia_frames=int(evaluate.shape[0]),
        niter=niter,
        seed=seed,
    )


# --------------------------------------------------------------------------------------------
# labelling


class CodebookIndex:
    """Nearest-centroid search over a fixed ``(K, D)`` codebook (faiss ``IndexFlatL2``).

    Build once per client and call :meth:`assign` per shard/utterance batch.
    """

    def __init__(self, codebook: np.ndarray, num_threads: int | None = None) -> None:
        cb = _as_frames(codebook)
        if cb.shape[0] > MAX_K:
            raise ValueError(f"codebook has {cb.shape[0]} > {MAX_K} centroids (int16 labels)")
        self.codebook = cb
        self.k, self.dim = cb.shape
        self.num_threads = num_threads
        self._index = faiss.IndexFlatL2(self.dim)
        self._index.add(cb)

    def assign(self, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Nearest centroid of each frame.

        Args:
            frames: ``(T, D)`` float32.

        Returns:
            ``labels`` ``(T,)`` int16 and ``sqdist`` ``(T,)`` float32 squared L2 distances
            (clipped at 0; float32 rounding in ``|x|^2 - 2xc + |c|^2`` can go slightly negative).
        """
        x = np.ascontiguousarray(frames, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"frames must be (T, {self.dim}), got shape {x.shape}")
        t = x.shape[0]
        labels = np.empty(t, dtype=np.int16)
        sqdist = np.empty(t, dtype=np.float32)
        with faiss_threads(self.num_threads):
            for s in range(0, t, _ASSIGN_CHUNK):
                dist, idx = self._index.search(x[s : s + _ASSIGN_CHUNK], 1)
                if idx.size and int(idx.min()) < 0:  # faiss finds no neighbour for NaN frames
                    raise ValueError("frames contain NaN or inf")
                labels[s : s + _ASSIGN_CHUNK] = idx[:, 0]
                sqdist[s : s + _ASSIGN_CHUNK] = dist[:, 0]
        np.maximum(sqdist, 0.0, out=sqdist)
        return labels, sqdist


def assign_labels(frames: np.ndarray, codebook: np.ndarray, *, num_threads: int | None = None) -> np.ndarray:
    """Nearest-centroid labels: ``(T, D)`` float32 frames, ``(K, D)`` codebook -> ``(T,)`` int16."""
    return CodebookIndex(codebook, num_threads).assign(frames)[0]


def assign_labels_with_sqdist(
    frames: np.ndarray, codebook: np.ndarray, *, num_threads: int | None = None
) -> tuple[np.ndarray, float]:
    """Labels ``(T,)`` int16 and the float64 sum of squared distances (inertia) of ``frames``."""
    labels, sqdist = CodebookIndex(codebook, num_threads).assign(frames)
    return labels, float(sqdist.sum(dtype=np.float64))


def label_utterances_with_sqdist(
    utterances: Sequence[np.ndarray], codebook: np.ndarray | CodebookIndex
) -> tuple[list[np.ndarray], list[float]]:
    """Label many utterances in one search (fast for a shard of short utterances).

    Args:
        utterances: ``U`` arrays ``(T_u, D)`` float32.
        codebook: ``(K, D)`` codebook or a prebuilt :class:`CodebookIndex`.

    Returns:
        ``U`` int16 label arrays ``(T_u,)`` (100 Hz) and ``U`` float sums of squared distances.
    """
    index = codebook if isinstance(codebook, CodebookIndex) else CodebookIndex(codebook)
    if len(utterances) == 0:
        return [], []
    lengths = np.array([len(u) for u in utterances], dtype=np.int64)
    labels, sqdist = index.assign(np.concatenate([np.asarray(u, np.float32) for u in utterances]))
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    sums = np.add.reduceat(sqdist.astype(np.float64), bounds[:-1]) if labels.size else None
    out_labels = [labels[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    out_sums = [float(sums[i]) if (sums is not None and lengths[i]) else 0.0 for i in range(len(lengths))]
    return out_labels, out_sums


def to_model_rate(labels_100hz: np.ndarray) -> np.ndarray:
    """100 Hz labels -> 50 Hz model-rate labels: every second frame, length ``(T + 1) // 2``."""
    labels = np.asarray(labels_100hz)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    return np.ascontiguousarray(labels[::2])


# --------------------------------------------------------------------------------------------
# quality


def label_counts(labels: np.ndarray, k: int) -> np.ndarray:
    """``(K,)`` int64 frames per cluster of ``(T,)`` labels in ``[0, k)``."""
    lab = np.asarray(labels).reshape(-1).astype(np.int64, copy=False)
    if lab.size and (lab.min() < 0 or lab.max() >= k):
        raise ValueError(f"labels outside [0, {k})")
    return np.bincount(lab, minlength=k).astype(np.int64)


def cluster_perplexity(counts: np.ndarray) -> float:
    """``exp(H)`` of the usage distribution ``counts / counts.sum()`` (natural log; 0 log 0 = 0).

    ``K`` for uniform usage over ``K`` clusters, 1.0 for a single used cluster, 0.0 for no frames.
    """
    c = np.asarray(counts, dtype=np.float64).reshape(-1)
    total = c.sum()
    if total <= 0:
        return 0.0
    p = c[c > 0] / total
    return float(np.exp(-(p * np.log(p)).sum()))


def empty_clusters(counts: np.ndarray) -> int:
    """Number of clusters with zero frames."""
    return int((np.asarray(counts).reshape(-1) == 0).sum())


def count_runs(labels: np.ndarray) -> int:
    """Runs of identical consecutive labels in one utterance's ``(T,)`` labels (0 when T = 0)."""
    lab = np.asarray(labels).reshape(-1)
    if lab.size == 0:
        return 0
    return 1 + int(np.count_nonzero(lab[1:] != lab[:-1]))


def mean_segment_length(labels: np.ndarray | Sequence[np.ndarray]) -> float:
    """Frames per run of one label: ``sum(T_u) / sum(runs_u)`` over one or several utterances.

    Runs never cross utterances. ``[0, 0, 1, 1, 1, 2]`` -> 6 / 3 = 2.0. 0.0 when there are no frames.
    """
    if isinstance(labels, np.ndarray) and labels.ndim <= 1:
        utts: Sequence[np.ndarray] = [labels]
    else:
        utts = labels
    acc = SegmentStats()
    for u in utts:
        acc.add(u)
    return acc.mean


@dataclass
class SegmentStats:
    """Accumulates frames and runs across utterances for :func:`mean_segment_length`."""

    frames: int = 0
    runs: int = 0

    def add(self, labels: np.ndarray) -> None:
        """Add one utterance's ``(T,)`` labels."""
        self.frames += int(np.asarray(labels).size)
        self.runs += count_runs(labels)

    @property
    def mean(self) -> float:
        """Frames per run so far (0.0 before any frame)."""
        return self.frames / self.runs if self.runs else 0.0


@dataclass
class QualityAccumulator:
    """Streams a client's 100 Hz labels (utterance by utterance) into a :class:`KMeansQuality`."""

    k: int
    counts: np.ndarray = field(init=False)
    segments: SegmentStats = field(default_factory=SegmentStats)
    sqdist_sum: float = 0.0
    sqdist_frames: int = 0

    def __post_init__(self) -> None:
        self.counts = np.zeros(self.k, dtype=np.int64)

    def add(self, labels_100hz: np.ndarray, sqdist_sum: float | None = None) -> None:
        """Add one utterance's ``(T,)`` 100 Hz labels and, optionally, its summed squared distance."""
        self.counts += label_counts(labels_100hz, self.k)
        self.segments.add(labels_100hz)
        if sqdist_sum is not None:
            self.sqdist_sum += float(sqdist_sum)
            self.sqdist_frames += int(np.asarray(labels_100hz).size)

    @property
    def frames_labelled(self) -> int:
        """100 Hz frames added so far."""
        return self.segments.frames

    def result(self, client_id: str, fit: KMeansFit) -> KMeansQuality:
        """The :class:`KMeansQuality` of ``client_id`` given its fit."""
        return KMeansQuality(
            client_id=str(client_id),
            k=int(fit.k),
            frames_fit=int(fit.frames_fit),
            inertia_per_frame=float(fit.inertia_per_frame),
            perplexity=cluster_perplexity(self.counts),
            empty_clusters=empty_clusters(self.counts),
            mean_segment_length=float(self.segments.mean),
            frames_labelled=int(self.frames_labelled),
            labelled_inertia_per_frame=(self.sqdist_sum / self.sqdist_frames if self.sqdist_frames else None),
        )
