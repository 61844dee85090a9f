"""WebRTC VAD with the py-webrtcvad example's ring-buffer collector, reduced to one speech span.

Each ``frame_ms`` frame of the int16-quantised waveform is classified by ``webrtcvad``; the
collector then walks the decisions as py-webrtcvad's ``example.py`` does (trigger when more than
90 % of a ``padding_ms`` ring buffer is voiced, un-trigger when more than 90 % is unvoiced). The
span runs from the first segment's start to the last one's end: leading and trailing non-speech
are trimmed, interior pauses kept. A fresh ``webrtcvad.Vad`` per utterance (it adapts its noise
model) makes the result independent of sharding. ``no_speech``: the collector never triggers, or
the voiced time is below ``min_speech_s``, or the voiced share below ``min_speech_ratio``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import repeat
from typing import Annotated, Any, Self

import numpy as np
import webrtcvad
from pydantic import ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from speech_assets.runtime.heap import scratch

try:  # the C extension behind webrtcvad.Vad.is_speech; calling it directly skips a Python wrapper
    from _webrtcvad import process as _vad_process
except ImportError:  # pragma: no cover - other webrtcvad builds
    _vad_process = None

VAD_SAMPLE_RATE = 16_000
FRAME_MS_CHOICES = (10, 20, 30)
_TRIGGER_FRACTION = 0.9


@pydantic_dataclass(frozen=True, config=ConfigDict(strict=True))
class VadConfig:
    """WebRTC VAD settings (Dagster config); ``aggressiveness``: 0 (least aggressive) to 3."""

    aggressiveness: Annotated[int, Field(ge=0, le=3)] = 2
    frame_ms: int = 30  # one of FRAME_MS_CHOICES
    padding_ms: Annotated[int, Field(le=10_000)] = 300  # at least frame_ms
    min_speech_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.5
    min_speech_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1

    @model_validator(mode="after")
    def _frames(self) -> Self:
        if self.frame_ms not in FRAME_MS_CHOICES:
            raise ValueError(f"frame_ms must be one of {FRAME_MS_CHOICES}, got {self.frame_ms}")
        if self.padding_ms < self.frame_ms:
            raise ValueError(f"padding_ms must be at least frame_ms ({self.frame_ms}), got {self.padding_ms}")
        return self

    @property
    def padding_frames(self) -> int:
        return self.padding_ms // self.frame_ms

    def frame_samples(self, sample_rate: int = VAD_SAMPLE_RATE) -> int:
        return sample_rate * self.frame_ms // 1000

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SpeechSpan:
    """The trimmed speech region ``[start_sample, end_sample)`` of a 16 kHz waveform."""

    start_sample: int
    end_sample: int
    speech_frames: int
    total_frames: int
    frame_ms: int
    sample_rate: int = VAD_SAMPLE_RATE

    @property
    def num_samples(self) -> int:
        return self.end_sample - self.start_sample

    @property
    def start_s(self) -> float:
        return self.start_sample / self.sample_rate

    @property
    def end_s(self) -> float:
        return self.end_sample / self.sample_rate

    @property
    def duration_s(self) -> float:
        return self.num_samples / self.sample_rate

    @property
    def speech_s(self) -> float:
        return self.speech_frames * self.frame_ms / 1000.0

    @property
    def speech_ratio(self) -> float:
        return self.speech_frames / self.total_frames if self.total_frames else 0.0


@dataclass(frozen=True)
class NoSpeech:
    """Too little speech. ``detail`` is human-readable; ``span`` is the collector's span, if any."""

    detail: str
    speech_frames: int
    total_frames: int
    span: SpeechSpan | None = None


def to_pcm16(wave: np.ndarray, out: np.ndarray | None = None, *, in_range: bool = False) -> np.ndarray:
    """Quantise float ``[-1, 1]`` samples to int16 (scaled by 32767, clipped, truncated) into ``out``.

    ``in_range``: the caller vouches that every ``|sample| <= 1``, which skips the clipping (a
    sample beyond would wrap around).
    """
    wave = np.asarray(wave)
    if in_range:
        if out is None:
            out = np.empty(wave.shape, np.int16)
        # float32 products truncated toward zero as they are stored, exactly as below
        return np.multiply(wave, np.float32(32767.0), out=out, dtype=np.float32, casting="unsafe")
    scaled = scratch("float32", np.float32, wave.shape[0]) if wave.ndim == 1 else None
    scaled = np.multiply(wave, np.float32(32767.0), dtype=np.float32, out=scaled)
    np.clip(scaled, -32768.0, 32767.0, out=scaled)
    if out is None:
        return scaled.astype(np.int16)
    np.copyto(out, scaled, casting="unsafe")  # truncation toward zero, as astype
    return out


def classify_frames(pcm16: np.ndarray, cfg: VadConfig, sample_rate: int = VAD_SAMPLE_RATE) -> list[bool]:
    """WebRTC VAD decision for each complete ``cfg.frame_ms`` frame of int16 PCM ``(N,)``."""
    pcm = np.ascontiguousarray(pcm16, dtype="<i2")
    if pcm.ndim != 1:
        raise ValueError(f"classify_frames expects mono (N,) PCM, got shape {pcm.shape}")
    frame_samples = cfg.frame_samples(sample_rate)
    count = pcm.shape[0] // frame_samples
    # read-only rows of one view: no copy, and ``map`` calls WebRTC's ``process`` without a Python step per frame
    frames = pcm[: count * frame_samples].reshape(count, frame_samples)
    frames.flags.writeable = False
    vad = webrtcvad.Vad(cfg.aggressiveness)
    if _vad_process is None:  # pragma: no cover
        return [vad.is_speech(frame.tobytes(), sample_rate) for frame in frames]
    return list(
        map(_vad_process, repeat(vad._vad, count), repeat(sample_rate, count), frames, repeat(frame_samples, count))
    )


