"""Listenable reject examples for the offline report: the first ``MAX_CLIP_S`` seconds of each one's
audio as 16 kHz FLAC under ``<report>/audio/`` and, for ``no_speech``, the VAD's decision drawn. A clip
is named by a hash of the reject (never by anything from the manifest); only files inside the corpus root
are read.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speech_assets.utils import atomic_path

MAX_CLIP_S = 6.0
MAX_VAD_S = 60.0  # a no_speech decision is redrawn from at most this much of the file
MAX_EXAMPLES = 24
MAX_BYTES = 4 * 2**20
# no audio to play: the file is missing, cannot be decoded, or lies outside the corpus
SILENT_REASONS = frozenset({"missing_file", "unreadable", "outside_root"})
SPEED_COPY = re.compile(r"-sp\d+_\d+$")  # <utt_id>-sp0_9: a speed-perturbed copy of <utt_id>


@dataclass(frozen=True)
class RejectExample:
    """One reject shown in the report; without a clip, ``note`` says why."""

    stage: str
    reason: str
    utt_id: str
    path: str
    detail: str
    clip: str | None
    note: str
    vad_png: bytes | None = None


def clip_name(stage: str, reason: str, utt_id: str, path: str, stat: os.stat_result) -> str:
    """A hash of the reject and of its file's size and time."""
    key = "\x1f".join([stage, reason, utt_id, path, str(stat.st_size), str(stat.st_mtime_ns)])
    return "reject-" + hashlib.sha256(key.encode()).hexdigest()[:24] + ".flac"


def _inside(path: Path, root: Path) -> Path | None:
    """``path`` resolved (symlinks and ``..`` followed) if inside ``root``, else ``None``."""
    try:
        resolved = path.resolve(strict=True)
        resolved.relative_to(root.resolve())
    except (OSError, ValueError):
        return None
    return resolved


def _read_16k(path: Path, seconds: float) -> np.ndarray:
    """At most ``seconds`` of ``path`` as peak-normalised 16 kHz mono float32 ``(N,)``."""
    import soundfile as sf

    from speech_assets.features import audio

    with sf.SoundFile(os.fspath(path)) as handle:
        rate = int(handle.samplerate)
        data = handle.read(frames=int(seconds * rate), dtype="float32", always_2d=True)
    if data.shape[0] == 0:
        raise audio.DecodeError("zero-length audio")
    return audio.to_16k_mono(data.T, rate)


def _vad_picture(wave: np.ndarray, vad) -> bytes:
    from speech_assets.features.vad import SpeechSpan, classify_frames, detect_speech, to_pcm16
    from speech_assets.stats import plots

    flags = classify_frames(to_pcm16(wave), vad)
    decision = detect_speech(wave, vad, peak_normalised=True)
    span = decision if isinstance(decision, SpeechSpan) else decision.span
    return plots.vad_decision(wave, flags, vad.frame_ms, None if span is None else (span.start_s, span.end_s))


def reject_examples(
    rows: Sequence[tuple[str, str, str, str, str]],
    corpus_root: Path | None,
    out_dir: Path,
    vad=None,
    *,
    max_examples: int = MAX_EXAMPLES,
    max_bytes: int = MAX_BYTES,
) -> list[RejectExample]:
    """Clips (written to ``out_dir``) for ``rows`` (``stage, reason, utt_id, path, detail``), in
    order, within the bounds; ``vad`` (a :class:`~speech_assets.features.vad.VadConfig`) draws the
    ``no_speech`` decisions. Unused files in ``out_dir`` are left to :func:`remove_unused`."""
    import soundfile as sf

    out_dir.mkdir(parents=True, exist_ok=True)
    examples, written, clips = [], 0, 0
    for stage, reason, utt_id, path, detail in rows:
        row = (stage, reason, utt_id, path or "", detail or "")
        if reason in SILENT_REASONS or not path:
            skipped = "no audio to play for this reason"
        elif (resolved := _inside(Path(path), corpus_root) if corpus_root is not None else None) is None:
            skipped = "not played: the file is not inside the corpus"
        elif clips >= max_examples or written >= max_bytes:
            skipped = "not copied: the report's bound on audio examples is reached"
        else:
            try:
                name = clip_name(stage, reason, utt_id, path, resolved.stat())
                long = _read_16k(resolved, MAX_VAD_S if reason == "no_speech" and vad is not None else MAX_CLIP_S)
            except Exception as error:  # noqa: BLE001 - a decoding failure is a note on the page, not a failed report
                skipped = f"not played: {type(error).__name__}"
            else:
                flac = io.BytesIO()
                sf.write(flac, np.clip(long[: int(MAX_CLIP_S * 16_000)], -1.0, 1.0), 16_000, "PCM_16", format="FLAC")
                payload = flac.getvalue()
                too_many_bytes = written + len(payload) > max_bytes
                skipped = "not copied: the report's bound on audio bytes is reached" if too_many_bytes else None
        if skipped is not None:
            examples.append(RejectExample(*row, clip=None, note=skipped))
            continue
        target = out_dir / name
        if not target.is_file() or target.stat().st_size != len(payload):
            with atomic_path(target, durable=False) as tmp:
                Path(tmp).write_bytes(payload)
        written += len(payload)
        clips += 1
        # a speed-perturbed copy's decision was made on other audio than the file's: not redrawn
        perturbed = SPEED_COPY.search(utt_id) is not None
        picture = _vad_picture(long, vad) if reason == "no_speech" and vad is not None and not perturbed else None
        original = " (the original of this speed-perturbed copy)" if perturbed else ""
        note = f"first {min(len(long) / 16_000, MAX_CLIP_S):.1f} s, 16 kHz mono{original}"
        examples.append(RejectExample(*row, clip=name, note=note, vad_png=picture))
    return examples


def remove_unused(out_dir: Path, used: set[str]) -> None:
    """Delete the clips in ``out_dir`` that the current report does not play."""
    for stale in out_dir.glob("reject-*.flac"):
        if stale.name not in used:
            stale.unlink(missing_ok=True)
