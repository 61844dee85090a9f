"""k-means targets for HuBERT-style pretraining: fit, label, quality (pure numpy/faiss, no Dagster).

Each federated client clusters only its own CMVN-normalised 39-dim MFCC frames: a sample of whole
utterances (:func:`sample_utterances`) is fitted (:func:`fit_kmeans`, K shrunk by
:func:`effective_k`), then every frame is labelled shard by shard and stored at 50 Hz
(:func:`to_model_rate`); targets/build.py runs this flow.

Why faiss (``bench/kmeans.py``): Lloyd's on a seeded subsample, seeded with scikit-learn's
k-means++, is 14-61x faster than the fairseq recipe (``MiniBatchKMeans``) at the same inertia, and
its codebooks are byte-identical for any thread count (scikit-learn's are not), so a
re-materialisation on another machine gets the same content hash.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import faiss
import numpy as np

from speech_assets.targets.config import MAX_K, KMeansConfig

_ASSIGN_CHUNK = 1 << 18  # frames per faiss search call: bounds its temporaries

# faiss threads for labelling: a shard's search is a few ms of work, and faiss' OpenMP threads on a
# busy 2-core machine made it 10-20x slower (docs/BENCHMARKS.md)
LABEL_THREADS = 1


@dataclass(frozen=True)
class KMeansFit:
    codebook: np.ndarray  # (k, 39) float32
    k: int
    frames_fit: int
    frames_trained: int  # Lloyd's iterations ran on these (<= frames_fit)
    inertia_per_frame: float  # mean squared L2 distance to the nearest centroid, over inertia_frames of them
    inertia_frames: int
    niter: int
    seed: int


def effective_k(num_frames: int, k: int, min_frames_per_centroid: int = 39) -> int:
    """``min(k, num_frames // min_frames_per_centroid)``, at least 1."""
    if num_frames < 1:
        raise ValueError(f"cannot cluster {num_frames} frames")
    if k < 1 or min_frames_per_centroid < 1:
        raise ValueError("k and min_frames_per_centroid must be >= 1")
    return max(1, min(k, num_frames // min_frames_per_centroid))


def sample_utterances(frame_counts: Sequence[int], max_frames: int, seed: int) -> np.ndarray:
    """Sorted indices of a seeded sample of whole utterances holding at most ``max_frames`` frames.

    Utterances are taken in a seeded order whenever they still fit. When none fits, the first
    one alone is returned (the only case where the total exceeds ``max_frames``).
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


@contextlib.contextmanager
def faiss_threads(num_threads: int | None) -> Iterator[None]:
    """Set faiss' OpenMP thread count inside the block and restore it after."""
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
    """Frames Lloyd's iterations run on (``max_points_per_centroid == 0``: all ``n``)."""
    if max_points_per_centroid <= 0:
        return n
    return min(n, max(max_points_per_centroid * k, min_train_frames, k))


def fit_kmeans(frames: np.ndarray, k: int, config: KMeansConfig = KMeansConfig()) -> KMeansFit:
    """Fit k-means (faiss Lloyd's) on ``(N, D)`` float32 ``frames`` with ``config``'s knobs (its ``k`` and
    fit sample are the caller's, already applied); deterministic for a seed and thread count.

    Lloyd's runs on a seeded subsample (:func:`train_frames`); the inertia is exact over all frames
    up to ``inertia_sample_frames`` (0: always), else estimated from a seeded sample of that many.
    ``niter``, ``nredo`` and ``init`` were validated when the config was made.
    """
    x = _as_frames(frames)
    n, d = x.shape
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in [1, {MAX_K}], got {k}")
    if n < k:
        raise ValueError(f"{n} frames cannot make {k} clusters; use effective_k()")

    rng = np.random.default_rng(config.seed)
    train = x
    n_train = train_frames(n, k, config.max_points_per_centroid, config.min_train_frames)
    if n_train < n:
        train = x[np.sort(rng.choice(n, size=n_train, replace=False))]
    faiss_seed = int(rng.integers(0, 2**31 - 1))

    with faiss_threads(config.num_threads):
        # we subsample ourselves (seeded, reported): these bounds silence faiss' own subsample/too-few warnings
        bounds = {"max_points_per_centroid": max(train.shape[0], 1), "min_points_per_centroid": 1}
        km = faiss.Kmeans(d, k, niter=config.niter, nredo=config.nredo, seed=faiss_seed, verbose=False, **bounds)
        plusplus = None
        if config.init == "k-means++":
            plusplus = _kmeans_plusplus(train, k, faiss_seed, config.init_sample_per_centroid)
        km.train(train, init_centroids=plusplus)
        codebook = np.ascontiguousarray(km.centroids, dtype=np.float32).reshape(k, d)
        del train
        evaluate = x
        if config.inertia_sample_frames and n > config.inertia_sample_frames:
            evaluate = x[np.sort(rng.choice(n, size=config.inertia_sample_frames, replace=False))]
        sqdist = float(CodebookIndex(codebook).assign(evaluate)[1].sum(dtype=np.float64))
    return KMeansFit(
        codebook=codebook,
        k=k,
        frames_fit=n,
        frames_trained=n_train,
        inertia_per_frame=sqdist / evaluate.shape[0],
        inertia_frames=int(evaluate.shape[0]),
        niter=config.niter,
        seed=config.seed,
    )


class CodebookIndex:
    """Nearest-centroid search over a fixed ``(K, D)`` codebook (faiss ``IndexFlatL2``), built once per client."""

    def __init__(self, codebook: np.ndarray, num_threads: int | None = None) -> None:
        cb = _as_frames(codebook)
        if cb.shape[0] > MAX_K:
            raise ValueError(f"codebook has {cb.shape[0]} > {MAX_K} centroids (int16 labels)")
        self.dim, self.num_threads = cb.shape[1], num_threads
        self._index = faiss.IndexFlatL2(self.dim)
        self._index.add(cb)

    def assign(self, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(T,)`` int16 labels and float32 squared distances of ``(T, D)`` frames (clipped at 0:
        float32 rounding in ``|x|^2 - 2xc + |c|^2`` can go slightly negative)."""
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


def label_utterances_with_sqdist(
    utterances: Sequence[np.ndarray], codebook: np.ndarray | CodebookIndex
) -> tuple[list[np.ndarray], list[float]]:
    """Label many ``(T_u, D)`` utterances in one search: their labels and sums of squared distances."""
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


def cluster_perplexity(counts: np.ndarray) -> float:
    """``exp(entropy)`` of cluster usage: ``K`` when uniform, 1.0 for one used cluster, 0.0 for no frames."""
    c = np.asarray(counts, dtype=np.float64).reshape(-1)
    total = c.sum()
    if total <= 0:
        return 0.0
    p = c[c > 0] / total
    return float(np.exp(-(p * np.log(p)).sum()))


def empty_clusters(counts: np.ndarray) -> int:
    return int((np.asarray(counts).reshape(-1) == 0).sum())


@dataclass
class SegmentStats:
    """Frames and runs of one label, accumulated across utterances (runs never cross utterances)."""

    frames: int = 0
    runs: int = 0

    def add(self, labels: np.ndarray) -> None:
        lab = np.asarray(labels).reshape(-1)
        self.frames += lab.size
        self.runs += int(lab.size > 0) + int(np.count_nonzero(lab[1:] != lab[:-1]))

    @property
    def mean(self) -> float:
        return self.frames / self.runs if self.runs else 0.0


@dataclass
class QualityAccumulator:
    """A client's labels streamed in (utterance by utterance): cluster counts, runs and squared distances."""

    k: int
    counts: np.ndarray = field(init=False)
    segments: SegmentStats = field(default_factory=SegmentStats)
    sqdist_sum: float = 0.0
    sqdist_frames: int = 0

    def __post_init__(self) -> None:
        self.counts = np.zeros(self.k, dtype=np.int64)

    def add(self, labels_100hz: np.ndarray, sqdist_sum: float | None = None) -> None:
        lab = np.asarray(labels_100hz).reshape(-1).astype(np.int64, copy=False)
        if lab.size and (lab.min() < 0 or lab.max() >= self.k):
            raise ValueError(f"labels outside [0, {self.k})")
        self.counts += np.bincount(lab, minlength=self.k)
        self.segments.add(labels_100hz)
        if sqdist_sum is not None:
            self.sqdist_sum += float(sqdist_sum)
            self.sqdist_frames += int(np.asarray(labels_100hz).size)

    @property
    def frames_labelled(self) -> int:
        return self.segments.frames

    @property
    def labelled_inertia_per_frame(self) -> float:
        return self.sqdist_sum / self.sqdist_frames if self.sqdist_frames else 0.0
