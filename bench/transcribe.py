"""Benchmark `speech-assets transcribe`: real-time factor and peak memory against audio length.

    .venv/bin/python bench/transcribe.py [--minutes 1 10 30] [--threads 1 2] [--model FOLDER]

Audio: the committed sample corpus's utterances (``data/sample``) concatenated with 0.4 s pauses
until each length, written as 16-bit FLAC. Model: ``--model`` (a recogniser folder), else a
randomly initialised ``tiny`` recogniser exported as ``finetuned_asr`` exports one (its text is
noise; its cost is the trained one's). Each (length, threads) runs in a fresh interpreter that
imports no torch: it loads the folder, transcribes the file greedily (segments of at most 20 s,
batches of 8) and reports its wall and CPU seconds and its peak RSS (``ru_maxrss``, the kernel's
high-water mark of the process). Real-time factor = wall seconds / audio seconds (lower is faster);
CPU seconds / audio seconds is the figure to read when other work shares the cores.
With ``onnxruntime-gpu`` installed the CUDA provider is used, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHILD = """
import json, resource, sys, time
from speech_assets.evaluation.recognise import Recogniser
start = time.perf_counter()
recogniser = Recogniser(sys.argv[1], threads=int(sys.argv[3]))
(transcript,) = recogniser.transcribe_all([sys.argv[2]])
wall = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
assert transcript.error is None, transcript.error
print(json.dumps({"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024,
    "seconds": transcript.seconds, "segments": len(transcript.segments), "provider": recogniser.providers[0],
    "torch": any(m.split(".")[0] == "torch" for m in sys.modules)}))
"""


def tiny_recogniser(folder: Path) -> Path:
    import torch

    from speech_assets.evaluation.recognise import vocabulary
    from speech_assets.evaluation.text import VOCAB_SIZE
    from speech_assets.features.cmvn import UtteranceCmvn, describe
    from speech_assets.features.vad import VadConfig
    from speech_assets.model.export import export_recogniser
    from speech_assets.model.hubert import HubertPretrainModel
    from speech_assets.model.presets import get_preset

    torch.manual_seed(0)
    model = HubertPretrainModel(get_preset("tiny"), {"ctc": VOCAB_SIZE}).eval()
    folder.mkdir()
    export_recogniser(model, folder, [np.zeros((40, 80), np.float32)])
    card = {
        "vocabulary": vocabulary(),
        "cmvn": describe(UtteranceCmvn()),
        "featurisation": {"vad": VadConfig().as_dict()},
    }
    (folder / "recogniser.json").write_text(json.dumps(card))
    return folder


def long_audio(minutes: float, path: Path) -> Path:
    from speech_assets.features.audio import load_16k_mono

    parts = [load_16k_mono(p) for p in sorted((REPO / "data" / "sample").rglob("*.flac"))]
    gap, wave, have, i = np.zeros(6400, np.float32), [], 0, 0
    while have < minutes * 60 * 16_000:
        wave += [parts[i % len(parts)], gap]
        have, i = have + len(parts[i % len(parts)]) + len(gap), i + 1
    sf.write(path, np.concatenate(wave)[: int(minutes * 60 * 16_000)], 16_000, subtype="PCM_16")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, nargs="+", default=[1, 10, 30])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", type=Path, help="a recogniser folder (default: a random tiny one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-transcribe.") as tmp:
        folder = args.model or tiny_recogniser(Path(tmp) / "recogniser")
        columns = "audio threads segments wall_s CPU_s real-time_factor CPU_s/audio_s peak_RSS_MB provider".split()
        print("| " + " | ".join(c.replace("_", " ") for c in columns) + " |\n" + "|---" * len(columns) + "|")
        for minutes in args.minutes:
            audio = long_audio(minutes, Path(tmp) / f"{minutes:g}min.flac")
            for threads in args.threads:
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, str(folder), str(audio), str(threads)],
                    capture_output=True,
                    text=True,
                    cwd=REPO,
                    check=True,
                )
                got = json.loads(out.stdout.splitlines()[-1])
                assert not got["torch"], "transcribe imported torch"
                print(
                    f"| {minutes:g} min | {threads} | {got['segments']} | {got['wall']:.1f} | {got['cpu']:.1f} | "
                    f"{got['wall'] / got['seconds']:.4f} | {got['cpu'] / got['seconds']:.4f} | {got['rss_mb']:.0f} | "
                    f"{got['provider']} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
