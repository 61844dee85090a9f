"""Federated rounds: where a round's time goes, what moves, and what it learns, against centralised
training on the same data.

    python bench/federated.py                                  # sample corpus, both engines
    python bench/federated.py --data-dir D --engines simulation --fraction-train 0.5 --rounds 5
    python bench/federated.py --data-dir D --variants plain dp secagg fedprox fedavg   # options' costs

Builds the pipeline's inputs on the committed sample corpus in a temp folder (unless
``--data-dir`` points at built outputs with ``clients/``, ``kmeans/`` and ``features/``), then,
each in a fresh run folder, ``rounds`` x ``local_steps`` on each sampled client with ``tiny``:

- per engine (``simulation``: Flower's simulation runtime, long-lived workers; ``deployment``: a
  local SuperLink and one SuperNode per client, a ``flwr-clientapp`` process per message) and per
  variant (``plain`` = FedAdam, ``fedavg``, ``fedprox``, ``dp``, ``secagg``, ``dp+secagg``);
- centralised (``--centralised``): the torchrun trainer, rounds x local_steps x sampled clients
  steps of the same batch, in one process.

Reported per run: round wall time, the slowest client's local training, the round overhead
(1 - slowest client's training / round wall, the issue's measure, for rounds 2.. and for every
round), the idle share of the cores (1 - sum of the clients' training / (cores x round wall),
the fair measure when more clients than cores train in a round), MB up and down, audio seconds
per second per client while training, peak memory of the whole process tree (PSS, sampled every
0.5 s), held-out masked accuracy and, with DP, epsilon.
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
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = {
    "plain": {},
    "fedavg": {"strategy": "fedavg"},
    "fedprox": {"strategy": "fedprox"},
    "dp": {"dp_noise_multiplier": 1.0, "dp_clipping_norm": 1.0},
    "secagg": {"secure_aggregation": True},
    "dp+secagg": {"dp_noise_multiplier": 1.0, "dp_clipping_norm": 1.0, "secure_aggregation": True},
}


class MemorySampler:
    """Peak PSS and RSS summed over this process and all its descendants (Ray's, Flower's)."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval, self.peak_pss, self.peak_rss, self.peak_processes = interval, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(self.interval):
            pss = rss = count = 0
            for process in [me, *me.children(recursive=True)]:
                try:
                    info = process.memory_full_info()
                except (psutil.Error, OSError):
                    continue
                pss, rss, count = pss + getattr(info, "pss", info.rss), rss + info.rss, count + 1
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
            self.peak_processes = max(self.peak_processes, count)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def build_inputs(root: Path) -> Path:
    """The pipeline up to kmeans_targets on the sample corpus, on a temp Dagster instance."""
    import dagster as dg

    from speech_assets.definitions import build_definitions
    from speech_assets.defs.resources import StoragePaths
    from speech_assets_tests.support.local_runs import materialize_data_stages

    home, out = root / "dagster_home", root / "out"
    home.mkdir(parents=True)
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    paths = StoragePaths(
        corpus=str(REPO / "data" / "sample"), data_dir=str(out), mlflow_tracking_uri=f"sqlite:///{out}/mlflow.db"
    )
    defs = build_definitions(paths)
    with dg.DagsterInstance.get() as instance:
        materialize_data_stages(defs, instance)
    return out


