"""Tests for speech_assets.targets.kmeans (small sizes, no wall-clock asserts)."""

from __future__ import annotations

import numpy as np
import pytest

from speech_assets.targets import kmeans as km
from speech_assets.targets.build import fit_k
from speech_assets.targets.config import KMeansConfig


def _blobs(
    n_per: int = 400, k: int = 8, dim: int = 39, noise: float = 0.1, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(k, dim)).astype(np.float32) * 10.0
    truth = np.repeat(np.arange(k), n_per)
    x = centers[truth] + rng.normal(scale=noise, size=(k * n_per, dim)).astype(np.float32)
    perm = rng.permutation(len(x))
    return np.ascontiguousarray(x[perm], dtype=np.float32), truth[perm], centers


@pytest.mark.parametrize("init", ["k-means++", "random"])
def test_fit_is_deterministic_for_a_seed(init: str) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3000, 39)).astype(np.float32)
    kw = dict(niter=5, max_points_per_centroid=64, min_train_frames=0, init=init)
    a = km.fit_kmeans(x, 16, KMeansConfig(seed=7, **kw))
    b = km.fit_kmeans(x, 16, KMeansConfig(seed=7, **kw))
    assert a.codebook.dtype == np.float32 and a.codebook.shape == (16, 39)
    assert a.codebook.tobytes() == b.codebook.tobytes()
    assert a.inertia_per_frame == b.inertia_per_frame
    assert a.frames_fit == 3000 and a.frames_trained == 16 * 64
    c = km.fit_kmeans(x, 16, KMeansConfig(seed=8, **kw))
    assert c.codebook.tobytes() != a.codebook.tobytes()


@pytest.mark.parametrize(
    ("n", "k", "mppc", "min_train", "expected"),
    [
        (1_000_000, 100, 256, 65_536, 65_536),
        (1_000_000, 500, 256, 65_536, 128_000),
        (10_000, 100, 256, 65_536, 10_000),
        (1_000_000, 100, 0, 65_536, 1_000_000),
    ],
)
def test_train_frames(n: int, k: int, mppc: int, min_train: int, expected: int) -> None:
    assert km.train_frames(n, k, mppc, min_train) == expected


def test_fit_restores_faiss_threads() -> None:
    import faiss

    before = faiss.omp_get_max_threads()
    x = np.random.default_rng(0).normal(size=(500, 39)).astype(np.float32)
    km.fit_kmeans(x, 4, KMeansConfig(niter=2, num_threads=1))
    assert faiss.omp_get_max_threads() == before


