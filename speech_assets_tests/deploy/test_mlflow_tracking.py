"""MLflow for a team: with a tracking server, artifacts go through the server and the run has a
URL; with a local store, artifacts go to `<data>/mlartifacts` and the run records its id and the
exact `mlflow ui` command that serves it (which is run here and serves the checkpoint)."""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path

import pytest

from speech_assets import locations
from speech_assets.defs.resources import StoragePaths
from speech_assets.train.tracking import run_url, ui_command
from speech_assets_tests.support.mlflow_server import MLFLOW, MlflowServer
from speech_assets_tests.support.postgres import PostgresServer
from speech_assets_tests.support.training_data import SyntheticCorpus, write_corpus


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCorpus:
    return write_corpus(tmp_path_factory.mktemp("corpus"), utterances_per_speaker=3, unlabelled_per_shard=0, seed=3)


def _train(
    corpus: SyntheticCorpus, run_dir: Path, tracking_uri: str, artifact_location: str | None, experiment: str
) -> dict:
    from speech_assets.train.trainer import train

    config = corpus.config(
        run_dir,
        max_steps=2,
        checkpoint_every=2,
        log_every=1,
        batch_seconds=6.0,
        mlflow_tracking_uri=tracking_uri,
        mlflow_artifact_location=artifact_location,
        mlflow_experiment=experiment,
        mlflow_run_name="team-test",
    )
    result = train(config)
    assert result is not None and result["step"] == 2
    return result


def test_artifact_location_and_run_link_follow_the_kind_of_store(tmp_path: Path) -> None:
    data = tmp_path / "out"
    # a server keeps its own default: artifacts go through it
    for uri in ("http://mlflow.internal:5000", "https://mlflow.example.com"):
        assert locations.mlflow_artifact_location(uri, data) is None
        assert StoragePaths(corpus="c", data_dir=str(data), mlflow_tracking_uri=uri).mlflow_artifact_location is None
        assert run_url(uri, "3", "abc") == f"{uri}/#/experiments/3/runs/abc"
    # stores the client writes itself: the data dir's mlartifacts folder, and a link into the UI
    # `make mlflow` serves over them on loopback
    for uri in (
        f"sqlite:///{tmp_path}/elsewhere/mlflow.db",
        f"file://{tmp_path}/mlruns",
        "postgresql+psycopg2://u:secret@db:5432/mlflow",
    ):
        assert StoragePaths(corpus="c", data_dir=str(data), mlflow_tracking_uri=uri).mlflow_artifact_location == str(
            data / "mlartifacts"
        )
        assert run_url(uri, "3", "abc") == "http://127.0.0.1:5000/#/experiments/3/runs/abc"
    assert locations.mlflow_artifact_location(f"sqlite:///{tmp_path}/mlflow.db") == str(tmp_path / "mlartifacts")
    # the recorded command never carries a database password
    command = ui_command("postgresql+psycopg2://u:secret@db:5432/mlflow", str(data / "mlartifacts"))
    assert "secret" not in command and "postgresql+psycopg2://u@db:5432/mlflow" in command


