"""The per-utterance feature pipeline and the shard builder (no Dagster imports).

Per utterance: decode -> mono -> 16 kHz -> peak normalisation -> VAD span -> trim -> features ->
one ``FeatureRecord`` or a ``RejectRow`` (stage ``vad``; ``features`` for non-finite features). A
shard holds one speaker's sorted records.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import traceback
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from queue import SimpleQueue

import numpy as np
import torch

from speech_assets.corpus.rejects import RejectRow, write_rejects
from speech_assets.features import audio
from speech_assets.features.cmvn import PartialSums, ShardStats
from speech_assets.features.featurize import FeatureExtractor
from speech_assets.features.jobs import ShardJob, ShardOutcome, UtteranceInput, check_speed_factors
from speech_assets.features.shards import (
    FEATURE_DIMS,
    FEATURE_DTYPES,
    SHARD_FORMAT,
    FeatureRecord,
    num_frames_for,
    write_shard,
)
from speech_assets.features.vad import NoSpeech, VadConfig, detect_speech
from speech_assets.layout import sidecar_paths
from speech_assets.runtime.heap import frozen_heap, scratch
from speech_assets.runtime.locks import exclusive_lock


@dataclass
class ShardResult:
    """What ``build_shard`` wrote and measured."""

    path: Path
    records: int
    rejects: list[RejectRow]
    stats: ShardStats
    audio_seconds: float
    trimmed_seconds: float
    frames: int = 0


def speed_perturbed_id(utt_id: str, factor: float) -> str:
    """``<utt_id>-sp0_9`` for factor 0.9 (letters, digits, ``_`` and ``-`` only, like every id)."""
    return f"{utt_id}-sp{format(factor, 'g').replace('.', '_')}"


def process_variants(
    utt: UtteranceInput,
    vad_cfg: VadConfig,
    extractor: FeatureExtractor,
    speed_factors: Sequence[float] = (),
    *,
    dtype: np.dtype | type = np.float32,
) -> list[FeatureRecord | RejectRow]:
    """The utterance decoded once, then itself and one speed-perturbed copy per factor (pitch and
    tempo together, as Kaldi's), each VAD-trimmed and featurised on its own audio so that its frames
    match it. ``dtype``: the records' matrices (float16 as a format-2 shard stores them)."""
    path, utt_id = utt.path, utt.utt_id
    try:
        decoded, sample_rate = audio.decode(path)
    except audio.DecodeError as exc:
        return [RejectRow(utt_id, os.fspath(path), "vad", "unreadable", str(exc))]
    duration_s = decoded.shape[1] / sample_rate
    try:
        # In place: ``decoded`` (or its mono mix / resampled copy) is this call's own buffer.
        wave = audio.to_16k_mono(decoded, sample_rate, in_place=True)
    except ValueError as exc:  # NaN / inf samples
        return [RejectRow(utt_id, os.fspath(path), "vad", "unreadable", f"{os.fspath(path)}: {exc}")]

    def featurise(wave: np.ndarray, duration_s: float, variant_id: str) -> FeatureRecord | RejectRow:
        span = detect_speech(wave, vad_cfg, peak_normalised=True)
        if isinstance(span, NoSpeech):
            return RejectRow(variant_id, os.fspath(path), "vad", "no_speech", span.detail)
        num_frames = num_frames_for(span.num_samples)
        if num_frames == 0:
            detail = f"speech span {span.duration_s:.3f} s is shorter than one 25 ms feature frame"
            return RejectRow(variant_id, os.fspath(path), "vad", "no_speech", detail)
        logmel, mfcc = extractor(wave[span.start_sample : span.end_sample], dtype)
        return FeatureRecord(
            utt_id=variant_id,
            speaker_id=utt.speaker_id,
            chapter_id=utt.chapter_id,
            num_frames=num_frames,
            duration_s=duration_s,
            speech_start_s=span.start_s,
            speech_end_s=span.end_s,
            trimmed_duration_s=span.duration_s,
            speech_ratio=span.speech_ratio,
            logmel=logmel,
            mfcc=mfcc,
        )

    results = [featurise(wave, duration_s, utt_id)]
    if speed_factors and isinstance(results[0], FeatureRecord):
        import torchaudio.functional as AF

        for factor in check_speed_factors(speed_factors):
            faster, _ = AF.speed(torch.from_numpy(wave), audio.TARGET_SAMPLE_RATE, factor)
            normalised = audio.normalise_peak(faster.numpy(), in_place=True)
            results.append(featurise(normalised, duration_s / factor, speed_perturbed_id(utt_id, factor)))
    return results


def stored_partial_sums(frames: np.ndarray) -> PartialSums:
    """``PartialSums.of(frames)`` bit for bit, with less CPU.

    torch makes the float64 copy into a reused buffer (numpy's float16 conversion is emulated and
    slow); einsums add the frames in order, as ``sum(axis=0)`` does, but faster. A NaN or inf makes
    its column's sum non-finite, so a caller checks the ``D`` sums instead of the ``T x D`` values.
    """
    frames = np.asarray(frames)
    if frames.ndim == 2 and frames.dtype in (np.float16, np.float32) and frames.flags.writeable:
        as64 = torch.from_numpy(scratch("float64", np.float64, frames.size)).view(frames.shape)
        values = as64.copy_(torch.from_numpy(np.ascontiguousarray(frames))).numpy()
    else:  # read-only (torch.from_numpy would warn) or other dtypes: plain numpy
        values = np.asarray(frames, dtype=np.float64)
    return PartialSums(int(frames.shape[0]), np.einsum("td->d", values), np.einsum("td,td->d", values, values))


def build_shard(
    utterances: Sequence[UtteranceInput],
    out_path: str | os.PathLike[str],
    vad_cfg: VadConfig = VadConfig(),
    extractor: FeatureExtractor | None = None,
    speed_factors: Sequence[float] = (),
) -> ShardResult:
    """Featurise ``utterances`` (and their ``speed_factors`` copies) into one shard at ``out_path``,
    an empty one when every utterance is rejected; its bytes depend only on inputs and config."""
    ids = [u.utt_id for u in utterances]
    if len(set(ids)) != len(ids):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"duplicate utt_id in one shard: {duplicates[:5]}")
    extractor = extractor if extractor is not None else FeatureExtractor()
    stored = FEATURE_DTYPES[SHARD_FORMAT]  # features come out of the extractor as the shard stores them
    records: list[FeatureRecord] = []
    rejects: list[RejectRow] = []
    stats = ShardStats()
    audio_seconds = 0.0
    # The records' objects are no cyclic garbage; a full collection of a torch process's heap
    # (~200k objects, ~95 ms) every few shards is not worth it (runtime.heap).
    with frozen_heap():
        for utt in sorted(utterances, key=lambda u: u.utt_id):
            for result in process_variants(utt, vad_cfg, extractor, speed_factors, dtype=stored):
                if isinstance(result, RejectRow):
                    rejects.append(result)
                    audio_seconds += utt.duration_s if result.utt_id == utt.utt_id else 0.0
                    continue
                # CMVN describes what readers see: the stored (float16) values. Their sums also tell
                # whether every value is finite there (NaN, inf, or beyond float16's 65504).
                parts = {name: stored_partial_sums(getattr(result, name)) for name in FEATURE_DIMS}
                if not all(np.isfinite(part.sum).all() for part in parts.values()):
                    detail = f"{utt.path}: features not finite in {stored} (NaN, inf or beyond its range)"
                    rejects.append(RejectRow(result.utt_id, utt.path, "features", "unreadable", detail))
                    continue
                audio_seconds += result.duration_s
                records.append(result)
                sums = stats.speakers.setdefault(result.speaker_id, {})
                for name, part in parts.items():
                    sums[name] = sums[name] + part if name in sums else part
        records.sort(key=lambda r: r.utt_id)
        path = write_shard(out_path, records, finite_checked=True)  # every record passed the check on its sums
    stats.speakers = dict(sorted(stats.speakers.items()))
    return ShardResult(
        path=Path(path),
        records=len(records),
        rejects=rejects,
        stats=stats,
        audio_seconds=audio_seconds,
        trimmed_seconds=float(sum(r.trimmed_duration_s for r in records)),
        frames=int(sum(r.num_frames for r in records)),
    )


