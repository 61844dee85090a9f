"""A feature run's shard jobs, planned from the manifest, and the totals of what they published.

One job per speaker: its manifest rows as ``UtteranceInput``s, its shard files, and the
``inputs_key`` its shard's meta must record for the shard to be reused. Torch-free, so the code
location can name :data:`FEATURES_CODE_VERSION` without loading the feature pipeline.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from speech_assets.corpus.manifest import ManifestRow, speaker_hashes
from speech_assets.features.shards import ShardFiles
from speech_assets.features.vad import VadConfig
from speech_assets.utils import sha256_strings

FEATURES_CODE_VERSION = "vad-features-v3"  # v2: 32-row row groups; v3: float16 features (shard format 2)


@dataclass(frozen=True)
class UtteranceInput:
    """One manifest row as the shard builder needs it (``path`` absolute)."""

    utt_id: str
    speaker_id: str
    chapter_id: str
    path: str
    duration_s: float = 0.0


@dataclass(frozen=True)
class ShardJob:
    """One speaker's shard to build unless its meta already vouches for the same ``inputs_key``."""

    speaker_id: str
    utterances: tuple[UtteranceInput, ...]
    files: ShardFiles
    inputs_key: str
    meta_extra: Mapping[str, object] = field(default_factory=dict)
    force: bool = False
    speed_factors: tuple[float, ...] = ()  # speed-perturbed copies of every utterance (part of inputs_key)

    @property
    def audio_seconds(self) -> float:
        return sum(u.duration_s for u in self.utterances)


@dataclass
class ShardOutcome:
    """What happened to one job: its published ``meta`` (None on error), whether this call
    rebuilt it, and the error (with traceback) if it failed."""

    speaker_id: str
    meta: dict | None
    rebuilt: bool
    error: str | None = None


def shard_inputs_key(speaker_hash: str, vad: VadConfig, speed_factors: tuple[float, ...] = ()) -> str:
    """What a shard's content depends on: its speaker's manifest rows, the config, the code."""
    parts = [speaker_hash, json.dumps(vad.as_dict(), sort_keys=True), FEATURES_CODE_VERSION]
    if speed_factors:  # absent when off, so that shards built without it stay valid
        parts.append(json.dumps({"speed_factors": list(speed_factors)}))
    return sha256_strings(parts)


def shard_jobs(
    rows: Iterable[ManifestRow],
    speakers: Sequence[str],
    shard_files: Callable[[str], ShardFiles],
    vad: VadConfig,
    speed_factors: tuple[float, ...] = (),
    manifest_version: str | None = None,
    force: bool = False,
) -> list[ShardJob]:
    """One job per speaker of ``speakers``, in that order, with its own rows of ``rows`` (other
    speakers' rows are ignored; a speaker without rows gets an empty job). ``speed_factors``:
    already checked (:func:`check_speed_factors`); ``manifest_version`` is recorded in each meta."""
    wanted = set(speakers)
    rows = [r for r in rows if r.speaker_id in wanted]
    hashes = speaker_hashes(rows)
    by_speaker: dict[str, list[UtteranceInput]] = {s: [] for s in speakers}
    for row in rows:
        by_speaker[row.speaker_id].append(
            UtteranceInput(row.utt_id, row.speaker_id, row.chapter_id, row.path, row.duration_s)
        )
    return [
        ShardJob(
            speaker_id=speaker,
            utterances=tuple(by_speaker[speaker]),
            files=shard_files(speaker),
            inputs_key=shard_inputs_key(hashes.get(speaker, ""), vad, speed_factors),
            meta_extra={
                "speaker_manifest_hash": hashes.get(speaker, ""),
                "manifest_version": manifest_version,
                "code_version": FEATURES_CODE_VERSION,
            },
            force=force,
            speed_factors=speed_factors,
        )
        for speaker in speakers
    ]


@dataclass
class ShardTotals:
    """The shards a run published (reused or rebuilt; failed ones are not counted) and their sums."""

    published: int = 0
    rebuilt: int = 0
    utterances: int = 0
    audio_seconds: float = 0.0
    trimmed_seconds: float = 0.0

    def add(self, outcome: ShardOutcome) -> None:
        """Count a published ``outcome`` (its ``meta`` set)."""
        if outcome.meta is None:
            raise ValueError(f"shard {outcome.speaker_id} was not published: {outcome.error or 'no meta'}")
        self.published += 1
        self.rebuilt += outcome.rebuilt
        self.utterances += outcome.meta["utterances"]
        self.audio_seconds += outcome.meta["audio_seconds"]
        self.trimmed_seconds += outcome.meta["trimmed_seconds"]

    def summary(self) -> str:
        return (
            f"{self.published} shard(s) published ({self.rebuilt} rebuilt): {self.utterances} utterances, "
            f"{self.audio_seconds / 3600:.3f} h of audio, {self.trimmed_seconds / 3600:.3f} h after VAD"
        )


def check_speed_factors(factors: Sequence[float]) -> tuple[float, ...]:
    """Sorted, distinct factors in (0.5, 2], none equal to 1 (the original is always kept)."""
    out = tuple(sorted({float(f) for f in factors}))
    if any(not 0.5 < f <= 2.0 or f == 1.0 for f in out):
        raise ValueError(f"speed factors must be in (0.5, 2] and not 1, got {list(factors)}")
    return out