def collect_span(flags: Sequence[bool] | np.ndarray, padding_frames: int) -> tuple[int, int] | None:
    """py-webrtcvad's ``vad_collector`` over per-frame decisions -> ``(first_frame, end_frame)`` or None,
    without a Python step per frame.

    Once the ring is full again after a clear it holds the last ``padding_frames`` decisions
    whatever happened before, so both conditions are computed once for every full window and each
    state's exit is a binary search; only the partial windows after a clear are checked on their
    own (they cannot reach the threshold unless ``padding_frames > 10``).
    """
    voiced = np.asarray(flags, dtype=bool)
    total = int(voiced.shape[0])
    maxlen = max(1, int(padding_frames))
    threshold = _TRIGGER_FRACTION * maxlen
    prefix = np.zeros(total + 1, dtype=np.int64)
    np.cumsum(voiced, out=prefix[1:])
    # Frame i's full window is frames i-maxlen+1 .. i (or 0 .. i before frame maxlen-1, which is
    # the ring's content when it was last cleared at frame 0).
    start = np.maximum(np.arange(1 - maxlen, total + 1 - maxlen), 0)
    in_full = prefix[1:] - prefix[start]
    hits = (  # per state (False: not triggered), frames whose full window makes it change state
        np.flatnonzero(in_full > threshold),
        np.flatnonzero((np.arange(1, total + 1) - start) - in_full > threshold),
    )
    partial_can_hit = maxlen - 1 > threshold
    first: int | None = None
    end = 0
    cleared = 0  # first frame in the ring since it was last cleared
    triggered = False
    while cleared < total:
        full_from = cleared + maxlen - 1  # first frame whose window is full again
        hit = -1
        if partial_can_hit and cleared > 0:
            stop = min(full_from, total)
            count = prefix[cleared + 1 : stop + 1] - prefix[cleared]
            if triggered:
                count = np.arange(1, stop - cleared + 1) - count
            partial = np.flatnonzero(count > threshold)
            hit = cleared + int(partial[0]) if partial.size else -1
        if hit < 0:
            candidates = hits[triggered]
            at = int(np.searchsorted(candidates, full_from if cleared > 0 else 0))
            if at == candidates.shape[0]:
                break
            hit = int(candidates[at])
        if not triggered and first is None:
            first = max(cleared, hit - maxlen + 1)
        elif triggered:
            end = hit + 1
        triggered = not triggered
        cleared = hit + 1
    if first is None:
        return None
    if triggered:
        end = total
    return first, end


def detect_speech(
    wave16k: np.ndarray,
    cfg: VadConfig = VadConfig(),
    sample_rate: int = VAD_SAMPLE_RATE,
    *,
    peak_normalised: bool = False,
) -> SpeechSpan | NoSpeech:
    """The speech span of a mono float32 waveform (``NoSpeech`` when there is too little);
    ``peak_normalised``: no sample beyond ``[-1, 1]``, which saves the clipping pass."""
    if sample_rate not in (8000, 16000, 32000, 48000):
        raise ValueError(f"WebRTC VAD needs 8/16/32/48 kHz audio, got {sample_rate} Hz")
    wave = np.asarray(wave16k)
    if wave.ndim != 1:
        raise ValueError(f"detect_speech expects mono (N,) audio, got shape {wave.shape}")
    pcm16 = to_pcm16(wave, out=scratch("int16", np.int16, wave.shape[0]), in_range=peak_normalised)
    flags = classify_frames(pcm16, cfg, sample_rate)
    total = len(flags)
    seconds = wave.shape[0] / sample_rate
    if total == 0:
        return NoSpeech(f"audio is {seconds:.3f} s, shorter than one {cfg.frame_ms} ms VAD frame", 0, 0)
    if (frames := collect_span(flags, cfg.padding_frames)) is None:
        voiced = sum(flags)
        detail = (
            f"VAD (aggressiveness {cfg.aggressiveness}) never triggered: {voiced}/{total} frames voiced "
            f"in {seconds:.2f} s, no {cfg.padding_ms} ms window more than 90% voiced"
        )
        return NoSpeech(detail, voiced, total)
    first, end = frames
    frame_samples = cfg.frame_samples(sample_rate)
    end_sample = wave.shape[0] if end == total else end * frame_samples
    span = SpeechSpan(first * frame_samples, end_sample, sum(flags[first:end]), total, cfg.frame_ms, sample_rate)
    if span.speech_s < cfg.min_speech_s:
        detail = (
            f"only {span.speech_s:.2f} s of voiced frames (< min_speech_s {cfg.min_speech_s:g} s) "
            f"in {seconds:.2f} s of audio"
        )
    elif span.speech_ratio < cfg.min_speech_ratio:
        detail = (
            f"speech ratio {span.speech_ratio:.3f} (< min_speech_ratio {cfg.min_speech_ratio:g}): "
            f"{span.speech_frames}/{total} frames voiced in {seconds:.2f} s of audio"
        )
    else:
        return span
    return NoSpeech(detail, span.speech_frames, total, span)
