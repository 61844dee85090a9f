"""The per-utterance feature pipeline and shard builder (pure: no Dagster imports).

Per utterance: decode -> mono -> 16 kHz -> peak normalisation (``audio``) -> WebRTC VAD span
(``vad``) -> trim -> features (``FeatureExtractor``) -> one ``FeatureRecord`` or a ``VadReject``.
A shard is the sorted records of a group of utterances (one speaker in the asset graph), written
atomically by ``features.write_shard``; its CMVN partial sums and rejects come back in a
``ShardResult``.

Feature recipe (Kaldi ``compute-fbank-feats`` / ``compute-mfcc-feats`` defaults, which is what
HuBERT iteration 1 uses through ``torchaudio.compliance.kaldi.mfcc``), computed from ONE shared
power spectrum:

* framing: 25 ms window (400 samples), 10 ms hop (160), no centring (``snip_edges``):
  ``T = 1 + (N - 400) // 160``, see ``features.num_frames_for``;
* per frame: DC offset removal, pre-emphasis 0.97 (``x[0] -= 0.97 * x[0]`` as in Kaldi), Povey
  window (``hann(400, periodic=False) ** 0.85``), zero-padded to ``n_fft = 512`` (Kaldi's
  ``round_to_power_of_two``) -> 257-bin power spectrum ``|X|^2``; no dither (deterministic);
* log-mel: 80 triangular HTK-mel filters (``torchaudio.functional.melscale_fbanks``, 20 Hz -
  8 kHz, no area normalisation), ``log(energy + 1e-6)``;
* MFCC: 23 HTK-mel filters over the same spectrum and range, ``log(energy + 1e-6)``, orthonormal
  DCT-II (``torchaudio.functional.create_dct``) to 13 coefficients (c0 kept, no energy
  replacement), cepstral liftering 22; then Δ and ΔΔ exactly as
  ``torchaudio.functional.compute_deltas`` (window 5, replicate padding; re-implemented as shifted
  differences, tested equal) -> ``(T, 39)`` = ``[c, Δc, ΔΔc]``.

The waveform fed to it is float in ``[-1, 1]`` (peak-normalised), not Kaldi's int16 scale, so
absolute log energies differ from Kaldi's by a constant ``2 * log(32768)``; CMVN removes it.
Tests check log-mel against ``torchaudio.compliance.kaldi.fbank`` and MFCC against
``torchaudio.compliance.kaldi.mfcc``.

Speed (see ``bench/features.py``): windowed frames are written straight into a zero-padded
``(T, 512)`` scratch buffer (``rfft(n=512)`` on 400-wide rows pads internally and is ~7x
slower), both filterbanks are applied in one sparse product, and scratch buffers are reused.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torchaudio.functional as AF

from speech_assets import audio
from speech_assets.cmvn import PartialSums, ShardStats
from speech_assets.corpus.manifest import REJECTS_SCHEMA
from speech_assets.features import (
    HOP_LENGTH,
    MFCC_DIM,
    N_MELS,
    N_MFCC,
    SAMPLE_RATE,
    WIN_LENGTH,
    FeatureRecord,
    num_frames_for,
    write_shard,
)
from speech_assets.utils import atomic_path
from speech_assets.vad import NoSpeech, VadConfig, detect_speech

LOG_FLOOR = 1e-6
PREEMPHASIS = 0.97
MFCC_MELS = 23
CEPSTRAL_LIFTER = 22.0
F_MIN = 20.0



def povey_window(length: int = WIN_LENGTH) -> torch.Tensor:
    """Kaldi's Povey window: a symmetric Hann window raised to 0.85."""
    return torch.hann_window(length, periodic=False, dtype=torch.float64).pow(0.85).to(torch.float32)


