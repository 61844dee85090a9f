"""Flower's processes (a SuperLink, a SuperNode per client, ``flwr run``, the simulation), each
stopped on success, failure and kill.

- Each dies with the thread that started it (``PR_SET_PDEATHSIG``, Linux only).
- Each Flower daemon runs under :mod:`speech_assets.runtime.supervise`, a child subreaper that stops
  it and its helpers when we die: they only watch their parent's pid, which a zombie still answers to.
- The federation lives in a private network namespace: Flower 1.42's Control API and Ray's servers
  authenticate no one, and any local user reaches the host's loopback. The SuperLink serves TLS with
  the federation's own CA and authenticates SuperNodes (:mod:`speech_assets.federated.auth`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import tomli_w

from speech_assets import locations
from speech_assets.federated.config import NodeConfig
from speech_assets.layout import FlowerFiles, FlowerHome
from speech_assets.runtime.netns import NoPrivateNetwork, PrivateNetwork
from speech_assets.runtime.processes import children_by_parent, die_with_parent, on_linux, terminate
from speech_assets.runtime.waiting import WaitTimeout, wait_until
from speech_assets.utils import atomic_write_text

CONNECTION_NAME = "speech_assets"
SUPERVISOR = "speech_assets.runtime.supervise"
SIMULATION = "speech_assets.federated.simulation"
RUN_ENV = "SPEECH_ASSETS_FEDERATED_RUN"
AUTH_MODULE = "speech_assets.federated.auth"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RUN_ID = re.compile(r"Successfully started run (\d+)")
# the federation's network namespace is its own: every port in it is free
SUPERLINK_PORT = 9093
SUPERLINK_ADDRESS = f"127.0.0.1:{SUPERLINK_PORT}"
FIRST_SUPERNODE_PORT = 9094
STARTUP_TIMEOUT_S = 120.0


class NeedsLinux(RuntimeError):
    """Parent-death signals, a child subreaper and private network namespaces are Linux's."""


def require_linux() -> None:
    if not on_linux():
        raise NeedsLinux(
            f"the local Flower federation needs Linux (parent-death signal and child subreaper), not {sys.platform}: "
            "point `superlink` at a SuperLink that runs elsewhere"
        )


def start_private(network: PrivateNetwork) -> PrivateNetwork:
    """Never fall back to the host's loopback, which every local user reaches."""
    try:
        return network.start()
    except NoPrivateNetwork as error:
        raise NeedsLinux(
            f"the local Flower federation runs where no other local user can reach it: {error}; "
            "otherwise point `superlink` at a SuperLink that runs elsewhere"
        ) from None


def spawn(
    command: Sequence[str], log_path: Path, env: Mapping[str, str], *, supervised: bool = False, piped: bool = False
) -> subprocess.Popen:
    """Start ``command`` in its own session, output to ``log_path`` (``piped``: to :func:`follow`),
    dying with us (``supervised``: under the supervisor, which gets SIGTERM and stops the tree)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if supervised:
        command = [sys.executable, "-m", SUPERVISOR, "--", *command]
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(  # noqa: S603
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if piped else log_file,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, signal.SIGTERM if supervised else signal.SIGKILL),  # noqa: PLW1509
        )


def flower_bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def flower_env(home: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``FLWR_HOME`` of its own, no telemetry, this interpreter's scripts and checkout first."""
    env = dict(os.environ if base is None else base)
    home.mkdir(parents=True, exist_ok=True)
    paths = [str(locations.repo_root()), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    # Flower starts its own helpers (flower-superexec, flwr-serverapp, ...) by name
    binaries = [str(Path(sys.executable).parent), *filter(None, env.get("PATH", "").split(os.pathsep))]
    env.update(
        PATH=os.pathsep.join(dict.fromkeys(binaries)),
        FLWR_HOME=str(home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        # the SuperExec of each daemon looks for new tasks this often (Flower's default: 1 s)
        FLWR_SUPEREXEC_TASK_POLL_INTERVAL=env.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.2"),
        PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)),
        PYTHONUNBUFFERED="1",
    )
    # a Dagster Pipes session belongs to the asset's process, not to Flower's
    return {k: v for k, v in env.items() if not k.startswith("DAGSTER_PIPES")}


