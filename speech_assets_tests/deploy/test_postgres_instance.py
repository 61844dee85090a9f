"""A team's instance: a DAGSTER_HOME whose dagster.yaml is deploy/postgres/dagster.yaml (the
repository's dagster.yaml plus Postgres storage), on a real PostgreSQL server, with MLflow on a real
tracking server whose backend store is the same PostgreSQL. The graph from the manifest through
training and the stats database runs in this process, one Dagster run per asset, against that
instance (the instance's storage is what is under test); what the runs left is checked with SQL
against the server. The `slow` test adds the documented CLI: `dagster asset materialize` and
`dagster schedule start` read that dagster.yaml and write to the same database.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from speech_assets.runtime.waiting import wait_until
from speech_assets_tests.conftest import REPO, SAMPLE_CORPUS
from speech_assets_tests.support.commands import run_group
from speech_assets_tests.support.mlflow_server import MlflowServer
from speech_assets_tests.support.postgres import PostgresServer

BIN = Path(sys.executable).parent
ASSETS = [  # the materialized ones (the manifest run observes speaker_manifest)
    "manifest",
    "vad_features",
    "cmvn_stats",
    "client_partitions",
    "kmeans_targets",
    "pretrained_checkpoint",
    "dataset_stats",
]
# one in-process run each; pretrained_checkpoint is tracked on the MLflow server. Federated
# pretraining and evaluation use the instance no differently and run against SQLite elsewhere.
RUNS = len(ASSETS)
SPEAKERS = ["1001", "1002", "1003", "1004"]  # half of the committed sample: the same stages, less waiting
SETTINGS = """
[clients]
num_clients = 2
heldout_fraction = 0.1
[kmeans]
k = 16
[training]
max_steps = 20
checkpoint_every = 10
log_every = 5
warmup_steps = 5
"""
SHA256 = re.compile(r"[0-9a-f]{64}")


def _run(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return run_group(command, env, REPO, timeout)


@pytest.fixture(scope="module")
def built(postgres: PostgresServer, mlflow_server: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("postgres_e2e")
    postgres.create_database("dagster")
    home = root / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "deploy" / "postgres" / "dagster.yaml", home / "dagster.yaml")
    (root / "settings.toml").write_text(SETTINGS)
    corpus = root / "corpus"
    for speaker in SPEAKERS:
        shutil.copytree(SAMPLE_CORPUS / speaker, corpus / speaker)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES") and not k.endswith("_CONFIG_JSON")},
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "DAGSTER_HOME": str(home),
        "SPEECH_ASSETS_DATA_DIR": str(root / "out"),
        "SPEECH_ASSETS_CORPUS": str(corpus),
        "SPEECH_ASSETS_SETTINGS": str(root / "settings.toml"),
        "MLFLOW_TRACKING_URI": mlflow_server.url,
        **postgres.env(),
    }
    _materialize_in_process(env)
    return {"home": home, "out": root / "out", "env": env}


def _materialize_in_process(env: dict[str, str]) -> None:
    import dagster as dg

    from speech_assets.definitions import build_definitions
    from speech_assets.defs.resources import PipelineSettings, StoragePaths
    from speech_assets_tests.support.local_runs import materialize_in_process

    saved = dict(os.environ)
    os.environ.update(env)  # the Postgres password and the instance's DAGSTER_HOME, as the CLI sees them
    try:
        defs = build_definitions(StoragePaths.from_environment(), PipelineSettings.load())
        with dg.DagsterInstance.get() as instance:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            for asset in ASSETS:
                partitions_def = defs.resolve_asset_graph().get(dg.AssetKey(asset)).partitions_def
                keys = (
                    list(instance.get_dynamic_partitions(partitions_def.name)) if partitions_def is not None else None
                )
                materialize_in_process(defs, instance, asset, keys)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _materializations(postgres: PostgresServer) -> list[tuple[str, str | None, str, str]]:
    """(asset, partition, data version, event JSON) of every materialization, from SQL alone."""
    rows = postgres.query(
        "dagster",
        "SELECT e.asset_key, e.partition, t.value, e.event FROM event_logs e "
        "JOIN asset_event_tags t ON t.event_id = e.id AND t.key = 'dagster/data_version' "
        "WHERE e.dagster_event_type = 'ASSET_MATERIALIZATION' ORDER BY e.id",
    )
    return [(json.loads(key)[0], partition, version, event) for key, partition, version, event in rows]


def _metadata(event: str) -> dict[str, dict]:
    materialization = json.loads(event)["dagster_event"]["event_specific_data"]["materialization"]
    return {entry["label"]: entry["entry_data"] for entry in materialization["metadata_entries"]}


def test_the_shipped_postgres_yaml_is_the_repository_instance_plus_storage() -> None:
    shipped = yaml.safe_load((REPO / "deploy" / "postgres" / "dagster.yaml").read_text())
    local = yaml.safe_load((REPO / "dagster.yaml").read_text())
    storage = shipped.pop("storage")
    assert shipped == local, "deploy/postgres/dagster.yaml must keep everything ./dagster.yaml has"
    assert set(storage) == {"postgres"} and storage["postgres"]["postgres_db"]["password"] == {
        "env": "DAGSTER_PG_PASSWORD"
    }


def test_runs_are_in_postgres_and_nothing_in_sqlite(built: dict, postgres: PostgresServer) -> None:
    assert postgres.query("dagster", "SELECT status, count(*) FROM runs GROUP BY status") == [("SUCCESS", RUNS)]
    assert not list(built["home"].rglob("*.db")), "a SQLite storage file appeared in DAGSTER_HOME"
    # the pool limit of the repository's dagster.yaml applies to the shared instance
    assert ("training", 1) in postgres.query("dagster", 'SELECT concurrency_key, "limit" FROM concurrency_limits')


def test_every_materialization_has_its_content_hash_in_postgres(
    built: dict, postgres: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dagster as dg

    found = _materializations(postgres)
    assert {asset for asset, *_ in found} == set(ASSETS)
    assert all(SHA256.fullmatch(version) for _, _, version, _ in found)
    # one materialization per shard, whose data version is that shard's own hash (on disk)
    shards = {partition: version for asset, partition, version, _ in found if asset == "vad_features"}
    assert sorted(shards) == SPEAKERS
    for speaker, version in shards.items():
        meta = json.loads((built["out"] / "features" / "shards" / f"{speaker}.meta.json").read_text())
        assert version == meta["shard_sha256"], speaker
    # Dagster reads the same rows through its own API
    for name, value in postgres.env().items():
        monkeypatch.setenv(name, value)
    with dg.DagsterInstance.from_config(str(built["home"])) as instance:
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        latest = instance.get_latest_materialization_event(dg.AssetKey("manifest"))
        assert latest is not None
        assert latest.asset_materialization.tags["dagster/data_version"] == next(
            v for a, _, v, _ in reversed(found) if a == "manifest"
        )


def test_dynamic_partitions_are_in_postgres(built: dict, postgres: PostgresServer) -> None:
    rows = postgres.query("dagster", "SELECT partitions_def_name, partition FROM dynamic_partitions")
    speakers = {p for name, p in rows if name == "speakers"}
    clients = {p for name, p in rows if name == "clients"}
    assert (
        speakers
        == set(pq.read_table(built["out"] / "manifest" / "manifest.parquet")["speaker_id"].to_pylist())
        == set(SPEAKERS)
    )
    assert (
        clients
        == set(pq.read_table(built["out"] / "clients" / "clients.parquet")["client_id"].to_pylist())
        == {"client_00", "client_01"}
    )


def test_training_is_tracked_by_the_server_on_postgres(
    built: dict, postgres: PostgresServer, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    ((_, _, version, event),) = [m for m in _materializations(postgres) if m[0] == "pretrained_checkpoint"]
    metadata = _metadata(event)
    run_id = metadata["mlflow_run_id"]["text"]
    url = metadata["mlflow_run_url"]["url"]
    assert url.startswith(f"{mlflow_server.url}/#/experiments/") and url.endswith(f"/runs/{run_id}")
    assert "mlflow_ui" not in metadata  # a server has a URL; the `mlflow ui` command is for local stores
    assert postgres.query("mlflow", "SELECT status FROM runs WHERE run_uuid = %s", (run_id,)) == [("FINISHED",)]
    (location,) = postgres.query(
        "mlflow",
        "SELECT e.artifact_location FROM experiments e JOIN runs r ON r.experiment_id = e.experiment_id "
        "WHERE r.run_uuid = %s",
        (run_id,),
    )[0]
    assert location.startswith("mlflow-artifacts:/")  # the server's default, not the data dir
    assert not (built["out"] / "mlartifacts").exists()
    checkpoint = Path(metadata["checkpoint"]["path"])
    downloaded = Path(
        MlflowClient(mlflow_server.url).download_artifacts(run_id, f"checkpoint/{checkpoint.name}", str(tmp_path))
    )
    assert hashlib.sha256(downloaded.read_bytes()).digest() == hashlib.sha256(checkpoint.read_bytes()).digest()
    assert version == metadata["checkpoint_sha256"]["text"]


@pytest.mark.slow
def test_the_documented_commands_use_the_postgres_instance(built: dict, postgres: PostgresServer) -> None:
    """`dagster asset materialize` and `dagster schedule start` read DAGSTER_HOME's dagster.yaml:
    their run, materialization and schedule state land in the same PostgreSQL database."""
    before = postgres.query("dagster", "SELECT count(*) FROM runs")[0][0]
    materialize = [
        str(BIN / "dagster"),
        "asset",
        "materialize",
        "-m",
        "speech_assets.definitions",
        "--select",
        "manifest",
    ]
    proc = _run(materialize, built["env"], timeout=900)
    assert proc.returncode == 0, f"dagster asset materialize failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    started = _run(
        [str(BIN / "dagster"), "schedule", "start", "-m", "speech_assets.definitions", "revalidate_corpus"],
        built["env"],
        timeout=300,
    )
    assert started.returncode == 0, started.stdout + started.stderr
    assert postgres.query("dagster", "SELECT count(*) FROM runs WHERE status = 'SUCCESS'")[0][0] == before + 1
    manifests = [version for asset, _, version, _ in _materializations(postgres) if asset == "manifest"]
    assert len(manifests) == 2 and manifests[0] == manifests[1]  # the same corpus, the same content hash
    assert postgres.query(
        "dagster", "SELECT job_type, status FROM jobs WHERE job_body LIKE '%%revalidate_corpus%%'"
    ) == [("SCHEDULE", "RUNNING")]
    assert not list(built["home"].rglob("*.db")), "a SQLite storage file appeared in DAGSTER_HOME"


def test_a_kill_9d_federated_run_on_postgres_gives_back_its_slot(built: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """federated_checkpoint records its run's processes like every slot-taking asset: on Postgres
    (no event-log heuristics there) a kill -9'd federated run is known dead and its slot freed."""
    import signal
    import time

    import dagster as dg

    from speech_assets.defs.runs import PROCESS_TAG, STEP_PROCESS_TAG_PREFIX, reap_dead_runs

    for name, value in built["env"].items():
        if name.startswith(("DAGSTER_PG", "PG")):
            monkeypatch.setenv(name, value)
    command = [
        str(BIN / "dagster"),
        "asset",
        "materialize",
        "-m",
        "speech_assets.definitions",
        "--select",
        "federated_checkpoint",
    ]
    process = subprocess.Popen(
        command,
        env=built["env"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    with dg.DagsterInstance.from_config(str(built["home"])) as instance:
        try:
            deadline = time.monotonic() + 300
            while True:
                held = instance.event_log_storage.get_concurrency_run_ids()
                runs = [instance.get_run_by_id(run_id) for run_id in held]
                if runs and STEP_PROCESS_TAG_PREFIX + "federated_checkpoint" in runs[0].tags:
                    break
                assert process.poll() is None, "the federated run ended before it was killed"
                assert time.monotonic() < deadline, "the federated run never took the training slot"
                time.sleep(0.5)
            (run,) = runs
            assert PROCESS_TAG in run.tags  # its worker: the CLI process
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        # the group's last processes may take a moment to be reaped
        reaped = wait_until(
            lambda: reap_dead_runs(instance, say=lambda _: None), 60, "the killed run to count as dead", interval=0.5
        )
        assert reaped == [run.run_id]
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
        assert not instance.event_log_storage.get_concurrency_run_ids()
    # and nothing of the federation outlives the run (SuperLink, SuperNodes, supervisors)
    wait_until(
        lambda: not _processes_mentioning(str(built["out"])),
        60,
        "every process of the federation to exit",
        interval=0.5,
    )


def _processes_mentioning(text: str) -> list[str]:
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or ())
        if text in command and process.pid != os.getpid():
            found.append(f"{process.pid}: {command[:200]}")
    return found
