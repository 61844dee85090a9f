"""The exported recogniser at work: audio files in, text out (``speech-assets transcribe``).

A recogniser folder (what ``finetuned_asr`` writes under ``<data>/finetune/recogniser/``) holds
``recogniser.onnx`` (log-mel ``(B, T, 80)`` with CMVN applied, ``lengths (B,)`` -> CTC
``log_probs (B, L, 29)``, ``output_lengths (B,)``) and ``recogniser.json`` (featurisation, VAD,
CMVN, vocabulary, parity). Each file is read as the pipeline reads the corpus
(:func:`speech_assets.features.build.process_variants`: any format libsndfile decodes, mixed to
mono, resampled to 16 kHz, peak-normalised, VAD-trimmed, 80 log-mel bands), normalised with the
recorded CMVN, run through onnxruntime on the CPU and decoded greedily, or (``decoder="beam"``)
by lexicon beam search with the word n-gram LM that the exported run built from its labelled
transcripts: ``recogniser.json``'s ``beam`` names the ARPA file and the lexicon in the folder
(:func:`speech_assets.evaluation.decoding.write_lm_files`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speech_assets.corpus.manifest import AUDIO_SUFFIXES
from speech_assets.evaluation.text import ALPHABET, BLANK, decode_greedy
from speech_assets.layout import FinetuneFiles, RecogniserFiles

DECODERS = ("greedy", "beam")


class RecogniserError(ValueError):
    """A recogniser folder that cannot be used, or a file that cannot be transcribed."""


def vocabulary() -> list[str]:
    """Token ``i``'s text: ``""`` for the blank (0), then the alphabet (what the JSON records)."""
    return ["" if i == BLANK else ALPHABET[i - 1] for i in range(len(ALPHABET) + 1)]


def model_folder(path: str | os.PathLike[str]) -> Path:
    """The recogniser folder of ``path``: the folder itself, or the folder of its ONNX or JSON file."""
    path = Path(path)
    folder = path.parent if path.suffix in (".onnx", ".json") else path
    files = RecogniserFiles(folder)
    if not files.onnx.is_file() or not files.card.is_file():
        raise RecogniserError(
            f"no recogniser at {path}: expected {RecogniserFiles.onnx.name} and {RecogniserFiles.card.name} "
            "(materialize finetuned_asr)"
        )
    return folder


def fetch_recogniser(uri: str, destination: Path, tracking_uri: str) -> Path:
    """The recogniser MLflow model ``uri`` (``models:/speech_assets_recogniser/latest``, ``.../<version>``,
    ``runs:/<run id>/recogniser``; what ``finetuned_asr`` logs and registers) downloaded from
    ``tracking_uri`` into ``destination`` and laid out as a recogniser folder (its ONNX model,
    ``recogniser.json`` and the files that JSON names). :class:`RecogniserError` when the model
    cannot be found or is not a recogniser."""
    from speech_assets.train.tracking import download_onnx_model

    try:
        onnx_file, extras = download_onnx_model(uri, tracking_uri, destination / "download")
    except ValueError as error:
        raise RecogniserError(str(error)) from error
    card = RecogniserFiles.card.name
    if card not in extras:
        raise RecogniserError(
            f"{uri} is not a speech_assets recogniser: the model has no {card} beside its ONNX file "
            "(finetuned_asr logs the recogniser with it)"
        )
    files = RecogniserFiles(destination / FinetuneFiles.recogniser.name)
    files.root.mkdir(parents=True)
    onnx_file.replace(files.onnx)
    for name, path in extras.items():
        path.replace(files.root / name)
    return files.root


