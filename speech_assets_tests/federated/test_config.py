"""Federated settings as they travel (run config, ConfigRecord, node config), the Flower App
description, light imports, and the supervisor that leaves no process behind (no Flower needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import tomli_w

from speech_assets.federated.config import FederatedConfig, LocalConfig, NodeConfig, settings_changes
from speech_assets.federated.history import SettingsChanged, check_settings
from speech_assets.federated.launch import (
    APP_DIR,
    STALL_MARGIN_S,
    Deployment,
    InsecureRefused,
    ProgressDeadline,
    check_transport,
    client_state_roots,
    completed_result,
    describe_engine,
    run_federation,
    stall_limit,
)
from speech_assets.layout import FederatedPaths
from speech_assets_tests.conftest import REPO


def _config(**overrides: object) -> FederatedConfig:
    values: dict[str, object] = {
        "run_dir": "/data/federated/abc",
        "run_name": "abc",
        "clients": ["client_01", "client_00"],
    }
    values.update(overrides)
    return FederatedConfig(**values)  # type: ignore[arg-type]


def test_run_config_round_trips_through_flower_scalars() -> None:
    config = _config(rounds=5, strategy="fedavg", eta=0.05, min_train_nodes=1, data_versions={"manifest": "m" * 64})
    values = config.to_run_config()
    assert all(isinstance(v, int | float | str | bool) for v in values.values())  # what a Flower run config holds
    assert values["clients"] == "client_00,client_01" and values["local-steps"] == 50
    assert FederatedConfig.from_run_config(values) == config
    # ... and through the TOML file that `flwr run --run-config` reads
    parsed = tomllib.loads(tomli_w.dumps(config.to_run_config()))
    assert FederatedConfig.from_run_config(parsed) == config


def test_every_run_config_key_is_declared_by_the_flower_app() -> None:
    """`flwr run --run-config` may only override keys the app's pyproject.toml declares."""
    app = tomllib.loads((APP_DIR / "pyproject.toml").read_text())
    declared = app["tool"]["flwr"]["app"]["config"]
    assert set(declared) == set(_config().to_run_config())
    defaults = FederatedConfig.from_run_config({**declared, "run-dir": "/x", "run-name": "x"})
    assert defaults.rounds == 3 and defaults.local_steps == 50 and defaults.strategy == "fedadam"
    assert (defaults.eta, defaults.beta_1, defaults.beta_2, defaults.tau) == (0.1, 0.9, 0.99, 1e-3)
    assert defaults.required_clients == len(defaults.clients)  # min clients = all
    components = app["tool"]["flwr"]["app"]["components"]
    assert components == {
        "serverapp": "speech_assets.federated.server_app:app",
        "clientapp": "speech_assets.federated.client_app:app",
    }


def test_the_flower_app_states_every_default() -> None:
    """The app's run config (what `flwr run <app>` runs with, unless --run-config overrides it)
    holds every default of FederatedConfig, in its run-config form and TOML type; the fields
    without a default (where the run writes, its name, its clients) are the app's examples."""
    assert app_default_drift((APP_DIR / "pyproject.toml").read_text()) == []


def app_default_drift(text: str) -> list[str]:
    """Where the app description ``text`` differs from FederatedConfig's defaults, a line each."""
    declared = tomllib.loads(text)["tool"]["flwr"]["app"]["config"]
    required = [f.name for f in fields(FederatedConfig) if f.default is MISSING and f.default_factory is MISSING]
    defaults = FederatedConfig(**{name: declared.get(name.replace("_", "-")) for name in required}).to_run_config()
    drift = [f"lacks {key}" for key in defaults if key not in declared]
    drift += [f"{key} is no FederatedConfig field" for key in declared if key not in defaults]
    for key, value in defaults.items():
        if key in declared and not (type(declared[key]) is type(value) and declared[key] == value):
            drift.append(f"{key} = {declared[key]!r}; the default is {value!r}")
    return drift