def write_sidecars(result: ShardResult) -> tuple[Path, Path]:
    """Write a shard's rejects and CMVN partial sums beside it."""
    rejects_path, stats_path = sidecar_paths(result.path)
    write_rejects(rejects_path, sorted(result.rejects, key=lambda r: (r.utt_id, r.reason)))
    result.stats.save(stats_path)
    return rejects_path, stats_path


def build_and_publish(job: ShardJob, vad_cfg: VadConfig, extractor: FeatureExtractor) -> ShardOutcome:
    """Build ``job``'s shard and publish it (sidecars, then meta) under the shard's lock, so a shard
    another run just built for the same inputs is reused; a crash leaves a valid meta or none."""
    with exclusive_lock(job.files.lock):
        meta = None if job.force else job.files.read_meta()
        if meta is not None and meta.get("inputs_key") == job.inputs_key:
            return ShardOutcome(job.speaker_id, meta, rebuilt=False)
        job.files.remove_temp_files()
        with job.files.publish():
            result = build_shard(job.utterances, job.files.shard, vad_cfg, extractor, job.speed_factors)
            write_sidecars(result)
        meta = job.files.write_meta(
            {
                **job.meta_extra,
                "speaker_id": job.speaker_id,
                "inputs_key": job.inputs_key,
                "utterances": result.records,
                "rejects": len(result.rejects),
                "frames": result.frames,
                "audio_seconds": result.audio_seconds,
                "trimmed_seconds": result.trimmed_seconds,
                "vad": vad_cfg.as_dict(),
                **({"speed_factors": list(job.speed_factors)} if job.speed_factors else {}),
            }
        )
        return ShardOutcome(job.speaker_id, meta, rebuilt=True)


