"""`speech-assets transcribe --model <MLflow model URI>`: a tiny real recogniser logged and
registered in a real SQLite MLflow store (as finetuned_asr does) is downloaded by its
``models:/`` and ``runs:/`` URIs and transcribes exactly as its local folder does; a model that is
not a recogniser, or no model at all, is refused with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from speech_assets.cli import main
from speech_assets.evaluation.recognise import vocabulary
from speech_assets.layout import RecogniserFiles
from speech_assets.model.export import RECOGNISER_OUTPUT_NAMES
from speech_assets.train.tracking import (
    EXPERIMENT,
    RECOGNISER_MODEL,
    RECOGNISER_REGISTERED_NAME,
    download_onnx_model,
    ensure_experiment,
    export_signature,
    log_onnx_model,
)
from speech_assets_tests.conftest import SAMPLE_CORPUS
from speech_assets_tests.evaluation.test_finetune import recogniser_folder


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, tiny_recogniser) -> dict:
    """A SQLite store with one finished run that holds the logged, registered recogniser, and a
    second run whose `recogniser` model has no recogniser.json (an encoder-like ONNX model)."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("mlflow")
    folder = recogniser_folder(tiny_recogniser, root / "recogniser", None)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = ensure_experiment(client, EXPERIMENT, uri, str(root / "mlartifacts"))
    runs = {}
    for kind in ("good", "bare"):
        runs[kind] = client.create_run(experiment, run_name=kind).info.run_id
        client.set_terminated(runs[kind])
    signature = export_signature(len(vocabulary()), RECOGNISER_OUTPUT_NAMES)
    logged = log_onnx_model(
        uri,
        runs["good"],
        folder / "recogniser.onnx",
        [folder / RecogniserFiles.card.name, folder / RecogniserFiles.frontend.name],
        name=RECOGNISER_MODEL,
        signature=signature,
        registered_name=RECOGNISER_REGISTERED_NAME,
    )
    log_onnx_model(uri, runs["bare"], folder / "recogniser.onnx", [], name=RECOGNISER_MODEL, signature=signature)
    return {"uri": uri, "folder": folder, "runs": runs, "logged": logged, "experiment": experiment, "root": root}


def transcribe(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    status = main(["transcribe", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_logged_recogniser_is_registered_in_its_run_and_experiment(store: dict) -> None:
    """Mutation killed: creating the logged model in another experiment than its run's (MLflow's
    fluent log_model does: the process's default experiment 0, artifacts under ./mlruns)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store["uri"])
    logged = store["logged"]
    assert logged["version"] == "1" and logged["registered_uri"] == f"models:/{RECOGNISER_REGISTERED_NAME}/1"
    model = client.get_logged_model(logged["model_uri"].removeprefix("models:/"))
    assert model.experiment_id == store["experiment"] and model.source_run_id == store["runs"]["good"]
    assert Path(model.artifact_location).is_relative_to(store["root"] / "mlartifacts")
    outputs = client.get_run(store["runs"]["good"]).outputs.model_outputs
    assert [o.model_id for o in outputs] == [model.model_id]
    version = client.get_model_version(RECOGNISER_REGISTERED_NAME, "1")
    assert version.run_id == store["runs"]["good"] and version.source == model.artifact_location


def test_the_signature_names_the_recogniser_tensors(store: dict, tmp_path: Path) -> None:
    """Mutation killed: logging without a signature (or with the encoder's outputs)."""
    from mlflow.models import Model

    onnx_file, extras = download_onnx_model(store["logged"]["registered_uri"], store["uri"], tmp_path)
    assert list(extras) == [RecogniserFiles.card.name, RecogniserFiles.frontend.name]
    signature = Model.load(str(onnx_file.parent)).signature
    inputs = {s.name: (str(s.type), s.shape) for s in signature.inputs.inputs}
    outputs = {s.name: (str(s.type), s.shape) for s in signature.outputs.inputs}
    assert inputs == {"feats": ("float32", (-1, -1, 80)), "lengths": ("int64", (-1,))}
    assert outputs == {"log_probs": ("float32", (-1, -1, 29)), "output_lengths": ("int64", (-1,))}


@pytest.mark.parametrize("which", ["latest", "version", "run"])
def test_transcribe_accepts_a_model_uri_and_reads_as_the_local_folder(
    store: dict, capsys, monkeypatch, tmp_path: Path, which: str
) -> None:
    """Mutation killed: `_cmd_transcribe` passing the URI to `Recogniser` as a path (it then
    reports 'no recogniser at models:/...')."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    monkeypatch.setenv("SPEECH_ASSETS_DATA_DIR", str(tmp_path))  # no mlflow.db there: the variable's store is read
    monkeypatch.chdir(tmp_path)
    audio = sorted(SAMPLE_CORPUS.rglob("*.flac"))[:2]
    uri = {
        "latest": f"models:/{RECOGNISER_REGISTERED_NAME}/latest",
        "version": f"models:/{RECOGNISER_REGISTERED_NAME}/1",
        "run": f"runs:/{store['runs']['good']}/{RECOGNISER_MODEL}",
    }[which]
    status, local, _ = transcribe(capsys, *map(str, audio), "--model", str(store["folder"]))
    assert status == 0 and len(local.splitlines()) == 2
    status, remote, err = transcribe(capsys, *map(str, audio), "--model", uri)
    assert status == 0, err
    assert remote == local
    assert not list(tmp_path.iterdir())  # the download is removed, nothing lands in the working directory


@pytest.mark.parametrize("uri", [f"models:/{RECOGNISER_REGISTERED_NAME}/latest", "runs:/{good}/recogniser"])
def test_the_default_store_is_the_data_directory_one(
    store: dict, capsys, monkeypatch, tmp_path: Path, uri: str
) -> None:
    """Mutations killed: reading the URI from MLflow's own default store instead of
    `sqlite:///<data dir>/mlflow.db` when MLFLOW_TRACKING_URI is unset; leaving a `models:/` URI
    to MLflow's download (it resolves the name through its global registry URI, not the store:
    the name is not found, and MLflow creates `./mlflow.db` in the working directory)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("SPEECH_ASSETS_DATA_DIR", str(store["root"]))
    monkeypatch.chdir(tmp_path)
    audio = sorted(SAMPLE_CORPUS.rglob("*.flac"))[0]
    status, out, err = transcribe(capsys, str(audio), "--model", uri.format(good=store["runs"]["good"]))
    assert status == 0 and out.startswith(f"{audio}\t"), err
    assert not list(tmp_path.iterdir())  # nothing in the working directory: no store of MLflow's own


@pytest.mark.parametrize(
    ("uri", "said"),
    [
        ("runs:/{bare}/recogniser", "is not a speech_assets recogniser: the model has no recogniser.json"),
        ("models:/speech_assets_recogniser/7", "no MLflow model at models:/speech_assets_recogniser/7"),
        ("models:/nothing_registered/latest", "no MLflow model at models:/nothing_registered/latest"),
    ],
)
def test_a_uri_without_the_recogniser_files_is_refused(store: dict, capsys, monkeypatch, uri: str, said: str) -> None:
    """Mutation killed: `fetch_recogniser` without its recogniser.json test (the bare model is then
    refused later, by `Recogniser`, as 'no recogniser at <temporary folder>')."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    audio = sorted(SAMPLE_CORPUS.rglob("*.flac"))[0]
    status, out, err = transcribe(capsys, str(audio), "--model", uri.format(bare=store["runs"]["bare"]))
    assert status == 1 and not out and err.startswith("error: ") and said in err, err
