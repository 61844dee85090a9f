"""The link `make mlflow` prints opens the speech_assets experiment on its runs table, in a real
MLflow store: a new store gets the experiment as training would create it, a store an older version
made gets the experiment kind tag it lacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from speech_assets.train.tracking import EXPERIMENT, EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, experiment_runs_table


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("MLFLOW_PORT", "5123")  # `make mlflow MLFLOW_PORT=5123`
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_runs_table_link_of_a_new_store_creates_the_experiment(store: str, tmp_path: Path) -> None:
    """Kills: the link without `/runs` or without `workflowType=machine_learning` (MLflow 3.17 then
    opens the GenAI traces view), and a store without the experiment answered with the UI's home."""
    from mlflow.tracking import MlflowClient

    url = experiment_runs_table(store)
    experiment = MlflowClient(tracking_uri=store).get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    assert url == f"http://127.0.0.1:5123/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning"
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert experiment.artifact_location == str(tmp_path / "mlartifacts")  # where training puts artifacts
    assert experiment_runs_table(store) == url  # the same experiment next time


def test_runs_table_link_of_an_older_store_tags_its_experiment(store: str) -> None:
    """A store made before the experiment had its kind tag: the link opens that experiment (its run
    kept), now tagged for the UIs that read the tag. Kills: dropping ensure_experiment's tagging
    of an existing experiment, and creating a second experiment instead of finding the first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    old = client.create_experiment(EXPERIMENT)
    run = client.create_run(old, tags={"mode": "centralised"})
    assert EXPERIMENT_KIND_TAG not in client.get_experiment(old).tags

    url = experiment_runs_table(store)
    assert url.endswith(f"/#/experiments/{old}/runs?workflowType=machine_learning")
    assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert [r.info.run_id for r in client.search_runs([old])] == [run.info.run_id]
