"""Cepstral mean and variance normalisation statistics from mergeable partial sums.

Each feature shard stores its own partial sums (per speaker: frame count, sum, sum of squares,
in float64), so global, per-speaker or per-client statistics combine from small sidecar files
without re-reading any feature matrix; one changed shard changes only its own sidecar.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from speech_assets.utils import save_npz

_MIN_VAR = 1e-8


@dataclass
class PartialSums:
    """Sufficient statistics of a set of frames: ``count``, ``sum`` ``(D,)``, ``sumsq`` ``(D,)``."""

    count: int
    sum: np.ndarray
    sumsq: np.ndarray

    @classmethod
    def of(cls, frames: np.ndarray) -> PartialSums:
        """Statistics of ``frames`` ``(T, D)``."""
        as64 = np.asarray(frames, dtype=np.float64)
        return cls(int(as64.shape[0]), as64.sum(axis=0), np.einsum("td,td->d", as64, as64))

    def __add__(self, other: PartialSums) -> PartialSums:
        return PartialSums(self.count + other.count, self.sum + other.sum, self.sumsq + other.sumsq)

    @property
    def mean(self) -> np.ndarray:
        return self.sum / max(self.count, 1)

    @property
    def var(self) -> np.ndarray:
        return np.maximum(self.sumsq / max(self.count, 1) - self.mean**2, _MIN_VAR)


@dataclass
class ShardStats:
    """Per-speaker partial sums of both features for one shard."""

    speakers: dict[str, dict[str, PartialSums]] = field(default_factory=dict)

    def add(self, speaker_id: str, feature: str, frames: np.ndarray) -> None:
        per_feature = self.speakers.setdefault(speaker_id, {})
        stats = PartialSums.of(frames)
        per_feature[feature] = per_feature[feature] + stats if feature in per_feature else stats

    def save(self, path: str | os.PathLike[str]) -> None:
        arrays: dict[str, np.ndarray] = {}
        for speaker, per_feature in sorted(self.speakers.items()):
            for feature, stats in sorted(per_feature.items()):
                key = f"{speaker}/{feature}"
                arrays[f"{key}/count"] = np.array(stats.count, np.int64)
                arrays[f"{key}/sum"] = stats.sum
                arrays[f"{key}/sumsq"] = stats.sumsq
        save_npz(path, arrays)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ShardStats:
        result = cls()
        with np.load(path) as data:
            keys = sorted({name.rsplit("/", 1)[0] for name in data.files})
            for key in keys:
                speaker, feature = key.rsplit("/", 1)
                result.speakers.setdefault(speaker, {})[feature] = PartialSums(
                    int(data[f"{key}/count"]), data[f"{key}/sum"], data[f"{key}/sumsq"]
                )
        return result


def combine(parts: Iterable[ShardStats], speakers: Iterable[str] | None = None) -> dict[str, PartialSums]:
    """Sum partial statistics per feature over all shards (optionally only ``speakers``)."""
    wanted = set(speakers) if speakers is not None else None
    totals: dict[str, PartialSums] = {}
    for part in parts:
        for speaker, per_feature in part.speakers.items():
            if wanted is not None and speaker not in wanted:
                continue
            for feature, stats in per_feature.items():
                totals[feature] = totals[feature] + stats if feature in totals else stats
    return totals


def merge(parts: Iterable[ShardStats]) -> ShardStats:
    """Every part's per-speaker sums in one ``ShardStats`` (a speaker found in several parts keeps
    the last part's sums: each speaker has one shard)."""
    return ShardStats({speaker: sums for part in parts for speaker, sums in part.speakers.items()})


def speakers_table(speakers: Sequence[str], metas: Mapping[str, Mapping], per_speaker: ShardStats) -> pa.Table:
    """One row per speaker of ``speakers`` (each with its shard's meta in ``metas``): utterances,
    MFCC frames in its CMVN sums (0 if none), audio and trimmed hours, and its shard's sha256."""
    return pa.table(
        {
            "speaker_id": list(speakers),
            "utterances": [metas[s]["utterances"] for s in speakers],
            "frames": [per_speaker.speakers[s]["mfcc"].count if s in per_speaker.speakers else 0 for s in speakers],
            "audio_hours": [metas[s]["audio_seconds"] / 3600 for s in speakers],
            "trimmed_hours": [metas[s]["trimmed_seconds"] / 3600 for s in speakers],
            "shard_sha256": [metas[s]["shard_sha256"] for s in speakers],
        }
    )


