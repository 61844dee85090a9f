"""Feature extraction, per-utterance processing and shard building."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import torch
import torchaudio
import torchaudio.functional as AF

from speech_assets.corpus.rejects import REJECTS_SCHEMA, RejectRow
from speech_assets.features import audio
from speech_assets.features import shards as features
from speech_assets.features.build import ShardResult, build_shard, process_variants, write_sidecars
from speech_assets.features.cmvn import PartialSums, ShardStats
from speech_assets.features.featurize import FeatureExtractor, compute_deltas
from speech_assets.features.jobs import UtteranceInput
from speech_assets.features.shards import FeatureRecord, num_frames_for
from speech_assets.features.vad import VadConfig
from speech_assets.layout import sidecar_paths
from speech_assets_tests.support.corpora import vowel, with_silence

SR = 16_000


@pytest.fixture(scope="module")
def extractor() -> FeatureExtractor:
    return FeatureExtractor()


def write_flac(path: Path, wave: np.ndarray, sample_rate: int = SR, subtype: str = "PCM_16") -> Path:
    sf.write(path, wave, sample_rate, subtype=subtype, format=path.suffix.lstrip(".").upper())
    return path


def mel_centres_hz(n_mels: int = 80, f_min: float = 20.0, f_max: float = 8000.0) -> np.ndarray:
    mel = lambda f: 2595.0 * np.log10(1.0 + f / 700.0)  # noqa: E731
    points = np.linspace(mel(f_min), mel(f_max), n_mels + 2)[1:-1]
    return 700.0 * (10 ** (points / 2595.0) - 1.0)


# --- FeatureExtractor ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_samples", [0, 399, 400, 401, 559, 560, 16000, 12345, 48000])
def test_frame_counts_follow_documented_formula(extractor, num_samples):
    wave = np.random.default_rng(num_samples).standard_normal(num_samples).astype(np.float32) * 0.1
    logmel, mfcc = extractor(wave)
    expected = num_frames_for(num_samples)
    assert expected == (0 if num_samples < 400 else 1 + (num_samples - 400) // 160)
    assert logmel.shape == (expected, 80) and mfcc.shape == (expected, 39)
    assert logmel.dtype == np.float32 and mfcc.dtype == np.float32
    assert logmel.flags.c_contiguous and mfcc.flags.c_contiguous
    assert np.isfinite(logmel).all() and np.isfinite(mfcc).all()


def kaldi_reference(wave: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """torchaudio's Kaldi-compliance fbank 80 and MFCC 13 (no dither), on the int16 scale."""
    scaled = torch.from_numpy(wave)[None] * 32768.0
    fbank = torchaudio.compliance.kaldi.fbank(scaled, num_mel_bins=80, dither=0.0).numpy()
    mfcc = torchaudio.compliance.kaldi.mfcc(scaled, use_energy=False, dither=0.0).numpy()
    return fbank, mfcc


# Per-coefficient absolute tolerances for MFCC parity with Kaldi. The two recipes' mel filters
# differ in shape (triangles in Hz vs in mel), which moves each log-mel energy by up to ~0.015;
# the DCT turns that into up to ~0.04 per coefficient before liftering, which then multiplies
# coefficient k by 1 + 11 sin(pi k / 22) (up to 12). Measured maxima are about 80% of these.
CEPSTRAL_LIFTER_GAIN = 1.0 + 11.0 * np.sin(np.pi * np.arange(13) / 22.0)
MFCC_ATOL = 0.06 * CEPSTRAL_LIFTER_GAIN
LOGMEL_ATOL = 0.03


def mfcc_parity_violations(mfcc: np.ndarray, kaldi_mfcc: np.ndarray) -> list[int]:
    """Coefficients whose largest absolute difference from Kaldi exceeds its tolerance."""
    worst = np.abs(mfcc[:, :13] - kaldi_mfcc).max(axis=0)
    return [k for k in range(13) if worst[k] > MFCC_ATOL[k]]


