"""A small synthetic, learnable corpus in the real on-disk formats (shards, labels, CMVN).

Each client has its own codebook of ``k`` random log-mel prototypes. An utterance is a run of
segments (``segment_frames`` at 100 Hz) whose cluster ids step cyclically (``c -> c + 1``), and
its frames are the prototype of their cluster plus noise: a masked frame's cluster is
predictable from the visible context, so held-out masked accuracy can rise far above 1/k.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speech_assets.features.cmvn import Cmvn, PartialSums
from speech_assets.features.shards import FRAME_RATE_HZ, MFCC_DIM, N_MELS, FeatureRecord, write_shard
from speech_assets.targets.labels import UtteranceLabels, write_labels
from speech_assets.train.config import ClientTargets, TrainConfig


@dataclass
class SyntheticCorpus:
    shards: list[str]
    cmvn: str
    clients: dict[str, ClientTargets]
    unlabelled: int

    def config(self, run_dir: Path, **overrides: object) -> TrainConfig:
        values: dict[str, object] = {
            "run_dir": str(run_dir),
            "shards": self.shards,
            "cmvn": self.cmvn,
            "clients": self.clients,
            "preset": "tiny",
            "max_steps": 10,
            "batch_seconds": 8.0,
            "grad_accum": 1,
            "lr": 2e-3,
            "warmup_steps": 5,
            "heldout_fraction": 0.15,
            "checkpoint_every": 5,
            "log_every": 5,
            "precision": "fp32",
            "device": "cpu",
            "threads": 1,  # same numerics on any machine
            "seed": 0,
        }
        values.update(overrides)
        return TrainConfig(**values)  # type: ignore[arg-type]


def write_corpus(
    root: Path,
    clients: Mapping[str, int] = {"client_a": 8, "client_b": 12},
    speakers_per_client: int = 2,
    utterances_per_speaker: int = 12,
    seconds: tuple[float, float] = (1.5, 4.0),
    unlabelled_per_shard: int = 1,
    segment_frames: tuple[int, int] = (40, 120),
    seed: int = 0,
) -> SyntheticCorpus:
    """Write one shard per speaker, one labels file per client and a CMVN file under ``root``."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    shards: list[str] = []
    targets: dict[str, ClientTargets] = {}
    stats = PartialSums(0, np.zeros(N_MELS), np.zeros(N_MELS))
    unlabelled = 0
    for client, k in sorted(clients.items()):
        prototypes = rng.normal(0.0, 3.0, size=(k, N_MELS)).astype(np.float32) - 5.0
        labelled: list[UtteranceLabels] = []
        for s in range(speakers_per_client):
            speaker = f"{client}-spk{s}"
            records = []
            for u in range(utterances_per_speaker + unlabelled_per_shard):
                frames = int(rng.uniform(*seconds) * FRAME_RATE_HZ)
                labels_100hz = _label_sequence(rng, frames, k, segment_frames)
                logmel = prototypes[labels_100hz] + rng.normal(0.0, 1.0, size=(frames, N_MELS)).astype(np.float32)
                utt_id = f"{speaker}-{u:04d}"
                records.append(_record(utt_id, speaker, logmel.astype(np.float32)))
                stats = stats + PartialSums.of(logmel)
                if u < utterances_per_speaker:
                    labelled.append(UtteranceLabels(utt_id, speaker, labels_100hz[::2].astype(np.int16)))
                else:
                    unlabelled += 1
            shards.append(str(write_shard(root / "shards" / f"{speaker}.parquet", records)))
        labels_path = write_labels(root / "kmeans" / client / "labels.parquet", labelled)
        targets[client] = ClientTargets(labels=str(labels_path), k=k)
    cmvn_path = root / "cmvn.npz"
    mfcc_stats = PartialSums(stats.count, np.zeros(MFCC_DIM), np.full(MFCC_DIM, float(stats.count)))
    Cmvn.from_sums({"logmel": stats, "mfcc": mfcc_stats}).save(cmvn_path)
    return SyntheticCorpus(shards=sorted(shards), cmvn=str(cmvn_path), clients=targets, unlabelled=unlabelled)


def _label_sequence(rng: np.random.Generator, frames: int, k: int, segment_frames: tuple[int, int]) -> np.ndarray:
    """100 Hz cluster ids: segments of ``segment_frames`` (inclusive range), ids stepping cyclically."""
    labels = np.empty(frames, dtype=np.int64)
    position, current = 0, int(rng.integers(k))
    while position < frames:
        length = int(rng.integers(segment_frames[0], segment_frames[1] + 1))
        labels[position : position + length] = current
        position += length
        current = (current + 1) % k
    return labels


def _record(utt_id: str, speaker: str, logmel: np.ndarray) -> FeatureRecord:
    frames = logmel.shape[0]
    duration = frames / FRAME_RATE_HZ
    return FeatureRecord(
        utt_id=utt_id,
        speaker_id=speaker,
        chapter_id="1",
        num_frames=frames,
        duration_s=duration,
        speech_start_s=0.0,
        speech_end_s=duration,
        trimmed_duration_s=duration,
        speech_ratio=1.0,
        logmel=logmel,
        mfcc=np.zeros((frames, MFCC_DIM), dtype=np.float32),
    )
