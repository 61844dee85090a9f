"""One federated run end to end: start the local federation (:mod:`processes`) or use a remote
SuperLink (then ``run_dir`` must be shared with its machine), submit the Flower App, follow it,
stop every process and read what the server wrote.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import tomli_w

from speech_assets import layout
from speech_assets.federated.config import (
    DP_MAX_CLIPPING_NORM,
    SECAGG_MIN_SHARES,
    SECAGG_THRESHOLD_FLOOR,
    FederatedConfig,
    NodeConfig,
    client_limit_problems,
    settings_changes,
)
from speech_assets.federated.history import check_settings, read_records, record_rounds
from speech_assets.federated.processes import LocalFederation, flwr_run, require_linux, simulation_run, write_connection
from speech_assets.hosts import check_endpoint
from speech_assets.layout import FederatedPaths
from speech_assets.runtime.locks import RunFolderLock
from speech_assets.utils import atomic_write_text, read_json

APP_DIR = Path(__file__).resolve().parent / "app"
# a remote SuperLink (``superlink``) is always the deployment engine
ENGINES = ("simulation", "deployment")


def describe_engine(superlink: str, engine: str) -> str:
    if superlink:
        return f"the SuperLink at {superlink}"
    return "Flower's simulation runtime" if engine == "simulation" else "a local SuperLink and one SuperNode per client"


class FederatedRunFailed(RuntimeError):
    """The ServerApp stopped the run (too few clients); ``failure`` is its ``failure.json``."""

    def __init__(self, failure: dict[str, Any]) -> None:
        super().__init__(failure["message"] + f" (rounds completed and saved: {failure['completed_rounds']})")
        self.failure = failure


def completed_result(config: FederatedConfig) -> dict[str, Any] | None:
    """The run's ``result.json`` if it finished every round with exactly these settings."""
    paths = FederatedPaths(config.run_dir)
    result, before = read_json(paths.result), read_json(paths.settings)
    if result.get("rounds") != config.rounds or not paths.final.is_file():
        return None
    return None if settings_changes(before, config.settings(), resuming=False) else result


class InsecureRefused(ValueError):
    """A remote SuperLink without TLS, and the settings do not say ``insecure = true``."""


def check_transport(superlink: str, root_certificates: str, insecure: bool) -> None:
    """Remote mode talks TLS unless ``insecure`` says otherwise; local mode always does (its own CA)."""
    if superlink:
        check_endpoint(superlink, "superlink")
    if superlink and root_certificates and not Path(root_certificates).is_file():
        raise ValueError(f"superlink_root_certificates {root_certificates!r} is not a file")
    if superlink and not root_certificates and not insecure:
        raise InsecureRefused(
            f"the SuperLink at {superlink} would be reached without TLS: set superlink_root_certificates to its CA "
            "certificate, or insecure = true to send the encoder and the run config in clear text and accept "
            "any server at that address"
        )


def client_state_roots(
    clients: list[str], data_dir: str | os.PathLike[str], root: str | os.PathLike[str] | None, run_dir: Path
) -> dict[str, Path]:
    """``<root>/<client>`` (default root ``<data>/federated_clients``), never inside the server's run folder."""
    base = Path(root) if root else layout.DataLayout(data_dir).client_state_dir
    roots = {c: (base / c).resolve() for c in clients}
    server = run_dir.resolve()
    inside = [str(p) for p in roots.values() if p == server or server in p.parents]
    if inside:
        raise ValueError(f"client state roots {inside} lie inside the server's run folder {server}")
    return roots


def stall_limit(config: FederatedConfig) -> float:
    """Seconds a round may take: two waits for connections, two for replies, and a margin."""
    return 2 * config.connect_timeout_s + 2 * config.round_timeout_s + STALL_MARGIN_S


STALL_MARGIN_S = 600.0


