"""WebRTC VAD span detection: config validation, collector semantics, trimming of known spans."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import webrtcvad

from speech_assets.features import audio
from speech_assets.features.vad import (
    NoSpeech,
    SpeechSpan,
    VadConfig,
    classify_frames,
    collect_span,
    detect_speech,
    to_pcm16,
)
from speech_assets_tests.support.corpora import vowel, with_silence

SR = 16_000
# WebRTC's VAD keeps saying "speech" for a few frames after speech stops: its own hangover
# (vad_core.c kOverHangMax2*: up to 14 / 7 / 5 frames at 10 / 20 / 30 ms, i.e. <= 150 ms, in
# modes 0-1; less in 2-3). The collector's padding comes on top of that.
VAD_HANGOVER_S = 0.15


def reference_collector(flags: list[bool], padding_frames: int) -> tuple[int, int] | None:
    """py-webrtcvad example.py's vad_collector, reduced to (first start, last end) in frames."""
    maxlen = max(1, padding_frames)
    ring: deque[bool] = deque(maxlen=maxlen)
    triggered, first, end = False, None, 0
    for index, flag in enumerate(flags):
        ring.append(flag)
        if not triggered:
            if sum(ring) > 0.9 * ring.maxlen:
                triggered = True
                if first is None:
                    first = index - len(ring) + 1
                ring.clear()
        elif len(ring) - sum(ring) > 0.9 * ring.maxlen:
            triggered = False
            end = index + 1
            ring.clear()
    if first is None:
        return None
    return first, (len(flags) if triggered else end)


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"aggressiveness": 0, "frame_ms": 10, "padding_ms": 10},
        {"aggressiveness": 3, "frame_ms": 20, "padding_ms": 1000},
        {"min_speech_s": 0, "min_speech_ratio": 0.0},
        {"min_speech_ratio": 1.0, "min_speech_s": 2.5},
    ],
)
def test_vad_config_accepts_valid_values(kwargs):
    cfg = VadConfig(**kwargs)
    assert cfg.padding_frames == cfg.padding_ms // cfg.frame_ms >= 1
    assert cfg.as_dict()["aggressiveness"] == cfg.aggressiveness


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"aggressiveness": -1}, "aggressiveness"),
        ({"aggressiveness": 4}, "aggressiveness"),
        ({"aggressiveness": 1.5}, "aggressiveness"),
        ({"aggressiveness": True}, "aggressiveness"),
        ({"aggressiveness": "2"}, "aggressiveness"),
        ({"frame_ms": 15}, "frame_ms"),
        ({"frame_ms": 0}, "frame_ms"),
        ({"frame_ms": 30.0}, "frame_ms"),
        ({"padding_ms": 0}, "padding_ms"),
        ({"padding_ms": 20}, "padding_ms"),  # shorter than the default 30 ms frame
        ({"padding_ms": 20_000}, "padding_ms"),
        ({"min_speech_s": -0.1}, "min_speech_s"),
        ({"min_speech_s": float("nan")}, "min_speech_s"),
        ({"min_speech_ratio": -0.01}, "min_speech_ratio"),
        ({"min_speech_ratio": 1.5}, "min_speech_ratio"),
    ],
)
def test_vad_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VadConfig(**kwargs)


# --- collector ----------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_frames", [1, 2, 3, 9, 10, 11, 12, 20, 30, 100])
def test_collect_span_matches_reference_collector(padding_frames):
    rng = np.random.default_rng(padding_frames)
    for _ in range(300):
        flags: list[bool] = []
        voiced = bool(rng.random() < 0.5)
        length = int(rng.integers(0, 250))
        while len(flags) < length:
            run = int(rng.integers(1, 50))
            flags += list(rng.random(run) < (0.95 if voiced else 0.05))
            voiced = not voiced
        flags = [bool(f) for f in flags[:length]]
        assert collect_span(flags, padding_frames) == reference_collector(flags, padding_frames)