def _publish_or_report(job: ShardJob, vad_cfg: VadConfig, extractor: FeatureExtractor | None = None) -> ShardOutcome:
    """``extractor`` None: a helper process's own."""
    try:
        return build_and_publish(job, vad_cfg, extractor or _worker_extractor())
    except Exception:  # noqa: BLE001 - one bad shard must not lose the others; reported per shard
        return ShardOutcome(job.speaker_id, None, rebuilt=False, error=traceback.format_exc(limit=8))


def _init_worker() -> None:
    from speech_assets.runtime.processes import die_with_parent, exit_without_teardown

    die_with_parent()  # a killed run leaves no feature worker behind
    exit_without_teardown()  # the pool's owner waits for its workers to exit
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # already set / parallel work already started
        torch.set_num_interop_threads(1)
    _worker_extractor()  # built before the first shard arrives


@functools.cache
def _worker_extractor() -> FeatureExtractor:
    return FeatureExtractor()


def iter_publish_shards(
    jobs: Sequence[ShardJob], vad_cfg: VadConfig = VadConfig(), workers: int | None = None
) -> Iterator[ShardOutcome]:
    """Build and publish many speakers' shards, largest first, over ``workers`` processes (this one
    included), yielding each outcome as it is published; a failed shard is an outcome with ``error``.

    Each shard is built on one torch thread, so its bytes do not depend on ``workers``. A caller
    that may stop early closes the generator (``contextlib.closing``), so the pool goes at once.
    """
    yield from publish_planned(plan_shards(jobs, default_workers() if workers is None else workers), vad_cfg)


# a helper process imports torch (~2 s): on 2 cores it lost below ~3 h of audio and won from ~5 h (docs/BENCHMARKS.md)
AUDIO_SECONDS_PER_EXTRA_WORKER = 4 * 3600.0


