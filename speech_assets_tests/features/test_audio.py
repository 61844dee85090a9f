"""Audio loading: decode, downmix, resample to 16 kHz, peak normalisation."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from speech_assets.features import audio


def tone(freq: float, seconds: float, sample_rate: int, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(round(seconds * sample_rate))) / sample_rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def dominant_frequency(wave: np.ndarray, sample_rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(wave.shape[0])))
    return float(np.argmax(spectrum) * sample_rate / wave.shape[0])


@pytest.mark.parametrize(
    ("sample_rate", "channels", "subtype", "fmt"),
    [
        (16000, 1, "PCM_16", "FLAC"),
        (8000, 1, "PCM_16", "WAV"),
        (44100, 2, "PCM_24", "FLAC"),
        (48000, 2, "FLOAT", "WAV"),
    ],
)
def test_decode_returns_channels_first_float32(tmp_path, sample_rate, channels, subtype, fmt):
    data = tone(440, 0.5, sample_rate)
    frames = np.stack([data, -0.5 * data], axis=1)[:, :channels]
    path = tmp_path / f"x.{fmt.lower()}"
    sf.write(path, frames, sample_rate, subtype=subtype, format=fmt)
    decoded, rate = audio.decode(path)
    assert rate == sample_rate
    assert decoded.dtype == np.float32
    assert decoded.shape == (channels, data.shape[0])
    np.testing.assert_allclose(decoded[0], data, atol=1e-4)


@pytest.mark.parametrize("content", [b"", b"not audio at all" * 10, b"fLaC" + b"\x00" * 40])
def test_decode_errors_are_decode_error(tmp_path, content):
    path = tmp_path / "bad.flac"
    path.write_bytes(content)
    with pytest.raises(audio.DecodeError):
        audio.decode(path)


def test_decode_missing_file(tmp_path):
    with pytest.raises(audio.DecodeError):
        audio.decode(tmp_path / "missing.flac")


def test_decode_zero_length(tmp_path):
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros((0, 1), np.float32), 16000, subtype="PCM_16")
    with pytest.raises(audio.DecodeError, match="zero-length"):
        audio.decode(path)


def test_to_mono():
    stereo = np.stack([np.ones(10, np.float32), np.zeros(10, np.float32)])
    mono = audio.to_mono(stereo)
    assert mono.shape == (10,) and mono.dtype == np.float32 and mono.flags.c_contiguous
    np.testing.assert_allclose(mono, 0.5)
    single = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(audio.to_mono(single[None, :]), single)
    np.testing.assert_array_equal(audio.to_mono(single), single)
    with pytest.raises(ValueError):
        audio.to_mono(np.zeros((1, 2, 3), np.float32))


def test_resample_skips_16k():
    wave = tone(440, 0.1, 16000)
    assert audio.resample(wave, 16000, 16000) is wave


@pytest.mark.parametrize("sample_rate", [8000, 11025, 22050, 24000, 44100, 48000])
@pytest.mark.parametrize("num_samples", [12345, 44100])
def test_resample_length_and_content(sample_rate, num_samples):
    wave = tone(1000, num_samples / sample_rate, sample_rate)[:num_samples]
    out = audio.resample(wave, sample_rate, 16000)
    assert out.dtype == np.float32
    assert out.shape == (-(-16000 * num_samples // sample_rate),)
    assert abs(out.shape[0] - num_samples * 16000 / sample_rate) < 1
    assert abs(dominant_frequency(out, 16000) - 1000) < 5
    assert np.abs(out).max() == pytest.approx(0.5, abs=0.02)


def test_resample_rejects_bad_rate():
    with pytest.raises(ValueError):
        audio.resample(np.zeros(10, np.float32), 0, 16000)


def test_normalise_peak_scales_to_target_without_touching_input():
    wave = tone(300, 0.2, 16000, amplitude=0.2)
    before = wave.copy()
    out = audio.normalise_peak(wave)
    assert np.abs(out).max() == pytest.approx(audio.PEAK_TARGET, rel=1e-6)
    np.testing.assert_array_equal(wave, before)
    assert out.dtype == np.float32


def test_normalise_peak_caps_gain():
    quiet = tone(300, 0.2, 16000, amplitude=1e-3)
    out = audio.normalise_peak(quiet)
    assert np.abs(out).max() == pytest.approx(1e-3 * 10 ** (audio.MAX_GAIN_DB / 20), rel=1e-3)


@pytest.mark.parametrize("wave", [np.zeros(1000, np.float32), np.full(1000, 1e-6, np.float32), np.zeros(0, np.float32)])
def test_normalise_peak_silence_has_no_division_by_zero(wave):
    with np.errstate(all="raise"):
        out = audio.normalise_peak(wave)
    np.testing.assert_array_equal(out, wave)
    assert out is not wave


@pytest.mark.parametrize("amplitude", [0.2, 1e-3, 0.0])
def test_normalise_peak_in_place_equals_the_copy(amplitude):
    wave = tone(300, 0.2, 16000, amplitude=amplitude)
    expected = audio.normalise_peak(wave)
    out = audio.normalise_peak(wave, in_place=True)
    assert out is wave
    np.testing.assert_array_equal(out, expected)
    readonly = tone(300, 0.2, 16000, amplitude=amplitude)
    readonly.flags.writeable = False
    other = audio.normalise_peak(readonly, in_place=True)  # not writable: falls back to a copy
    assert other is not readonly
    np.testing.assert_array_equal(other, expected)


def test_normalise_peak_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        audio.normalise_peak(np.array([0.0, np.nan], np.float32))


def test_load_16k_mono_from_44k_stereo_24bit(tmp_path):
    data = tone(500, 1.0, 44100, amplitude=0.3)
    path = tmp_path / "x.flac"
    sf.write(path, np.stack([data, data], axis=1), 44100, subtype="PCM_24")
    wave = audio.load_16k_mono(path)
    assert wave.dtype == np.float32 and wave.ndim == 1
    assert wave.shape == (16000,)
    assert np.abs(wave).max() == pytest.approx(audio.PEAK_TARGET, rel=1e-3)
    assert abs(dominant_frequency(wave, 16000) - 500) < 5
    assert audio.decode(path)[1] == 44100


@pytest.mark.parametrize(
    ("orig", "new", "num_samples"),
    [
        (8000, 16000, 12345),
        (11025, 16000, 44100),
        (44100, 16000, 44101),
        (48000, 16000, 4800),
        (1001, 1600, 5000),
        (1600, 1001, 5000),
        (997, 16000, 3000),
        (192000, 16000, 19200),
        (24000, 16000, 7),
    ],
)
def test_polyphase_resample_matches_torchaudio(orig, new, num_samples):
    """Kills: a bounded-memory resampler that drifts from ``torchaudio.functional.resample`` (the
    features of a corpus would change with the implementation): same length, same values to
    float rounding (torchaudio's own phase term is float32)."""
    import torch
    import torchaudio.functional as AF

    wave = (np.random.default_rng(orig).standard_normal(num_samples) * 0.3).astype(np.float32)
    expected = AF.resample(torch.from_numpy(wave), orig, new).numpy()
    out = audio.resample(wave, orig, new)
    assert out.dtype == np.float32 and out.shape == expected.shape
    np.testing.assert_allclose(out, expected, atol=1e-4, rtol=0)