def _labels(x: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    return km.CodebookIndex(codebook).assign(x)[0]


def _sqdist(x: np.ndarray, codebook: np.ndarray) -> float:
    return float(km.CodebookIndex(codebook).assign(x)[1].sum(dtype=np.float64))


def test_fit_recovers_separated_blobs() -> None:
    noise = 0.1
    x, truth, _ = _blobs(noise=noise)
    fit = km.fit_kmeans(x, 8, KMeansConfig(niter=20))
    # inertia per frame ~ dim * noise^2 when every blob gets its own centroid
    assert fit.inertia_per_frame == pytest.approx(39 * noise**2, rel=0.1)
    labels = _labels(x, fit.codebook)
    # the partition equals the truth up to renaming
    pairs = set(zip(truth.tolist(), labels.tolist()))
    assert len(pairs) == 8 and len({p[0] for p in pairs}) == 8 and len({p[1] for p in pairs}) == 8


def test_fit_inertia_sample_estimates_full_inertia() -> None:
    x = np.random.default_rng(2).normal(size=(6000, 39)).astype(np.float32)
    exact = km.fit_kmeans(x, 8, KMeansConfig(niter=4, inertia_sample_frames=0))
    sampled = km.fit_kmeans(x, 8, KMeansConfig(niter=4, inertia_sample_frames=2000))
    assert exact.inertia_frames == 6000 and sampled.inertia_frames == 2000
    assert exact.codebook.tobytes() == sampled.codebook.tobytes()
    full = _sqdist(x, exact.codebook) / len(x)
    assert exact.inertia_per_frame == pytest.approx(full, rel=1e-6)
    assert sampled.inertia_per_frame == pytest.approx(full, rel=0.03)


def test_fit_rejects_too_few_frames() -> None:
    with pytest.raises(ValueError):
        km.fit_kmeans(np.zeros((5, 39), np.float32), 10)


@pytest.mark.parametrize(
    ("num_frames", "k", "mfpc", "expected"),
    [
        (1_000_000, 100, 39, 100),
        (3900, 100, 39, 100),
        (3899, 100, 39, 99),
        (1000, 100, 39, 25),
        (10, 100, 39, 1),
        (1000, 100, 10, 100),
    ],
)
def test_effective_k_shrinks(num_frames: int, k: int, mfpc: int, expected: int) -> None:
    got = km.effective_k(num_frames, k, mfpc)
    assert got == expected
    logged: list[str] = []
    assert fit_k("c", num_frames, KMeansConfig(k=k, min_frames_per_centroid=mfpc), logged.append) == got
    assert bool(logged) == (got < k) and all(str(k) in msg and str(got) in msg for msg in logged)


def test_effective_k_rejects_no_frames() -> None:
    with pytest.raises(ValueError):
        km.effective_k(0, 100)


def test_assign_labels_dtype_length_and_sqdist() -> None:
    x, _, centers = _blobs(n_per=50, k=5)
    labels = _labels(x, centers)
    assert labels.dtype == np.int16 and labels.shape == (len(x),)
    brute = ((x[:, None, :] - centers[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(labels, brute.argmin(1))
    labels2, sq = km.CodebookIndex(centers).assign(x)
    np.testing.assert_array_equal(labels, labels2)
    assert float(sq.sum(dtype=np.float64)) == pytest.approx(float(brute.min(1).sum()), rel=1e-4)
    assert _labels(np.zeros((0, 39), np.float32), centers).shape == (0,)
    bad = x[:4].copy()
    bad[1, 3] = np.nan
    with pytest.raises(ValueError):
        _labels(bad, centers)


def test_label_utterances_splits_per_utterance() -> None:
    x, _, centers = _blobs(n_per=30, k=4)
    utts = [x[:7], x[7:7], x[7:50], x[50:]]
    labels, sums = km.label_utterances_with_sqdist(utts, centers)
    assert [len(lab) for lab in labels] == [7, 0, 43, len(x) - 50]
    np.testing.assert_array_equal(np.concatenate(labels), _labels(x, centers))
    assert sums[1] == 0.0
    assert sum(sums) == pytest.approx(_sqdist(x, centers), rel=1e-5)


@pytest.mark.parametrize("t", [0, 1, 2, 7, 8, 101])
def test_to_model_rate_length(t: int) -> None:
    lab = np.arange(t, dtype=np.int16)
    out = km.to_model_rate(lab)
    assert out.dtype == np.int16 and len(out) == (t + 1) // 2
    np.testing.assert_array_equal(out, lab[::2])


@pytest.mark.parametrize(
    ("counts", "perplexity", "empty"),
    [
        ([5, 5, 5, 5], 4.0, 0),
        ([10, 0, 0, 0], 1.0, 3),
        ([1, 1, 0, 0], 2.0, 2),
        ([0, 0], 0.0, 2),
        ([3, 1], float(np.exp(-(0.75 * np.log(0.75) + 0.25 * np.log(0.25)))), 0),
    ],
)
def test_perplexity_and_empty_clusters(counts: list[int], perplexity: float, empty: int) -> None:
    assert km.cluster_perplexity(np.array(counts)) == pytest.approx(perplexity)
    assert km.empty_clusters(np.array(counts)) == empty


@pytest.mark.parametrize(
    ("utterances", "expected"),
    [
        ([[0, 0, 1, 1, 1, 2]], 2.0),
        ([[3, 3, 3, 3]], 4.0),
        ([[0, 1, 0, 1]], 1.0),
        ([[1, 1], [1, 1, 1]], 2.5),  # runs never cross utterances
        ([[5], [], [5, 5, 6]], 4 / 3),
        ([[]], 0.0),
    ],
)
def test_segment_stats_mean(utterances: list[list[int]], expected: float) -> None:
    arrays = [np.array(u, dtype=np.int16) for u in utterances]
    acc = km.SegmentStats()
    for a in arrays:
        acc.add(a)
    assert acc.mean == pytest.approx(expected)


def test_quality_accumulator() -> None:
    acc = km.QualityAccumulator(4)
    acc.add(np.array([0, 0, 1, 1], np.int16), 2.0)
    acc.add(np.array([1, 1], np.int16), 1.0)
    assert acc.frames_labelled == 6 and km.empty_clusters(acc.counts) == 2
    assert acc.counts.tolist() == [2, 4, 0, 0] and acc.segments.mean == pytest.approx(2.0)
    assert acc.labelled_inertia_per_frame == pytest.approx(0.5)
    with pytest.raises(ValueError, match="outside"):
        acc.add(np.array([4], np.int16))


def test_sample_utterances_budget_and_determinism() -> None:
    rng = np.random.default_rng(0)
    counts = rng.integers(100, 1500, size=500)
    a = km.sample_utterances(counts, 50_000, seed=3)
    b = km.sample_utterances(counts, 50_000, seed=3)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.int64 and np.all(np.diff(a) > 0)
    total = int(counts[a].sum())
    assert total <= 50_000
    unchosen = np.setdiff1d(np.arange(len(counts)), a)
    assert 50_000 - total < int(counts[unchosen].min())  # no unchosen utterance would still fit
    assert not np.array_equal(a, km.sample_utterances(counts, 50_000, seed=4))


def test_sample_utterances_edge_cases() -> None:
    np.testing.assert_array_equal(km.sample_utterances([3, 4, 5], 100, seed=0), [0, 1, 2])
    one = km.sample_utterances([500, 600], 100, seed=0)  # nothing fits: one utterance alone
    assert len(one) == 1 and one[0] in (0, 1)
    mixed = km.sample_utterances([500, 60, 30], 100, seed=0)
    assert int(np.asarray([500, 60, 30])[mixed].sum()) <= 100
    assert km.sample_utterances([], 10, seed=0).shape == (0,)


def test_config_defaults_and_kwargs() -> None:
    cfg = km.KMeansConfig()
    assert cfg.k == 100 and cfg.max_fit_frames == 2_000_000
    x = np.random.default_rng(0).normal(size=(800, 39)).astype(np.float32)
    fit = km.fit_kmeans(x, 5, cfg)
    assert fit.k == 5 and fit.codebook.shape == (5, 39)
    with pytest.raises(ValueError):
        km.KMeansConfig(k=0)


@pytest.mark.parametrize(
    "knobs",
    [{"nredo": 2}, {"niter": 0}, {"nredo": 0}, {"init": "kmeans"}],
    ids=["redo-plusplus", "niter", "nredo", "init"],
)
def test_the_config_refuses_what_fit_kmeans_cannot_run(knobs: dict) -> None:
    """fit_kmeans trusts its config for these: one k-means++ init would seed every redo."""
    with pytest.raises(ValueError):
        KMeansConfig(**knobs)
