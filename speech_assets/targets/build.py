"""One client's target set: k-means fitted on its own shards and every frame labelled
(``build_client_targets``), or new speakers labelled with the codebook it has
(``extend_client_targets``); ``codebook.npy``, ``labels.parquet`` (format: labels.py) and
``state.npz`` under the client's folder."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from speech_assets.features.cmvn import Cmvn
from speech_assets.features.shards import FeatureRecord, iter_shard, read_shard_table
from speech_assets.layout import TargetFiles
from speech_assets.targets import kmeans
from speech_assets.targets.labels import UtteranceLabels, append_labels, write_labels
from speech_assets.utils import atomic_path, save_npz

# a shard's records -> their frames to cluster, one (T, D) float32 matrix each
Featurise = Callable[[list[FeatureRecord]], list[np.ndarray]]


@dataclass
class ClientTargetSet:
    """What one client's k-means stage produced (all paths under ``out_dir``)."""

    client_id: str
    k: int
    k_requested: int
    frames_fit: int
    frames_labelled: int
    utterances: int
    inertia_per_frame: float  # on the fitted frames
    labelled_inertia_per_frame: float  # exact, over every labelled frame
    perplexity: float
    empty_clusters: int
    mean_segment_length: float
    shards_read: list[str]
    codebook_path: Path
    labels_path: Path


def build_client_targets(
    client_id: str,
    shard_paths: list[Path],
    client_cmvn: Cmvn | None,
    out_dir: Path,
    config: kmeans.KMeansConfig = kmeans.KMeansConfig(),
    log: Callable[[str], None] = print,
    label_only: Collection[Path] = (),
    *,
    feature: str = "mfcc",
    featurise: Featurise | None = None,
    model_rate: bool = False,
) -> ClientTargetSet:
    """Fit one client's k-means on its own shards only, then label every frame of them at 50 Hz.

    ``label_only`` shards (the held-out speakers') are labelled but never fitted; ``client_cmvn``
    must exclude them too. The fit sees at most ``config.max_fit_frames`` frames of whole utterances.
    Clustered: the ``client_cmvn``-normalised MFCC, or the ``featurise``d ``feature`` (iteration 2,
    whose ``model_rate`` frames are at 50 Hz already: not halved, and stored with no CMVN).
    """
    featurise = featurise or _mfcc_in(client_cmvn)
    fit_paths = [path for path in shard_paths if path not in set(label_only)]
    sample = fit_sample(client_id, fit_paths, config.max_fit_frames, config.seed, model_rate=model_rate)
    fit_frames: list[np.ndarray] = []
    for shard_number, utt_ids in sorted(sample.items()):
        records = iter_shard(fit_paths[shard_number], features=(feature,), dtype=None)
        fit_frames += featurise([record for record in records if record.utt_id in utt_ids])
    frames = np.concatenate(fit_frames, axis=0)
    del fit_frames
    k_used = fit_k(client_id, frames.shape[0], config, log)
    fit = kmeans.fit_kmeans(frames, k_used, config)
    del frames

    quality = kmeans.QualityAccumulator(k_used)
    index = kmeans.CodebookIndex(fit.codebook, kmeans.LABEL_THREADS)
    items = _label_shards(shard_paths, feature, featurise, index, quality, halve=not model_rate)
    identity = (np.zeros(fit.codebook.shape[1], np.float32), np.ones(fit.codebook.shape[1], np.float32))
    mean, std = (client_cmvn.mean["mfcc"], client_cmvn.std["mfcc"]) if client_cmvn else identity
    state = ClientState(fit.codebook, mean, std, fit.frames_fit, fit.inertia_per_frame, quality)
    return write_client_targets(client_id, config.k, out_dir, state, items, shard_paths)


def fit_k(client_id: str, num_frames: int, config: kmeans.KMeansConfig, log: Callable[[str], None]) -> int:
    """``config.k``, shrunk (and logged) when the client is too small for it."""
    k_used = kmeans.effective_k(num_frames, config.k, config.min_frames_per_centroid)
    if k_used < config.k:
        log(f"client {client_id}: only {num_frames} frames, K shrinks from {config.k} to {k_used}")
    return k_used


