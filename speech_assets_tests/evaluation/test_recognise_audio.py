"""`speech-assets transcribe` on real recordings: long files cut at pauses into bounded segments,
word times and confidences, unique ids, raw audio in with no torch, and parity with the pipeline
(a random `tiny` recogniser exported as finetuned_asr exports one)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from speech_assets.cli import main
from speech_assets.evaluation.recognise import (
    FEATURE_ATOL,
    Recogniser,
    audio_parity,
    labelled_files,
    plan_segments,
)
from speech_assets.features import audio
from speech_assets.features.cmvn import UtteranceCmvn
from speech_assets.features.featurize import FeatureExtractor
from speech_assets_tests.conftest import SAMPLE_CORPUS
from speech_assets_tests.evaluation.test_finetune import recogniser_folder

SAMPLES = sorted(SAMPLE_CORPUS.rglob("*.flac"))
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tiny_recogniser) -> Path:
    return recogniser_folder(tiny_recogniser, tmp_path_factory.mktemp("recogniser") / "r", None)


@pytest.fixture(scope="module")
def long_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 2.5 minutes of real speech: sample utterances with half a second of silence between."""
    gap = np.zeros(8000, np.float32)
    wave = np.concatenate([part for path in SAMPLES[:30] for part in (audio.load_16k_mono(path), gap)])
    path = tmp_path_factory.mktemp("long") / "long.flac"
    sf.write(path, wave, 16_000)
    return path


class Spy(Recogniser):
    """The recogniser, recording the longest row (samples) of each onnxruntime batch."""

    rows: list[int]

    def log_probs(self, waves):
        self.rows = [*getattr(self, "rows", []), max(len(w) for w in waves)]
        return super().log_probs(waves)


def test_long_audio_is_cut_at_pauses_else_with_overlap() -> None:
    """Mutation killed: cutting at the window's end even where a pause lies in it (first case)."""
    flags = np.ones(100, bool)
    flags[20:40] = False
    assert plan_segments(flags, 0, 100, 50, 10, 5, 4) == [(0, 25, 0, 30), (35, 85, 30, 83), (81, 100, 83, 100)]
    # no pause: hard cuts, each segment starting `overlap` frames before the last one ended
    assert plan_segments(np.ones(100, bool), 0, 100, 30, 10, 10, 4) == [
        (0, 30, 0, 28),
        (26, 56, 28, 54),
        (52, 82, 54, 80),
        (78, 100, 80, 100),
    ]


def test_long_audio_goes_through_bounded_segments_in_batches(folder: Path, long_file: Path) -> None:
    """A long file is transcribed in segments of at most max_segment_s, several to a batch, so no
    onnxruntime input (and no attention matrix) grows with the file. Fails on today's code
    (no segments: the whole file is one input)."""
    recogniser = Spy(folder, max_segment_s=8.0, batch_size=4)
    (transcript,) = recogniser.transcribe_all([long_file])
    assert transcript.error is None and transcript.seconds > 140
    assert max(recogniser.rows) <= 8 * 16_000 and len(recogniser.rows) >= 5
    segments = transcript.segments
    assert len(segments) >= 140 / 8 and all(s.end - s.start <= 8.0 for s in segments)
    assert all(a.start < b.start and a.end <= b.end for a, b in zip(segments, segments[1:]))
    assert transcript.text == " ".join(s.text for s in segments if s.text)
    assert len({s.text for s in segments}) > len(segments) / 2  # each segment decoded from its own log-probs