@pytest.mark.parametrize(
    ("default", "written", "drift"),
    [
        ("rounds = 3", "rounds = 4", "rounds = 4; the default is 3"),
        ("rounds = 3", "rounds = 3.0", "rounds = 3.0; the default is 3"),
        (
            'client-lr-schedule = "constant"',
            'client-lr-schedule = "linear"',
            "client-lr-schedule = 'linear'; the default is 'constant'",
        ),
        ("secure-aggregation = false", "secure-aggregation = true", "secure-aggregation = True; the default is False"),
        ("weight-decay = 0.01", "weight-decay = 0.02", "weight-decay = 0.02; the default is 0.01"),
        ('heldout-speakers = ""', 'heldout-speakers = "s1"', "heldout-speakers = 's1'; the default is ''"),
        ('client-weights = "{}"', 'client-weights = "{ }"', "client-weights = '{ }'; the default is '{}'"),
        ("keep-rounds = 2\n", "", "lacks keep-rounds"),
    ],
)
def test_an_app_default_that_drifts_is_found(default: str, written: str, drift: str) -> None:
    text = (APP_DIR / "pyproject.toml").read_text()
    assert text.count(default) == 1
    assert app_default_drift(text.replace(default, written)) == [drift]


def test_flower_validates_the_app_description() -> None:
    from flwr.cli.config_utils import load_and_validate

    config, _warnings = load_and_validate(APP_DIR / "pyproject.toml", check_module=True)
    assert config["tool"]["flwr"]["app"]["publisher"] == "speech_assets"


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"strategy": "scaffold"}, "strategy"),
        ({"fraction_train": 0.0}, "fraction_train"),
        ({"fraction_train": 1.5}, "fraction_train"),
        ({"evaluate_every": 0}, "evaluate_every"),
        ({"dp_noise_multiplier": -1.0}, "dp_noise_multiplier"),
        ({"dp_noise_multiplier": 1.0, "dp_clipping_norm": 0.0}, "dp_clipping_norm"),
        ({"dp_delta": 1.0}, "dp_delta"),
        ({"proximal_mu": float("nan")}, "proximal_mu"),
        ({"secure_aggregation": True, "fraction_train": 0.25}, "secure_aggregation"),
        ({"secure_aggregation": True, "min_train_nodes": 1}, "secure_aggregation"),
        ({"secure_aggregation": True, "secagg_threshold": 1}, "secagg_threshold"),
        ({"secure_aggregation": True, "secagg_threshold": 3}, "secagg_threshold"),
        ({"secure_aggregation": True, "secagg_num_shares": 4}, "secagg_num_shares"),
        ({"secure_aggregation": True, "secagg_num_shares": 1}, "secagg_num_shares"),
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


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [("linear", [(4e-3, 3e-3), (3e-3, 2e-3), (2e-3, 1e-3), (1e-3, 0.0)]), ("constant", [(4e-3, 4e-3)] * 4)],
)
def test_the_clients_lr_follows_the_schedule_over_rounds(schedule: str, expected: list[tuple[float, float]]) -> None:
    config = _config(rounds=4, client_lr=4e-3, client_lr_schedule=schedule)
    got = [(config.local(r).lr, config.local(r).lr_end) for r in range(1, 5)]
    assert [v for pair in got for v in pair] == pytest.approx([v for pair in expected for v in pair])
    from speech_assets.federated.local import round_schedule

    factor = round_schedule(config.local(2))  # within a round: linear from lr towards lr_end
    steps = config.local_steps
    assert factor(0) == 1.0 and factor(steps) == pytest.approx(config.local(2).lr_end / config.local(2).lr)
    with pytest.raises(ValueError, match="client_lr_schedule"):
        _config(client_lr_schedule="cosine")