def run_federated(data: Path, root: Path, engine: str, variant: str, args: argparse.Namespace) -> dict:
    from speech_assets.corpus.clients import read_clients
    from speech_assets.federated.config import FederatedConfig
    from speech_assets.federated.history import summarize_rounds
    from speech_assets.federated.launch import Deployment, run_federation
    from speech_assets.train.accuracy import ACCURACY, MAJORITY

    name = f"{engine}-{variant}".replace("+", "-")
    run_dir = root / name
    table = read_clients(data / "clients" / "clients.parquet")
    clients = table.clients
    config = FederatedConfig(
        run_dir=str(run_dir),
        run_name=name,
        clients=clients,
        rounds=args.rounds,
        local_steps=args.local_steps,
        client_lr=args.lr,
        batch_seconds=args.batch_seconds,
        heldout_speakers=table.heldout,
        seed=args.seed,
        fraction_train=args.fraction_train,
        evaluate_every=args.evaluate_every,
        precision="fp32",
        client_weights=table.weights(clients),
        train_speakers=table.train_speakers(),
        **VARIANTS[variant],
    )
    started = time.monotonic()
    with MemorySampler() as memory:
        result = run_federation(
            config,
            data,
            Deployment(
                engine=engine, threads_per_client=args.threads_per_client, client_state_root=root / f"{name}-clients"
            ),
            log=lambda line: print(f"  [{name}] {line}", flush=True),
        )
    wall = time.monotonic() - started
    records = [json.loads((run_dir / "rounds" / f"round_{r:05d}.json").read_text()) for r in range(1, args.rounds + 1)]
    cores = os.cpu_count() or 1
    per_round = []
    for record, line in zip(records, summarize_rounds(records), strict=True):
        rows = record["rows"]
        # under DP the round files keep no client's time or audio (docs/PRIVACY.md): then neither figure exists
        withheld = any(row.get("seconds") is None or row.get("audio_seconds") is None for row in rows)
        busy = None if withheld else sum(row["seconds"] for row in rows)
        per_round.append(
            {
                "round": line["round"],
                "clients": line["clients"],
                "sampled": line["sampled"],
                "round_seconds": line["round_seconds"],
                "slowest_client_seconds": record["slowest_client_seconds"],
                "overhead": line["overhead"],
                "idle_cores": None if withheld else 1 - busy / (min(cores, len(rows)) * record["round_seconds"]),
                "evaluated": record["evaluated"],
                "audio_seconds_per_second_per_client": None
                if withheld
                else sum(r["audio_seconds"] for r in rows) / max(busy, 1e-9),
                "mb_up": line["bytes_up"] / 1e6,
                "mb_down": line["bytes_down"] / 1e6,
                "epsilon": line["epsilon"],
            }
        )
    steady = per_round[1:] or per_round

    def mean(key: str, lines: list[dict]) -> float | None:
        values = [line[key] for line in lines]
        return None if None in values else sum(values) / len(values)

    return {
        "mode": "federated",
        "engine": engine,
        "variant": variant,
        "clients": len(clients),
        "sampled_per_round": config.sample_size,
        "threads_per_client": args.threads_per_client or 1,
        "schedule": f"{args.rounds} rounds x {args.local_steps} local steps x {config.sample_size} of {len(clients)} "
        f"clients",
        "total_steps": args.rounds * args.local_steps * config.sample_size,
        "heldout_masked_accuracy": result.get(ACCURACY),  # leak-free, as every view shows it
        "heldout_majority_accuracy": result.get(MAJORITY),
        "round_seconds": mean("round_seconds", steady),
        "first_round_seconds": per_round[0]["round_seconds"],
        "slowest_client_seconds": mean("slowest_client_seconds", steady),
        "overhead": mean("overhead", steady),
        "overhead_all_rounds": mean("overhead", per_round),
        "overhead_train_rounds": mean("overhead", [line for line in steady if not line["evaluated"]] or steady),
        "idle_cores": mean("idle_cores", steady),
        "audio_seconds_per_second_per_client": mean("audio_seconds_per_second_per_client", steady),
        "mb_up_per_round": mean("mb_up", per_round),
        "mb_down_per_round": mean("mb_down", per_round),
        "epsilon": per_round[-1]["epsilon"],
        "peak_pss_mb": memory.peak_pss / 1e6,
        "peak_rss_mb": memory.peak_rss / 1e6,
        "peak_processes": memory.peak_processes,
        "wall_seconds": wall,
        "per_round": per_round,
    }


