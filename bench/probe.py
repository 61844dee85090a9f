"""Downstream probe table (model against CER) and the distilled student's CPU speed against its teacher.

    make demo && python bench/probe.py --data-dir data/out          # outputs of a finished build
    python bench/probe.py --data-dir data/out --steps 800 --probe bilstm

Reads the newest ``training/*/final.pt`` (teacher), ``distill/*/final.pt`` (student) and
``federated/*/final.pt`` of a built data dir, then in one process: the same CTC probe on fbank
(log-mel), a random encoder, the pretrained, federated and distilled encoders (training speakers
-> the clients table's held-out speakers, greedy CER/WER via jiwer; each model through the input
normalisation its checkpoint records, one probe per seed; mean ± std over seeds and the paired
verdict over held-out utterances against fbank and random), and single-thread forward speed of student and
teacher on the same held-out utterances (best of 3 rounds, taking turns). Prints both tables and
the machine; record them in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def newest(pattern: str, root: Path) -> Path | None:
    found = sorted(root.glob(pattern), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=REPO / "data" / "out")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--probe", default="linear", choices=["linear", "bilstm"])
    parser.add_argument(
        "--seeds", default="0,1,2", help="probe seeds, comma-separated (each model: one probe per seed)"
    )
    parser.add_argument("--max-train", type=int, default=400)
    parser.add_argument("--max-eval", type=int, default=200)
    args = parser.parse_args()

    import pyarrow.parquet as pq
    import torch

    from speech_assets.corpus.clients import read_clients
    from speech_assets.evaluation.compare import (
        compare_encoders,
        leaderboard,
        leaderboard_markdown,
        markdown_table,
        split_utterances,
        standing,
    )
    from speech_assets.evaluation.encoders import load_utterances
    from speech_assets.evaluation.probe_options import ProbeOptions
    from speech_assets.evaluation.protocol import probe_models
    from speech_assets.model.encoders import load_encoder
    from speech_assets.model.speed import forward_speed
    from speech_assets.train.distill import encoder_parameters

    data = args.data_dir.resolve()
    teacher_path = newest("training/*/final.pt", data)
    if teacher_path is None:
        sys.exit(f"no training/*/final.pt under {data}: run `make demo` (or point --data-dir at a build)")
    encoders = {"pretrained": load_encoder(teacher_path)}
    for name, pattern in (("federated", "federated/*/final.pt"), ("distilled", "distill/*/final.pt")):
        if (path := newest(pattern, data)) is not None:
            encoders[name] = load_encoder(path)

    # the baselines read the input the way the pretrained encoder does; the random encoder is seed 0's
    models = probe_models(encoders, seed=0)
    clients = read_clients(data / "clients" / "clients.parquet")
    held = {a.speaker_id for a in clients if a.heldout}
    manifest = pq.read_table(data / "manifest" / "manifest.parquet", columns=["utt_id", "transcript"]).to_pydict()
    shards = [
        data / "features" / "shards" / f"{a.speaker_id}.parquet" for a in sorted(clients, key=lambda a: a.speaker_id)
    ]
    utterances = load_utterances(shards, dict(zip(manifest["utt_id"], manifest["transcript"], strict=True)))
    train, test = split_utterances(utterances, held, args.max_train, args.max_eval)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    print(
        f"machine: {platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}"
    )
    print(f"data: {data}; {len(train)} training utterances, {len(test)} held-out ({len(held)} held-out speakers)")
    started = time.perf_counter()
    results = compare_encoders(train, test, models, ProbeOptions(probe=args.probe, steps=args.steps, seeds=seeds))
    print(
        f"\nprobe ({args.probe}, {args.steps} steps, seeds {list(seeds)}), "
        f"{time.perf_counter() - started:.0f} s for all models:\n"
    )
    print(leaderboard_markdown(leaderboard(results)))
    print()
    print(markdown_table(results))
    print()
    print("\n".join(standing(results)))
    if "distilled" in encoders:
        teacher, student = encoders["pretrained"].model, encoders["distilled"].model
        speed = forward_speed(
            {"teacher": teacher, "student": student}, [u.feats for u in test[:32]], repeats=3, threads=1
        )
        print("\n| encoder | parameters | CPU forward, audio s/s (1 thread) |\n|---|---|---|")
        for name, model in (("teacher", teacher), ("student", student)):
            print(f"| {name} ({model.preset.name}) | {encoder_parameters(model):,} | {speed[name]:.0f} |")
        print(f"\nstudent/teacher speed: {speed['student'] / speed['teacher']:.2f}x")
    else:
        print("\nno distill/*/final.pt: materialize distilled_checkpoint for the speed comparison")
    return 0


if __name__ == "__main__":
    sys.exit(main())