def test_word_times_are_monotonic_inside_the_file_with_confidences(folder: Path, long_file: Path, capsys) -> None:
    """`--json` gives each segment's times and text and each word's start, end and confidence;
    the plain output stays one line per file."""
    assert main(["transcribe", str(long_file), "--model", str(folder), "--json", "--max-segment-s", "8"]) == 0
    record = json.loads(capsys.readouterr().out)
    words = [w for s in record["segments"] for w in s["words"]]
    assert words and [w["word"] for w in words] == record["text"].split()
    assert all(0 <= w["start"] < w["end"] <= record["seconds"] and 0 < w["confidence"] <= 1 for w in words)
    assert all(a["end"] <= b["start"] + 1e-9 for a, b in zip(words, words[1:]))
    for segment in record["segments"]:
        assert all(segment["start"] <= w["start"] and w["end"] <= segment["end"] for w in segment["words"])
    assert main(["transcribe", str(long_file), "--model", str(folder), "--format", "srt", "--max-segment-s", "8"]) == 0
    srt = capsys.readouterr().out
    assert srt.startswith("1\n00:00:") and srt.count(" --> ") == sum(bool(s["text"]) for s in record["segments"])
    assert main(["transcribe", str(long_file), "--model", str(folder)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_unique_ids_for_one_stem_and_every_libsndfile_suffix(tmp_path: Path, monkeypatch) -> None:
    """Fails on today's code: ids were stems (`a` twice) and folders read only .flac/.wav."""
    wave = audio.load_16k_mono(SAMPLES[0])
    for name in ("in/a.wav", "in/a.flac", "in/sub/a.ogg", "in/b.aiff", "other/a.wav"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        sf.write(tmp_path / name, wave, 16_000)
    (tmp_path / "in" / "notes.txt").write_text("not audio")
    ids = [name for name, _ in labelled_files([tmp_path / "in", tmp_path / "other"])]
    assert ids == ["a.flac", "a.wav", "b.aiff", "sub/a.ogg", f"{(tmp_path / 'other/a.wav').as_posix()}"]
    assert labelled_files([tmp_path / "in/a.wav", tmp_path / "in/a.wav"])[1][0].endswith("a.wav#2")
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{tmp_path / 'in/a.wav'}\n{tmp_path / 'in/b.aiff'}\n"))
    assert [name for name, _ in labelled_files(["-"])] == [str(tmp_path / "in/a.wav"), str(tmp_path / "in/b.aiff")]


def test_unique_ids_in_the_transcribe_output(folder: Path, tmp_path: Path, capsys) -> None:
    wave = audio.load_16k_mono(SAMPLES[0])
    for name in ("a.wav", "a.flac"):
        sf.write(tmp_path / name, wave, 16_000)
    assert main(["transcribe", str(tmp_path), "--model", str(folder)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["a.flac", "a.wav"]
    assert all(len(line.split("\t")) == 3 for line in lines)  # both transcribed


BLOCK_TORCH = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchaudio"):
            raise ImportError(f"{name} is unimportable in this test")
sys.meta_path.insert(0, Blocked())
from speech_assets.cli import main
status = main(sys.argv[1:])
heavy = {m.split(".")[0] for m in sys.modules} & {"torch", "torchaudio", "pyarrow", "dagster", "mlflow"}
assert not heavy, f"{sorted(heavy)} imported: transcribe needs onnxruntime, numpy, soundfile (and webrtcvad)"
sys.exit(status)
"""


def test_transcribe_is_torch_free(folder: Path) -> None:
    """Fails on today's code: the pipeline's featurisation imports torch (an error line, exit 1)."""
    command = [
        sys.executable,
        "-c",
        BLOCK_TORCH,
        "transcribe",
        str(SAMPLES[0]),
        str(SAMPLES[1]),
        "--model",
        str(folder),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert [line.split("\t")[0] for line in proc.stdout.splitlines()] == [str(SAMPLES[0]), str(SAMPLES[1])]


def test_raw_audio_parity_with_the_pipeline(folder: Path, tiny_recogniser) -> None:
    """frontend.onnx gives the pipeline's CMVN log-mel within FEATURE_ATOL (a padded batch row as
    its own), and transcribing the audio gives the pipeline's greedy text."""
    recogniser = Recogniser(folder)
    waves = [audio.normalise_peak(audio.load_16k_mono(path)) for path in SAMPLES[:2]]
    feats, lengths = recogniser.features(waves)
    for wave, row, length in zip(waves, feats, lengths):
        expected = UtteranceCmvn().apply(FeatureExtractor()(wave)[0], "logmel")
        assert length == len(expected) and np.abs(row[:length] - expected).max() <= FEATURE_ATOL
        assert not row[length:].any()
    model = tiny_recogniser[0]  # the model recogniser_folder exported
    parity = audio_parity(folder, model, UtteranceCmvn(), SAMPLES[:4])
    assert parity["utterances"] == parity["same_text"] == 4 and parity["feature_max_abs_diff"] <= FEATURE_ATOL


GOOD = {"utterances": 8, "same_text": 8, "feature_max_abs_diff": 1e-4, "feature_atol": FEATURE_ATOL}


@pytest.mark.parametrize(
    ("record", "passed"),
    [(GOOD, True), ({**GOOD, "same_text": 7}, False), ({**GOOD, "feature_max_abs_diff": 0.01}, False), ({}, False)],
)
def test_raw_audio_parity_check_fails_on_other_text_or_features(tmp_path: Path, record: dict, passed: bool) -> None:
    from speech_assets.defs.model_checks import recogniser_reads_raw_audio
    from speech_assets.defs.resources import StoragePaths
    from speech_assets.layout import DataLayout, RecogniserFiles

    card = RecogniserFiles(DataLayout(tmp_path).finetune.recogniser).card
    card.parent.mkdir(parents=True)
    card.write_text(json.dumps({"audio_parity": record}))
    paths = StoragePaths(corpus=str(tmp_path), data_dir=str(tmp_path), mlflow_tracking_uri="sqlite://")
    assert recogniser_reads_raw_audio(paths=paths).passed is passed