class ProgressDeadline:
    """Why to give up once ``limit`` seconds passed since the start or the last completed round."""

    def __init__(self, limit: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.clock = limit, clock
        self.since = clock()

    def progressed(self) -> None:
        self.since = self.clock()

    def check(self) -> str | None:
        idle = self.clock() - self.since
        if idle > self.limit:
            return f"no round completed for {idle:.0f} s (more than {self.limit:.0f} s)"
        return None


@dataclass(frozen=True)
class Deployment:
    """Where and how a federation runs; the ``secagg_*`` and ``dp_max_clipping_norm`` limits are the
    local clients' own."""

    superlink: str = ""
    insecure: bool = False
    root_certificates: str = ""
    client_state_root: str | os.PathLike[str] = ""  # empty: <data>/federated_clients
    threads_per_client: int = 0
    device: str = "auto"
    engine: str = "simulation"
    secagg_min_shares: int = SECAGG_MIN_SHARES
    secagg_threshold_floor: str = SECAGG_THRESHOLD_FLOOR
    dp_max_clipping_norm: float = DP_MAX_CLIPPING_NORM

    @classmethod
    def of(cls, source: Any) -> Deployment:
        """From the ``[federated]`` settings or the CLI's arguments, which name them alike."""
        names = [f.name for f in fields(cls) if f.name != "root_certificates"]
        return cls(root_certificates=source.superlink_root_certificates, **{n: getattr(source, n) for n in names})

    def limit_problems(self, dp_clipping_norm: float) -> list[str]:
        """What is wrong with the local clients' limits for a run clipping at ``dp_clipping_norm`` (0: no DP)."""
        max_norm = self.dp_max_clipping_norm
        problems = client_limit_problems(self.secagg_min_shares, self.secagg_threshold_floor, max_norm, "_")
        if 0 < max_norm < dp_clipping_norm:
            problems.append(
                f"dp_max_clipping_norm ({max_norm}) must be 0 or at least dp_clipping_norm ({dp_clipping_norm}): "
                "every client would refuse every round"
            )
        return problems


def node_configs(
    config: FederatedConfig,
    data_dir: str | os.PathLike[str],
    roots: Mapping[str, Path],
    threads: int,
    deployment: Deployment,
) -> list[NodeConfig]:
    """What each local client requires of every round is fixed here, before the server says anything."""
    max_norm = deployment.dp_max_clipping_norm
    return [
        NodeConfig(
            client_id=c,
            data_dir=str(Path(data_dir)),
            state_root=str(roots[c]),
            threads=threads,
            device=deployment.device,
            secagg_min_shares=deployment.secagg_min_shares,
            secagg_threshold_floor=deployment.secagg_threshold_floor,
            dp_max_clipping_norm=(max_norm or config.dp_clipping_norm) if config.differential_privacy else max_norm,
            require_secure_aggregation=config.secure_aggregation,
            require_dp=config.differential_privacy,
        )
        for c in config.clients
    ]


def run_federation(
    config: FederatedConfig,
    data_dir: str | os.PathLike[str],
    deployment: Deployment = Deployment(),
    *,
    env: Mapping[str, str] | None = None,
    log: Callable[[str], None] = print,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    tracker: Any = None,
) -> dict[str, Any]:
    """Run (or resume, or reuse) the federated run ``config`` and return its ``result.json``;
    ``tracker`` (a ``FederatedTracker``) gets every round, then the result or the failure. Raises
    :class:`FederatedRunFailed` when the server stopped the run (the next call resumes)."""
    superlink, engine = deployment.superlink, deployment.engine
    check_transport(superlink, deployment.root_certificates, deployment.insecure)
    problems = deployment.limit_problems(config.dp_clipping_norm if config.differential_privacy else 0.0)
    if problems:
        raise ValueError("[federated] limits of the local clients: " + "; ".join(problems))
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
    if not superlink:
        require_linux()
    paths = FederatedPaths(config.run_dir)
    roots = client_state_roots(config.clients, data_dir, deployment.client_state_root, paths.root)
    # the simulation runs as many workers as cores / threads, whatever the number of clients
    local_threads = 1 if engine == "simulation" else max(1, (os.cpu_count() or 1) // len(config.clients))
    threads = deployment.threads_per_client or local_threads
    # a remote SuperLink's SuperNodes have their own
    nodes = [] if superlink else node_configs(config, data_dir, roots, threads, deployment)

    def each_round(record: dict[str, Any]) -> None:
        if tracker is not None:
            tracker.log_round(record)
        if on_round is not None:
            on_round(record)

    with RunFolderLock(paths.root).acquire(command=f"federated run {config.run_name}"):
        check_settings(paths, config)
        if tracker is not None:
            tracker.start()
        try:
            result = _run(config, nodes, threads, deployment, env, log, each_round)
        except BaseException as error:
            if tracker is not None:
                tracker.fail(str(error) or type(error).__name__)
            raise
        if tracker is not None:
            tracker.finish(result)
        return result


def _run(
    config: FederatedConfig,
    nodes: list[NodeConfig],
    threads: int,
    deployment: Deployment,
    env: Mapping[str, str] | None,
    log: Callable[[str], None],
    each_round: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    paths = FederatedPaths(config.run_dir)
    seen = 0

    def follow_rounds() -> bool:
        """Report each new round record (earlier attempts' first); a round saved before its evaluation
        once the evaluation is in."""
        nonlocal seen
        new = [r for r in record_rounds(paths) if r > seen]
        for record in read_records(paths, new[-1]) if new else ():
            if int(record["round"]) > seen:
                if record.get("evaluation_pending"):
                    break
                each_round(record)
                seen = int(record["round"])
        return bool(new)

    done = completed_result(config)
    if done is not None:
        log(f"federated run {config.run_name} already finished all {config.rounds} rounds: reusing it")
        follow_rounds()
        return done
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.result.unlink(missing_ok=True)
    paths.failure.unlink(missing_ok=True)
    atomic_write_text(paths.run_config, tomli_w.dumps(config.to_run_config()))  # for `flwr run --run-config`
    started = time.monotonic()
    deadline = ProgressDeadline(stall_limit(config))

    def forward(line: str) -> None:
        if " server INFO round " in line:
            return  # each_round reports it
        if " server " in line or "ERROR" in line or "Error" in line or "Traceback" in line:
            log(line)

    def progress() -> str | None:
        if follow_rounds():
            deadline.progressed()
        return deadline.check()

    superlink, insecure = deployment.superlink, deployment.insecure
    if superlink:
        cli_home = paths.flower.cli
        write_connection(cli_home, superlink, insecure=insecure, root_certificates=deployment.root_certificates)
        log(f"submitting {config.run_name} to the SuperLink at {superlink}{' without TLS' if insecure else ''}")
        outcome = flwr_run(APP_DIR, paths.run_config, cli_home, paths.flower.run_log, forward, env, progress)
    elif deployment.engine == "simulation":
        log(
            f"federated run {config.run_name} on Flower's simulation runtime: {len(nodes)} clients, "
            f"{max(1, (os.cpu_count() or 1) // threads)} workers of {threads} thread(s)"
        )
        outcome = simulation_run(paths.run_config, nodes, threads, paths.flower.simulation_log, forward, env, progress)
    else:
        with LocalFederation(paths.flower_dir, nodes, env=env, log=log) as federation:

            def should_stop() -> str | None:
                if federation.superlink is not None and federation.superlink.process.poll() is not None:
                    return f"the SuperLink exited with code {federation.superlink.process.returncode}"
                return progress()

            home, run_log = federation.files.cli, paths.flower.run_log
            outcome = flwr_run(
                APP_DIR, paths.run_config, home, run_log, forward, env, should_stop, federation.network.enter
            )
    follow_rounds()
    if paths.failure.is_file():
        raise FederatedRunFailed(json.loads(paths.failure.read_text()))
    if not paths.result.is_file():
        raise RuntimeError(
            f"flwr run (exit code {outcome.returncode}, run id {outcome.run_id}) ended without a result; "
            f"see {paths.server_log} and {paths.flower_dir}"
        )
    result = json.loads(paths.result.read_text())
    run_id = f" (flwr run id {outcome.run_id})" if outcome.run_id is not None else ""
    log(f"federated run {config.run_name} finished in {time.monotonic() - started:.0f} s{run_id}")
    return result
