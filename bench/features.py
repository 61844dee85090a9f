"""Benchmark the vad_features pipeline: bare ceiling vs the asset's full path, per core.

    .venv/bin/python bench/features.py [--corpus DIR] [--minutes 30] [--workers N]
    .venv/bin/python bench/features.py --quick --processes 6     # the ratios over 6 fresh processes

Audio: every FLAC/WAV under ``--corpus``; by default the committed sample corpus under
``data/sample`` (or, if that has no FLACs yet, synthetic speech-like audio). Consecutive files
are concatenated into utterances of about ``--utterance-seconds`` (default 12 s, LibriSpeech's
mean utterance length; 0 keeps the files as they are) and written as 16-bit FLAC into a
temporary folder, with a slightly different gain per copy, until there are ``--minutes`` of
audio, so the benchmark decodes real, distinct FLAC files.

Measured in one process with one torch thread (so "per core"):

(a) bare ceiling: ``audio.decode`` + both transforms (``FeatureExtractor``: log-mel 80, MFCC 39)
    over every file in a tight loop;
(a16) as (a), the extractor writing float16 (what a shard stores, and what (b) asks it for):
    shown beside (a) so that no extractor speed-up counts for (b) alone;
(b) the asset's full path: ``build.build_shard`` per shard, i.e. decode, mono, resampling where
    needed, peak normalisation, WebRTC VAD, trimming, float16 features, CMVN partial sums and the
    atomic Parquet write (with fsync);
(c) the peer: what fairseq (HuBERT's ``dump_mfcc_feature``) and lhotse users run per utterance,
    ``torchaudio.compliance.kaldi.fbank`` (80 bins) + ``torchaudio.compliance.kaldi.mfcc`` (13
    ceps, ``use_energy=False``) + Δ and ΔΔ with ``torchaudio.functional.compute_deltas`` -> 39,
    on the same decode (``audio.decode`` + ``to_mono``) of the same files. The peer does no VAD,
    no trimming, no statistics and no write, which favours it.

All three are repeated ``--repeats`` times, interleaved, and the best of each is reported as a
real-time factor (audio seconds / wall seconds; process CPU seconds are shown too, since the
wall clock inflates when other processes share the cores), with the ratios (b)/(a) (target
>= 0.7) and (b)/(c) (target >= 2), and a per-stage CPU breakdown of (b). ``--quick`` stops
there. ``--processes N`` runs that quick measurement in N fresh interpreters one after another
and reports each one's figures with their median: the same code's ratios move by about ±3 %
from one process to the next (where the allocator and the kernel put its buffers), more than
most changes this benchmark is asked to judge. Otherwise, then: read-back speed of the shards
(binary blobs via ``features.iter_shard``) against the same data as Parquet ``list<float>``
columns, and the parallel throughput of ``build.iter_publish_shards`` with ``--workers``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import soundfile as sf  # noqa: E402
import torch  # noqa: E402
import torchaudio.compliance.kaldi as kaldi  # noqa: E402
import torchaudio.functional as AF  # noqa: E402
from machine import cpu_model  # noqa: E402  (bench/machine.py)

from speech_assets.features import audio  # noqa: E402
from speech_assets.features import shards as features  # noqa: E402
from speech_assets.features.build import (  # noqa: E402
    build_shard,
    default_workers,
    iter_publish_shards,
    stored_partial_sums,
)
from speech_assets.features.featurize import FeatureExtractor  # noqa: E402
from speech_assets.features.jobs import ShardJob, UtteranceInput  # noqa: E402
from speech_assets.features.shards import ShardFiles  # noqa: E402
from speech_assets.features.vad import SpeechSpan, VadConfig, detect_speech  # noqa: E402

TARGET_RTF = 1000.0
TARGET_RATIO = 0.7  # (b) / (a)
TARGET_PEER = 2.0  # (b) / (c)


# --- corpus ------------------------------------------------------------------------------------


def synth_speech_like(seconds: float, seed: int, sample_rate: int = 16_000) -> np.ndarray:
    """Harmonic 'vowels' (gliding f0, formant-ish spectral tilt, syllable envelope) with pauses."""
    rng = np.random.default_rng(seed)
    n = int(seconds * sample_rate)
    out = np.zeros(n, np.float32)
    pos = int(rng.uniform(0.2, 0.6) * sample_rate)
    while pos < n - sample_rate // 2:
        burst = int(rng.uniform(0.8, 2.5) * sample_rate)
        burst = min(burst, n - pos - sample_rate // 4)
        t = np.arange(burst) / sample_rate
        f0 = rng.uniform(100, 220) * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t))
        phase = 2 * np.pi * np.cumsum(f0) / sample_rate
        voice = sum(np.sin(k * phase) * (0.8**k) for k in range(1, 25))
        syllables = 0.55 + 0.45 * np.sin(2 * np.pi * rng.uniform(3, 5) * t)
        edge = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.03)
        out[pos : pos + burst] = (0.3 * voice * syllables * edge).astype(np.float32)
        pos += burst + int(rng.uniform(0.15, 0.6) * sample_rate)
    out += (0.003 * rng.standard_normal(n)).astype(np.float32)
    return out


def source_waves(corpus: Path | None) -> tuple[str, list[tuple[np.ndarray, int]]]:
    """(description, [(mono float32 wave, sample_rate)]) from a corpus, the sample data or synthesis."""
    folder = corpus if corpus is not None else REPO / "data" / "sample"
    files = sorted([*folder.rglob("*.flac"), *folder.rglob("*.wav")]) if folder.is_dir() else []
    waves = []
    for path in files:
        try:
            decoded, rate = audio.decode(path)
        except audio.DecodeError:
            continue
        waves.append((audio.to_mono(decoded), rate))
    if waves:
        return f"{len(waves)} files from {folder}", waves
    if corpus is not None:
        raise SystemExit(f"no decodable FLAC/WAV files under {corpus}")
    return "synthetic speech-like audio (data/sample has no FLACs yet)", [
        (synth_speech_like(6.0, seed), 16_000) for seed in range(40)
    ]


def build_corpus(
    sources: list[tuple[np.ndarray, int]], minutes: float, utterance_seconds: float, folder: Path, speakers: int
) -> list[UtteranceInput]:
    """Write >= ``minutes`` of FLAC utterances into ``folder`` (16-bit, the sources' rates)."""
    target = minutes * 60.0
    utterances: list[UtteranceInput] = []
    total = 0.0
    copy = 0
    index = 0
    while total < target:
        gain = 0.9 ** (copy % 5)
        pieces: list[np.ndarray] = []
        rate = sources[index % len(sources)][1]
        length = 0.0
        while True:
            wave, wave_rate = sources[index % len(sources)]
            if wave_rate != rate:
                break
            pieces.append(wave)
            length += wave.shape[0] / rate
            index += 1
            if index % len(sources) == 0:
                copy += 1
            if utterance_seconds <= 0 or length >= utterance_seconds:
                break
        if not pieces:  # rate change at the first piece: take it alone
            wave, rate = sources[index % len(sources)]
            pieces, length = [wave], wave.shape[0] / rate
            index += 1
        data = np.clip(np.concatenate(pieces) * gain, -1.0, 1.0)
        number = len(utterances)
        speaker = f"{1000 + number % speakers}"
        utt_id = f"{speaker}-0-{number:05d}"
        path = folder / f"{utt_id}.flac"
        sf.write(path, data, rate, subtype="PCM_16", format="FLAC")
        utterances.append(UtteranceInput(utt_id, speaker, "0", str(path), data.shape[0] / rate))
        total += data.shape[0] / rate
    return utterances


# --- measurements ------------------------------------------------------------------------------


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def bare_ceiling(paths: Sequence[str], extractor: FeatureExtractor, dtype: type = np.float32) -> None:
    for path in paths:
        decoded, _ = audio.decode(path)
        extractor(audio.to_mono(decoded), dtype)


def peer_path(paths: Sequence[str]) -> None:
    """(c) decode + Kaldi-compatible fbank 80 + MFCC 13 + Δ + ΔΔ (torchaudio), per utterance."""
    with torch.inference_mode():
        for path in paths:
            decoded, rate = audio.decode(path)
            wave = torch.from_numpy(audio.to_mono(decoded)).unsqueeze(0)
            kaldi.fbank(wave, num_mel_bins=80, sample_frequency=rate, dither=0.0)
            ceps = kaldi.mfcc(wave, num_ceps=13, sample_frequency=rate, dither=0.0, use_energy=False).T
            delta = AF.compute_deltas(ceps)
            torch.cat([ceps, delta, AF.compute_deltas(delta)]).T.contiguous()


def full_path(shards: dict[str, list[UtteranceInput]], out: Path, cfg: VadConfig, extractor: FeatureExtractor) -> None:
    for key, utterances in shards.items():
        build_shard(utterances, out / f"{key}.parquet", cfg, extractor)


def stage_breakdown(
    shards: dict[str, list[UtteranceInput]], out: Path, cfg: VadConfig, extractor: FeatureExtractor
) -> dict[str, float]:
    """CPU seconds per stage of the full path (the steps of ``process_variants`` + ``build_shard``;
    "CMVN sums" includes the finiteness check build_shard reads off them)."""
    spent = dict.fromkeys(["decode", "mono+resample+normalise", "VAD", "features", "CMVN sums", "Parquet write"], 0.0)
    clock = time.thread_time
    stored = features.FEATURE_DTYPES[features.SHARD_FORMAT]  # build_shard's features come out in it
    for key, utterances in shards.items():
        records = []
        for utt in utterances:
            t0 = clock()
            decoded, rate = audio.decode(utt.path)
            t1 = clock()
            wave = audio.to_16k_mono(decoded, rate, in_place=True)
            t2 = clock()
            span = detect_speech(wave, cfg, peak_normalised=True)
            t3 = clock()
            if not isinstance(span, SpeechSpan):
                spent["decode"] += t1 - t0
                spent["mono+resample+normalise"] += t2 - t1
                spent["VAD"] += t3 - t2
                continue
            logmel, mfcc = extractor(wave[span.start_sample : span.end_sample], stored)
            t4 = clock()
            parts = stored_partial_sums(logmel), stored_partial_sums(mfcc)
            all(np.isfinite(part.sum).all() for part in parts)
            t5 = clock()
            for name, seconds in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                spent[name] += seconds
            records.append(
                features.FeatureRecord(
                    utt.utt_id,
                    utt.speaker_id,
                    utt.chapter_id,
                    logmel.shape[0],
                    utt.duration_s,
                    span.start_s,
                    span.end_s,
                    span.duration_s,
                    span.speech_ratio,
                    logmel,
                    mfcc,
                )
            )
        t0 = clock()
        features.write_shard(out / f"{key}.parquet", records)
        spent["Parquet write"] += clock() - t0
    return spent


def write_list_shard(shard: Path, target: Path) -> int:
    """Rewrite a blob shard with ``list<float>`` feature columns (same values, same settings)."""
    table = features.read_shard_table(shard)
    dtype = features.feature_dtype(table.schema)  # float16 in format-2 shards
    columns = {}
    for name in ("logmel", "mfcc"):
        blobs = table.column(name).combine_chunks()
        offsets = np.frombuffer(blobs.buffers()[1], dtype=np.int32)[blobs.offset : blobs.offset + len(blobs) + 1]
        values = np.frombuffer(blobs.buffers()[2], dtype=dtype)[
            offsets[0] // dtype.itemsize : offsets[-1] // dtype.itemsize
        ]
        offsets = (offsets - offsets[0]) // dtype.itemsize
        columns[name] = pa.ListArray.from_arrays(
            pa.array(offsets, pa.int32()), pa.array(values, pa.from_numpy_dtype(dtype))
        )
    for name in ("logmel", "mfcc"):
        table = table.set_column(table.schema.get_field_index(name), name, columns[name])
    pq.write_table(table, target, compression="zstd", compression_level=3, row_group_size=256)
    return table.num_rows


def read_blobs(paths: Sequence[Path]) -> int:
    total = 0
    for path in paths:
        for record in features.iter_shard(path):
            total += record.logmel.nbytes + record.mfcc.nbytes
    return total


def read_lists_arrow(paths: Sequence[Path]) -> int:
    """Best case for list<float>: flatten the child arrays and slice them by offsets (no Python lists)."""
    total = 0
    for path in paths:
        table = pq.read_table(path)
        frames = table.column("num_frames").to_numpy()
        for name, dim in (("logmel", features.N_MELS), ("mfcc", features.MFCC_DIM)):
            column = table.column(name).combine_chunks()
            values = column.values.to_numpy()
            offsets = column.offsets.to_numpy()
            for row in range(len(column)):
                matrix = values[offsets[row] : offsets[row + 1]].reshape(int(frames[row]), dim)
                total += matrix.nbytes
    return total


def read_lists_pylist(paths: Sequence[Path]) -> int:
    """The anti-pattern: list<float> through Python lists."""
    total = 0
    for path in paths:
        table = pq.read_table(path)
        for name, dim in (("logmel", features.N_MELS), ("mfcc", features.MFCC_DIM)):
            for row in table.column(name).to_pylist():
                total += np.asarray(row, dtype=np.float32).reshape(-1, dim).nbytes  # as float32, what consumers get
    return total


def rtf(audio_seconds: float, seconds: float) -> float:
    return audio_seconds / seconds if seconds > 0 else float("inf")


def across_processes(args: argparse.Namespace) -> int:
    """``--processes N``: the quick measurement in N fresh interpreters, one after another."""
    command = [
        sys.executable,
        __file__,
        "--quick",
        "--minutes",
        str(args.minutes),
        "--repeats",
        str(args.repeats),
        "--utterance-seconds",
        str(args.utterance_seconds),
        "--speakers",
        str(args.speakers),
    ]
    if args.corpus is not None:
        command += ["--corpus", str(args.corpus)]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_features_runs_") as tmp:
        for index in range(args.processes):
            result = Path(tmp) / f"{index}.json"
            subprocess.run([*command, "--result-json", str(result)], check=True, stdout=subprocess.DEVNULL)
            results.append(json.loads(result.read_text()))
            figures = results[-1]
            print(
                f"process {index + 1}/{args.processes}: (b)/(a) CPU {figures['b_over_a']['cpu']:.3f}, "
                f"(b)/(c) CPU {figures['b_over_c']['cpu']:.2f} (load {figures['load_at_start']:.2f} at start)",
                flush=True,
            )
    print()
    print(f"-- {args.processes} fresh processes, one after another (each: best of {args.repeats} interleaved runs) --")
    print(
        f"{'':12s}{'(a) CPU RTF':>12s}{'(b) CPU RTF':>12s}{'(c) CPU RTF':>12s}"
        f"{'(b)/(a) CPU':>13s}{'(b)/(a) wall':>13s}{'(b)/(c) CPU':>13s}{'(b)/(c) wall':>13s}"
    )

    def row(label: str, pick: Callable[[Sequence[float]], float]) -> None:
        cells = [pick([r["rtf_cpu"][k] for r in results]) for k in "abc"]
        ratios = [
            pick([r[name][clock] for r in results]) for name in ("b_over_a", "b_over_c") for clock in ("cpu", "wall")
        ]
        print(f"{label:12s}" + "".join(f"{c:12.0f}" for c in cells) + "".join(f"{x:13.3f}" for x in ratios))

    for index, result in enumerate(results):
        row(f"process {index + 1}", lambda values, i=index: values[i])
    row("median", statistics.median)
    row("min", min)
    row("max", max)
    ratio = statistics.median(r["b_over_a"]["cpu"] for r in results)
    peer = statistics.median(r["b_over_c"]["cpu"] for r in results)
    print(
        f"targets by the median (CPU): (b)/(a) >= {TARGET_RATIO}: {'PASS' if ratio >= TARGET_RATIO else 'FAIL'} "
        f"({ratio:.3f}); (b)/(c) >= {TARGET_PEER:g}: {'PASS' if peer >= TARGET_PEER else 'FAIL'} ({peer:.2f}x)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=None, help="FLAC/WAV folder (default: data/sample)")
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes of audio to benchmark (default 30)")
    parser.add_argument("--workers", type=int, default=None, help="processes for the parallel run (default: all cores)")
    parser.add_argument(
        "--utterance-seconds", type=float, default=12.0, help="concatenate files to ~this length (0: as is)"
    )
    parser.add_argument(
        "--speakers", type=int, default=6, help="speakers (= shards, ~5 min each by default) to spread utterances over"
    )
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats of (a), (b), (c); best is reported")
    parser.add_argument("--quick", action="store_true", help="only (a), (b), (c) and the stage breakdown")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the generated corpus and shards here")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="run the quick measurement in this many fresh processes; report the median",
    )
    parser.add_argument(
        "--result-json", type=Path, default=None, help=argparse.SUPPRESS
    )  # a --processes child's figures
    args = parser.parse_args(argv)
    if args.processes > 1:
        return across_processes(args)
    if args.result_json is not None:
        from speech_assets.runtime.processes import die_with_parent

        die_with_parent()  # a killed parent leaves no benchmark running

    torch.set_num_threads(1)
    workers = args.workers or default_workers()
    cores = default_workers()
    print("== speech_assets feature benchmark ==")
    print(f"machine : {cpu_model()}, {os.cpu_count()} logical CPUs, {cores} usable by this process")
    print(
        f"software: Python {platform.python_version()}, torch {torch.__version__} (1 thread), "
        f"numpy {np.__version__}, pyarrow {pa.__version__}, libsndfile {sf.__libsndfile_version__}"
    )
    load_at_start = os.getloadavg()
    print(f"load avg at start: {' '.join(f'{x:.2f}' for x in load_at_start)}")

    with tempfile.TemporaryDirectory(prefix="bench_features_") as tmp:
        root = args.workdir or Path(tmp)
        (root / "audio").mkdir(parents=True, exist_ok=True)
        description, sources = source_waves(args.corpus)
        started = time.perf_counter()
        utterances = build_corpus(sources, args.minutes, args.utterance_seconds, root / "audio", args.speakers)
        audio_seconds = sum(u.duration_s for u in utterances)
        lengths = [u.duration_s for u in utterances]
        print(
            f"corpus  : {description} -> {len(utterances)} FLAC utterances, {audio_seconds / 60:.1f} min "
            f"(mean {statistics.mean(lengths):.1f} s, min {min(lengths):.1f} s, max {max(lengths):.1f} s), "
            f"written in {time.perf_counter() - started:.1f} s"
        )
        shards: dict[str, list[UtteranceInput]] = {}
        for utt in utterances:
            shards.setdefault(utt.speaker_id, []).append(utt)
        paths = [u.path for u in utterances]
        cfg = VadConfig()
        extractor = FeatureExtractor()
        print(
            f"config  : {cfg}; features n_fft={extractor.n_fft}, window={extractor.window_name}, "
            f"MFCC from {extractor.mfcc_mels} mel bins; {len(shards)} shards"
        )

        # Warm-up (page cache, allocator, lazy imports), not timed.
        bare_ceiling(paths[:4], extractor)
        full_path({"warmup": utterances[:4]}, root / "warmup", cfg, extractor)
        peer_path(paths[:4])

        out = root / "shards"
        a_runs: list[tuple[float, float]] = []
        a16_runs: list[tuple[float, float]] = []
        b_runs: list[tuple[float, float]] = []
        c_runs: list[tuple[float, float]] = []
        for _ in range(max(1, args.repeats)):
            a_runs.append(timed(lambda: bare_ceiling(paths, extractor)))
            b_runs.append(timed(lambda: full_path(shards, out, cfg, extractor)))
            c_runs.append(timed(lambda: peer_path(paths)))
            a16_runs.append(timed(lambda: bare_ceiling(paths, extractor, np.float16)))
        a_wall, a_cpu = min(w for w, _ in a_runs), min(c for _, c in a_runs)
        a16_wall, a16_cpu = min(w for w, _ in a16_runs), min(c for _, c in a16_runs)
        b_wall, b_cpu = min(w for w, _ in b_runs), min(c for _, c in b_runs)
        c_wall, c_cpu = min(w for w, _ in c_runs), min(c for _, c in c_runs)
        ratio_wall, ratio_cpu = a_wall / b_wall, a_cpu / b_cpu
        peer_wall, peer_cpu = c_wall / b_wall, c_cpu / b_cpu

        print()
        print(
            f"-- single process, 1 torch thread: best of {len(a_runs)} interleaved runs "
            f"(real-time factor = audio s / s) --"
        )
        print(f"{'':44s}{'wall RTF':>10s}{'CPU RTF':>10s}   wall s of each run")
        print(
            f"{'(a) bare ceiling: decode + log-mel + MFCC':44s}{rtf(audio_seconds, a_wall):10.0f}"
            f"{rtf(audio_seconds, a_cpu):10.0f}   {' '.join(f'{w:.2f}' for w, _ in a_runs)}"
        )
        print(
            f"{'(b) full path: + VAD, trim, stats, Parquet':44s}{rtf(audio_seconds, b_wall):10.0f}"
            f"{rtf(audio_seconds, b_cpu):10.0f}   {' '.join(f'{w:.2f}' for w, _ in b_runs)}"
        )
        print(
            f"{'(c) peer: decode + kaldi fbank + mfcc + deltas':44s}{rtf(audio_seconds, c_wall):10.0f}"
            f"{rtf(audio_seconds, c_cpu):10.0f}   {' '.join(f'{w:.2f}' for w, _ in c_runs)}"
        )
        print(
            f"{'(a16) ceiling, features written as float16':44s}{rtf(audio_seconds, a16_wall):10.0f}"
            f"{rtf(audio_seconds, a16_cpu):10.0f}   {' '.join(f'{w:.2f}' for w, _ in a16_runs)}"
        )
        print(f"{'ratio (b) / (a)':44s}{ratio_wall:10.3f}{ratio_cpu:10.3f}")
        print(f"{'ratio (b) / (a16)  [(b) stores float16]':44s}{a16_wall / b_wall:10.3f}{a16_cpu / b_cpu:10.3f}")
        print(f"{'ratio (b) / (c)  [(c): no VAD, no write]':44s}{peer_wall:10.3f}{peer_cpu:10.3f}")
        for clock, b_seconds, ratio, peer in (
            ("wall", b_wall, ratio_wall, peer_wall),
            ("CPU", b_cpu, ratio_cpu, peer_cpu),
        ):
            b_rtf = rtf(audio_seconds, b_seconds)
            print(
                f"targets ({clock:4s}): (b) >= {TARGET_RTF:.0f}x real time per core: "
                f"{'PASS' if b_rtf >= TARGET_RTF else 'FAIL'} ({b_rtf:.0f}x); "
                f"(b)/(a) >= {TARGET_RATIO}: {'PASS' if ratio >= TARGET_RATIO else 'FAIL'} ({ratio:.3f}); "
                f"(b)/(c) >= {TARGET_PEER:g}: {'PASS' if peer >= TARGET_PEER else 'FAIL'} ({peer:.2f}x)"
            )
        if os.getloadavg()[0] > 0.5 * cores:
            print(
                f"note: load average {os.getloadavg()[0]:.1f} on {cores} cores: other processes compete for the "
                f"CPU; wall-clock figures are inflated, the CPU-time ones less so"
            )
        breakdown = stage_breakdown(shards, root / "breakdown", cfg, extractor)
        total = sum(breakdown.values())
        print("stages of (b), CPU ms per audio second (one instrumented pass; (a) = decode + features):")
        print(
            "  "
            + ", ".join(f"{name} {secs / audio_seconds * 1e3:.3f}" for name, secs in breakdown.items())
            + f"; total {total / audio_seconds * 1e3:.3f}"
        )
        if args.result_json is not None:
            args.result_json.write_text(
                json.dumps(
                    {
                        "rtf_cpu": {
                            "a": rtf(audio_seconds, a_cpu),
                            "b": rtf(audio_seconds, b_cpu),
                            "c": rtf(audio_seconds, c_cpu),
                        },
                        "b_over_a": {"cpu": ratio_cpu, "wall": ratio_wall},
                        "b_over_c": {"cpu": peer_cpu, "wall": peer_wall},
                        "load_at_start": load_at_start[0],
                    }
                )
            )
        if args.quick:
            print(f"load avg at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            return 0

        shard_files = sorted(out.glob("*.parquet"))
        kept = sum(pq.ParquetFile(p).metadata.num_rows for p in shard_files)
        size = sum(p.stat().st_size for p in shard_files)
        print(
            f"shards  : {len(shard_files)} files, {kept} utterances kept of {len(utterances)}, "
            f"{size / 1e6:.1f} MB on disk"
        )

        # Read-back: blobs vs list<float>.
        list_dir = root / "lists"
        list_dir.mkdir(exist_ok=True)
        list_files = []
        for path in shard_files:
            target = list_dir / path.name
            write_list_shard(path, target)
            list_files.append(target)
        list_size = sum(p.stat().st_size for p in list_files)
        print()
        print(
            f"-- read-back of the {kept} utterances' features (best of 3; list<float> shards: "
            f"{list_size / 1e6:.1f} MB) --"
        )
        readers = [
            ("binary blobs (features.iter_shard)", read_blobs, shard_files),
            ("list<float>, Arrow offsets -> numpy", read_lists_arrow, list_files),
            ("list<float>, via Python lists", read_lists_pylist, list_files),
        ]
        speeds = {}
        for label, reader, files in readers:
            nbytes = reader(files)
            best = min(timed(lambda: reader(files))[0] for _ in range(3))
            speeds[label] = nbytes / best / 1e6
            print(f"{label:40s}{speeds[label]:10.0f} MB/s{kept / best:12.0f} utt/s")
        blob_speed = speeds[readers[0][0]]
        print(
            f"blobs vs list<float>: {blob_speed / speeds[readers[1][0]]:.1f}x (Arrow path), "
            f"{blob_speed / speeds[readers[2][0]]:.1f}x (Python lists)"
        )

        # Parquet write settings: how much of (b) is zstd, at the level write_shard uses and at 1.
        print()
        print("-- Parquet write cost (in memory, the (b) shards' tables, best of 3) --")
        tables = [features.read_shard_table(p) for p in shard_files]
        raw = sum(t.nbytes for t in tables)
        for level in (3, 1):

            def write_all(level: int = level) -> int:
                size = 0
                for table in tables:
                    sink = pa.BufferOutputStream()
                    pq.write_table(
                        table,
                        sink,
                        compression="zstd",
                        compression_level=level,
                        use_dictionary=["speaker_id", "chapter_id"],
                        write_statistics=["utt_id", "speaker_id", "num_frames"],
                        row_group_size=256,
                    )
                    size += sink.getvalue().size
                return size

            size = write_all()
            best = min(timed(write_all)[1] for _ in range(3))
            print(
                f"zstd level {level}: {best / audio_seconds * 1e3:.3f} ms CPU per audio s "
                f"({rtf(audio_seconds, best):.0f}x), size {size / raw:.3f} of raw"
            )

        # Parallel.
        print()
        print(f"-- parallel: iter_publish_shards, {workers} worker process(es), {len(shards)} shards, largest first --")
        jobs = [
            ShardJob(key, tuple(utts), ShardFiles.of(root / "parallel", key), inputs_key="bench", force=True)
            for key, utts in shards.items()
        ]
        wall, _ = timed(lambda: list(iter_publish_shards(jobs, cfg, workers)))
        used = min(workers, cores)
        print(
            f"cold (this process plus {workers - 1} helper interpreters that import torch): {wall:.2f} s -> "
            f"{rtf(audio_seconds, wall):.0f}x real time aggregate, "
            f"{rtf(audio_seconds, wall) / used:.0f}x per core; "
            f"speed-up {b_wall / wall:.2f}x over the single process (b)"
        )
        same = all(
            (root / "parallel" / f"{k}.parquet").read_bytes() == (out / f"{k}.parquet").read_bytes() for k in shards
        )
        print(f"parallel shards byte-identical to the single-process ones: {same}")
        print(f"load avg at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
