"""Audio loading: decode (soundfile) -> mono float32 -> resample to 16 kHz -> peak normalisation.

Pure numpy (no torch, no Dagster), one utterance at a time. ``resample`` computes what
``torchaudio.functional.resample`` does, polyphase, so memory is bounded for any pair of rates
(torchaudio's dense kernel for 8,001 Hz -> 16 kHz takes gigabytes). Peak (not RMS) normalisation
never clips when the VAD quantises to int16; its gain is capped at 20 dB because WebRTC VAD calls
stationary noise above about -30 dBFS speech, and a boosted noise-only recording would be "speech".
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import soundfile as sf

TARGET_SAMPLE_RATE = 16_000
PEAK_TARGET = 0.95
MAX_GAIN_DB = 20.0
SILENCE_PEAK = 1.0 / 65536.0  # below half an int16 LSB: treat as digital silence


class DecodeError(RuntimeError):
    """The file could not be decoded (corrupt, empty, not audio)."""


def decode(path: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
    """Decode ``path`` to float32 ``(C, N)`` in ``[-1, 1]`` and its sample rate (``DecodeError`` if it cannot)."""
    try:
        with sf.SoundFile(os.fspath(path)) as handle:
            sample_rate = int(handle.samplerate)
            data = handle.read(dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, OSError, ValueError) as exc:
        raise DecodeError(f"cannot decode {os.fspath(path)}: {exc}") from exc
    if data.shape[0] == 0:
        raise DecodeError(f"{os.fspath(path)}: zero-length audio")
    return data.T, sample_rate


def to_mono(audio: np.ndarray) -> np.ndarray:
    """Average channels of ``(C, N)`` audio to a contiguous float32 ``(N,)``; ``(N,)`` passes through."""
    if audio.ndim == 1:
        return np.ascontiguousarray(audio, dtype=np.float32)
    if audio.ndim != 2:
        raise ValueError(f"expected (C, N) or (N,) audio, got shape {audio.shape}")
    if audio.shape[0] == 1:
        return np.ascontiguousarray(audio[0], dtype=np.float32)
    return audio.mean(axis=0, dtype=np.float32)


LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99
_CHUNK_TAPS = 1 << 22  # taps gathered at once (16 MiB of float32), whatever the rates


@dataclass(frozen=True)
class _Polyphase:
    """``torchaudio``'s sinc kernel for ``orig -> new`` (divided by their gcd), one row per output phase
    with only its non-negligible taps: phase ``i`` of block ``b`` is ``sum(kernel[i] * padded[b *
    orig + first[i] : ... + taps])``, ``padded`` being the input after ``width`` zeros."""

    orig: int
    new: int
    width: int
    first: np.ndarray  # (new,) int64
    kernel: np.ndarray  # (new, taps) float32


@lru_cache(maxsize=16)
def _polyphase(orig_sr: int, new_sr: int) -> _Polyphase:
    gcd = math.gcd(orig_sr, new_sr)
    orig, new = orig_sr // gcd, new_sr // gcd
    base = min(orig, new) * ROLLOFF
    width = math.ceil(LOWPASS_FILTER_WIDTH * orig / base)
    half = LOWPASS_FILTER_WIDTH * orig / base  # the window's half-length, in input samples (<= width)
    phases = np.arange(new)
    centre = width + phases * orig / new  # where phase i sits among torchaudio's columns
    first = np.maximum(np.floor(centre - half), 0).astype(np.int64)
    last = np.minimum(np.ceil(centre + half), orig + 2 * width - 1).astype(np.int64)
    taps = int((last - first).max()) + 1
    kernel = np.empty((new, taps), np.float32)
    for start in range(0, new, max(1, _CHUNK_TAPS // taps)):  # float64 temporaries a chunk at a time
        stop = min(new, start + max(1, _CHUNK_TAPS // taps))
        column = first[start:stop, None] + np.arange(taps)
        # as torchaudio computes it, down to its phase term in float32
        phase = (-phases[start:stop]).astype(np.float32) / np.float32(new)
        t = ((column - width) / orig + phase[:, None].astype(np.float64)) * base
        t = np.clip(t, -LOWPASS_FILTER_WIDTH, LOWPASS_FILTER_WIDTH)
        window = np.cos(t * math.pi / LOWPASS_FILTER_WIDTH / 2) ** 2
        t *= math.pi
        with np.errstate(invalid="ignore", divide="ignore"):
            values = np.where(t == 0, 1.0, np.sin(t) / t) * window * (base / orig)
        values[column > orig + 2 * width - 1] = 0.0  # past the end of torchaudio's row
        kernel[start:stop] = values
    return _Polyphase(orig, new, width, first, kernel)


def resample(wave: np.ndarray, orig_sr: int, new_sr: int) -> np.ndarray:
    """``torchaudio.functional.resample(wave, orig_sr, new_sr)`` for mono float32 ``(N,)``, in memory
    bounded by the chunk size, not by the rates' gcd."""
    if orig_sr <= 0 or new_sr <= 0:
        raise ValueError(f"invalid sample rates {orig_sr} -> {new_sr}")
    wave = np.ascontiguousarray(wave, dtype=np.float32)
    if orig_sr == new_sr:
        return wave
    poly = _polyphase(int(orig_sr), int(new_sr))
    orig, new, taps = poly.orig, poly.new, poly.kernel.shape[1]
    length = wave.shape[0]
    target = -(-new * length // orig)
    padded = np.zeros(length + 2 * poly.width + orig + taps, np.float32)
    padded[poly.width : poly.width + length] = wave
    windows = np.lib.stride_tricks.sliding_window_view(padded, taps)  # a view: (len - taps + 1, taps)
    out = np.empty(target, np.float32)
    blocks = -(-target // new)
    per_chunk = max(1, _CHUNK_TAPS // (new * taps))
    for block in range(0, blocks, per_chunk):
        count = min(per_chunk, blocks - block)
        starts = (np.arange(block, block + count)[:, None] * orig + poly.first).reshape(-1)
        gathered = windows[starts].reshape(count, new, taps)
        values = np.einsum("bpt,pt->bp", gathered, poly.kernel).reshape(-1)
        done = block * new
        out[done : done + count * new] = values[: target - done]
    return out


def normalise_peak(
    wave: np.ndarray, target: float = PEAK_TARGET, max_gain_db: float = MAX_GAIN_DB, *, in_place: bool = False
) -> np.ndarray:
    """Scale ``wave`` so its absolute peak is ``target`` (gain capped at ``max_gain_db``); digital
    silence is returned unscaled. ``in_place``: scale a writable float32 ``wave`` itself (a second
    multi-MB array per utterance costs more in page faults than the multiply)."""
    reuse = in_place and wave.dtype == np.float32 and wave.flags.writeable
    peak = float(max(wave.max(), -wave.min())) if wave.size else 0.0
    if not math.isfinite(peak):
        raise ValueError("waveform contains NaN or infinite samples")
    if peak < SILENCE_PEAK:
        return wave if reuse else wave.astype(np.float32, copy=True)
    gain = np.float32(min(target / peak, 10.0 ** (max_gain_db / 20.0)))
    return np.multiply(wave, gain, out=wave if reuse else None, dtype=np.float32)


def to_16k_mono(audio: np.ndarray, sample_rate: int, *, in_place: bool = False) -> np.ndarray:
    """``(C, N)`` audio at ``sample_rate`` as peak-normalised mono float32 ``(N,)`` at 16 kHz, as the
    pipeline reads every utterance (``in_place``: as :func:`normalise_peak`)."""
    return normalise_peak(resample(to_mono(audio), sample_rate, TARGET_SAMPLE_RATE), in_place=in_place)


def load_16k_mono(path: str | os.PathLike[str]) -> np.ndarray:
    """Decode ``path`` and return peak-normalised mono float32 ``(N,)`` at 16 kHz."""
    return to_16k_mono(*decode(path))