def run_centralised(data: Path, root: Path, args: argparse.Namespace, clients: list[str]) -> dict:
    import pyarrow.parquet as pq

    from speech_assets.corpus.clients import read_clients
    from speech_assets.train.accuracy import ACCURACY, MAJORITY
    from speech_assets.train.config import ClientTargets, TrainConfig

    speakers = sorted(pq.read_table(data / "clients" / "clients.parquet").column("speaker_id").to_pylist())
    sampled = max(1, int(args.fraction_train * len(clients)))
    steps = args.rounds * args.local_steps * sampled
    run_dir = root / "centralised"
    config = TrainConfig(
        run_dir=str(run_dir),
        shards=[str(data / "features" / "shards" / f"{s}.parquet") for s in speakers],
        cmvn=str(data / "cmvn" / "cmvn.npz"),
        clients={
            c: ClientTargets(
                str(data / "kmeans" / c / "labels.parquet"),
                json.loads((data / "kmeans" / c / "quality.json").read_text())["k"],
            )
            for c in clients
        },
        preset="tiny",
        max_steps=steps,
        batch_seconds=args.batch_seconds,
        grad_accum=1,
        lr=args.lr,
        warmup_steps=max(1, steps // 10),
        seed=args.seed,
        heldout_speakers=read_clients(data / "clients" / "clients.parquet").heldout,
        checkpoint_every=steps,
        log_every=max(1, steps // 10),
        precision="fp32",
        device="cpu",
        nproc=1,
    )
    config_path = root / "centralised.json"
    config.to_json(config_path)
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "speech_assets.train", "--config", str(config_path)],
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    wall = time.monotonic() - started
    result = json.loads((run_dir / "result.json").read_text())
    shard_bytes = sum((data / "features" / "shards" / f"{s}.parquet").stat().st_size for s in speakers)
    return {
        "mode": "centralised",
        "engine": "torchrun (1 process)",
        "variant": "AdamW",
        "schedule": f"{steps} steps",
        "total_steps": steps,
        "heldout_masked_accuracy": result.get(ACCURACY),  # leak-free, as every view shows it
        "heldout_majority_accuracy": result.get(MAJORITY),
        "round_seconds": wall / args.rounds,
        "mb_up_per_round": None,
        "mb_down_per_round": None,
        "audio_seconds_per_second_per_client": result.get("audio_seconds_per_second"),
        "wall_seconds": wall,
        "data_moved_mb": shard_bytes / 1e6,
    }


def _fmt(value: object, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, help="built pipeline outputs (default: build the sample corpus)")
    parser.add_argument("--engines", nargs="*", default=["simulation", "deployment"])
    parser.add_argument("--variants", nargs="*", default=["plain"], choices=sorted(VARIANTS))
    parser.add_argument("--centralised", action="store_true", help="also the centralised trainer on the same data")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--local-steps", type=int, default=50)
    parser.add_argument("--fraction-train", type=float, default=1.0)
    parser.add_argument("--evaluate-every", type=int, default=5)
    parser.add_argument("--threads-per-client", type=int, default=0)
    parser.add_argument("--batch-seconds", type=float, default=16.0)
    parser.add_argument("--lr", type=float, default=2e-3, help="client (and centralised) learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here (appended as one JSON line per run)")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_federated_") as tmp:
        root = Path(tmp)
        started = time.monotonic()
        data = args.data_dir.resolve() if args.data_dir else build_inputs(root / "inputs")
        print(f"inputs ready in {time.monotonic() - started:.0f} s: {data}", flush=True)
        from speech_assets.corpus.clients import read_clients

        clients = read_clients(data / "clients" / "clients.parquet").clients
        runs = [(engine, variant) for engine in args.engines for variant in args.variants]
        for engine, variant in runs:
            print(f"== {engine} {variant}", flush=True)
            rows.append(run_federated(data, root, engine, variant, args))
            if args.json:
                with open(args.json, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(rows[-1] | {"machine": machine()}, default=str) + "\n")
        if args.centralised:
            print("== centralised", flush=True)
            rows.append(run_centralised(data, root, args, clients))
    print()
    print(
        f"machine: {machine()}; {len(clients)} clients; batch {args.batch_seconds:.0f} s of audio per step; tiny; fp32"
    )
    header = (
        "engine",
        "variant",
        "schedule",
        "round s (2..)",
        "round 1 s",
        "slowest client s",
        "overhead (2..)",
        "overhead, train-only rounds",
        "idle cores",
        "audio s/s per client",
        "MB up/round",
        "MB down/round",
        "peak PSS MB",
        "held-out acc.",
        "majority",
        "epsilon",
        "wall s",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = (
            row["engine"],
            row["variant"],
            row["schedule"],
            _fmt(row["round_seconds"], 1),
            _fmt(row.get("first_round_seconds"), 1),
            _fmt(row.get("slowest_client_seconds"), 1),
            _fmt(row.get("overhead"), 3),
            _fmt(row.get("overhead_train_rounds"), 3),
            _fmt(row.get("idle_cores"), 3),
            _fmt(row.get("audio_seconds_per_second_per_client"), 0),
            _fmt(row["mb_up_per_round"], 1),
            _fmt(row["mb_down_per_round"], 1),
            _fmt(row.get("peak_pss_mb"), 0),
            _fmt(row["heldout_masked_accuracy"]),
            _fmt(row["heldout_majority_accuracy"]),
            _fmt(row.get("epsilon"), 2),
            _fmt(row["wall_seconds"], 0),
        )
        print("| " + " | ".join(str(c) for c in cells) + " |")
    for row in rows:
        for line in row.get("per_round", []):
            print(
                f"  {row['engine']} {row['variant']} round {line['round']}: "
                f"{line['clients']}/{line['sampled']} clients, "
                f"{line['round_seconds']:.1f} s, slowest client {_fmt(line['slowest_client_seconds'], 1)} s, overhead "
                f"{_fmt(line['overhead'])}, idle cores "
                f"{_fmt(line['idle_cores'])}{' (evaluated)' if line['evaluated'] else ''}"
            )


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