def test_node_config_is_parsed_by_flower_as_written() -> None:
    from flwr.common.config import parse_config_args

    node = NodeConfig(client_id="client_02", data_dir="/data/out", state_root="/clients/client_02", threads=2)
    parsed = parse_config_args([node.to_node_config()])
    assert NodeConfig.from_node_config(parsed) == node
    assert node.client_dir("run") == Path("/clients/client_02/run")
    # without a state root: a folder of the client's own beside the data, not the server's run folder
    assert NodeConfig("c", "/d").client_dir("run") == Path("/d/federated_clients/c/run")
    with pytest.raises(ValueError, match="client-id"):
        NodeConfig.from_node_config({"data-dir": "/d"})
    with pytest.raises(ValueError, match="state-root"):
        NodeConfig.from_node_config({"client-id": "c", "data-dir": "/d", "state-dir": "/x"})


@pytest.mark.parametrize("name", ["..", ".", "../other", "a/b", "", "run name", "x" * 65])
def test_a_run_name_from_the_server_becomes_a_path_only_when_it_is_a_safe_id(name: str) -> None:
    """The run name in a round's ConfigRecord comes from the server: `..` or `a/b` must never
    become the client's state folder (the old check forbade only `/`, on the server)."""
    record = _config().local().to_record() | {"run-name": name}
    with pytest.raises(ValueError, match="run name sent by the server"):
        LocalConfig.from_record(record)
    with pytest.raises(ValueError, match="run name sent by the server"):
        NodeConfig("client_00", "/data").client_dir(name)
    with pytest.raises(ValueError, match="run_name"):
        _config(run_name=name)
    with pytest.raises(ValueError, match="client-id"):
        NodeConfig(name or "..", "/data")


def test_the_launcher_refuses_local_client_limits_before_anything_starts(tmp_path: Path) -> None:
    for deployment, why in [
        (Deployment(secagg_min_shares=1), "secagg_min_shares must be an int of at least 2"),
        (Deployment(dp_max_clipping_norm=0.5), "every client would refuse every round"),
    ]:
        with pytest.raises(ValueError, match=why):
            run_federation(_config(dp_noise_multiplier=1.0, run_dir=str(tmp_path / "abc")), tmp_path, deployment)
    assert not (tmp_path / "abc").exists()


def test_client_state_lives_under_roots_the_supernodes_own(tmp_path: Path) -> None:
    """Local SuperNodes keep their heads and CMVN under <data>/federated_clients/<client>, never
    under the server's run folder (it was <run>/clients/<client>)."""
    data, run_dir = tmp_path / "out", tmp_path / "out" / "federated" / "abc"
    roots = client_state_roots(["client_00", "client_01"], data, None, run_dir)
    assert roots == {c: (data / "federated_clients" / c).resolve() for c in ("client_00", "client_01")}
    assert roots == client_state_roots(["client_00", "client_01"], data, data / "federated_clients", run_dir)
    with pytest.raises(ValueError, match="inside the server's run folder"):
        client_state_roots(["client_00"], data, run_dir / "clients", run_dir)
    assert not hasattr(FederatedPaths, "client_dir")  # the server's layout has no client folder


def test_settings_changes_name_what_changed() -> None:
    before = _config(eta=0.01, rounds=2, data_versions={"manifest": "a"}).settings()
    assert (
        settings_changes(
            before, _config(eta=0.01, rounds=2, data_versions={"manifest": "a"}).settings(), resuming=False
        )
        == []
    )
    # more rounds (or other timeouts) may resume a run; a result is reused only for the same rounds
    longer = _config(eta=0.01, rounds=3, round_timeout_s=5.0, data_versions={"manifest": "a"}).settings()
    assert settings_changes(before, longer, resuming=True) == []
    assert settings_changes(before, longer, resuming=False) == ["rounds: 2 -> 3"]
    other = _config(eta=0.05, strategy="fedavg", rounds=2, data_versions={"manifest": "b"}).settings()
    assert settings_changes(before, other, resuming=True) == [
        'data_versions: {"manifest": "a"} -> {"manifest": "b"}',
        "eta: 0.01 -> 0.05",
        "strategy: 'fedadam' -> 'fedavg'",
    ]