@pytest.mark.parametrize(
    ("flags", "padding", "expected"),
    [
        ([], 10, None),
        ([False] * 50, 10, None),
        ([True] * 9 + [False] * 40, 10, None),  # 9 of 10 is not "more than 90 %"
        ([False] * 5 + [True] * 20 + [False] * 20, 10, (5, 35)),  # un-triggers after 10 unvoiced frames
        ([False] * 5 + [True] * 20, 10, (5, 25)),  # still triggered at the end
        ([True] * 12 + [False] * 15 + [True] * 12 + [False] * 30, 10, (0, 49)),  # a 2nd segment extends the span
    ],
)
def test_collect_span_cases(flags, padding, expected):
    assert collect_span(flags, padding) == expected
    assert reference_collector(flags, padding) == expected


# --- detection on signals --------------------------------------------------------------------------


def test_webrtcvad_accepts_the_synthetic_vowel_and_not_silence():
    cfg = VadConfig()
    voiced = classify_frames(to_pcm16(audio.normalise_peak(vowel(2.0))), cfg)
    assert np.mean(voiced) > 0.9
    quiet = classify_frames(to_pcm16(np.zeros(SR, np.float32)), cfg)
    assert not any(quiet)


@pytest.mark.parametrize(
    ("aggressiveness", "frame_ms", "padding_ms"),
    [(2, 30, 300), (0, 30, 300), (3, 30, 300), (2, 10, 300), (2, 20, 300), (2, 30, 600), (1, 20, 200)],
)
def test_vad_trims_known_speech_span(aggressiveness, frame_ms, padding_ms):
    lead, speech, trail = 1.5, 3.0, 1.5
    wave = audio.normalise_peak(with_silence(lead, speech, trail))
    cfg = VadConfig(aggressiveness=aggressiveness, frame_ms=frame_ms, padding_ms=padding_ms)
    span = detect_speech(wave, cfg)
    assert isinstance(span, SpeechSpan), span
    frame, padding = frame_ms / 1000, padding_ms / 1000
    true_start, true_end = lead, lead + speech
    # Leading/trailing non-speech is trimmed to within one frame plus the collector padding
    # (plus WebRTC's own hangover at the end).
    assert true_start - padding - frame <= span.start_s <= true_start + frame
    assert true_end - frame <= span.end_s <= true_end + padding + frame + VAD_HANGOVER_S
    assert span.start_s > 0.5 and span.end_s < lead + speech + trail - 0.5  # really trimmed
    assert span.start_sample % cfg.frame_samples() == 0
    assert 0.4 < span.speech_ratio <= speech / (lead + speech + trail) + 0.1
    assert span.total_frames == wave.shape[0] // cfg.frame_samples()


def test_interior_pauses_are_kept():
    pause = np.zeros(SR, np.float32)
    wave = audio.normalise_peak(np.concatenate([with_silence(1.0, 1.5, 0.0), pause, vowel(1.5), pause]))
    span = detect_speech(wave, VadConfig())
    assert isinstance(span, SpeechSpan)
    assert span.start_s < 1.05 and span.end_s > 5.0 - 0.05  # one span over both bursts and the pause


def test_speech_to_the_end_keeps_the_tail():
    wave = audio.normalise_peak(with_silence(1.0, 2.0, 0.0))
    span = detect_speech(wave, VadConfig())
    assert isinstance(span, SpeechSpan)
    assert span.end_sample == wave.shape[0]


@pytest.mark.parametrize(
    ("wave", "match"),
    [
        (np.zeros(3 * SR, np.float32), "never triggered"),
        ((1e-4 * np.random.default_rng(0).standard_normal(3 * SR)).astype(np.float32), "never triggered"),
        (np.zeros(100, np.float32), "shorter than one"),
    ],
    ids=["digital-silence", "noise-floor", "too-short"],
)
def test_silence_is_no_speech_with_readable_detail(wave, match):
    result = detect_speech(audio.normalise_peak(wave), VadConfig())
    assert isinstance(result, NoSpeech)
    assert match in result.detail


def test_too_little_speech_thresholds():
    wave = audio.normalise_peak(with_silence(2.0, 0.6, 2.0))
    assert isinstance(detect_speech(wave, VadConfig(min_speech_s=0.3, min_speech_ratio=0.0)), SpeechSpan)
    short = detect_speech(wave, VadConfig(min_speech_s=1.0, min_speech_ratio=0.0))
    assert isinstance(short, NoSpeech) and "min_speech_s" in short.detail and short.span is not None
    sparse = detect_speech(wave, VadConfig(min_speech_s=0.0, min_speech_ratio=0.5))
    assert isinstance(sparse, NoSpeech) and "speech ratio" in sparse.detail