@pytest.mark.parametrize("seed", [1, 2])
def test_logmel_and_mfcc_match_kaldi(extractor, seed):
    """The recipe is Kaldi fbank / mfcc (what HuBERT iteration 1 uses). Fed the same int16-scale
    waveform, every log-mel bin and every MFCC coefficient agrees within an absolute tolerance."""
    wave = audio.normalise_peak(with_silence(0.3, 2.0, 0.3, seed=seed))
    fbank, kaldi_mfcc = kaldi_reference(wave)
    logmel, mfcc = extractor(wave * 32768.0)
    assert fbank.shape == logmel.shape and kaldi_mfcc.shape == (mfcc.shape[0], 13)
    assert np.abs(fbank - logmel).max() < LOGMEL_ATOL
    assert mfcc_parity_violations(mfcc, kaldi_mfcc) == []
    # On the [-1, 1] scale the pipeline uses, log energies are lower by exactly 2 log(32768)
    # (CMVN removes it), wherever the energy is well above the log floor (1e-6).
    unscaled_logmel, _ = extractor(wave)
    above_floor = unscaled_logmel > np.log(1e-6) + 10
    assert above_floor.mean() > 0.3
    assert np.abs(logmel - unscaled_logmel - 2 * np.log(32768))[above_floor].max() < 1e-3


@pytest.mark.parametrize(
    "broken",
    [
        {"cepstral_lifter": 0},
        {"mfcc_mels": 40},
        {"window": "hamming"},
        {"preemphasis": 0.0},
        {"remove_dc_offset": False},
    ],
)
def test_mfcc_parity_catches_a_changed_recipe(broken):
    """The parity check above is not a tautology: each of these recipe changes fails it."""
    wave = audio.normalise_peak(with_silence(0.3, 2.0, 0.3, seed=1))
    _, kaldi_mfcc = kaldi_reference(wave)
    _, mfcc = FeatureExtractor(**broken)(wave * 32768.0)
    assert mfcc_parity_violations(mfcc, kaldi_mfcc) != []