def test_resuming_a_run_folder_with_other_settings_is_refused(tmp_path: Path) -> None:
    config = _config(run_dir=str(tmp_path / "abc"), eta=0.01)
    paths = FederatedPaths(config.run_dir)
    check_settings(paths, config)  # a fresh folder records its settings
    assert json.loads(paths.settings.read_text())["eta"] == 0.01
    check_settings(paths, _config(run_dir=str(tmp_path / "abc"), eta=0.01, rounds=5))  # more rounds: fine
    with pytest.raises(SettingsChanged, match=r"eta: 0\.01 -> 0\.02.*tau: 0\.001 -> 0\.1"):
        check_settings(paths, _config(run_dir=str(tmp_path / "abc"), eta=0.02, tau=0.1))
    # a finished result is reused only when every setting, rounds included, matches
    paths.result.write_text(json.dumps({"rounds": 5}))
    paths.final.write_bytes(b"final")
    assert completed_result(_config(run_dir=str(tmp_path / "abc"), eta=0.01, rounds=5)) == {"rounds": 5}
    assert completed_result(_config(run_dir=str(tmp_path / "abc"), eta=0.01, rounds=5, max_update_norm=3.0)) is None
    # rounds without settings: nothing says what they were trained with
    legacy = FederatedPaths(tmp_path / "legacy")
    legacy.rounds_dir.mkdir(parents=True)
    legacy.round_record(1).write_text("{}")
    with pytest.raises(SettingsChanged, match="no settings.json"):
        check_settings(legacy, _config(run_dir=str(legacy.root)))


