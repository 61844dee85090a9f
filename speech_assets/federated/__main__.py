"""``python -m speech_assets.federated --data-dir D --run-dir R [options]``: one federated run on
the pipeline's outputs under ``D`` (client targets, shards), written to ``R``.

Without ``--superlink`` it starts a SuperLink and one SuperNode per client on 127.0.0.1 and stops
them at the end (also on SIGTERM/SIGINT; on SIGKILL the kernel stops them). Exit codes: 0 done,
2 the server stopped the run for lack of clients (completed rounds saved), 1 other errors (among
them: the run folder was started with other settings, or a remote SuperLink without TLS).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import typing
from dataclasses import fields
from pathlib import Path

from speech_assets.corpus.clients import read_clients
from speech_assets.federated.config import FederatedConfig
from speech_assets.federated.history import SettingsChanged
from speech_assets.federated.launch import (
    ENGINES,
    Deployment,
    FederatedRunFailed,
    InsecureRefused,
    run_federation,
)
from speech_assets.federated.processes import NeedsLinux
from speech_assets.layout import DataLayout
from speech_assets.train.accuracy import heldout_accuracy

SKIPPED = {"run_dir", "run_name", "clients", "client_weights", "data_versions", "heldout_speakers", "train_speakers"}


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")
    return text.lower() in ("true", "1", "yes")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m speech_assets.federated", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="the pipeline's data dir (kmeans/, features/, clients/)")
    parser.add_argument("--run-dir", required=True, help="the run folder (resumed if it exists)")
    parser.add_argument("--clients", default="", help="comma-separated client ids (default: clients/clients.parquet)")
    parser.add_argument("--superlink", default="", help="host:port of an existing SuperLink (default: start one)")
    parser.add_argument("--superlink-root-certificates", default="", help="CA certificate of that SuperLink's TLS")
    parser.add_argument("--insecure", action="store_true", help="reach that SuperLink without TLS (clear text)")
    parser.add_argument(
        "--client-state-root",
        default="",
        help="local SuperNodes keep their state under <this>/<client> (default: DATA_DIR/federated_clients)",
    )
    parser.add_argument("--threads-per-client", type=int, default=0)
    parser.add_argument(
        "--engine",
        default="simulation",
        choices=ENGINES,
        help="simulation: Flower's simulation runtime here (default); deployment: a local SuperLink "
        "and one SuperNode per client (--superlink always uses the deployment engine)",
    )
    parser.add_argument("--device", default="auto")
    # the local clients' own limits (their node config; docs/PRIVACY.md)
    parser.add_argument("--secagg-min-shares", type=int, default=Deployment.secagg_min_shares)
    parser.add_argument("--secagg-threshold-floor", default=Deployment.secagg_threshold_floor)
    parser.add_argument("--dp-max-clipping-norm", type=float, default=Deployment.dp_max_clipping_norm)
    # resolved hints: an Annotated alias (AtLeast1 ...) is its base type
    hints = typing.get_type_hints(FederatedConfig)
    for item in fields(FederatedConfig):
        if item.name in SKIPPED:
            continue
        kind = {int: int, float: float, bool: _bool}.get(hints[item.name], str)
        parser.add_argument(f"--{item.name.replace('_', '-')}", type=kind, default=item.default)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run_dir = Path(args.run_dir).resolve()
    values = {item.name: getattr(args, item.name) for item in fields(FederatedConfig) if item.name not in SKIPPED}
    table = read_clients(DataLayout(args.data_dir).clients_file)  # the pipeline's one held-out split
    clients = [c for c in args.clients.split(",") if c] or table.clients
    weights = table.weights(clients)
    speakers = {"heldout_speakers": table.heldout, "train_speakers": table.train_speakers(clients)}
    try:
        config = FederatedConfig(
            run_dir=str(run_dir), run_name=run_dir.name, clients=clients, client_weights=weights, **speakers, **values
        )
    except ValueError as error:  # the run folder's name is the run name: a safe id
        _parser().error(str(error))

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        result = run_federation(
            config,
            Path(args.data_dir).resolve(),
            Deployment.of(args),
            log=lambda line: print(line, flush=True),
        )
    except FederatedRunFailed as error:
        print(f"federated run failed: {error}", file=sys.stderr, flush=True)
        return 2
    except (SettingsChanged, InsecureRefused, NeedsLinux) as error:
        print(f"federated run refused: {error}", file=sys.stderr, flush=True)
        return 1
    # the held-out masked accuracy every view shows (leak-free frames: speech_assets.train.accuracy)
    found = heldout_accuracy(result)
    summary = {k: result[k] for k in ("checkpoint", "checkpoint_sha256")}
    print(json.dumps(summary | {"heldout_masked_accuracy": found.accuracy if found else None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
