"""One centralised training knob at a time, judged by the held-out probe: the sweeps behind issue 22's misses.

    # once: builds the corpus, features, k-means (data dir under --work)
    python bench/learning.py --out /tmp/learning.md
    python bench/sweep.py --data /tmp/speech_assets_learning/run-*/data --name lr3e-3 --set lr=0.003
    python bench/sweep.py --data ... --name span20 --set mask_length=20 --set mask_prob=0.04 --probe-steps 1600

Each run trains the pretrained encoder in this process (one process, every core: the same step
as ``pretrained_checkpoint``'s torchrun workers) on the data dir's shards, k-means targets and
held-out split (``clients.parquet``), with :class:`~speech_assets.train.config.TrainConfig`'s
fields from ``--set``; then the same CTC probe as ``downstream_probe`` scores fbank (cached per probe
options) and the new encoder on the held-out speakers, one probe per ``--probe-seeds`` seed.
``--federated`` runs the federation instead (the ServerApp's round loop and the real ClientApp
in this process; ``--set`` takes FederatedConfig fields, e.g. ``eta=0.01``).
Every run appends one JSON line to ``<out>/sweep.jsonl`` (knobs, leak-free masked accuracy against
the majority rate, probe CER/WER per seed, layer weights, wall times) and prints the table of all
runs so far; a run whose ``final.pt`` exists is probed again, not retrained.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def train_config(data: Path, run_dir: Path, knobs: dict[str, Any]) -> Any:
    from speech_assets.corpus.clients import read_clients
    from speech_assets.train.config import ClientTargets, TrainConfig

    rows = read_clients(data / "clients" / "clients.parquet")
    clients = sorted({r.client_id for r in rows})
    base = {
        "run_dir": str(run_dir),
        "shards": [
            str(data / "features" / "shards" / f"{r.speaker_id}.parquet")
            for r in sorted(rows, key=lambda r: r.speaker_id)
        ],
        "cmvn": str(data / "cmvn" / "cmvn.npz"),
        "heldout_speakers": rows.heldout,
        "clients": {
            c: ClientTargets(
                str(data / "kmeans" / c / "labels.parquet"),
                json.loads((data / "kmeans" / c / "quality.json").read_text())["k"],
            )
            for c in clients
        },
        "nproc": 1,
        "threads": os.cpu_count() or 1,
        "checkpoint_every": 10**6,
        "log_every": 100,
    }
    return TrainConfig(**{**base, **knobs})


def federated_run(data: Path, run_dir: Path, knobs: dict[str, Any]) -> Path:
    """The federation in this process: the ServerApp's round loop (FedAdam as the ServerApp builds
    it) with the real ClientApp answering each message in process (no SuperLink, no SuperNodes:
    the same rounds as ``federated_checkpoint`` without Flower's per-message process start-ups);
    ``knobs``: FederatedConfig fields. Returns the run's ``final.pt``."""
    from speech_assets.corpus.clients import read_clients
    from speech_assets.federated.config import FederatedConfig
    from speech_assets.federated.server_app import Server
    from speech_assets_tests.support.federated_data import InProcessGrid, serverapp_identity

    rows = read_clients(data / "clients" / "clients.parquet")
    clients = sorted({r.client_id for r in rows})
    config = FederatedConfig(
        **{
            "run_dir": str(run_dir),
            "run_name": run_dir.name,
            "clients": clients,
            "client_weights": rows.weights(clients),
            "heldout_speakers": rows.heldout,
            "train_speakers": rows.train_speakers(),
            "connect_timeout_s": 5,
            **knobs,
        }
    )
    threads = max(1, os.cpu_count() or 1)
    grid = InProcessGrid(
        {node: client for node, client in enumerate(clients, start=1)}, data, run_dir / "clients", threads
    )
    with serverapp_identity():
        Server(grid, config).run()  # type: ignore[arg-type]  (writes <run_dir>/result.json and final.pt)
    return run_dir / "final.pt"


def probe_utterances(data: Path, max_train: int, max_eval: int) -> tuple[list[Any], list[Any]]:
    """(training speakers', held-out speakers') utterances of the data dir, as ``downstream_probe`` reads them."""
    import pyarrow.parquet as pq

    from speech_assets.corpus.clients import read_clients
    from speech_assets.evaluation.compare import split_utterances
    from speech_assets.evaluation.encoders import load_utterances

    rows = read_clients(data / "clients" / "clients.parquet")
    held = {r.speaker_id for r in rows if r.heldout}
    manifest = pq.read_table(data / "manifest" / "manifest.parquet", columns=["utt_id", "transcript"]).to_pydict()
    shards = [
        data / "features" / "shards" / f"{r.speaker_id}.parquet" for r in sorted(rows, key=lambda r: r.speaker_id)
    ]
    utterances = load_utterances(shards, dict(zip(manifest["utt_id"], manifest["transcript"], strict=True)))
    return split_utterances(utterances, held, max_train, max_eval)


def probe(
    split: tuple[list[Any], list[Any]],
    checkpoint: Path | None,
    steps: int,
    seeds: tuple[int, ...],
    lrs: tuple[float, ...],
) -> list[Any]:
    """Probe rows (held-out and train split) of fbank (``checkpoint`` None) or the encoder at ``checkpoint``."""
    from speech_assets.evaluation.compare import FBANK, ProbeModel, compare_encoders
    from speech_assets.evaluation.probe_options import ProbeOptions
    from speech_assets.features.cmvn import UtteranceCmvn, from_record
    from speech_assets.model.encoders import load_encoder

    if checkpoint is None:
        model = ProbeModel(FBANK, "", "utterance", lambda x: UtteranceCmvn().apply(x, "logmel"))
    else:
        encoder = load_encoder(checkpoint)
        normaliser = from_record(encoder.checkpoint.get("normalisation")) or UtteranceCmvn()
        model = ProbeModel(
            "pretrained", encoder.sha256, "recorded", lambda x: normaliser.apply(x, "logmel"), encoder.model
        )
    return compare_encoders(*split, [model], ProbeOptions(steps=steps, lrs=lrs, seeds=seeds))


def summary(results: list[Any]) -> dict[str, Any]:
    held = [r for r in results if r.split == "heldout"]
    trained = [r for r in results if r.split == "train"]
    cers = [r.cer for r in held]
    return {
        "cer": cers,
        "cer_mean": statistics.fmean(cers),
        "cer_std": statistics.stdev(cers) if len(cers) > 1 else None,
        "wer_mean": statistics.fmean(r.wer for r in held),
        "train_cer_mean": statistics.fmean(r.cer for r in trained),
        "layer_weights": held[0].layer_weights,
        "utterances": held[0].utterances,
        "lr": held[0].lr,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, required=True, help="a built data dir (bench/learning.py's <run>/data, or data/out)"
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/speech_assets_sweep"))
    parser.add_argument("--name", required=True, help="this run's name (its run folder under --out)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a TrainConfig field, e.g. lr=0.003"
    )
    parser.add_argument("--probe-steps", type=int, default=400)
    parser.add_argument(
        "--probe-lrs",
        default="0.002",
        help="comma-separated; several: chosen per model on a development split of the training speakers",
    )
    parser.add_argument("--probe-seeds", default="0", help="comma-separated")
    parser.add_argument("--max-train", type=int, default=400)
    parser.add_argument("--max-eval", type=int, default=200)
    parser.add_argument("--fbank-only", action="store_true", help="probe fbank only (no training)")
    parser.add_argument(
        "--federated",
        action="store_true",
        help="a federated run (FederatedConfig fields in --set) instead of a centralised one",
    )
    args = parser.parse_args()

    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    data = args.data.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = tuple(int(s) for s in args.probe_seeds.split(","))
    lrs = tuple(float(x) for x in args.probe_lrs.split(","))
    lr_key, seed_key = "_".join(map(str, lrs)), "_".join(map(str, seeds))
    probe_key = f"steps{args.probe_steps}-lr{lr_key}-seeds{seed_key}-t{args.max_train}-e{args.max_eval}"
    split = probe_utterances(data, args.max_train, args.max_eval)
    fbank_cache = args.out / f"fbank-{probe_key}.json"
    if not fbank_cache.is_file():
        started = time.perf_counter()
        fbank = summary(probe(split, None, args.probe_steps, seeds, lrs))
        fbank["seconds"] = time.perf_counter() - started
        fbank_cache.write_text(json.dumps(fbank))
    fbank = json.loads(fbank_cache.read_text())
    print(f"fbank ({probe_key}): CER {fbank['cer_mean']:.3f} (train {fbank['train_cer_mean']:.3f})", flush=True)
    if args.fbank_only:
        return 0

    from speech_assets.train.trainer import train

    knobs = {key: parse_value(value) for key, value in (item.split("=", 1) for item in args.set)}
    run_dir = args.out / args.name
    record: dict[str, Any] = {"name": args.name, "knobs": knobs, "probe": probe_key}
    result_file = run_dir / "result.json"
    if not result_file.is_file():
        started = time.perf_counter()
        if args.federated:
            run_dir.mkdir(parents=True, exist_ok=True)
            federated_run(data, run_dir, knobs)
        else:
            train(train_config(data, run_dir, knobs))
        record["train_seconds"] = time.perf_counter() - started
    result = json.loads(result_file.read_text())
    for key in (
        "step",
        "train_audio_seconds",
        "heldout_leak_free_masked_accuracy",
        "heldout_leak_free_majority_accuracy",
        "heldout_masked_accuracy",
        "heldout_majority_accuracy",
    ):
        record[key] = result.get(key)
    record["leak_free_x_majority"] = (
        result["heldout_leak_free_masked_accuracy"] / result["heldout_leak_free_majority_accuracy"]
    )
    started = time.perf_counter()
    record["pretrained"] = summary(probe(split, run_dir / "final.pt", args.probe_steps, seeds, lrs))
    record["probe_seconds"] = time.perf_counter() - started
    record["fbank_cer_mean"] = fbank["cer_mean"]
    record["x_fbank"] = record["pretrained"]["cer_mean"] / fbank["cer_mean"]
    record["machine"] = f"{platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}"
    with (args.out / "sweep.jsonl").open("a") as out:
        out.write(json.dumps(record) + "\n")
    print("\n| run | knobs | probe | leak-free acc / majority | CER (train) | × fbank | layer weights |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- |")
    for line in (args.out / "sweep.jsonl").read_text().splitlines():
        r = json.loads(line)
        p = r["pretrained"]
        print(
            f"| {r['name']} | {r['knobs']} | {r['probe']} | {r['heldout_leak_free_masked_accuracy']:.3f} / "
            f"{r['heldout_leak_free_majority_accuracy']:.3f} "
            f"= {r['leak_free_x_majority']:.2f}× | {p['cer_mean']:.3f} ({p['train_cer_mean']:.3f}) | "
            f"{r['x_fbank']:.3f} | "
            f"{[round(w, 2) for w in p['layer_weights']]} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