def test_the_cli_refuses_to_resume_with_other_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m speech_assets.federated` on a run folder started with other settings stops
    before it starts anything, naming the change."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from speech_assets.federated.__main__ import main

    data = tmp_path / "out"
    (data / "clients").mkdir(parents=True)
    pq.write_table(
        pa.table(
            {
                "speaker_id": ["s1", "s2"],
                "client_id": ["client_00", "client_01"],
                "hours": [0.1, 0.2],
                "utterances": [3, 5],
                "heldout": [False, False],
            }
        ),
        data / "clients" / "clients.parquet",
    )
    run_dir = tmp_path / "run"
    first = FederatedConfig(
        run_dir=str(run_dir),
        run_name="run",
        clients=["client_00", "client_01"],
        client_weights={"client_00": 3.0, "client_01": 5.0},
        local_steps=7,
    )
    check_settings(FederatedPaths(run_dir), first)
    code = main(["--data-dir", str(data), "--run-dir", str(run_dir), "--local-steps", "8", "--connect-timeout-s", "5"])
    assert code == 1
    assert "local_steps: 7 -> 8" in capsys.readouterr().err
    assert not (run_dir / "flower").exists()  # nothing was started


def test_a_remote_superlink_without_tls_is_refused_unless_insecure(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    check_transport("", "", insecure=False)  # local: the launcher's own CA and node authentication
    check_transport("fl.example.org:9093", str(ca), insecure=False)
    check_transport("fl.example.org:9093", "", insecure=True)
    with pytest.raises(InsecureRefused, match="insecure = true"):
        check_transport("fl.example.org:9093", "", insecure=False)
    with pytest.raises(ValueError, match="is not a file"):
        check_transport("fl.example.org:9093", str(tmp_path / "missing.pem"), insecure=False)


@pytest.mark.parametrize(
    ("superlink", "engine", "where"),
    [
        ("", "simulation", "Flower's simulation runtime"),
        ("", "deployment", "a local SuperLink and one SuperNode per client"),
        ("link.example:9093", "simulation", "the SuperLink at link.example:9093"),  # a SuperLink: deployment always
    ],
)
def test_the_engine_is_described_in_words(superlink: str, engine: str, where: str) -> None:
    assert describe_engine(superlink, engine) == where


@pytest.mark.parametrize(
    "superlink", ["[fe80::1%$(id)]:9093", "[fe80::1% x]:9093", "fl.example.org", "a b:9093", "::1:9093"]
)
def test_the_launcher_refuses_a_superlink_that_is_not_host_and_port(superlink: str, tmp_path: Path) -> None:
    """The command line's `--superlink` is checked as the settings file's is, before anything is written."""
    from speech_assets.federated.launch import Deployment, run_federation

    with pytest.raises(ValueError, match="is not host:port"):
        run_federation(_config(run_dir=str(tmp_path / "run")), tmp_path, Deployment(superlink=superlink, insecure=True))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("superlink", ["", "fl.example.org:9093", "[fe80::1%eth0]:9093", "10.0.0.5:9093"])
def test_the_settings_file_takes_a_superlink_endpoint(superlink: str, tmp_path: Path) -> None:
    from speech_assets.defs.resources import PipelineSettings

    (tmp_path / "pipeline.toml").write_text(f'[federated]\nsuperlink = "{superlink}"\n')
    assert PipelineSettings.load(tmp_path / "pipeline.toml").federated.superlink == superlink


@pytest.mark.parametrize(
    "superlink", ["[fe80::1%$(id)]:9093", "[fe80::1% x]:9093", "h$(id):9093", "fl.example.org", "::1:9093"]
)
def test_the_settings_file_refuses_a_superlink_that_is_not_host_and_port(superlink: str, tmp_path: Path) -> None:
    from speech_assets.defs.resources import PipelineSettings

    (tmp_path / "pipeline.toml").write_text(f"[federated]\nsuperlink = {json.dumps(superlink)}\n")
    with pytest.raises(ValueError, match="superlink .* is not host:port"):
        PipelineSettings.load(tmp_path / "pipeline.toml")


@pytest.mark.parametrize("key", ["superlink", "superlink-root-certificates", "insecure", "client-state-root"])
def test_a_flower_run_config_cannot_name_where_the_federation_connects(key: str) -> None:
    """The app's run config holds no endpoint, certificate or client folder (so `flwr run
    --run-config` cannot add one: Flower refuses keys the app does not declare), and the
    ServerApp refuses a run config naming one."""
    declared = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert key not in declared
    with pytest.raises(ValueError, match=f"run config may not set \\['{key}'\\].*settings file only"):
        FederatedConfig.from_run_config({**_config().to_run_config(), key: "attacker.example:9093"})


def test_the_launcher_gives_up_on_a_run_without_progress() -> None:
    """flwr run is followed with a deadline: no round completed within stall_limit -> stop."""
    now = [0.0]
    config = _config(connect_timeout_s=10.0, round_timeout_s=20.0)
    deadline = ProgressDeadline(stall_limit(config), clock=lambda: now[0])
    assert stall_limit(config) == 2 * 10.0 + 2 * 20.0 + STALL_MARGIN_S
    now[0] = stall_limit(config)
    assert deadline.check() is None
    deadline.progressed()  # a round completed
    now[0] += stall_limit(config) + 1
    assert "no round completed" in str(deadline.check())


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
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[] False"


@pytest.mark.parametrize(
    "override",
    [
        {"insecure": True},
        {"client_state_root": "/"},
        {"superlink": "attacker.example:9093"},
        {"superlink_root_certificates": "/tmp/attacker-ca.pem"},
    ],
)
def test_run_config_cannot_redirect_the_federation_give_up_tls_or_move_the_client_state(
    override: dict, tmp_path: Path
) -> None:
    """`superlink`, `superlink_root_certificates`, `insecure` and `client_state_root` come from
    the settings file only: run config naming them is rejected by Dagster before a run exists."""
    import dagster as dg

    from speech_assets.definitions import build_definitions
    from speech_assets.defs.resources import PipelineSettings, StoragePaths
    from speech_assets_tests.conftest import SAMPLE_CORPUS

    paths = StoragePaths(
        corpus=str(SAMPLE_CORPUS), data_dir=str(tmp_path / "out"), mlflow_tracking_uri=f"sqlite:///{tmp_path}/m.db"
    )
    job = (
        build_definitions(paths, PipelineSettings())
        .resolve_implicit_global_asset_job_def()
        .get_subset(asset_selection={dg.AssetKey("federated_checkpoint")})
    )
    with dg.DagsterInstance.ephemeral() as instance:
        with pytest.raises(dg.DagsterInvalidConfigError, match=f'unexpected config entry "{next(iter(override))}"'):
            job.execute_in_process(
                instance=instance, run_config={"ops": {"federated_checkpoint": {"config": override}}}
            )
        assert not instance.get_runs()


def test_off_linux_the_local_federation_refuses_at_once_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from speech_assets.federated.launch import run_federation
    from speech_assets.federated.processes import NeedsLinux

    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(NeedsLinux) as refused:
        run_federation(_config(run_dir=str(tmp_path / "run")), tmp_path)
    assert "needs Linux" in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_without_a_private_network_the_local_federation_refuses_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No util-linux (or no user namespaces): the local federation does not fall back to a
    loopback every local user reaches; it refuses before starting anything."""
    from speech_assets.federated.processes import LocalFederation, NeedsLinux

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    federation = LocalFederation(tmp_path / "flower", [NodeConfig("client_00", str(tmp_path))], log=lambda line: None)
    with pytest.raises(NeedsLinux) as refused:
        federation.start()
    assert "no other local user can reach it" in str(refused.value) and "\n" not in str(refused.value)
    assert federation.superlink is None and not (tmp_path / "flower" / "superlink").exists()


def test_without_a_private_network_a_simulation_refuses_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulation engine does not fall back to the host's loopback either (Ray's servers,
    which authenticate no one, would be every local user's): it refuses before starting anything."""
    from speech_assets.federated.processes import NeedsLinux, simulation_run

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    log = tmp_path / "flower" / "simulation.log"
    with pytest.raises(NeedsLinux) as refused:
        simulation_run(
            tmp_path / "run_config.toml", [NodeConfig("client_00", str(tmp_path))], 1, log, lambda line: None
        )
    assert "no other local user can reach it" in str(refused.value) and "\n" not in str(refused.value)
    assert not log.exists()


@pytest.mark.parametrize(
    ("clients", "fraction", "minimum", "expected"),
    [(4, 1.0, 0, 4), (4, 0.5, 0, 2), (64, 0.25, 0, 16), (64, 0.01, 0, 1), (64, 0.1, 10, 10), (3, 0.1, 0, 1)],
)
def test_a_round_samples_a_fraction_of_the_clients_with_a_minimum(
    clients: int, fraction: float, minimum: int, expected: int
) -> None:
    config = _config(
        clients=[f"client_{i:02d}" for i in range(clients)], fraction_train=fraction, min_train_nodes=minimum
    )
    assert config.sample_size == expected
    assert config.required_clients == (minimum or expected)


def test_run_config_carries_the_privacy_and_sampling_settings() -> None:
    config = _config(
        clients=["a", "b", "c", "d"],
        fraction_train=0.5,
        secure_aggregation=True,
        dp_noise_multiplier=0.7,
        strategy="fedprox",
        proximal_mu=0.1,
    )
    again = FederatedConfig.from_run_config(config.to_run_config())
    assert again == config
    assert config.local().proximal_mu == 0.1 and _config(proximal_mu=0.1).local().proximal_mu == 0.0  # fedprox only


def test_the_cli_parses_each_option_as_its_field_type(capsys: pytest.CaptureFixture[str]) -> None:
    """Options typed by an ``Annotated`` alias (``AtLeast1`` ...) arrive as their base type, and a
    bad value is argparse's error naming the option."""
    from speech_assets.federated.__main__ import _parser

    args = _parser().parse_args(["--data-dir", "d", "--run-dir", "r", "--rounds", "4", "--client-lr", "0.01"])
    assert args.rounds == 4 and isinstance(args.rounds, int)
    assert isinstance(args.client_lr, float)
    with pytest.raises(SystemExit) as stopped:
        _parser().parse_args(["--data-dir", "d", "--run-dir", "r", "--rounds", "four"])
    assert stopped.value.code == 2
    assert "argument --rounds: invalid int value: 'four'" in capsys.readouterr().err
