"""Manifest benchmark: first validation of a corpus vs a re-run over the unchanged corpus.

    python bench/manifest.py [--files 1024] [--workers N]

Builds a LibriSpeech-layout corpus of at least ``--files`` FLAC files by replicating the
committed sample under new speaker ids (each copy one sample apart, so that none is a duplicate), then times what the
``manifest`` asset does (scan,
full decode, write manifest/rejects/cache) cold, and again with the decode cache over the
unchanged corpus. Target (issue 2): the re-run costs under a tenth of the first run.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's speech_assets and the tests' support/

from speech_assets.corpus import manifest as m  # noqa: E402
from speech_assets.corpus.rejects import write_rejects  # noqa: E402
from speech_assets_tests.support.corpora import copy_recording  # noqa: E402

SAMPLE = REPO / "data" / "sample"


def build_corpus(root: Path, files: int) -> int:
    sources = sorted(SAMPLE.rglob("*.flac"))
    copies = -(-files // len(sources))
    count = 0
    for copy in range(copies):
        for src in sources:
            speaker, chapter, utt = src.stem.split("-")
            new_speaker = f"{copy + 1}{speaker}"
            folder = root / new_speaker / chapter
            folder.mkdir(parents=True, exist_ok=True)
            utt_id = f"{new_speaker}-{chapter}-{utt}"
            if copy == 0:
                shutil.copyfile(src, folder / f"{utt_id}.flac")
            else:  # one recording under two ids would be a duplicate_audio reject
                copy_recording(src, folder / f"{utt_id}.flac", nudge=copy)
            text = dict(
                line.split(" ", 1) for line in (src.parent / f"{speaker}-{chapter}.trans.txt").read_text().splitlines()
            )
            with open(folder / f"{new_speaker}-{chapter}.trans.txt", "a") as handle:
                handle.write(f"{utt_id} {text[src.stem]}\n")
            count += 1
    return count


def run_once(corpus: Path, out: Path, workers: int) -> tuple[float, m.ScanResult]:
    started = time.perf_counter()
    cache = m.load_cache(out / "decode_cache.parquet")
    result = m.scan_corpus(corpus, cache=cache, workers=workers)
    m.write_manifest(out / "manifest.parquet", result.rows)
    write_rejects(out / "rejects.parquet", result.rejects)
    if result.cache != cache:
        m.save_cache(out / "decode_cache.parquet", result.cache)
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}")
    with tempfile.TemporaryDirectory() as tmp:
        corpus, out = Path(tmp) / "corpus", Path(tmp) / "out"
        out.mkdir()
        files = build_corpus(corpus, args.files)
        first, result = run_once(corpus, out, args.workers)
        hours = sum(r.duration_s for r in result.rows) / 3600
        second, again = run_once(corpus, out, args.workers)
        print(f"corpus: {files} FLAC files, {hours:.2f} h, {args.workers} decode workers")
        print(
            f"first run (decodes every file): {first:8.2f} s  ({result.decoded_files} decoded, "
            f"{hours * 3600 / first:.0f}x real time)"
        )
        print(f"no-change re-run (cache hits):  {second:8.2f} s  ({again.decoded_files} decoded)")
        ratio = second / first
        print(f"re-run / first = {ratio:.3f}  (target < 0.1: {'PASS' if ratio < 0.1 else 'FAIL'})")


if __name__ == "__main__":
    main()