class FeatureExtractor:
    """Log-mel 80 and MFCC 39 from 16 kHz mono float32 audio (torch CPU; build once per worker).

    Thread count is the caller's business (``torch.set_num_threads``); the parallel shard builder
    sets 1 per worker process. Output is deterministic for a given input and thread count.
    """

    def __init__(
        self,
        n_fft: int = 512,
        window: str = "povey",
        preemphasis: float = PREEMPHASIS,
        remove_dc_offset: bool = True,
        mfcc_mels: int = MFCC_MELS,
        cepstral_lifter: float = CEPSTRAL_LIFTER,
        log_floor: float = LOG_FLOOR,
        f_min: float = F_MIN,
        f_max: float = SAMPLE_RATE / 2,
    ) -> None:
        if n_fft < WIN_LENGTH:
            raise ValueError(f"n_fft must be >= the {WIN_LENGTH}-sample window, got {n_fft}")
        if window == "povey":
            win = povey_window()
        elif window == "hann":
            win = torch.hann_window(WIN_LENGTH, periodic=False)
        elif window == "hamming":
            win = torch.hamming_window(WIN_LENGTH, periodic=False)
        else:
            raise ValueError(f"unknown window {window!r} (povey, hann, hamming)")
        self.n_fft = n_fft
        self.window_name = window
        self.window = win.contiguous()
        self._window0 = float(win[0])
        self._scratch: dict[str, torch.Tensor] = {}
        self.preemphasis = float(preemphasis)
        self.remove_dc_offset = remove_dc_offset
        self.mfcc_mels = mfcc_mels
        self.cepstral_lifter = cepstral_lifter
        self.log_floor = float(log_floor)
        n_freqs = n_fft // 2 + 1
        logmel_fb = AF.melscale_fbanks(n_freqs, f_min, f_max, N_MELS, SAMPLE_RATE, norm=None, mel_scale="htk")
        mfcc_fb = AF.melscale_fbanks(n_freqs, f_min, f_max, mfcc_mels, SAMPLE_RATE, norm=None, mel_scale="htk")
        # One matmul produces both filterbanks: (F, 80 + mfcc_mels).
        self.fbanks = torch.cat([logmel_fb, mfcc_fb], dim=1).contiguous()
        self._fbanks_t = self.fbanks.T.contiguous().to_sparse().coalesce()
        dct = AF.create_dct(N_MFCC, mfcc_mels, norm="ortho")  # (mfcc_mels, 13)
        if cepstral_lifter:
            n = torch.arange(N_MFCC, dtype=torch.float64)
            lifter = 1.0 + 0.5 * cepstral_lifter * torch.sin(math.pi * n / cepstral_lifter)
            dct = (dct.double() * lifter).float()
        self.dct = dct.contiguous()
        self._dct_t = dct.T.contiguous()

    def describe(self) -> dict[str, Any]:
        """The recipe as plain data (for config hashes and metadata)."""
        return {
            "sample_rate": SAMPLE_RATE,
            "win_length": WIN_LENGTH,
            "hop_length": HOP_LENGTH,
            "n_fft": self.n_fft,
            "window": self.window_name,
            "preemphasis": self.preemphasis,
            "remove_dc_offset": self.remove_dc_offset,
            "n_mels": N_MELS,
            "mfcc_mels": self.mfcc_mels,
            "n_mfcc": N_MFCC,
            "cepstral_lifter": self.cepstral_lifter,
            "log_floor": self.log_floor,
            "deltas": "compute_deltas(win_length=5, replicate) == torchaudio.functional.compute_deltas",
        }

    @torch.inference_mode()
    def power_spectrum(self, x: torch.Tensor) -> torch.Tensor:
        """16 kHz mono ``(N,)`` (N >= 400) -> ``(T, n_fft // 2 + 1)`` power spectrum.

        The result is a view of a scratch buffer that the next call overwrites (the extractor
        is therefore not thread-safe; build one per worker).

        Equivalent to Kaldi's per-frame DC removal -> pre-emphasis -> window -> zero-padded FFT,
        but computed without per-frame copies: pre-emphasis runs once over the whole signal and
        the frame-local corrections are folded in, using ``y[n] = z[n] - (1 - p) * mean`` for
        ``n >= 1`` and ``y[0] = (1 - p) * (x[0] - mean)`` (``z``: signal-level pre-emphasis). The
        windowed frames are written straight into a zero-padded ``(T, n_fft)`` buffer: asking
        ``torch.fft.rfft`` to pad (``n=512`` on 400-wide rows) is ~7x slower than this.
        """
        num_frames = num_frames_for(int(x.shape[0]))
        frames = x.unfold(0, WIN_LENGTH, HOP_LENGTH)  # (T, 400) strided view, no copy
        p = self.preemphasis
        if p:
            z = torch.empty_like(x)
            torch.sub(x[1:], x[:-1], alpha=p, out=z[1:])
            z[:1] = x[:1]
        else:
            z = x
        buffer = self._workspace("frames", num_frames, self.n_fft)  # pad columns stay zero
        body = buffer[:, :WIN_LENGTH]
        torch.mul(z.unfold(0, WIN_LENGTH, HOP_LENGTH), self.window, out=body)
        mean = frames.mean(dim=1) if self.remove_dc_offset else None
        if mean is not None:
            body.addr_(mean, self.window, alpha=-(1.0 - p))
        if self._window0 != 0.0:
            first = frames[:, 0] - mean if mean is not None else frames[:, 0]
            torch.mul(first, self._window0 * (1.0 - p), out=body[:, 0])
        else:
            body[:, 0] = 0.0
        n_freqs = self.n_fft // 2 + 1
        spectrum = self._workspace("spectrum", num_frames, 2 * n_freqs)  # interleaved re, im
        torch.fft.rfft(buffer, out=spectrum.view(torch.complex64))
        spectrum.square_()
        power = self._workspace("power", num_frames, n_freqs)
        return torch.add(spectrum[:, 0::2], spectrum[:, 1::2], out=power)

    def _workspace(self, name: str, rows: int, cols: int) -> torch.Tensor:
        """A reusable zero-initialised ``(rows, cols)`` float32 scratch buffer (grows on demand).

        Reusing buffers avoids page-faulting fresh multi-MB allocations for every utterance;
        only ever-written columns change, so untouched columns (the FFT zero padding) stay zero.
        """
        flat = self._scratch.get(name)
        if flat is None or flat.shape[0] < rows or flat.shape[1] != cols:
            flat = torch.zeros(max(rows, 1024), cols, dtype=torch.float32)
            self._scratch[name] = flat
        return flat[:rows]

    def __call__(self, wave: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """16 kHz mono ``(N,)`` -> (log-mel ``(T, 80)``, MFCC+Δ+ΔΔ ``(T, 39)``), float32 numpy."""
        if isinstance(wave, np.ndarray):
            x = torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))
        else:
            x = wave.detach().to(torch.float32).contiguous()
        if x.ndim != 1:
            raise ValueError(f"expected mono (N,) audio, got shape {tuple(x.shape)}")
        num_frames = num_frames_for(int(x.shape[0]))
        if num_frames == 0:
            return np.zeros((0, N_MELS), np.float32), np.zeros((0, MFCC_DIM), np.float32)
        with torch.inference_mode():
            power_t = self.power_spectrum(x).T.contiguous()  # (F, T)
            # Both filterbanks in one sparse product: each triangular filter touches a handful of
            # bins (~1k non-zeros of 26k), so COO sparse @ dense is ~5x faster than a dense matmul.
            mel = torch.sparse.mm(self._fbanks_t, power_t)  # (80 + mfcc_mels, T)
            mel.add_(self.log_floor).log_()
            logmel = mel[:N_MELS].T.contiguous()
            cepstra = torch.matmul(self._dct_t, mel[N_MELS:])  # (13, T)
            delta = compute_deltas(cepstra)
            delta2 = compute_deltas(delta)
            mfcc = torch.cat([cepstra, delta, delta2], dim=0).T.contiguous()
        return logmel.numpy(), mfcc.numpy()