def worker_count(audio_seconds: float) -> int:
    """Processes for a shard job, the step's own included."""
    return max(1, min(os.cpu_count() or 1, int(audio_seconds // AUDIO_SECONDS_PER_EXTRA_WORKER) + 1))


@dataclass(frozen=True)
class ShardPlan:
    """A shard job, planned once: jobs largest first, how many need building, helper processes."""

    ordered: tuple[ShardJob, ...]
    to_build: int
    helpers: int

    def describe(self) -> str:
        where = f"this process and {self.helpers} helper process(es)" if self.helpers else "this process"
        return f"{self.to_build} shard(s) to build in {where}, {len(self.ordered) - self.to_build} unchanged"


def plan_shards(jobs: Sequence[ShardJob], workers: int | None = None) -> ShardPlan:
    """Plan ``jobs`` over ``workers`` processes (None: by the audio to build)."""
    if workers is not None and int(workers) < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    speakers = [job.speaker_id for job in jobs]
    if len(set(speakers)) != len(speakers):
        raise ValueError("one job per speaker")
    ordered = tuple(sorted(jobs, key=lambda job: (-job.audio_seconds, job.speaker_id)))
    # build_and_publish checks again under the shard's lock
    todo = [job for job in ordered if job.force or (job.files.read_meta() or {}).get("inputs_key") != job.inputs_key]
    if workers is None:
        workers = worker_count(sum(job.audio_seconds for job in todo))
    # no helper for one shard or none: it would start, import torch and find nothing
    return ShardPlan(ordered, len(todo), max(0, min(int(workers), len(todo)) - 1))


def publish_planned(plan: ShardPlan, vad_cfg: VadConfig = VadConfig()) -> Iterator[ShardOutcome]:
    """This process builds shards from the first second on while the helper processes start (a
    fresh interpreter importing torch takes seconds); each helper takes the next shard whenever
    it is free.

    A shard goes to the pool only when a task there has just ended, so the helpers never sit on a
    backlog while this process runs out of work. If the pool breaks (a helper killed), the
    helpers' shards in flight come back as errors and this process builds the rest.
    """
    helpers = plan.helpers
    pending = deque(plan.ordered)
    lock = threading.Lock()
    state = {"outstanding": 0, "stopping": False}  # helper shards handed out, not yet reported
    # A helper's finished shard, or None: a shard handed back to this process (the pool broke).
    finished: SimpleQueue[tuple[Future, ShardJob] | None] = SimpleQueue()
    pool = None
    if helpers:  # spawn: safe with torch's thread pools
        pool = ProcessPoolExecutor(max_workers=helpers, mp_context=get_context("spawn"), initializer=_init_worker)

    def hand_out(_: Future | None = None) -> None:  # in the pool's thread, when a helper is free
        with lock:
            if state["stopping"] or not pending:
                return
            job = pending.popleft()
            state["outstanding"] += 1
        try:
            future = pool.submit(_publish_or_report, job, vad_cfg)
        except Exception:  # noqa: BLE001 - the pool broke or is shutting down: this process builds it
            with lock:
                pending.appendleft(job)
                state["outstanding"] -= 1
            finished.put(None)
            return
        future.add_done_callback(lambda done, job=job: (finished.put((done, job)), hand_out()))

    def report(item: tuple[Future, ShardJob] | None) -> Iterator[ShardOutcome]:
        if item is not None:
            with lock:
                state["outstanding"] -= 1
            try:
                outcome = item[0].result()
            except Exception:  # noqa: BLE001 - the helper process itself died (e.g. OOM kill)
                outcome = ShardOutcome(item[1].speaker_id, None, False, error=traceback.format_exc(limit=4))
            yield outcome

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(helpers):  # a helper's first task ends as soon as it has started and is free
            pool.submit(os.getpid).add_done_callback(hand_out)
        extractor = FeatureExtractor()
        with frozen_heap():
            while True:
                while not finished.empty():
                    yield from report(finished.get())
                with lock:
                    job = pending.popleft() if pending else None
                    idle = job is None and state["outstanding"] == 0
                if job is not None:
                    yield _publish_or_report(job, vad_cfg, extractor)
                elif idle:
                    break
                else:  # out of work here: wait for a helper's shard (or one handed back)
                    yield from report(finished.get())
    finally:  # also when the caller stops early: the helpers' shards in flight end, no new one starts
        with lock:
            state["stopping"] = True
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(previous)


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)