def test_detect_speech_validates_input():
    with pytest.raises(ValueError, match="mono"):
        detect_speech(np.zeros((2, SR), np.float32), VadConfig())
    with pytest.raises(ValueError, match="kHz"):
        detect_speech(np.zeros(SR, np.float32), VadConfig(), sample_rate=22_050)


def test_to_pcm16_clips_and_scales():
    pcm = to_pcm16(np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0], np.float32))
    assert pcm.dtype == np.int16
    assert pcm.tolist() == [0, 16383, -16383, 32767, -32767, 32767, -32768]


def test_to_pcm16_into_a_buffer_and_view_rows_match_bytes_frames():
    wave = audio.normalise_peak(with_silence(0.7, 1.5, 0.6, seed=5))
    out = np.full(wave.shape[0], 7, np.int16)
    assert to_pcm16(wave, out=out) is out
    np.testing.assert_array_equal(out, to_pcm16(wave))
    pcm = to_pcm16(wave)
    cfg = VadConfig(aggressiveness=1, frame_ms=10, padding_ms=100)
    # The reference: py-webrtcvad's own API on bytes frames.
    vad = webrtcvad.Vad(cfg.aggressiveness)
    data, step = pcm.tobytes(), 2 * cfg.frame_samples()
    expected = [vad.is_speech(data[i : i + step], SR) for i in range(0, len(data) - step + 1, step)]
    assert classify_frames(pcm, cfg) == expected
    assert classify_frames(pcm[:-1], cfg) == expected[: (pcm.shape[0] - 1) // cfg.frame_samples()]
    assert classify_frames(np.zeros(0, np.int16), cfg) == []
    with pytest.raises(ValueError, match="mono"):
        classify_frames(np.zeros((2, SR), np.int16), cfg)


@pytest.mark.parametrize(
    "wave",
    [
        np.array([0.0, 1.0, -1.0, 0.5, -0.5, 1e-9, -1e-9, 0.99999994, -0.99999994, 3.0518e-05], np.float32),
        audio.normalise_peak(with_silence(0.4, 1.0, 0.4, seed=8)),
        audio.normalise_peak(np.random.default_rng(9).uniform(-1e-3, 1e-3, SR).astype(np.float32)),  # gain capped
        np.zeros(0, np.float32),
    ],
    ids=["edges", "speech", "quiet", "empty"],
)
def test_in_range_quantisation_is_the_clipping_one(wave):
    """``in_range`` skips the clipping pass and nothing else: the same int16 values, into a buffer too."""
    expected = to_pcm16(wave)
    np.testing.assert_array_equal(to_pcm16(wave, in_range=True), expected)
    out = np.full(wave.shape, 7, np.int16)
    assert to_pcm16(wave, out=out, in_range=True) is out
    np.testing.assert_array_equal(out, expected)


def test_a_peak_normalised_wave_gets_the_same_span():
    for seed in range(10, 14):
        wave = audio.normalise_peak(with_silence(0.5, 1.5, 0.5, noise=1e-2 * (seed - 9), seed=seed))
        assert detect_speech(wave, VadConfig(), peak_normalised=True) == detect_speech(wave, VadConfig())


def test_detect_speech_reuses_its_buffers_without_leaking_between_calls():
    long = audio.normalise_peak(with_silence(1.0, 3.0, 1.0, seed=6))
    short = audio.normalise_peak(with_silence(0.3, 1.0, 0.3, seed=7))
    expected = detect_speech(short.copy(), VadConfig())
    detect_speech(long, VadConfig())
    assert detect_speech(short, VadConfig()) == expected


def test_detection_is_deterministic_and_stateless():
    wave = audio.normalise_peak(with_silence(1.0, 2.0, 1.0, seed=3))
    other = audio.normalise_peak(with_silence(0.3, 1.0, 0.3, noise=3e-2, seed=4))
    first = detect_speech(wave, VadConfig())
    detect_speech(other, VadConfig())  # a fresh VAD per call: no state leaks between utterances
    assert detect_speech(wave, VadConfig()) == first