def audio_files(inputs: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """``inputs`` in order, each folder replaced by the audio files under it (sorted; the suffixes
    the manifest reads); a named file is kept whatever its suffix (decoding decides)."""
    found: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            found += sorted(p for p in item.rglob("*") if p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES)
        else:
            found.append(item)
    return found


@dataclass(frozen=True)
class Transcript:
    """One file's outcome: ``text`` and the audio's ``seconds``, or ``error`` (and no text)."""

    id: str
    path: str
    text: str | None
    seconds: float | None
    error: str | None = None

    def line(self) -> str:
        if self.error is not None:
            return f"{self.id}\terror: {self.error}"
        return f"{self.id}\t{self.text}\t{self.seconds:.2f}"


class Recogniser:
    """A recogniser folder loaded for transcription (onnxruntime, CPU), decoding with ``decoder``
    (one of :data:`DECODERS`)."""

    def __init__(self, path: str | os.PathLike[str], decoder: str = "greedy") -> None:
        import onnxruntime

        from speech_assets.features.cmvn import from_record
        from speech_assets.features.featurize import FeatureExtractor
        from speech_assets.features.vad import VadConfig

        self.folder = model_folder(path)
        self.files = RecogniserFiles(self.folder)
        self.spec = json.loads(self.files.card.read_text(encoding="utf-8"))
        if self.spec.get("vocabulary") != vocabulary():
            raise RecogniserError(f"{self.files.card}: its vocabulary is not this version's {len(vocabulary())} tokens")
        self.cmvn = from_record(self.spec.get("cmvn"))
        if self.cmvn is None:
            raise RecogniserError(f"{self.files.card} records no CMVN")
        self.vad = VadConfig(**self.spec["featurisation"]["vad"])
        self.extractor = FeatureExtractor()
        self.session = onnxruntime.InferenceSession(str(self.files.onnx), providers=["CPUExecutionProvider"])
        if decoder not in DECODERS:
            raise RecogniserError(f"unknown decoder {decoder!r}; known: {', '.join(DECODERS)}")
        self.beam = self._beam() if decoder == "beam" else None

    def _beam(self):
        """The beam decoder of the files ``recogniser.json`` names (inside the folder only)."""
        from speech_assets.evaluation.decoding import beam_decoder_from_files, unavailable

        beam = self.spec.get("beam")
        if not beam:
            raise RecogniserError(
                f"{self.files.card} records no n-gram LM and lexicon for beam decoding "
                "(rematerialize finetuned_asr with the beam decoder installed), or use --decoder greedy"
            )
        files = []
        for key in ("lm", "lexicon"):
            name = str(beam.get(key) or "")
            if not name or Path(name).name != name or not (self.folder / name).is_file():
                raise RecogniserError(f"{self.files.card}: beam {key} file {name!r} is not in {self.folder}")
            files.append(self.folder / name)
        if reason := unavailable():
            raise RecogniserError(f"beam decoding cannot run here: {reason}")
        return beam_decoder_from_files(
            *files,
            beam_size=int(beam["beam_size"]),
            lm_weight=float(beam["lm_weight"]),
            word_score=float(beam["word_score"]),
        )

    def log_probs(self, feats: np.ndarray) -> np.ndarray:
        """``(L, 29)`` CTC log-probabilities of normalised log-mel ``feats (T, 80)``."""
        log_probs, lengths = self.session.run(
            ["log_probs", "output_lengths"],
            {"feats": feats[None].astype(np.float32), "lengths": np.array([feats.shape[0]], dtype=np.int64)},
        )
        return log_probs[0, : int(lengths[0])]

    def transcribe(self, path: str | os.PathLike[str]) -> Transcript:
        """``path``'s transcript, or its error (unreadable, no speech, too short)."""
        from speech_assets.features.build import process_variants
        from speech_assets.features.shards import FeatureRecord

        path = Path(path)
        utt_id = path.stem
        if not path.is_file():
            return Transcript(utt_id, str(path), None, None, f"no such file: {path}")
        (record,) = process_variants(path, utt_id, "", "", self.vad, self.extractor)
        if not isinstance(record, FeatureRecord):
            return Transcript(utt_id, str(path), None, None, f"{record.reason}: {record.detail}")
        if record.num_frames < 2:
            return Transcript(utt_id, str(path), None, None, "too_short: less than 2 feature frames of speech")
        feats = self.cmvn.apply(record.logmel, "logmel")
        log_probs = self.log_probs(feats)
        text = self.beam([log_probs])[0] if self.beam else decode_greedy(log_probs.argmax(axis=-1).tolist())
        return Transcript(utt_id, str(path), text, round(float(record.duration_s), 3))

    def transcribe_all(self, paths: Iterable[str | os.PathLike[str]]) -> Iterator[Transcript]:
        for path in paths:
            try:
                yield self.transcribe(path)
            except Exception as error:  # noqa: BLE001 - one bad file must not stop the others
                yield Transcript(Path(path).stem, str(path), None, None, f"{type(error).__name__}: {error}")
