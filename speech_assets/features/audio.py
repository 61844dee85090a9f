"""Audio loading: decode (soundfile) -> mono float32 -> resample to 16 kHz -> peak normalisation.

Everything here is pure numpy/torch (no Dagster) and works on one utterance at a time.

* ``decode`` reads any format libsndfile knows (FLAC, WAV, OGG, ...) as float32 in ``[-1, 1]``
  (integer PCM scaled by ``1 / 2**(bits-1)``), channels first ``(C, N)``.
* ``to_mono`` averages channels.
* ``resample_to_16k`` uses ``torchaudio.functional.resample`` semantics (windowed sinc, Hann window,
  ``lowpass_filter_width=6``, ``rolloff=0.99``) with the kernel cached per input rate; 16 kHz input
  is returned unchanged. The output has ``ceil(N * 16000 / sr)`` samples.
* ``normalise_peak`` scales the waveform so that its absolute peak is ``PEAK_TARGET`` (0.95, about
  -0.45 dBFS). Peak (not RMS) normalisation is used because it can never clip when the waveform is
  later quantised to int16 for the WebRTC VAD. The gain is capped at ``MAX_GAIN_DB`` (20 dB):
  WebRTC VAD calls stationary noise louder than about -30 dBFS "speech", so boosting a
  noise-only recording to full scale would turn its noise floor into speech; with the cap a
  -60 dBFS (RMS) noise floor ends up at -40 dBFS, well below that. An all-zero (or sub-LSB,
  peak < ``SILENCE_PEAK``) waveform is returned unchanged: no division by zero, and silence
  stays silence (the VAD then rejects it as ``no_speech``).
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import numpy as np
import soundfile as sf
import torch

TARGET_SAMPLE_RATE = 16_000
PEAK_TARGET = 0.95
MAX_GAIN_DB = 20.0
SILENCE_PEAK = 1.0 / 65536.0  # below half an int16 LSB: treat as digital silence


class DecodeError(RuntimeError):
    """The file could not be decoded (corrupt, empty, not audio)."""


def decode(path: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
    """Decode ``path`` to float32 ``(C, N)`` (channels first) in ``[-1, 1]`` and its sample rate.

    Raises ``DecodeError`` for unreadable or zero-length files.
    """
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


@lru_cache(maxsize=16)
def _resampler(orig_sr: int, new_sr: int) -> torch.nn.Module:
    # Imported lazily: torchaudio import costs ~0.3 s and 16 kHz corpora never need it.
    import torchaudio

    return torchaudio.transforms.Resample(orig_sr, new_sr, resampling_method="sinc_interp_hann")


def resample_to_16k(wave: np.ndarray, sample_rate: int) -> np.ndarray:
    """Resample mono float32 ``(N,)`` from ``sample_rate`` to 16 kHz (no-op at 16 kHz)."""
    if sample_rate <= 0:
        raise ValueError(f"invalid sample rate {sample_rate}")
    if sample_rate == TARGET_SAMPLE_RATE:
        return wave
    with torch.inference_mode():
        out = _resampler(int(sample_rate), TARGET_SAMPLE_RATE)(torch.from_numpy(np.ascontiguousarray(wave)))
    return out.numpy()


def normalise_peak(
    wave: np.ndarray, target: float = PEAK_TARGET, max_gain_db: float = MAX_GAIN_DB, *, in_place: bool = False
) -> np.ndarray:
    """Scale ``wave`` so its absolute peak is ``target`` (gain capped at ``max_gain_db``).

    Returns a new float32 array (the input is never modified) unless ``in_place`` is set and
    ``wave`` is a writable float32 array, which is then scaled in place and returned: the
    feature pipeline owns its freshly decoded buffer, and a second multi-MB array per utterance
    costs more in page faults than the multiply itself. Same values either way. Digital silence
    (peak below ``SILENCE_PEAK``) is returned unscaled (a copy unless ``in_place``), so there is
    never a division by zero.
    """
    reuse = in_place and wave.dtype == np.float32 and wave.flags.writeable
    if wave.size == 0:
        return wave if reuse else wave.astype(np.float32, copy=True)
    peak = float(max(wave.max(), -wave.min()))
    if not math.isfinite(peak):
        raise ValueError("waveform contains NaN or infinite samples")
    if peak < SILENCE_PEAK:
        return wave if reuse else wave.astype(np.float32, copy=True)
    gain = np.float32(min(target / peak, 10.0 ** (max_gain_db / 20.0)))
    if reuse:
        return np.multiply(wave, gain, out=wave)
    return np.multiply(wave, gain, dtype=np.float32)


def load_16k_mono(path: str | os.PathLike[str]) -> np.ndarray:
    """Decode ``path`` and return peak-normalised mono float32 ``(N,)`` at 16 kHz."""
    wave, sample_rate = load_16k_mono_with_rate(path)
    return wave


def load_16k_mono_with_rate(path: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
    """Like ``load_16k_mono`` but also returns the file's original sample rate."""
    audio, sample_rate = decode(path)
    wave = resample_to_16k(to_mono(audio), sample_rate)
    return normalise_peak(wave), sample_rate