def fit_sample(
    client_id: str, shard_paths: list[Path], max_fit_frames: int, seed: int, model_rate: bool = False
) -> dict[int, set[str]]:
    """The utterances of a client's fit sample per shard number, up to ``max_fit_frames`` frames
    (counted at 100 Hz, or at 50 Hz with ``model_rate``)."""
    frame_counts: list[int] = []
    index: list[tuple[int, str]] = []
    for shard_number, path in enumerate(shard_paths):
        table = read_shard_table(path, columns=["utt_id", "num_frames"])
        for utt_id, frames in zip(*table.to_pydict().values(), strict=True):  # utt_id, num_frames
            index.append((shard_number, utt_id))
            frame_counts.append((int(frames) + 1) // 2 if model_rate else frames)
    if sum(frame_counts) == 0:
        raise ValueError(f"client {client_id} has no feature frames to cluster")
    wanted: dict[int, set[str]] = {}
    for position in kmeans.sample_utterances(frame_counts, max_fit_frames, seed):
        shard_number, utt_id = index[position]
        wanted.setdefault(shard_number, set()).add(utt_id)
    return wanted


def extend_client_targets(client_id: str, new_shard_paths: list[Path], out_dir: Path) -> ClientTargetSet:
    """Label new speakers' shards with the client's codebook and CMVN from ``state.npz``: the cost is
    the new audio's, and old utterances keep byte-identical labels."""
    state = ClientState.load(TargetFiles(out_dir).state)
    stored_cmvn = Cmvn(mean={"mfcc": state.cmvn_mean}, std={"mfcc": state.cmvn_std}, frames=0)
    index = kmeans.CodebookIndex(state.codebook, kmeans.LABEL_THREADS)
    new = _label_shards(new_shard_paths, "mfcc", _mfcc_in(stored_cmvn), index, state.quality)
    return write_client_targets(
        client_id, int(state.codebook.shape[0]), out_dir, state, new, new_shard_paths, append=True
    )


def _mfcc_in(cmvn: Cmvn) -> Featurise:
    return lambda records: [cmvn.apply(record.mfcc, "mfcc") for record in records]  # stored float16: float32 out


@dataclass
class ClientState:
    """What labelling more data later needs: codebook ``(K, 39)``, the CMVN it lives in, and the
    running quality statistics."""

    codebook: np.ndarray
    cmvn_mean: np.ndarray
    cmvn_std: np.ndarray
    frames_fit: int
    inertia_per_frame: float
    quality: kmeans.QualityAccumulator

    def save(self, path: Path) -> None:
        save_npz(
            path,
            {
                "codebook": self.codebook,
                "cmvn_mean": self.cmvn_mean,
                "cmvn_std": self.cmvn_std,
                "frames_fit": np.array(self.frames_fit),
                "inertia_per_frame": np.array(self.inertia_per_frame),
                "counts": self.quality.counts,
                "segment_frames": np.array(self.quality.segments.frames),
                "segment_runs": np.array(self.quality.segments.runs),
                "sqdist_sum": np.array(self.quality.sqdist_sum),
                "sqdist_frames": np.array(self.quality.sqdist_frames),
            },
        )

    @classmethod
    def load(cls, path: Path) -> ClientState:
        with np.load(path) as data:
            quality = kmeans.QualityAccumulator(int(data["codebook"].shape[0]))
            quality.counts = data["counts"].astype(np.int64)
            quality.segments = kmeans.SegmentStats(int(data["segment_frames"]), int(data["segment_runs"]))
            quality.sqdist_sum, quality.sqdist_frames = float(data["sqdist_sum"]), int(data["sqdist_frames"])
            return cls(
                data["codebook"],
                data["cmvn_mean"],
                data["cmvn_std"],
                int(data["frames_fit"]),
                float(data["inertia_per_frame"]),
                quality,
            )


def _label_shards(
    shard_paths: list[Path],
    feature: str,
    featurise: Featurise,
    index: kmeans.CodebookIndex,
    quality: kmeans.QualityAccumulator,
    halve: bool = True,
) -> list[UtteranceLabels]:
    """Label every utterance of ``shard_paths`` (one shard in memory at a time, one search each);
    ``halve``: the labels are at 100 Hz, stored at the model's 50 Hz."""
    items: list[UtteranceLabels] = []
    for path in shard_paths:
        records = list(iter_shard(path, features=(feature,), dtype=None))  # views as stored
        labels_per_utt, sqdists = kmeans.label_utterances_with_sqdist(featurise(records), index)
        for record, labels, sqdist in zip(records, labels_per_utt, sqdists, strict=True):
            quality.add(labels, sqdist)
            stored = kmeans.to_model_rate(labels) if halve else labels
            items.append(UtteranceLabels(record.utt_id, record.speaker_id, stored))
    return items


def write_client_targets(
    client_id: str,
    k_requested: int,
    out_dir: Path,
    state: ClientState,
    items: list[UtteranceLabels],
    shards_read: list[Path],
    append: bool = False,
) -> ClientTargetSet:
    """Write the client's codebook, state and labels: ``items`` alone, or with ``append`` the
    labels already in ``out_dir`` plus ``items``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    codebook_path = TargetFiles(out_dir).codebook
    with atomic_path(codebook_path) as tmp, open(tmp, "wb") as handle:
        np.save(handle, state.codebook.astype(np.float32), allow_pickle=False)
    labels_path = TargetFiles(out_dir).labels
    utterances = len(items) + (pq.read_metadata(labels_path).num_rows if append else 0)
    labels_path = (append_labels if append else write_labels)(labels_path, items)
    state.save(TargetFiles(out_dir).state)
    quality = state.quality
    return ClientTargetSet(
        client_id=client_id,
        k=int(state.codebook.shape[0]),
        k_requested=k_requested,
        frames_fit=state.frames_fit,
        frames_labelled=quality.frames_labelled,
        utterances=utterances,
        inertia_per_frame=state.inertia_per_frame,
        labelled_inertia_per_frame=quality.labelled_inertia_per_frame,
        perplexity=float(kmeans.cluster_perplexity(quality.counts)),
        empty_clusters=int(kmeans.empty_clusters(quality.counts)),
        mean_segment_length=float(quality.segments.mean),
        shards_read=[str(p) for p in shards_read],
        codebook_path=codebook_path,
        labels_path=labels_path,
    )