def wait_listening(daemon: Daemon, timeout: float, network: PrivateNetwork) -> None:
    def listening() -> bool:
        if daemon.process.poll() is not None:
            raise RuntimeError(
                f"flower-{daemon.name} exited with code {daemon.process.returncode}:\n{_tail(daemon.log)}"
            )
        return network.listening(daemon.port)

    try:
        wait_until(listening, timeout, f"flower-{daemon.name} to listen on 127.0.0.1:{daemon.port}", interval=0.2)
    except WaitTimeout as error:
        raise WaitTimeout(f"{error}:\n{_tail(daemon.log)}") from None


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class Daemon:
    name: str
    process: subprocess.Popen
    log: Path
    port: int


class LocalFederation:
    """A SuperLink and one SuperNode per client on the 127.0.0.1 of a private network namespace,
    for the duration of a ``with``; ``folder`` (0700) is laid out as :class:`FlowerFiles`."""

    def __init__(
        self,
        folder: Path,
        nodes: Sequence[NodeConfig],
        *,
        env: Mapping[str, str] | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.folder, self.nodes, self.base_env = folder, list(nodes), env
        self.files = FlowerFiles(folder)
        self.log = log
        self.superlink: Daemon | None = None
        self.supernodes: dict[str, Daemon] = {}
        self.node_ids: dict[str, int] = {}
        self.network = PrivateNetwork()

    @property
    def daemons(self) -> list[Daemon]:
        return ([self.superlink] if self.superlink else []) + list(self.supernodes.values())

    def start(self) -> LocalFederation:
        from speech_assets.federated.auth import make_node_key, make_tls

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.folder.chmod(0o700)
            start_private(self.network)
            tls = make_tls(self.files.tls_dir)
            command = [flower_bin("flower-superlink"), "--ssl-ca-certfile", str(tls.ca)]
            command += ["--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key), "--enable-supernode-auth"]
            command.append("--disable-runtime-dependency-installation")
            files = self.files
            self.superlink = self._spawn(
                "superlink", command, SUPERLINK_PORT, files.superlink_log, files.superlink_home
            )
            wait_listening(self.superlink, STARTUP_TIMEOUT_S, self.network)
            write_connection(self.files.cli, SUPERLINK_ADDRESS, insecure=False, root_certificates=str(tls.ca))
            for node in self.nodes:
                make_node_key(files.auth_dir, node.client_id)
            self.node_ids = self.register({node.client_id: files.auth.public(node.client_id) for node in self.nodes})
            for index, node in enumerate(self.nodes):
                client, private = node.client_id, files.auth.private(node.client_id)
                command = [flower_bin("flower-supernode"), "--root-certificates", str(tls.ca)]
                command += ["--superlink", SUPERLINK_ADDRESS, "--auth-supernode-private-key", str(private)]
                # the same keys sign its secure-aggregation advertisements and check its peers'
                command += ["--node-config", replace(node, node_keys=str(files.auth_dir)).to_node_config()]
                log_path, home = files.supernode_log(client), files.supernode_home(client)
                port = FIRST_SUPERNODE_PORT + index
                self.supernodes[client] = self._spawn(f"supernode {client}", command, port, log_path, home)
            pids = {d.name: {"supervisor": d.process.pid, "pid": self.daemon_pid(d)} for d in self.daemons}
            self.files.pids.write_text(json.dumps(pids, indent=1, sort_keys=True) + "\n")
            self.log(
                f"Flower federation on {SUPERLINK_ADDRESS}: SuperLink pid {self.superlink.process.pid}, "
                + ", ".join(f"{c} pid {d.process.pid}" for c, d in self.supernodes.items())
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, command: list[str], port: int, log_path: Path, home: Path) -> Daemon:
        """A supervised Flower daemon listening on ``port`` inside the namespace."""
        command = [*command, "--host", "127.0.0.1", "--port", str(port)]
        process = spawn(self.network.enter(command), log_path, flower_env(home, self.base_env), supervised=True)
        return Daemon(name, process, log_path, port)

    def register(self, public_keys: Mapping[str, Path]) -> dict[str, int]:
        """Register the SuperNodes' keys (one interpreter for all), write ``nodes.json``: ``{client: node id}``."""
        command = [sys.executable, "-m", AUTH_MODULE, "register", str(self.files.cli), CONNECTION_NAME]
        command += [str(p) for p in public_keys.values()]
        done = subprocess.run(  # noqa: S603
            self.network.enter(command),
            env=flower_env(self.files.cli, self.base_env),
            capture_output=True,
            text=True,
            timeout=STARTUP_TIMEOUT_S,
            preexec_fn=die_with_parent,  # noqa: PLW1509
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"registering the SuperNodes' keys failed (exit code {done.returncode}):\n{done.stderr[-3000:]}"
            )
        by_key = json.loads(done.stdout.strip().splitlines()[-1])
        node_ids = {client: int(by_key[str(path)]) for client, path in public_keys.items()}
        self.files.nodes.write_text(json.dumps({str(n): c for c, n in node_ids.items()}, sort_keys=True) + "\n")
        return node_ids

    @staticmethod
    def daemon_pid(daemon: Daemon) -> int | None:
        """The Flower process itself: the supervisor's child."""

        def child() -> int:
            if daemon.process.poll() is not None:
                raise ChildProcessError(daemon.name)
            return min(children_by_parent().get(daemon.process.pid, [0]))

        try:
            return wait_until(child, 10.0, f"{daemon.name}'s process", interval=0.05)
        except (WaitTimeout, ChildProcessError):
            return None

    def stop(self) -> None:
        daemons = self.daemons
        if daemons:
            terminate([d.process for d in daemons], grace=10.0)
        self.superlink, self.supernodes = None, {}
        self.network.stop()
        # the registrations died with the SuperLink; the keys and the node ids mean nothing now
        self.files.nodes.unlink(missing_ok=True)
        _remove_private_keys(self.files)

    def __enter__(self) -> LocalFederation:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_connection(home: Path, address: str, insecure: bool = False, root_certificates: str = "") -> None:
    """``$FLWR_HOME/config.toml`` with one connection, :data:`CONNECTION_NAME`."""
    connection: dict[str, object] = {"address": address}
    if insecure:
        connection["insecure"] = True
    elif root_certificates:
        connection["root-certificates"] = root_certificates
    home.mkdir(parents=True, exist_ok=True)
    superlink = {"superlink": {"default": CONNECTION_NAME, CONNECTION_NAME: connection}}
    FlowerHome(home).config.write_text(tomli_w.dumps(superlink), encoding="utf-8")


@dataclass
class FlwrRun:
    returncode: int
    run_id: int | None


def flwr_run(
    app_dir: Path,
    run_config: Path,
    home: Path,
    log_path: Path,
    on_line: Callable[[str], None],
    env: Mapping[str, str] | None = None,
    should_stop: Callable[[], str | None] = lambda: None,
    enter: Callable[[Sequence[str]], list[str]] = list,
) -> FlwrRun:
    """Submit the app to ``home``'s SuperLink and :func:`follow` it; a stopped run is ``flwr stop``-ped
    there too. The caller judges success from what the ServerApp wrote."""
    command = [flower_bin("flwr"), "run", str(app_dir), CONNECTION_NAME, "--run-config", str(run_config), "--stream"]
    process_env = flower_env(home, env)
    process = spawn(enter(command), log_path, process_env, piped=True)
    run_id: list[int] = []

    def each(line: str) -> None:
        if not run_id and (match := _RUN_ID.search(line)):
            run_id.append(int(match.group(1)))
        on_line(line)

    def stop() -> None:
        if run_id:  # best effort
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(  # noqa: S603
                    enter([flower_bin("flwr"), "stop", str(run_id[0]), CONNECTION_NAME]),
                    env=process_env,
                    capture_output=True,
                    timeout=60,
                    preexec_fn=die_with_parent,  # noqa: PLW1509
                )

    returncode = follow(process, log_path, each, should_stop, grace=5, on_stop=stop)
    return FlwrRun(returncode, run_id[0] if run_id else None)


def follow(
    process: subprocess.Popen,
    log_path: Path,
    on_line: Callable[[str], None],
    should_stop: Callable[[], str | None],
    grace: float,
    on_stop: Callable[[], None] = lambda: None,
) -> int:
    """Copy ``process``'s piped output to ``log_path`` and ``on_line`` until it ends (its exit code);
    a reason from ``should_stop`` calls ``on_stop`` and raises. ``process`` never outlives this."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    try:
        with open(log_path, "a", encoding="utf-8") as log_file:
            buffer = b""
            while True:
                ready, _, _ = select.select([fd], [], [], 0.5)
                chunk = os.read(fd, 1 << 16) if ready else b""
                if chunk:
                    buffer += chunk
                    *complete, buffer = buffer.split(b"\n")
                    for raw in complete:
                        line = _ANSI.sub("", raw.decode(errors="replace")).rstrip()
                        log_file.write(line + "\n")
                        on_line(line)
                    log_file.flush()
                elif ready or process.poll() is not None:  # end of output
                    return process.wait()
                if (reason := should_stop()) is not None:
                    on_stop()
                    raise RuntimeError(f"federated run stopped: {reason}")
    finally:
        if process.poll() is None:
            terminate([process], grace=grace)


def _remove_private_keys(files: FlowerFiles) -> None:
    for path in files.auth.all_private():
        path.unlink(missing_ok=True)


def simulation_run(
    run_config: Path,
    nodes: Sequence[NodeConfig],
    cpus_per_client: int,
    log_path: Path,
    on_line: Callable[[str], None],
    env: Mapping[str, str] | None = None,
    should_stop: Callable[[], str | None] = lambda: None,
) -> FlwrRun:
    """The run on Flower's simulation runtime in a supervised tree, followed like :func:`flwr_run`.
    Ray's servers listen without authentication (some on every address): the tree gets a private
    network namespace. Ray's world-writable session folders lie in a fresh 0700 ``RAY_TMPDIR``."""
    from speech_assets.federated.auth import make_node_key

    files = FlowerFiles(log_path.parent)
    nodes_file = files.simulation_nodes
    nodes_file.parent.mkdir(parents=True, exist_ok=True)
    # each client's identity key pair, as on the deployment engine: they sign its secure-aggregation
    # advertisements, and the folder's public keys are the authorised nodes
    for node in nodes:
        make_node_key(files.auth_dir, node.client_id)
    nodes = [replace(node, node_keys=str(files.auth_dir)) for node in nodes]
    atomic_write_text(nodes_file, json.dumps([asdict(node) for node in nodes], indent=1) + "\n")
    command = [sys.executable, "-m", SIMULATION, "--run-config", str(run_config), "--nodes", str(nodes_file)]
    command += ["--cpus-per-client", str(cpus_per_client)]
    base = dict(env if env is not None else os.environ)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(_remove_private_keys, files)
        network = start_private(PrivateNetwork())
        cleanup.callback(network.stop)
        # short: Ray's unix socket paths under it must stay within 107 bytes
        ray_dir = cleanup.enter_context(
            tempfile.TemporaryDirectory(
                prefix="speech-assets-ray-", dir=base.get("RAY_TMPDIR") or None, ignore_cleanup_errors=True
            )
        )
        # every process of the tree (Ray's included) names the run in its environment, for flower_processes
        process_env = base | {"RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": ray_dir, RUN_ENV: str(run_config.parent)}
        process = spawn(network.enter(command), log_path, process_env, supervised=True, piped=True)
        return FlwrRun(follow(process, log_path, on_line, should_stop, grace=10), None)
