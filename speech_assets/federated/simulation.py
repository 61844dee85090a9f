"""``python -m speech_assets.federated.simulation``: one federated run on Flower's simulation runtime.

The deployment engine's ServerApp (in a thread) and ClientApp (in Ray workers that live for the
run, so torch and data indices load once). Node ``partition-id`` *i* is client ``nodes[i]``;
``cpus / cpus_per_client`` workers. Started by :func:`~speech_assets.federated.processes.simulation_run`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from pathlib import Path

from speech_assets.federated.config import FederatedConfig, NodeConfig

# Ray's shared-memory object store: messages hold one encoder (a few MB for `tiny`)
OBJECT_STORE_BYTES = 256 * 1024 * 1024


def run(config: FederatedConfig, nodes: list[NodeConfig], cpus: int, cpus_per_client: int) -> None:
    from flwr.simulation import run_simulation

    from speech_assets.federated.client_app import build_client_app
    from speech_assets.federated.server_app import build_server_app

    init_args = {
        "num_cpus": cpus,
        "num_gpus": 0,
        "include_dashboard": False,
        "object_store_memory": OBJECT_STORE_BYTES,
        "_node_ip_address": "127.0.0.1",
        "logging_level": "warning",
    }
    resources = {"num_cpus": cpus_per_client, "num_gpus": 0.0}
    run_simulation(
        server_app=build_server_app(config),
        client_app=build_client_app(nodes),
        num_supernodes=len(nodes),
        backend_config={"client_resources": resources, "init_args": init_args},  # type: ignore[typeddict-item]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m speech_assets.federated.simulation", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--run-config", required=True, help="the run's run_config.toml (FederatedConfig)")
    parser.add_argument("--nodes", required=True, help="JSON list of the clients' node configs, partition order")
    parser.add_argument("--cpus", type=int, default=0, help="CPUs Ray may use (0 = all)")
    parser.add_argument("--cpus-per-client", type=int, default=1)
    args = parser.parse_args(argv)
    config = FederatedConfig.from_run_config(tomllib.loads(Path(args.run_config).read_text()))
    nodes = [NodeConfig(**entry) for entry in json.loads(Path(args.nodes).read_text())]
    if [n.client_id for n in nodes] != config.clients:
        parser.error("the nodes file must list exactly the run's clients, in order")
    cpus = args.cpus or os.cpu_count() or 1
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    run(config, nodes, cpus, max(1, min(args.cpus_per_client, cpus)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
