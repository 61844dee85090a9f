"""Federated settings as they travel (run config, ConfigRecord, node config), the Flower App
description, light imports, and the supervisor that leaves no process behind (no Flower needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

from speech_assets.federated.config import FederatedConfig, LocalConfig, NodeSettings
from speech_assets.federated.launch import APP_DIR, write_run_config
from speech_assets.federated.processes import alive, descendants
from speech_assets_tests.conftest import REPO


def _config(**overrides: object) -> FederatedConfig:
    values: dict[str, object] = {"run_dir": "/data/federated/abc", "run_name": "abc", "clients": ["client_01", "client_00"]}
    values.update(overrides)
    return FederatedConfig(**values)  # type: ignore[arg-type]


def test_run_config_round_trips_through_flower_scalars(tmp_path: Path) -> None:
    config = _config(rounds=5, strategy="fedavg", eta=0.05, min_train_nodes=1, data_versions={"manifest": "m" * 64})
    values = config.to_run_config()
    assert all(isinstance(v, int | float | str | bool) for v in values.values())  # what a Flower run config holds
    assert values["clients"] == "client_00,client_01" and values["local-steps"] == 50
    assert FederatedConfig.from_run_config(values) == config
    # ... and through the TOML file that `flwr run --run-config` reads
    parsed = tomllib.loads(write_run_config(config, tmp_path / "run.toml").read_text())
    assert FederatedConfig.from_run_config(parsed) == config


def test_every_run_config_key_is_declared_by_the_flower_app() -> None:
    """`flwr run --run-config` may only override keys the app's pyproject.toml declares."""
    app = tomllib.loads((APP_DIR / "pyproject.toml").read_text())
    declared = app["tool"]["flwr"]["app"]["config"]
    assert set(declared) == set(_config().to_run_config())
    defaults = FederatedConfig.from_run_config({**declared, "run-dir": "/x", "run-name": "x"})
    assert defaults.rounds == 3 and defaults.local_steps == 50 and defaults.strategy == "fedadam"
    assert (defaults.eta, defaults.beta_1, defaults.beta_2, defaults.tau) == (1e-2, 0.9, 0.99, 1e-3)
    assert defaults.required_clients == len(defaults.clients)  # min clients = all
    components = app["tool"]["flwr"]["app"]["components"]
    assert components == {
        "serverapp": "speech_assets.federated.server_app:app",
        "clientapp": "speech_assets.federated.client_app:app",
    }


def test_flower_validates_the_app_description() -> None:
    from flwr.cli.config_utils import load_and_validate

    config, _warnings = load_and_validate(APP_DIR / "pyproject.toml", check_module=True)
    assert config["tool"]["flwr"]["app"]["publisher"] == "speech_assets"


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"strategy": "fedprox"}, "strategy"),
        ({"min_train_nodes": 3}, "min_train_nodes"),
        ({"rounds": 0}, "rounds"),
        ({"beta_2": 1.0}, "beta_2"),
        ({"clients": []}, "clients is empty"),
        ({"preset": "huge"}, "preset"),
    ],
)
def test_invalid_settings_are_refused(overrides: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        _config(**overrides)


def test_round_instructions_round_trip() -> None:
    local = _config(local_steps=7, client_lr=3e-4).local()
    record = local.to_record()
    assert record["local-steps"] == 7 and record["lr"] == 3e-4
    assert LocalConfig.from_record(record) == local
    with pytest.raises(ValueError, match="local-steps"):
        LocalConfig.from_record({k: v for k, v in record.items() if k != "local-steps"})


def test_node_config_is_parsed_by_flower_as_written() -> None:
    from flwr.common.config import parse_config_args

    node = NodeSettings(client_id="client_02", data_dir="/data/out", state_dir="/runs/x/clients/client_02", threads=2)
    parsed = parse_config_args([node.to_node_config()])
    assert NodeSettings.from_node_config(parsed) == node
    assert node.client_dir("run") == Path("/runs/x/clients/client_02")
    assert NodeSettings("c", "/d").client_dir("run") == Path("/d/federated/run/clients/c")
    with pytest.raises(ValueError, match="client-id"):
        NodeSettings.from_node_config({"data-dir": "/d"})


def test_settings_and_launcher_import_neither_torch_nor_flower() -> None:
    code = textwrap.dedent(
        """
        import sys
        import speech_assets.federated.config, speech_assets.federated.launch, speech_assets.federated.history
        heavy = [m for m in ("torch", "flwr") if m in sys.modules]
        import speech_assets.definitions
        print(heavy, "flwr" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[] False"


# ------------------------------------------------------------------------------------- supervisor
LAUNCHER = """
import os, sys, time
from pathlib import Path
from speech_assets.federated.processes import spawn
# a "daemon" that starts a helper in a session of its own and then idles, like flower-superlink
daemon = ["bash", "-c", "setsid sleep 301 & echo $! > {pidfile}; exec sleep 302"]
spawn(daemon, Path("{log}"), dict(os.environ), supervised=True)
print("started", flush=True)
time.sleep(600)
"""


def _pids_of(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in raw.replace(b"\0", b" ") and alive(int(entry)):
                found.append(int(entry))
    return found


def test_kill_9_of_the_launcher_leaves_no_process(tmp_path: Path) -> None:
    """The supervisor is told by the kernel when its parent dies and takes down the daemon and
    the helper the daemon started in another session (which a process group would miss)."""
    pidfile = tmp_path / "helper.pid"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER.format(pidfile=pidfile, log=tmp_path / "daemon.log")],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        assert launcher.stdout is not None and launcher.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 30
        while not pidfile.is_file() or not pidfile.read_text().strip():
            assert time.monotonic() < deadline, "the daemon never started its helper"
            time.sleep(0.1)
        helper = int(pidfile.read_text())
        tree = descendants([launcher.pid])
        assert helper in _pids_of("sleep 301") and len(tree) >= 2  # supervisor + daemon (+ helper elsewhere)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 30
        while (left := _pids_of("sleep 301") + _pids_of("sleep 302") + [p for p in tree if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == []
    finally:
        for pid in _pids_of("sleep 301") + _pids_of("sleep 302"):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


def test_supervisor_reports_the_command_exit_code_and_reaps_what_it_left(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "speech_assets.federated.supervise", "--grace", "1", "--",
               "bash", "-c", "setsid sleep 303 & exit 7"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert done.returncode == 7
    assert _pids_of("sleep 303") == []