def naive_power_spectrum(wave: np.ndarray, window: np.ndarray, preemphasis: float, dc: bool, n_fft: int) -> np.ndarray:
    """Kaldi's per-frame processing, written out literally (float64)."""
    frames = np.lib.stride_tricks.sliding_window_view(wave.astype(np.float64), 400)[::160].copy()
    if dc:
        frames -= frames.mean(axis=1, keepdims=True)
    if preemphasis:
        frames[:, 1:] -= preemphasis * frames[:, :-1].copy()
        frames[:, 0] -= preemphasis * frames[:, 0]
    frames *= window
    return np.abs(np.fft.rfft(frames, n=n_fft, axis=1)) ** 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"window": "hamming"},  # non-zero first window sample: exercises the frame-edge correction
        {"window": "hamming", "preemphasis": 0.0},
        {"window": "hann", "remove_dc_offset": False},
        {"window": "hamming", "remove_dc_offset": False, "n_fft": 400},
    ],
)
def test_power_spectrum_equals_per_frame_kaldi_processing(kwargs):
    extractor = FeatureExtractor(**kwargs)
    rng = np.random.default_rng(0)
    wave = (0.3 * rng.standard_normal(4000) + 0.2).astype(np.float32)  # with a DC offset
    power = extractor.power_spectrum(torch.from_numpy(wave)).numpy()
    expected = naive_power_spectrum(
        wave, extractor.window.double().numpy(), extractor.preemphasis, extractor.remove_dc_offset, extractor.n_fft
    )
    assert power.shape == expected.shape == (num_frames_for(4000), extractor.n_fft // 2 + 1)
    np.testing.assert_allclose(power, expected, rtol=1e-3, atol=2e-6 * expected.max())


def test_mfcc_deltas_are_torchaudio_compute_deltas(extractor):
    wave = audio.normalise_peak(vowel(1.0))
    _, mfcc = extractor(wave)
    static = torch.from_numpy(mfcc[:, :13].T.copy())[None]
    delta = AF.compute_deltas(static)
    delta2 = AF.compute_deltas(delta)
    np.testing.assert_allclose(mfcc[:, 13:26], delta[0].T.numpy(), atol=1e-4)
    np.testing.assert_allclose(mfcc[:, 26:], delta2[0].T.numpy(), atol=1e-4)


@pytest.mark.parametrize("frames", [1, 2, 3, 4, 5, 100])
@pytest.mark.parametrize("win_length", [3, 5, 7])
def test_compute_deltas_equals_torchaudio(frames, win_length):
    x = torch.randn(13, frames) * 10
    expected = AF.compute_deltas(x[None], win_length=win_length)[0]
    torch.testing.assert_close(compute_deltas(x, win_length), expected, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        compute_deltas(x, 2)


def test_extractor_options_and_validation():
    wave = audio.normalise_peak(vowel(0.5))
    options = (
        {"n_fft": 400},
        {"window": "hann"},
        {"window": "hamming", "preemphasis": 0.0},
        {"mfcc_mels": 40, "cepstral_lifter": 0},
        {"remove_dc_offset": False},
    )
    for kwargs in options:
        logmel, mfcc = FeatureExtractor(**kwargs)(wave)
        assert logmel.shape == (num_frames_for(wave.shape[0]), 80) and mfcc.shape[1] == 39
    with pytest.raises(ValueError):
        FeatureExtractor(n_fft=256)
    with pytest.raises(ValueError):
        FeatureExtractor(window="boxcar")
    with pytest.raises(ValueError):
        FeatureExtractor()(np.zeros((2, 1000), np.float32))
    assert FeatureExtractor().describe()["n_fft"] == 512


def test_extractor_reuse_gives_identical_results(extractor):
    long = audio.normalise_peak(with_silence(0.5, 3.0, 0.5, seed=2))
    short = audio.normalise_peak(vowel(0.7))
    first = extractor(short)
    kept = [matrix.copy() for matrix in first]
    extractor(long)  # grows and dirties the scratch buffers
    for matrix, copy in zip(first, kept):  # returned matrices are never views of scratch buffers
        np.testing.assert_array_equal(matrix, copy)
    again = extractor(short)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    logmel, _ = extractor(torch.from_numpy(short))  # tensors work too
    np.testing.assert_array_equal(logmel, first[0])


@pytest.mark.parametrize("num_samples", [0, 400, 3 * SR + 77])
def test_float16_output_is_the_float32_output_rounded(extractor, num_samples):
    """What a format-2 shard stores, written straight from the extractor: bit for bit numpy's
    float16 cast of the float32 result (round to nearest even), shapes and all."""
    wave = audio.normalise_peak(with_silence(0.5, 3.0, 0.5, seed=4))[:num_samples]
    for as32, as16 in zip(extractor(wave), extractor(wave, np.float16), strict=True):
        assert as16.dtype == np.float16 and as16.shape == as32.shape and as16.flags.c_contiguous
        np.testing.assert_array_equal(as16.view(np.uint16), as32.astype(np.float16).view(np.uint16))
    with pytest.raises(ValueError, match="float32 or float16"):
        extractor(wave, np.float64)


# --- process_variants, one utterance -------------------------------------------------------------


@pytest.mark.parametrize(
    ("sample_rate", "channels", "subtype", "suffix"),
    [
        (8000, 2, "PCM_24", ".wav"),
        (8000, 1, "PCM_16", ".flac"),
        (44100, 2, "PCM_24", ".flac"),
        (22050, 1, "PCM_24", ".flac"),
    ],
)
def test_resampled_inputs_give_16k_features(tmp_path, extractor, sample_rate, channels, subtype, suffix):
    """The same (band-limited) signal generated at 16 kHz and at another rate gives the same features."""
    cfg = VadConfig()
    fmax = 3600 if sample_rate < SR else 7600  # what the input rate can carry
    reference = write_flac(tmp_path / "ref.flac", vowel(2.0, SR, fmax=fmax), SR, "PCM_24")
    ref = process_variants(UtteranceInput("ref", "s", "c", str(reference)), cfg, extractor)[0]
    mono = vowel(2.0, sample_rate, fmax=fmax)
    data = np.stack([mono, 0.8 * mono], axis=1) if channels == 2 else mono
    other = write_flac(tmp_path / f"other{suffix}", data, sample_rate, subtype)
    rec = process_variants(UtteranceInput("other", "s", "c", str(other)), cfg, extractor)[0]
    assert isinstance(ref, FeatureRecord) and isinstance(rec, FeatureRecord)
    assert rec.duration_s == pytest.approx(2.0)
    assert rec.num_frames == ref.num_frames == num_frames_for(32000)
    assert (rec.speech_start_s, rec.speech_end_s) == (0.0, 2.0)
    inner = slice(3, -3)  # resampler edge effects
    # Mel bins where the signal has energy and the resampler's low-pass is flat (it starts to
    # roll off a few hundred Hz below the 8 kHz Nyquist frequency).
    band = mel_centres_hz() < (3400 if sample_rate < SR else 6500)
    diff = np.abs(rec.logmel[inner] - ref.logmel[inner])[:, band]
    assert diff.mean() < 0.02 and np.percentile(diff, 99) < 0.2
    if sample_rate > SR:  # full band: MFCC (computed over 20 Hz - 8 kHz) match closely too
        static = np.abs(rec.mfcc[inner, :13] - ref.mfcc[inner, :13])
        assert static.mean() < 0.05 * np.abs(ref.mfcc[inner, :13]).mean()


def test_resampled_frame_count_for_odd_lengths(tmp_path, extractor):
    num_samples = 44100 * 2 + 37
    wave = vowel(num_samples / 44100, 44100)[:num_samples]
    path = write_flac(tmp_path / "odd.flac", np.stack([wave, wave], axis=1), 44100, "PCM_24")
    rec = process_variants(UtteranceInput("odd", "s", "c", str(path)), VadConfig(), extractor)[0]
    assert isinstance(rec, FeatureRecord)
    resampled = -(-16000 * num_samples // 44100)  # ceil: what the resampler returns
    assert rec.speech_end_s == pytest.approx(resampled / SR)
    assert rec.num_frames == num_frames_for(resampled) == rec.logmel.shape[0]


def test_one_utterance_is_trimmed_and_reported(tmp_path, extractor):
    path = write_flac(tmp_path / "u.flac", with_silence(1.0, 2.0, 1.0))
    rec = process_variants(UtteranceInput("u1", "spk", "ch", str(path)), VadConfig(), extractor)[0]
    assert isinstance(rec, FeatureRecord)
    assert rec.duration_s == pytest.approx(4.0)
    assert 0.6 <= rec.speech_start_s <= 1.03 and 3.0 <= rec.speech_end_s <= 3.5
    assert rec.trimmed_duration_s == pytest.approx(rec.speech_end_s - rec.speech_start_s)
    assert rec.num_frames == num_frames_for(round(rec.trimmed_duration_s * SR))
    assert 0.3 < rec.speech_ratio < 0.7
    assert (rec.utt_id, rec.speaker_id, rec.chapter_id) == ("u1", "spk", "ch")


@pytest.mark.parametrize(
    "wave",
    [np.zeros(3 * SR, np.float32), (1e-4 * np.random.default_rng(1).standard_normal(3 * SR)).astype(np.float32)],
    ids=["zeros", "noise-floor"],
)
def test_silence_only_file_is_no_speech_reject(tmp_path, extractor, wave):
    path = write_flac(tmp_path / "silence.flac", wave)
    result = process_variants(UtteranceInput("sil", "s", "c", str(path)), VadConfig(), extractor)[0]
    assert isinstance(result, RejectRow)
    assert result.stage == "vad" and result.reason == "no_speech" and result.utt_id == "sil"
    assert "never triggered" in result.detail and "frames voiced" in result.detail


def test_unreadable_file_is_a_reject_not_a_crash(tmp_path, extractor):
    path = tmp_path / "broken.flac"
    path.write_bytes(b"fLaC garbage")
    result = process_variants(UtteranceInput("bad", "s", "c", str(path)), VadConfig(), extractor)[0]
    assert isinstance(result, RejectRow) and result.reason == "unreadable" and result.stage == "vad"


# --- shards --------------------------------------------------------------------------------------


@pytest.fixture()
def corpus(tmp_path) -> list[UtteranceInput]:
    folder = tmp_path / "audio"
    folder.mkdir()
    waves = {
        "s1-c-0002": with_silence(0.5, 1.5, 0.5, seed=2),
        "s1-c-0000": with_silence(0.8, 2.0, 0.4, seed=0),
        "s1-c-0001": np.zeros(2 * SR, np.float32),  # silence -> no_speech
        "s1-c-0003": with_silence(0.2, 1.0, 0.6, seed=3),
    }
    utterances = []
    for utt_id, wave in waves.items():
        path = write_flac(folder / f"{utt_id}.flac", wave)
        utterances.append(UtteranceInput(utt_id, "s1", "c", str(path), wave.shape[0] / SR))
    return utterances


def test_build_shard_writes_sorted_records_rejects_and_stats(tmp_path, corpus, extractor):
    out = tmp_path / "shards" / "s1.parquet"
    result = build_shard(corpus, out, VadConfig(), extractor)
    assert isinstance(result, ShardResult) and result.path == out and out.exists()
    assert result.records == 3
    assert [r.utt_id for r in result.rejects] == ["s1-c-0001"]
    assert result.rejects[0].reason == "no_speech" and result.rejects[0].stage == "vad"
    assert result.audio_seconds == pytest.approx(sum(u.duration_s for u in corpus))
    records = list(features.iter_shard(out))
    assert [r.utt_id for r in records] == ["s1-c-0000", "s1-c-0002", "s1-c-0003"]
    assert result.frames == sum(r.num_frames for r in records)
    assert result.trimmed_seconds == pytest.approx(sum(r.trimmed_duration_s for r in records), abs=1e-4)
    table = pq.read_table(out)
    assert table.schema.equals(features.SHARD_SCHEMA)
    assert pq.ParquetFile(out).metadata.row_group(0).column(0).compression == "ZSTD"
    for record in records:  # stored features equal a fresh computation
        again = process_variants(next(u for u in corpus if u.utt_id == record.utt_id), VadConfig(), extractor)[0]
        np.testing.assert_array_equal(record.logmel, again.logmel.astype(np.float16))  # as stored: float16
        np.testing.assert_array_equal(record.mfcc, again.mfcc.astype(np.float16))
    stats = result.stats.speakers["s1"]
    everything = np.concatenate([r.logmel for r in records])
    expected = PartialSums.of(everything)
    assert stats["logmel"].count == expected.count == result.frames
    # build.py adds per-utterance sums, the expectation sums every frame at once: equal to
    # well within the rounding
    np.testing.assert_allclose(stats["logmel"].sum, expected.sum, rtol=0, atol=1e-3 * expected.count)
    np.testing.assert_allclose(stats["logmel"].sumsq, expected.sumsq, rtol=1e-4)
    assert stats["mfcc"].count == result.frames


def test_build_shard_is_byte_identical_when_repeated(tmp_path, corpus, extractor):
    first = build_shard(corpus, tmp_path / "a.parquet", VadConfig(), extractor)
    second = build_shard(list(reversed(corpus)), tmp_path / "b.parquet", VadConfig(), FeatureExtractor())
    assert first.path.read_bytes() == second.path.read_bytes()
    other = build_shard(corpus, tmp_path / "c.parquet", VadConfig(padding_ms=600), extractor)
    assert other.path.read_bytes() != first.path.read_bytes()  # config matters


def test_build_shard_keeps_the_loaded_heap_out_of_collections(tmp_path, corpus, extractor):
    """Collections while a shard is built leave the process's existing heap (torch, pyarrow, ...)
    frozen, and build_shard hands it back after."""
    import gc

    seen: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start" and len(seen) < 200:  # counting the frozen objects walks them: ~1 ms
            seen.append(gc.get_freeze_count())

    threshold = gc.get_threshold()
    gc.callbacks.append(record)
    assert gc.get_freeze_count() == 0
    gc.set_threshold(5, 1, 1_000_000)  # young collections every few objects, no full ones meanwhile
    try:
        build_shard(corpus, tmp_path / "s1.parquet", VadConfig(), extractor)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(record)
    assert max(seen) > 10_000  # nothing else in this test freezes the heap
    assert gc.get_freeze_count() == 0


def test_shards_are_byte_identical_across_processes(tmp_path, corpus, extractor):
    """This process and a separate interpreter write the same bytes (helper processes publish the
    bytes of one thread: test_build.py)."""
    local = build_shard(corpus, tmp_path / "inproc" / "s1.parquet", VadConfig(), extractor)
    script = textwrap.dedent(
        """
        import json, sys
        from speech_assets.features.build import build_shard
        from speech_assets.features.jobs import UtteranceInput
        from speech_assets.features.vad import VadConfig
        utts = [UtteranceInput(**u) for u in json.loads(sys.argv[1])]
        build_shard(utts, sys.argv[2], VadConfig())
        """
    )
    payload = json.dumps([u.__dict__ for u in corpus])
    target = tmp_path / "subprocess" / "s1.parquet"
    subprocess.run([sys.executable, "-c", script, payload, str(target)], check=True, timeout=300)
    assert target.read_bytes() == local.path.read_bytes()


def test_build_shard_all_rejected_writes_empty_shard(tmp_path, extractor):
    path = write_flac(tmp_path / "silence.flac", np.zeros(SR, np.float32))
    utterances = [UtteranceInput("x", "s", "c", str(path), 1.0)]
    result = build_shard(utterances, tmp_path / "s.parquet", VadConfig(), extractor)
    assert result.records == 0 and len(result.rejects) == 1 and result.stats.speakers == {}
    table = pq.read_table(result.path)
    assert table.num_rows == 0 and table.schema.equals(features.SHARD_SCHEMA)
    assert list(features.iter_shard(result.path)) == []


def test_build_shard_rejects_duplicate_ids(tmp_path, corpus, extractor):
    with pytest.raises(ValueError, match="duplicate"):
        build_shard([corpus[0], corpus[0]], tmp_path / "d.parquet", VadConfig(), extractor)


def test_failed_write_leaves_no_shard_and_no_temp_file(tmp_path, corpus, extractor, monkeypatch):
    out = tmp_path / "shards" / "s1.parquet"

    def half_write(table, where, **kwargs):
        Path(where).write_bytes(b"PAR1 half a shard")
        raise OSError("disk full (injected)")

    monkeypatch.setattr(pq, "write_table", half_write)
    with pytest.raises(OSError, match="injected"):
        build_shard(corpus, out, VadConfig(), extractor)
    assert sorted(p.name for p in out.parent.iterdir()) == []

    monkeypatch.undo()  # an existing shard survives a failed rewrite untouched
    good = build_shard(corpus, out, VadConfig(), extractor).path.read_bytes()
    monkeypatch.setattr(pq, "write_table", half_write)
    with pytest.raises(OSError):
        build_shard(corpus[:2], out, VadConfig(), extractor)
    assert out.read_bytes() == good
    assert sorted(p.name for p in out.parent.iterdir()) == ["s1.parquet"]


def test_write_sidecars(tmp_path, corpus, extractor):
    result = build_shard(corpus, tmp_path / "s1.parquet", VadConfig(), extractor)
    rejects_path, stats_path = write_sidecars(result)
    assert (rejects_path, stats_path) == sidecar_paths(tmp_path / "s1.parquet")
    assert rejects_path.name == "s1.rejects.parquet" and stats_path.name == "s1.stats.npz"
    rejects = pq.read_table(rejects_path)
    assert rejects.schema.equals(REJECTS_SCHEMA) and rejects.column("utt_id").to_pylist() == ["s1-c-0001"]
    loaded = ShardStats.load(stats_path)
    assert loaded.speakers["s1"]["logmel"].count == result.frames


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_shard_partial_sums_are_bit_identical_to_partial_sums_of(dtype):
    from speech_assets.features.build import stored_partial_sums

    rng = np.random.default_rng(11)
    for frames in (1200, 7, 0, 300, 9000):  # big first, then smaller ones reusing its buffers, then bigger
        for dim, scale in ((80, 4.0), (39, 1.0)):
            matrix = (rng.standard_normal((frames, dim)) * scale + 3).astype(dtype)
            # magnitudes over many octaves: a different order of additions would show in the last bits
            wide = (rng.standard_normal((frames, dim)) * np.exp2(rng.integers(-14, 14, (frames, dim)))).astype(dtype)
            for values in (matrix, wide, wide[:, ::-1], np.asarray(wide).copy()):
                ours, expected = stored_partial_sums(values), PartialSums.of(values)
                assert ours.count == expected.count == frames
                np.testing.assert_array_equal(ours.sum, expected.sum)
                np.testing.assert_array_equal(ours.sumsq, expected.sumsq)
    read_only = (rng.standard_normal((50, 80))).astype(dtype)
    read_only.flags.writeable = False
    ours, expected = stored_partial_sums(read_only), PartialSums.of(read_only)
    np.testing.assert_array_equal(ours.sumsq, expected.sumsq)


def test_a_nan_or_inf_shows_in_the_partial_sums():
    """build_shard reads finiteness off the sums instead of scanning every value."""
    from speech_assets.features.build import stored_partial_sums

    for bad in (np.nan, np.inf, -np.inf, 70000.0):  # 70000 overflows float16
        matrix = np.ones((20, 39), np.float32)
        matrix[13, 5] = bad
        with np.errstate(over="ignore"):
            part = stored_partial_sums(matrix.astype(np.float16))
        assert not np.isfinite(part.sum[5]) and np.isfinite(np.delete(part.sum, 5)).all()


def test_features_not_finite_when_stored_are_a_reject(tmp_path):
    """A digital-silence stretch inside the speech gives log(0) = -inf with no log floor: the
    utterance is rejected at the features stage, the shard keeps the others."""
    speech = with_silence(0.3, 2.0, 0.3, seed=5)
    gap = speech.copy()
    middle = gap.shape[0] // 2
    gap[middle : middle + 2000] = 0.0
    folder = tmp_path / "audio"
    folder.mkdir()
    utterances = [
        UtteranceInput(name, "s1", "c", str(write_flac(folder / f"{name}.flac", wave)), wave.shape[0] / SR)
        for name, wave in (("s1-c-0000", speech), ("s1-c-0001", gap))
    ]
    result = build_shard(utterances, tmp_path / "s1.parquet", VadConfig(), FeatureExtractor(log_floor=0.0))
    assert result.records == 1 and [r.utt_id for r in features.iter_shard(result.path)] == ["s1-c-0000"]
    (reject,) = result.rejects
    assert (reject.utt_id, reject.reason, reject.stage) == ("s1-c-0001", "unreadable", "features")
    assert "not finite in float16" in reject.detail
    assert result.stats.speakers["s1"]["logmel"].count == result.frames
