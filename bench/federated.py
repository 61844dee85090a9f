"""Federated (FedAdam, FedAvg) vs centralised pretraining: same data, same model, same total steps.

    python bench/federated.py                         # sample corpus, 3 rounds x 50 local steps
    python bench/federated.py --rounds 3 --local-steps 50 --data-dir data/out   # existing outputs

Builds the pipeline's inputs (manifest -> shards -> CMVN -> 4 clients -> per-client k-means) on
the committed sample corpus in a temp folder (unless ``--data-dir`` points at built outputs),
then runs, each in a fresh run folder:

- federated with FedAdam and with FedAvg: real Flower processes on loopback (a SuperLink and one
  SuperNode per client, ``flwr run``), ``rounds`` x ``local_steps`` steps per client;
- centralised: the torchrun trainer (one process), ``rounds x local_steps x clients`` steps of the
  same per-step batch, so both see the same number of batches of the same size.

Prints held-out masked accuracy beside the majority-class rate (always predicting a client's most
frequent training label, on the same masked frames), time per round and bytes per round.
Federated evaluation uses each client's own CMVN and head; centralised the global CMVN.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_inputs(root: Path) -> Path:
    """The pipeline up to kmeans_targets on the sample corpus, on a temp Dagster instance."""
    import dagster as dg

    from speech_assets.definitions import build_definitions
    from speech_assets.defs.resources import StoragePaths
    from speech_assets.testing.local_runs import materialize_data_stages

    home, out = root / "dagster_home", root / "out"
    home.mkdir(parents=True)
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    paths = StoragePaths(corpus=str(REPO / "data" / "sample"), data_dir=str(out), mlflow_tracking_uri=f"sqlite:///{out}/mlflow.db")
    defs = build_definitions(paths)
    with dg.DagsterInstance.get() as instance:
        materialize_data_stages(defs, instance)
    return out


def run_federated(data: Path, root: Path, strategy: str, args: argparse.Namespace) -> dict:
    from speech_assets.federated.config import FederatedConfig
    from speech_assets.corpus.clients import heldout_of, read_clients
    from speech_assets.federated.launch import client_ids, run_federation

    run_dir = root / f"federated-{strategy}"
    config = FederatedConfig(
        run_dir=str(run_dir), run_name=run_dir.name, clients=client_ids(data), rounds=args.rounds,
        local_steps=args.local_steps, strategy=strategy, client_lr=args.lr, batch_seconds=args.batch_seconds,
        heldout_speakers=heldout_of(read_clients(data / "clients" / "clients.parquet")), seed=args.seed,
    )  # fmt: skip
    started = time.monotonic()
    result = run_federation(config, data, log=lambda line: print(f"  [{strategy}] {line}", flush=True))
    steps = args.rounds * args.local_steps * len(config.clients)
    return {
        "mode": "federated", "strategy": {"fedadam": "FedAdam", "fedavg": "FedAvg"}[strategy],
        "schedule": f"{args.rounds} rounds x {args.local_steps} local steps x {len(config.clients)} clients",
        "total_steps": steps, "heldout_masked_accuracy": result["heldout_masked_accuracy"],
        "heldout_majority_accuracy": result["heldout_majority_accuracy"],
        "seconds_per_round": result["mean_round_seconds"],
        "mb_up_per_round": result["bytes_up_per_round"] / 1e6, "mb_down_per_round": result["bytes_down_per_round"] / 1e6,
        "wall_seconds": time.monotonic() - started, "per_round": result["round_summaries"],
    }  # fmt: skip


def run_centralised(data: Path, root: Path, args: argparse.Namespace, clients: list[str]) -> dict:
    import pyarrow.parquet as pq

    from speech_assets.corpus.clients import heldout_of, read_clients
    from speech_assets.train.config import ClientTargets, TrainConfig

    speakers = sorted(pq.read_table(data / "clients" / "clients.parquet").column("speaker_id").to_pylist())
    steps = args.rounds * args.local_steps * len(clients)
    run_dir = root / "centralised"
    config = TrainConfig(
        run_dir=str(run_dir),
        shards=[str(data / "features" / "shards" / f"{s}.parquet") for s in speakers],
        cmvn=str(data / "cmvn" / "cmvn.npz"),
        clients={c: ClientTargets(str(data / "kmeans" / c / "labels.parquet"),
                                  json.loads((data / "kmeans" / c / "quality.json").read_text())["k"]) for c in clients},
        preset="tiny", max_steps=steps, batch_seconds=args.batch_seconds, grad_accum=1, lr=args.lr,
        warmup_steps=max(1, steps // 10), seed=args.seed,
        heldout_speakers=heldout_of(read_clients(data / "clients" / "clients.parquet")),
        checkpoint_every=steps, log_every=max(1, steps // 10), precision="fp32", device="cpu", nproc=1,
    )  # fmt: skip
    config_path = root / "centralised.json"
    config.to_json(config_path)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "speech_assets.train", "--config", str(config_path)], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    wall = time.monotonic() - started
    result = json.loads((run_dir / "result.json").read_text())
    shard_bytes = sum((data / "features" / "shards" / f"{s}.parquet").stat().st_size for s in speakers)
    return {
        "mode": "centralised", "strategy": "AdamW (one job)", "schedule": f"{steps} steps",
        "total_steps": steps, "heldout_masked_accuracy": result["heldout_masked_accuracy"],
        "heldout_majority_accuracy": result["heldout_majority_accuracy"],
        "seconds_per_round": wall / args.rounds, "mb_up_per_round": None, "mb_down_per_round": None,
        "wall_seconds": wall, "data_moved_mb": shard_bytes / 1e6,
    }  # fmt: skip


def _fmt(value: object, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, help="built pipeline outputs (default: build the sample corpus)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=50)
    parser.add_argument("--batch-seconds", type=float, default=16.0)
    parser.add_argument("--lr", type=float, default=2e-3, help="client (and centralised) learning rate")
    parser.add_argument("--heldout-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=["centralised", "fedadam", "fedavg"])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_federated_") as tmp:
        root = Path(tmp)
        started = time.monotonic()
        data = args.data_dir.resolve() if args.data_dir else build_inputs(root / "inputs")
        print(f"inputs ready in {time.monotonic() - started:.0f} s: {data}", flush=True)
        from speech_assets.federated.launch import client_ids

        clients = client_ids(data)
        rows = []
        for mode in args.only:
            print(f"== {mode}", flush=True)
            if mode == "centralised":
                rows.append(run_centralised(data, root, args, clients))
            else:
                rows.append(run_federated(data, root, mode, args))
    header = ("mode", "strategy", "total steps", "held-out masked acc.", "majority class", "s / round", "MB up / round", "MB down / round", "wall s")
    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"{len(clients)} clients; batch {args.batch_seconds:.0f} s of audio per step; tiny preset")  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = (row["mode"], row["strategy"], row["total_steps"], _fmt(row["heldout_masked_accuracy"]),
                 _fmt(row["heldout_majority_accuracy"]), _fmt(row["seconds_per_round"], 1), _fmt(row["mb_up_per_round"], 1),
                 _fmt(row["mb_down_per_round"], 1), _fmt(row["wall_seconds"], 0))  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")
    for row in rows:
        for line in row.get("per_round", []):
            print(f"  {row['strategy']} round {line['round']}: held-out {_fmt(line['heldout_masked_accuracy'])} "
                  f"(majority {_fmt(line['majority_accuracy'])}), train loss {_fmt(line['train_loss'], 4)}, "
                  f"{line['round_seconds']:.0f} s")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