def compute_deltas(specgram: torch.Tensor, win_length: int = 5) -> torch.Tensor:
    """``torchaudio.functional.compute_deltas(specgram, win_length, mode="replicate")`` for ``(D, T)``.

    Same formula, ``d_t = sum_{n=1..N} n (c_{t+n} - c_{t-n}) / (2 sum n^2)`` with edge replication,
    written as shifted differences instead of a grouped ``conv1d``: ~20x less overhead per call.
    Matches torchaudio to float rounding (tested).
    """
    if win_length < 3:
        raise ValueError(f"Window length should be greater than or equal to 3. Found win_length {win_length}")
    n = (win_length - 1) // 2
    frames = specgram.shape[-1]
    lead = specgram.shape[:-1]
    padded = torch.cat([specgram[..., :1].expand(*lead, n), specgram, specgram[..., -1:].expand(*lead, n)], dim=-1)
    out = torch.zeros_like(specgram)
    for k in range(1, n + 1):
        out.add_(padded[..., n + k : n + k + frames] - padded[..., n - k : n - k + frames], alpha=k)
    return out.div_(n * (n + 1) * (2 * n + 1) / 3)


@dataclass(frozen=True)
class UtteranceInput:
    """One manifest row as the shard builder needs it (``path`` absolute)."""

    utt_id: str
    speaker_id: str
    chapter_id: str
    path: str
    duration_s: float = 0.0


@dataclass(frozen=True)
class VadReject:
    """An utterance dropped at the feature stage (``no_speech``, or ``unreadable`` if decoding fails)."""

    utt_id: str
    path: str
    detail: str
    reason: str = "no_speech"
    stage: str = "vad"

    def as_row(self) -> dict[str, str]:
        return {
            "utt_id": self.utt_id,
            "path": self.path,
            "stage": self.stage,
            "reason": self.reason,
            "detail": self.detail,
        }


