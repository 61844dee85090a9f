"""MLflow tracking against a real SQLite store: the link `make mlflow` prints opens the speech_assets
experiment on its runs table (a new store gets the experiment as training would create it, an older
store's experiment gets the kind tag it lacks); every kind of model's run carries its ``mode`` tag, the
same summarised ``input.*`` tags whatever the trainer, and a fine-tuning run's initialisation."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from speech_assets.federated.config import FederatedConfig
from speech_assets.federated.tracking import FederatedTracker
from speech_assets.train.config import DistillConfig, FinetuneConfig, TrainConfig
from speech_assets.train.tracking import (
    EXPERIMENT,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    MlflowTracker,
    experiment_runs_table,
)

# the data versions each asset passes its trainer (speech_assets/defs/lineage.py input_versions, and
# the encoder's asset, the labelled text, the iteration-2 targets where the asset adds them)
SHARED = {
    "manifest": "m" * 64,
    "cmvn_stats": "c" * 64,
    "client_partitions": "p" * 64,
    "kmeans_targets/client_00": "k0" * 32,
    "kmeans_targets/client_01": "k1" * 32,
    **{f"vad_features/spk{i}": f"{i}" * 64 for i in range(3)},
}
TEACHER = {"pretrained_checkpoint": "e" * 64}
FINETUNE = {
    **TEACHER,
    "manifest": "m" * 64,
    "client_partitions": "p" * 64,
    **{f"vad_features/spk{i}": f"{i}" * 64 for i in range(3)},
    "labelled": "l" * 64,
}
RUN = {"shards": ["a.parquet"], "cmvn": "cmvn.npz"}


def _runs(tmp_path: Path, store: str) -> dict[str, str]:
    """{name: MLflow run id} of a run of each kind, started as its trainer starts it."""
    iteration2 = {**TEACHER, **{k.replace("kmeans_targets/", "kmeans_targets_iter2/"): v for k, v in SHARED.items()}}
    clients = {"client_00": {"labels": "l.parquet", "k": 4}}
    tracked = {"mlflow_tracking_uri": store}
    pretrained = FinetuneConfig(
        run_dir=str(tmp_path / "ft-p"),
        **RUN,
        clients={},
        encoder="final.pt",
        labelled="labelled.json",
        seed=1,
        budget_minutes=2.5,
        data_versions=FINETUNE,
        **tracked,
    )
    configs = {
        "centralised": TrainConfig(
            run_dir=str(tmp_path / "c"), **RUN, clients=clients, data_versions=SHARED, **tracked
        ),
        "iteration2": TrainConfig(
            run_dir=str(tmp_path / "i2"), **RUN, clients=clients, data_versions=iteration2, mode="iteration2", **tracked
        ),
        "distilled": DistillConfig(
            run_dir=str(tmp_path / "d"),
            **RUN,
            clients={},
            teacher="final.pt",
            data_versions={**TEACHER, **SHARED},
            **tracked,
        ),
        "pretrained": pretrained,
        "scratch": replace(pretrained, run_dir=str(tmp_path / "ft-s"), init="scratch", seed=0, budget_minutes=10.0),
    }
    ids = {name: MlflowTracker(config).start(None, {"reason": "test"}) for name, config in configs.items()}
    federated = FederatedConfig(
        run_dir=str(tmp_path / "f"), run_name="f", clients=["client_00", "client_01"], data_versions=SHARED
    )
    ids["federated"] = FederatedTracker(federated, store).start()
    return ids


def test_every_mlflow_run_carries_the_same_summarised_inputs_and_its_mode(tmp_path: Path) -> None:
    """Mutations killed: the federated tracker tagging (and logging as params) each raw
    ``data_version.<asset>/<partition>`` (issue 46: ~20 tags where the others had ``input.*``);
    a fine-tuning run tagged ``mode: centralised``; ``init``/``labelled_minutes``/``seed`` left off;
    a scratch run listing the encoder it only took the architecture of as an input."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ids = _runs(tmp_path, store)
    client = MlflowClient(store)
    runs = {name: client.get_run(run_id) for name, run_id in ids.items()}
    modes = {name: run.data.tags["mode"] for name, run in runs.items()}
    assert modes == {
        "centralised": "centralised",
        "iteration2": "iteration2",
        "distilled": "distilled",
        "pretrained": "finetuned",
        "scratch": "finetuned",
        "federated": "federated",
    }
    summary = {
        "input.manifest": "m" * 16,
        "input.cmvn_stats": "c" * 16,
        "input.client_partitions": "p" * 16,
        "input.vad_features": "3 partitions",
    }
    expected = {
        "centralised": summary | {"input.kmeans_targets": "2 partitions"},
        "federated": summary | {"input.kmeans_targets": "2 partitions"},
        "iteration2": summary | {"input.kmeans_targets_iter2": "2 partitions", "input.pretrained_checkpoint": "e" * 16},
        "distilled": summary | {"input.kmeans_targets": "2 partitions", "input.pretrained_checkpoint": "e" * 16},
        "pretrained": {
            "input.manifest": "m" * 16,
            "input.client_partitions": "p" * 16,
            "input.vad_features": "3 partitions",
            "input.labelled": "l" * 16,
            "input.pretrained_checkpoint": "e" * 16,
        },
    }
    expected["scratch"] = {k: v for k, v in expected["pretrained"].items() if k != "input.pretrained_checkpoint"}
    for name, run in runs.items():
        tags, params = run.data.tags, run.data.params
        assert {k: v for k, v in tags.items() if k.startswith("input.")} == expected[name], name
        assert not [k for k in [*tags, *params] if k.startswith("data_version")], name
        # every version, unabridged, in one artifact
        inputs = client.download_artifacts(run.info.run_id, "inputs.json", str(tmp_path / name))
        assert len(json.loads(Path(inputs).read_text())) >= 7, name
    fine = {name: runs[name].data.tags for name in ("pretrained", "scratch")}
    assert [(t["init"], t["labelled_minutes"], t["seed"]) for t in fine.values()] == [
        ("pretrained", "2.5", "1"),
        ("scratch", "10", "0"),
    ]
    assert not {"init", "labelled_minutes"} & set(runs["centralised"].data.tags)


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
