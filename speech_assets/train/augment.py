"""Online augmentation of the shards' 100 Hz log-mel (frames and targets unchanged): additive noise
at an SNR, and SpecAugment. Off by default (HuBERT uses neither). Every draw comes from
:func:`utterance_rng` of ``(seed, epoch, utt_id)``, so an epoch replays exactly after a resume.

Noise is mixed in the mel power domain (in expectation the mel power of speech plus independent
noise is the sum of theirs), so no waveform is decoded again. Babble takes other utterances of the
*same client*: no audio crosses clients.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

NOISE_KINDS = ("", "coloured", "babble")  # or a folder of noise audio
BABBLE_TALKERS = 3
COLOUR_EXPONENTS = (0.0, 1.0, 2.0)  # white, pink, brown
HOP = 160  # samples per 100 Hz frame at 16 kHz
WINDOW = 400
NOISE_SUFFIXES = (".flac", ".wav")
MAX_NOISE_FILES = 10_000  # MUSAN's noise/ has 930
MAX_NOISE_ENTRIES = 100_000  # files and folders looked at while listing (a folder like / is refused)
MAX_NOISE_FILE_BYTES = 512 * 2**20
MAX_NOISE_BYTES = 16 * 2**30
NOISE_CACHE_BYTES = 256 * 2**20  # featurised noise kept per process (~2 h of log-mel)


def noise_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The ``.flac``/``.wav`` files under ``folder``, sorted (symbolic links not followed); ``ValueError``
    if there are none, or more files, bytes or entries than the limits above allow."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"noise folder {root} does not exist")
    found: list[Path] = []
    total = entries = 0
    for directory, folders, names in os.walk(root):
        folders.sort()
        entries += len(folders) + len(names)
        if entries > MAX_NOISE_ENTRIES:
            raise ValueError(
                f"noise folder {root} holds more than {MAX_NOISE_ENTRIES} files and folders: name a folder of "
                f"noise audio"
            )
        for name in names:
            path = Path(directory) / name
            if path.suffix.lower() not in NOISE_SUFFIXES:
                continue
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode):
                continue
            if info.st_size > MAX_NOISE_FILE_BYTES:
                raise ValueError(f"noise file {path} has {info.st_size} bytes (at most {MAX_NOISE_FILE_BYTES})")
            found.append(path)
            total += info.st_size
            if len(found) > MAX_NOISE_FILES or total > MAX_NOISE_BYTES:
                raise ValueError(
                    f"noise folder {root} holds more than {MAX_NOISE_FILES} audio files or {MAX_NOISE_BYTES} bytes"
                )
    if not found:
        raise ValueError(f"no .flac or .wav noise under {root}")
    return sorted(found)


@dataclass(frozen=True)
class Augmentation:
    """What training adds to each utterance; the defaults add nothing.

    ``noise``: ``""`` (none), ``"coloured"``, ``"babble"`` or a folder of noise audio; applied
    to ``noise_prob`` of the utterances at an SNR drawn uniformly from ``snr_db``.
    ``specaugment``: ``freq_masks`` frequency masks of up to ``freq_mask_width`` mel bins and
    ``time_masks`` time masks of up to ``time_mask_width`` frames (at most ``time_mask_ratio`` of
    the utterance each), set to 0, the CMVN mean (SpecAugment's LD policy has 2 + 2, F = 27).
    """

    noise: str = ""
    noise_prob: float = 0.5
    snr_db: tuple[float, float] = (5.0, 20.0)
    specaugment: bool = False
    freq_masks: int = 2
    freq_mask_width: int = 27
    time_masks: int = 2
    time_mask_width: int = 40
    time_mask_ratio: float = 0.2

    def __post_init__(self) -> None:
        low, high = self.snr_db
        if low > high:
            raise ValueError(f"snr_db must be (low, high), got {self.snr_db}")
        if not 0.0 <= self.noise_prob <= 1.0 or not 0.0 < self.time_mask_ratio <= 1.0:
            raise ValueError("noise_prob must be in [0, 1] and time_mask_ratio in (0, 1]")
        if min(self.freq_masks, self.freq_mask_width, self.time_masks, self.time_mask_width) < 0:
            raise ValueError("mask counts and widths must be >= 0")
        if self.noise not in NOISE_KINDS and not Path(self.noise).is_dir():
            raise ValueError(f"noise must be one of {NOISE_KINDS[1:]} or a folder of noise audio, got {self.noise!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.noise) or self.specaugment

    def describe(self) -> str:
        parts = []
        if self.noise:
            parts.append(f"noise={self.noise} p={self.noise_prob} snr={self.snr_db[0]:g}..{self.snr_db[1]:g} dB")
        if self.specaugment:
            parts.append(
                f"specaugment {self.freq_masks}x F{self.freq_mask_width} + {self.time_masks}x T{self.time_mask_width}"
            )
        return ", ".join(parts) or "none"


def utterance_rng(seed: int, epoch: int, utt_id: str, purpose: str) -> np.random.Generator:
    """The generator of one utterance's ``purpose`` ("noise", "specaugment") in one epoch."""
    digest = hashlib.sha256(f"{seed}\0{epoch}\0{utt_id}\0{purpose}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def mix_at_snr(logmel: np.ndarray, noise_logmel: np.ndarray, snr_db: float) -> np.ndarray:
    """``log(exp(logmel) + g * exp(noise_logmel))`` with ``g`` such that the mean mel power of
    speech over that of the scaled noise is ``snr_db``. Both ``(T, 80)``; float32 out."""
    if logmel.shape != noise_logmel.shape:
        raise ValueError(f"speech {logmel.shape} and noise {noise_logmel.shape} differ")
    speech = np.exp(logmel.astype(np.float64))
    noise = np.exp(noise_logmel.astype(np.float64))
    gain = speech.mean() / (noise.mean() * 10.0 ** (snr_db / 10.0))
    return np.log(speech + gain * noise).astype(np.float32)


def coloured_noise(samples: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """``(samples,)`` Gaussian noise whose power spectrum falls as ``f ** -exponent``, peak 0.5."""
    spectrum = np.fft.rfft(rng.standard_normal(samples))
    frequency = np.fft.rfftfreq(samples)
    frequency[0] = frequency[1]
    spectrum *= frequency ** (-exponent / 2.0)
    wave = np.fft.irfft(spectrum, n=samples)
    return (0.5 * wave / max(np.abs(wave).max(), 1e-12)).astype(np.float32)


def crop(features: np.ndarray, frames: int, rng: np.random.Generator) -> np.ndarray:
    """``frames`` consecutive rows of ``features`` at a random start, tiled when it is shorter."""
    if features.shape[0] < frames:
        features = np.tile(features, (-(-frames // features.shape[0]), 1))
    start = int(rng.integers(0, features.shape[0] - frames + 1))
    return features[start : start + frames]


class Augmenter:
    """Applies an :class:`Augmentation` to one utterance's log-mel; ``babble_source(utt_id, rng, count)``
    gives up to ``count`` log-mel matrices of other utterances of the same client."""

    def __init__(self, options: Augmentation, seed: int = 0) -> None:
        self.options = options
        self.seed = seed
        self._cache: OrderedDict[Path, np.ndarray] = OrderedDict()

    def noise(
        self,
        logmel: np.ndarray,
        utt_id: str,
        epoch: int,
        babble_source: Callable[[str, np.random.Generator, int], Sequence[np.ndarray]] | None = None,
    ) -> np.ndarray:
        """Raw (pre-CMVN) log-mel ``(T, 80)`` with noise mixed in, or unchanged (this utterance
        and epoch drew no noise, or noise is off)."""
        options = self.options
        if not options.noise or logmel.shape[0] == 0:
            return logmel
        rng = utterance_rng(self.seed, epoch, utt_id, "noise")
        if rng.random() >= options.noise_prob:
            return logmel
        snr = float(rng.uniform(*options.snr_db))
        frames = logmel.shape[0]
        if options.noise == "coloured":
            exponent = COLOUR_EXPONENTS[int(rng.integers(len(COLOUR_EXPONENTS)))]
            noise = self.extractor(coloured_noise(frames * HOP + WINDOW, exponent, rng))[0][:frames]
        elif options.noise == "babble":
            talkers = list(babble_source(utt_id, rng, BABBLE_TALKERS)) if babble_source else []
            if not talkers:
                return logmel  # a client of one utterance has nobody to babble
            power = sum(np.exp(crop(t, frames, rng).astype(np.float64)) for t in talkers)
            noise = np.log(power).astype(np.float32)
        else:
            noise = crop(self._noise_features(self.files[int(rng.integers(len(self.files)))]), frames, rng)
        return mix_at_snr(logmel, noise, snr)

    def specaugment(self, feats: torch.Tensor, utt_id: str, epoch: int) -> torch.Tensor:
        """Frequency and time masks on CMVN-normalised ``feats (T, 80)`` (a new tensor), with
        torchaudio's ``mask_along_axis`` under a torch RNG seeded from the utterance's generator."""
        import torchaudio.functional as AF

        options = self.options
        if not options.specaugment or feats.shape[0] == 0:
            return feats
        rng = utterance_rng(self.seed, epoch, utt_id, "specaugment")
        spectrogram = feats.T.unsqueeze(0).clone()  # (1, 80, T): torchaudio's (channel, freq, time)
        time_width = min(options.time_mask_width, int(options.time_mask_ratio * feats.shape[0]))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(rng.integers(0, 2**63 - 1)))
            for _ in range(options.freq_masks if options.freq_mask_width else 0):
                spectrogram = AF.mask_along_axis(spectrogram, options.freq_mask_width, 0.0, axis=1)
            for _ in range(options.time_masks if time_width else 0):
                spectrogram = AF.mask_along_axis(spectrogram, time_width, 0.0, axis=2)
        return spectrogram.squeeze(0).T.contiguous()

    @functools.cached_property
    def extractor(self) -> Any:
        from speech_assets.features.featurize import FeatureExtractor

        return FeatureExtractor()

    @functools.cached_property
    def files(self) -> list[Path]:
        return noise_files(self.options.noise)

    def _noise_features(self, path: Path) -> np.ndarray:
        """Log-mel of one noise file: featurised when first drawn, kept while the cache has room."""
        features = self._cache.get(path)
        if features is not None:
            self._cache.move_to_end(path)
            return features
        from speech_assets.features.audio import load_16k_mono

        try:
            wave = load_16k_mono(str(path))
        except Exception as error:
            raise ValueError(f"noise file {path} cannot be decoded: {error}") from error
        if len(wave) == 0:
            raise ValueError(f"noise file {path} holds no audio")
        if len(wave) < WINDOW:
            wave = np.resize(wave, WINDOW)  # tiled up to one analysis window
        features = self.extractor(wave)[0]
        self._cache[path] = features
        while sum(f.nbytes for f in self._cache.values()) > NOISE_CACHE_BYTES and len(self._cache) > 1:
            self._cache.popitem(last=False)
        return features

    def __getstate__(self) -> dict[str, object]:
        # DataLoader workers featurise the noise they draw themselves instead of receiving it pickled
        return {key: value for key, value in self.__dict__.items() if key != "extractor"} | {"_cache": OrderedDict()}