@dataclass(frozen=True)
class Cmvn:
    """Mean and standard deviation per feature kind, each ``(D,)`` float32."""

    mean: Mapping[str, np.ndarray]
    std: Mapping[str, np.ndarray]
    frames: int

    @classmethod
    def from_sums(cls, totals: Mapping[str, PartialSums]) -> Cmvn:
        if not totals:
            raise ValueError("no frames to compute CMVN statistics from")
        return cls(
            mean={k: v.mean.astype(np.float32) for k, v in totals.items()},
            std={k: np.sqrt(v.var).astype(np.float32) for k, v in totals.items()},
            frames=min(v.count for v in totals.values()),
        )

    def apply(self, frames: np.ndarray, feature: str) -> np.ndarray:
        """Normalise ``frames`` ``(T, D)`` of ``feature`` to zero mean, unit variance (float32)."""
        return ((frames - self.mean[feature]) / self.std[feature]).astype(np.float32, copy=False)

    def save(self, path: str | os.PathLike[str]) -> None:
        arrays = {"frames": np.array(self.frames, np.int64)}
        for feature in self.mean:
            arrays[f"{feature}_mean"] = self.mean[feature]
            arrays[f"{feature}_std"] = self.std[feature]
        save_npz(path, arrays)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cmvn:
        with np.load(Path(path)) as data:
            features = [name[: -len("_mean")] for name in data.files if name.endswith("_mean")]
            return cls(
                mean={f: data[f"{f}_mean"].astype(np.float32) for f in features},
                std={f: data[f"{f}_std"].astype(np.float32) for f in features},
                frames=int(data["frames"]),
            )


MIN_STD = 1e-3  # well above the variance floor: a smaller std means silent, clipped or broken features


def degenerate_dimensions(stats: Cmvn, min_std: float = MIN_STD) -> dict[str, list[int]]:
    """Per feature, the dimensions whose mean or std is not finite or whose std is below
    ``min_std``; features with none are left out (empty: every dimension is sound)."""
    bad = {
        feature: [
            int(d) for d in np.flatnonzero(~np.isfinite(stats.mean[feature]) | ~np.isfinite(std) | (std < min_std))
        ]
        for feature, std in stats.std.items()
    }
    return {k: v for k, v in bad.items() if v}


class UtteranceCmvn:
    """Per-utterance CMVN: each ``(T, D)`` matrix is normalised by its own mean and standard
    deviation over time. It needs no statistic of any other utterance, so it is what a federation
    (which has no global statistics) trains with, and it can never carry a held-out speaker's
    statistics into training."""

    kind = "utterance"

    def apply(self, frames: np.ndarray, feature: str) -> np.ndarray:
        """``frames (T, D)`` -> ``(T, D)`` float32, zero mean and unit variance per dimension."""
        as64 = np.asarray(frames, dtype=np.float64)
        if as64.shape[0] == 0:
            return as64.astype(np.float32)
        std = np.sqrt(np.maximum(as64.var(axis=0), _MIN_VAR))
        return ((as64 - as64.mean(axis=0)) / std).astype(np.float32)


NORMALISATIONS = ("utterance", "global")
Normaliser = Cmvn | UtteranceCmvn


def training_cmvn(kind: str, speaker_sums: str | os.PathLike[str], speakers: Iterable[str]) -> Normaliser:
    """The input normalisation a model trains with: ``utterance`` (:class:`UtteranceCmvn`) or
    ``global``, the CMVN of the training ``speakers`` only, from the per-speaker sums that
    ``cmvn_stats`` writes (``speaker_sums.npz``): a held-out speaker's frames never enter it."""
    if kind == "utterance":
        return UtteranceCmvn()
    if kind != "global":
        raise ValueError(f"normalisation must be one of {NORMALISATIONS}, got {kind!r}")
    return Cmvn.from_sums(combine([ShardStats.load(speaker_sums)], speakers=speakers))


def describe(normaliser: Normaliser) -> dict[str, object]:
    """What a checkpoint records of its normalisation, so that evaluation and export apply
    exactly it (:func:`from_record`): ``{"kind": "utterance"}`` or the global log-mel statistics."""
    if isinstance(normaliser, UtteranceCmvn):
        return {"kind": "utterance"}
    return {
        "kind": "global",
        "frames": normaliser.frames,
        "mean": [float(v) for v in normaliser.mean["logmel"]],
        "std": [float(v) for v in normaliser.std["logmel"]],
    }


def from_record(record: Mapping[str, object] | None) -> Normaliser | None:
    """The normaliser :func:`describe` recorded; ``None`` for a checkpoint that recorded none."""
    if not record:
        return None
    if record.get("kind") == "utterance":
        return UtteranceCmvn()
    if record.get("kind") == "global":
        mean = np.asarray(record["mean"], dtype=np.float32)
        std = np.asarray(record["std"], dtype=np.float32)
        return Cmvn(mean={"logmel": mean}, std={"logmel": std}, frames=int(record.get("frames", 0)))  # type: ignore[arg-type]
    raise ValueError(f"unknown normalisation record {record!r}")