@dataclass
class ShardResult:
    """What ``build_shard`` wrote and measured. ``rejects`` rows: utt_id, path, stage, reason, detail."""

    path: Path
    records: int
    rejects: list[dict[str, str]]
    stats: ShardStats
    audio_seconds: float
    trimmed_seconds: float
    frames: int = 0
    wall_seconds: float = 0.0


def process_utterance(
    path: str | os.PathLike[str],
    utt_id: str,
    speaker_id: str,
    chapter_id: str,
    vad_cfg: VadConfig,
    extractor: FeatureExtractor,
) -> FeatureRecord | VadReject:
    """Decode, VAD-trim and featurise one utterance."""
    try:
        decoded, sample_rate = audio.decode(path)
    except audio.DecodeError as exc:
        return VadReject(utt_id, os.fspath(path), str(exc), reason="unreadable")
    duration_s = decoded.shape[1] / sample_rate
    try:
        wave = audio.normalise_peak(audio.resample_to_16k(audio.to_mono(decoded), sample_rate))
    except ValueError as exc:  # NaN / inf samples
        return VadReject(utt_id, os.fspath(path), f"{os.fspath(path)}: {exc}", reason="unreadable")
    span = detect_speech(wave, vad_cfg)
    if isinstance(span, NoSpeech):
        return VadReject(utt_id, os.fspath(path), span.detail)
    num_frames = num_frames_for(span.num_samples)
    if num_frames == 0:
        return VadReject(
            utt_id, os.fspath(path), f"speech span {span.duration_s:.3f} s is shorter than one 25 ms feature frame"
        )
    logmel, mfcc = extractor(wave[span.start_sample : span.end_sample])
    return FeatureRecord(
        utt_id=utt_id,
        speaker_id=speaker_id,
        chapter_id=chapter_id,
        num_frames=num_frames,
        duration_s=duration_s,
        speech_start_s=span.start_s,
        speech_end_s=span.end_s,
        trimmed_duration_s=span.duration_s,
        speech_ratio=span.speech_ratio,
        logmel=logmel,
        mfcc=mfcc,
    )


def _partial_sums(frames: np.ndarray) -> PartialSums:
    """Same numbers as ``PartialSums.of`` (float64 accumulation) without a float64 copy of ``frames``."""
    return PartialSums(
        int(frames.shape[0]),
        frames.sum(axis=0, dtype=np.float64),
        np.einsum("td,td->d", frames, frames, dtype=np.float64),
    )


def build_shard(
    utterances: Sequence[UtteranceInput],
    out_path: str | os.PathLike[str],
    vad_cfg: VadConfig = VadConfig(),
    extractor: FeatureExtractor | None = None,
) -> ShardResult:
    """Featurise ``utterances`` and write one shard atomically at ``out_path``.

    Always writes a shard, an empty one (schema only) when every utterance is rejected, so each
    partition is materialised the same way. Output bytes depend only on inputs and config.
    """
    started = time.perf_counter()
    ids = [u.utt_id for u in utterances]
    if len(set(ids)) != len(ids):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"duplicate utt_id in one shard: {duplicates[:5]}")
    extractor = extractor if extractor is not None else FeatureExtractor()
    records: list[FeatureRecord] = []
    rejects: list[dict[str, str]] = []
    sums: dict[tuple[str, str], PartialSums] = {}
    audio_seconds = 0.0
    for utt in sorted(utterances, key=lambda u: u.utt_id):
        result = process_utterance(utt.path, utt.utt_id, utt.speaker_id, utt.chapter_id, vad_cfg, extractor)
        if isinstance(result, VadReject):
            rejects.append(result.as_row())
            audio_seconds += utt.duration_s
            continue
        audio_seconds += result.duration_s
        records.append(result)
        for name in ("logmel", "mfcc"):
            part = _partial_sums(getattr(result, name))
            key = (result.speaker_id, name)
            sums[key] = sums[key] + part if key in sums else part
    path = write_shard(out_path, records)
    stats = ShardStats()
    for (speaker, name), part in sorted(sums.items()):
        stats.speakers.setdefault(speaker, {})[name] = part
    return ShardResult(
        path=Path(path),
        records=len(records),
        rejects=rejects,
        stats=stats,
        audio_seconds=audio_seconds,
        trimmed_seconds=float(sum(r.trimmed_duration_s for r in records)),
        frames=int(sum(r.num_frames for r in records)),
        wall_seconds=time.perf_counter() - started,
    )