def test_training_against_a_tracking_server_sends_the_checkpoint_through_it(
    tiny_corpus: SyntheticCorpus,
    mlflow_server: MlflowServer,
    artifacts_destination: Path,
    postgres: PostgresServer,
    tmp_path: Path,
) -> None:
    from mlflow.tracking import MlflowClient

    paths = StoragePaths(corpus="unused", data_dir=str(tmp_path / "out"), mlflow_tracking_uri=mlflow_server.url)
    result = _train(
        tiny_corpus, tmp_path / "run", mlflow_server.url, paths.mlflow_artifact_location, "team_server_test"
    )

    client = MlflowClient(mlflow_server.url)
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/")  # the server's store, not a client path
    assert (
        result["mlflow_run_url"] == f"{mlflow_server.url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    )
    assert result["mlflow_run_url"].startswith("http://127.0.0.1:") and result["mlflow_ui"] is None

    # the checkpoint went through the server: downloaded through it, and on the server's side
    expected = _sha256(Path(result["checkpoint"]))
    downloaded = Path(client.download_artifacts(run.info.run_id, "checkpoint/final.pt", str(tmp_path / "download")))
    assert _sha256(downloaded) == expected
    on_server = [p for p in artifacts_destination.rglob("final.pt") if run.info.run_id in p.parts]
    assert len(on_server) == 1 and _sha256(on_server[0]) == expected
    assert not (tmp_path / "out" / "mlartifacts").exists()

    # the run lives in the server's PostgreSQL backend store (SQL against the server itself)
    rows = postgres.query("mlflow", "SELECT status, name FROM runs WHERE run_uuid = %s", (run.info.run_id,))
    assert rows == [("FINISHED", "team-test")]
    metric_rows = postgres.query(
        "mlflow", "SELECT count(*) FROM metrics WHERE run_uuid = %s AND key = 'loss'", (run.info.run_id,)
    )
    assert metric_rows[0][0] >= 2


def test_local_store_records_the_mlflow_ui_command_that_serves_the_run(
    tiny_corpus: SyntheticCorpus, tmp_path: Path
) -> None:
    data = tmp_path / "out"
    store = f"sqlite:///{data / 'mlflow.db'}"
    paths = StoragePaths(corpus="unused", data_dir=str(data), mlflow_tracking_uri=store)
    result = _train(tiny_corpus, data / "training" / "run", store, paths.mlflow_artifact_location, "speech_assets")
    assert result["mlflow_run_url"].startswith("http://127.0.0.1:5000/#/experiments/") and result["mlflow_run_id"]
    assert result["mlflow_ui"] == (
        f"mlflow ui --backend-store-uri {store} --default-artifact-root {data / 'mlartifacts'} --host "
        f"127.0.0.1 --workers 1 --port 5000"
    )
    assert list((data / "mlartifacts").rglob("final.pt"))

    # the recorded command, as written (on a free port), serves the run and its checkpoint
    command = shlex.split(result["mlflow_ui"])
    assert command[-2:] == ["--port", "5000"]
    with MlflowServer(tmp_path / "ui.log", command=[MLFLOW, *command[1:-2]]) as ui:
        run = ui.get_json(f"/api/2.0/mlflow/runs/get?run_id={result['mlflow_run_id']}")["run"]
        assert run["info"]["status"] == "FINISHED"
        served = ui.get_bytes(f"/get-artifact?path=checkpoint/final.pt&run_uuid={result['mlflow_run_id']}")
    assert hashlib.sha256(served).hexdigest() == _sha256(Path(result["checkpoint"]))


@pytest.mark.parametrize("store", ["server", "sqlite elsewhere"])
def test_every_tracked_asset_takes_the_artifact_location_from_storage_paths(store: str, tmp_path: Path) -> None:
    """Centralised, iteration-2 and distilled runs get it through ``run_inputs``; the federated
    run through its tracker: both from ``StoragePaths.mlflow_artifact_location``, never a folder
    of their own (a server's experiment with artifacts on the Dagster machine's disk)."""
    from speech_assets.defs.federated import federated_tracker
    from speech_assets.federated.config import FederatedConfig

    data = tmp_path / "out"
    uri = {"server": "http://mlflow.internal:5000", "sqlite elsewhere": f"sqlite:///{tmp_path / 'team' / 'mlflow.db'}"}[
        store
    ]
    paths = StoragePaths(corpus="unused", data_dir=str(data), mlflow_tracking_uri=uri)
    config = FederatedConfig(run_dir=str(paths.federated_run("r").root), run_name="r", clients=["client_00"])
    tracker = federated_tracker(paths, config, git_sha=None, dagster_run_id=None)
    assert tracker.artifact_location == paths.mlflow_artifact_location
    assert tracker.artifact_location == (None if store == "server" else str(data / "mlartifacts"))


def test_a_federated_experiment_created_on_a_tracking_server_keeps_its_artifacts_there(
    mlflow_server: MlflowServer, artifacts_destination: Path, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    from speech_assets.defs.federated import federated_tracker
    from speech_assets.federated.config import FederatedConfig

    data = tmp_path / "out"
    paths = StoragePaths(corpus="unused", data_dir=str(data), mlflow_tracking_uri=mlflow_server.url)
    run = paths.federated_run("fedserver")
    config = FederatedConfig(run_dir=str(run.root), run_name=run.root.name, clients=["client_00"])
    tracker = federated_tracker(paths, config, git_sha=None, dagster_run_id=None)
    tracker.experiment = "federated_first_on_the_server"  # this run creates the experiment
    tracker.start()
    run.root.mkdir(parents=True, exist_ok=True)
    run.final.write_bytes(b"a federated encoder")
    tracker.finish({"checkpoint_sha256": _sha256(run.final)})

    client = MlflowClient(mlflow_server.url)
    experiment = client.get_experiment_by_name("federated_first_on_the_server")
    assert experiment.artifact_location.startswith("mlflow-artifacts:/"), experiment.artifact_location
    assert client.get_run(tracker.run_id).info.artifact_uri.startswith("mlflow-artifacts:/")
    on_server = [p for p in artifacts_destination.rglob("final.pt") if tracker.run_id in p.parts]
    assert len(on_server) == 1 and on_server[0].read_bytes() == b"a federated encoder"
    assert not paths.layout.mlflow_artifacts.exists()