def sidecar_paths(shard_path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``<dir>/<stem>.rejects.parquet`` and ``<dir>/<stem>.stats.npz`` beside ``<dir>/<stem>.parquet``."""
    shard_path = Path(shard_path)
    stem = shard_path.name.removesuffix(".parquet")
    return shard_path.with_name(f"{stem}.rejects.parquet"), shard_path.with_name(f"{stem}.stats.npz")


def write_rejects(path: str | os.PathLike[str], rejects: Sequence[Mapping[str, str]]) -> Path:
    """Write reject rows (sorted by utt_id) atomically as Parquet with ``REJECTS_SCHEMA``."""
    rows = sorted(rejects, key=lambda r: (r["utt_id"], r["reason"]))
    columns = {f.name: [str(r[f.name]) for r in rows] for f in REJECTS_SCHEMA}
    table = pa.Table.from_pydict(columns, schema=REJECTS_SCHEMA)
    path = Path(path)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return path


def write_sidecars(result: ShardResult) -> tuple[Path, Path]:
    """Write a shard's rejects and CMVN partial sums beside it (see ``sidecar_paths``)."""
    rejects_path, stats_path = sidecar_paths(result.path)
    write_rejects(rejects_path, result.rejects)
    result.stats.save(stats_path)
    return rejects_path, stats_path


# --- parallel shards -------------------------------------------------------------------------

_WORKER_EXTRACTOR: FeatureExtractor | None = None


def _init_worker() -> None:
    """Process-pool initializer: one torch thread per worker, one extractor per worker."""
    global _WORKER_EXTRACTOR
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set / parallel work already started
        pass
    _WORKER_EXTRACTOR = FeatureExtractor()


def _run_job(
    key: Hashable, utterances: Sequence[UtteranceInput], out_path: str, vad_cfg: VadConfig
) -> tuple[Hashable, ShardResult]:
    global _WORKER_EXTRACTOR
    if _WORKER_EXTRACTOR is None:
        _WORKER_EXTRACTOR = FeatureExtractor()
    return key, build_shard(utterances, out_path, vad_cfg, _WORKER_EXTRACTOR)


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def make_pool(workers: int | None = None) -> ProcessPoolExecutor:
    """A process pool for ``build_shards_parallel``: ``spawn`` context (safe with torch's thread
    pools), one torch thread and one ``FeatureExtractor`` per worker. Reuse it across calls to
    pay the worker start-up (a fresh interpreter importing torch: seconds) once."""
    workers = default_workers() if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), initializer=_init_worker)


def build_shards_parallel(
    jobs: Sequence[tuple[Hashable, Sequence[UtteranceInput], str | os.PathLike[str]]],
    vad_cfg: VadConfig = VadConfig(),
    workers: int | None = None,
    executor: Executor | None = None,
) -> dict[Hashable, ShardResult]:
    """Build many shards, largest (by total ``duration_s``) first, over ``workers`` processes.

    ``jobs`` are ``(key, utterances, out_path)``; returns ``{key: ShardResult}`` in ``jobs`` order.
    ``workers=None`` uses every core this process may run on; ``workers=1`` runs in-process with
    torch limited to one thread for the duration (same bytes as the pool). Otherwise a
    ``make_pool(workers)`` pool is started and shut down, unless ``executor`` (e.g. a reused
    ``make_pool``) is given. A shard that raises fails the call (after the others finish).
    """
    workers = default_workers() if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    keys = [key for key, _, _ in jobs]
    if len(set(keys)) != len(keys):
        raise ValueError("shard keys must be unique")
    ordered = sorted(jobs, key=lambda job: (-sum(u.duration_s for u in job[1]), str(job[0])))
    results: dict[Hashable, ShardResult] = {}
    if executor is None and (workers == 1 or len(ordered) <= 1):
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            extractor = FeatureExtractor()
            for key, utterances, out_path in ordered:
                results[key] = build_shard(utterances, out_path, vad_cfg, extractor)
        finally:
            torch.set_num_threads(previous)
        return {key: results[key] for key in keys}
    pool = executor if executor is not None else make_pool(min(workers, len(ordered)))
    try:
        futures = [pool.submit(_run_job, key, list(utts), os.fspath(out), vad_cfg) for key, utts, out in ordered]
        errors = []
        for future in as_completed(futures):
            try:
                key, result = future.result()
            except Exception as exc:  # noqa: BLE001 - re-raised below with the others' results kept
                errors.append(exc)
                continue
            results[key] = result
        if errors:
            raise errors[0]
    finally:
        if executor is None:
            pool.shutdown()
    return {key: results[key] for key in keys}
