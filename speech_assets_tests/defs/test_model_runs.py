"""The model assets in real Dagster runs on the sample build (executed in this process against its
instance; the demo build runs the same assets through `dagster asset materialize`, a slow test):

- pretrained_checkpoint (iteration 1, torchrun, 40 steps), then HuBERT iteration 2 (20 steps):
  kmeans_targets_iter2 (each client clusters its own frames in a layer of that encoder) and
  pretrained_checkpoint_iter2; lineage, K, 50 Hz alignment and input versions.
- distilled_checkpoint, encoder_export (ONNX parity check, the user guide's example), downstream_probe
  (fbank and random baselines, results in DuckDB through dataset_stats).
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import dagster as dg
import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from speech_assets.targets.labels import read_labels
from speech_assets_tests.conftest import REPO, SAMPLE_CORPUS
from speech_assets_tests.support.local_runs import materialize_in_process

SHORT = {"preset": "tiny", "max_steps": 40, "checkpoint_every": 20}


@pytest.fixture(scope="module")
def trained(sample_build: dict):
    """The sample build with a 40-step iteration-1 checkpoint; yields (out, defs, instance)."""
    out, defs = sample_build["out"], sample_build["defs"]
    with dg.DagsterInstance.from_config(str(sample_build["home"])) as instance:
        materialize_in_process(
            defs, instance, "pretrained_checkpoint", run_config={"ops": {"pretrained_checkpoint": {"config": SHORT}}}
        )
        yield out, defs, instance


@pytest.fixture(scope="module")
def distilled(trained) -> list[str]:
    """distilled_checkpoint materialized; the torch modules its step built in this process (the
    Dagster one: the workers are torchrun's)."""
    out, defs, instance = trained
    built: list[str] = []
    init = torch.nn.Module.__init__

    def counted(module: torch.nn.Module, *args, **kwargs) -> None:
        built.append(type(module).__name__)
        init(module, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.Module, "__init__", counted)
        materialize_in_process(
            defs,
            instance,
            "distilled_checkpoint",
            run_config={"ops": {"distilled_checkpoint": {"config": {"max_steps": 20}}}},
        )
    return built


@pytest.fixture(scope="module")
def evaluated(trained, distilled):
    out, defs, instance = trained
    materialize_in_process(defs, instance, "encoder_export")
    # two probe seeds and one lr: a third of the default's probes, still a mean and a spread per model
    probe = {"steps": 40, "seeds": [0, 1], "lrs": [0.01]}
    materialize_in_process(
        defs, instance, "downstream_probe", run_config={"ops": {"downstream_probe": {"config": probe}}}
    )
    materialize_in_process(defs, instance, "dataset_stats")
    return trained


def test_iteration_2_targets_and_checkpoint_from_the_iteration_1_encoder(trained) -> None:
    out, defs, instance = trained
    clients = list(instance.get_dynamic_partitions("clients"))  # a range runs in registration order
    # a layer the encoder lacks: the step fails saying so, before any client is touched
    with pytest.raises(dg.Failure) as failure:
        materialize_in_process(
            defs,
            instance,
            "kmeans_targets_iter2",
            clients[:1],
            run_config={"ops": {"kmeans_targets_iter2": {"config": {"layer": 9}}}},
        )
    assert failure.value.description == "[iteration2] layer 9 is outside 1..4"
    assert not (out / "kmeans_iter2").exists()
    materialize_in_process(defs, instance, "kmeans_targets_iter2", clients)
    materialize_in_process(
        defs,
        instance,
        "pretrained_checkpoint_iter2",
        run_config={"ops": {"pretrained_checkpoint_iter2": {"config": {"max_steps": 20, "checkpoint_every": 10}}}},
    )
    event = (
        instance.fetch_materializations(dg.AssetKey("pretrained_checkpoint_iter2"), limit=1)
        .records[0]
        .asset_materialization
    )
    (teacher,) = [json.loads(p.read_text()) for p in (out / "training").glob("*/result.json")]
    for client_dir in sorted((out / "kmeans_iter2").glob("client_*")):
        quality = json.loads((client_dir / "quality.json").read_text())
        # lineage: which encoder and layer made the targets; K=500 shrank for these small clients
        assert quality["checkpoint_sha256"] == teacher["checkpoint_sha256"] and quality["layer"] == 2
        assert 1 < quality["k"] <= 500 and quality["perplexity"] > 1
        labels = read_labels(client_dir / "labels.parquet")
        for speaker in quality["speakers"]:
            shard = pq.read_table(
                out / "features" / "shards" / f"{speaker}.parquet", columns=["utt_id", "num_frames"]
            ).to_pylist()
            for row in shard:  # one label per 50 Hz encoder frame
                assert len(labels[row["utt_id"]]) == (row["num_frames"] + 1) // 2
    (result,) = [json.loads(p.read_text()) for p in (out / "training_iter2").glob("*/result.json")]
    assert result["step"] == 20
    assert event.tags["dagster/data_version"] == result["checkpoint_sha256"]
    assert event.metadata["input_versions"].value["kmeans_targets_iter2"].startswith("4 partitions")


def test_probe_compares_encoders_with_baselines(evaluated) -> None:
    out, _, instance = evaluated
    event = instance.fetch_materializations(dg.AssetKey("downstream_probe"), limit=1).records[0].asset_materialization
    assert next(iter(event.metadata)) == "leaderboard"  # the leaderboard first, as a table with its columns
    board = event.metadata["leaderboard"]
    assert isinstance(board, dg.TableMetadataValue) and board.schema.columns[0].name == "encoder"
    assert {r.data["encoder"] for r in board.records} >= {"fbank", "random", "pretrained", "distilled"}
    standing = event.metadata["standing"].value
    for encoder in ("pretrained", "distilled"):  # one line each, against both baselines, with a verdict
        line = next(line for line in standing.splitlines() if line.startswith(f"- {encoder}:"))
        assert re.search(r"fbank [+-]\d\.\d{3} \[", line) and re.search(r"random [+-]\d\.\d{3} \[", line), line
        # the sample holds out one speaker: whatever the verdict, it is indicative only
        assert re.search(
            r"(better than|worse than|no evidence against) .*\(indicative only: 1 held-out speaker", line
        ), line
    # the caveat once, beside the table; the verdict metadata in the words of its check, a warning here
    assert list(event.metadata)[:2] == ["leaderboard", "how_to_read"]
    assert "Indicative only here" in event.metadata["how_to_read"].value
    assert event.metadata["pretrained_beats_fbank"].value.startswith("warn: indicative only (1 held-out speaker")
    for name in ("utterances.parquet", "leaderboard.parquet"):
        assert (out / "probe" / name).is_file()
    table = pq.read_table(out / "probe" / "results.parquet")
    assert table.column_names == [
        "model",
        "checkpoint_sha256",
        "probe",
        "layer_weights",
        "split",
        "cer",
        "wer",
        "utterances",
        "steps",
        "seed",
        "normalisation",
        "speakers",
        "lr",
    ]
    assert all(r["lr"] == 0.01 for r in table.to_pylist())  # each model's, chosen from the run's lrs
    rows = table.to_pylist()
    assert sorted({r["seed"] for r in rows}) == [0, 1]  # every model over the same probe seeds
    heldout = {r["model"]: r for r in rows if r["split"] == "heldout" and r["seed"] == 0}
    # the probe's test speakers: in no encoder's training data and not in the probe's own
    split = json.loads((out / "probe" / "speakers.json").read_text())
    assert split["test"] and not set(split["test"]) & set(split["train"])
    clients = pq.read_table(out / "clients" / "clients.parquet").to_pylist()
    assert set(split["test"]) <= {r["speaker_id"] for r in clients if r["heldout"]}
    for name, record in split["encoders"].items():
        assert not set(split["test"]) & set(record["train"]), name
        assert set(split["test"]) <= set(record["heldout"]), name
    for row in rows:  # probe training rows are scored on the probe's training speakers only
        assert row["speakers"] <= (len(split["test"]) if row["split"] == "heldout" else len(split["train"]))
    # each encoder read its input as it was trained: per utterance by default
    assert {r["normalisation"] for r in rows} == {"utterance"}
    # every checkpoint asset that exists: iteration 2 when its test ran first, federated when built
    assert (
        {"fbank", "random", "pretrained", "distilled"}
        <= set(heldout)
        <= {"fbank", "random", "pretrained", "distilled", "iteration2", "federated"}
    )
    for model, row in heldout.items():
        assert 0 <= row["cer"] <= 2 and row["utterances"] > 0, model
        assert abs(sum(row["layer_weights"]) - 1) < 1e-3, model
    pretrained = json.loads(next((out / "training").glob("*/result.json")).read_text())
    assert heldout["pretrained"]["checkpoint_sha256"] == pretrained["checkpoint_sha256"]
    assert len(heldout["fbank"]["layer_weights"]) == 1 and len(heldout["pretrained"]["layer_weights"]) == 5
    con = duckdb.connect(str(out / "stats.duckdb"), read_only=True)
    try:
        in_db = con.execute(
            "SELECT model, cer FROM probe_results WHERE split = 'heldout' AND seed = 0 ORDER BY model"
        ).fetchall()
    finally:
        con.close()
    assert in_db == sorted((m, r["cer"]) for m, r in heldout.items())


def test_every_model_is_one_mlflow_experiment_linked_to_its_dagster_run(evaluated) -> None:
    """The Dagster runs of the model assets and their MLflow runs: one experiment, a ``mode`` tag,
    ``dagster_run_id`` back to the run that made each, the held-out results as ``val/`` series,
    the probe's CER/WER on each encoder's run, and the MLflow run as a link in the metadata."""
    from mlflow.tracking import MlflowClient

    out, defs, instance = evaluated
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    experiments = {
        e.experiment_id: e.name for e in client.search_experiments() if client.search_runs([e.experiment_id])
    }
    assert set(experiments.values()) == {"speech_assets"}
    for asset, mode in (("pretrained_checkpoint", "centralised"), ("distilled_checkpoint", "distilled")):
        record = instance.fetch_materializations(dg.AssetKey(asset), limit=1).records[0]
        metadata = record.asset_materialization.metadata
        run = client.get_run(metadata["mlflow_run_id"].value)
        assert run.data.tags["mode"] == mode and run.data.tags["dagster_run_id"] == record.run_id
        url = metadata["mlflow_run_url"]
        assert isinstance(url, dg.UrlMetadataValue)
        assert url.value == f"http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
        assert {"probe/cer", "probe/wer", "probe/cer_std"} <= set(run.data.metrics), sorted(run.data.metrics)
        assert not any(name.startswith("final.") for name in run.data.metrics)
    metadata = (
        instance.fetch_materializations(dg.AssetKey("pretrained_checkpoint"), limit=1)
        .records[0]
        .asset_materialization.metadata
    )
    run_id = metadata["mlflow_run_id"].value
    # SHORT: 40 steps, a checkpoint (and a held-out evaluation) every 20
    assert [m.step for m in client.get_metric_history(run_id, "val/leak_free_masked_accuracy")] == [20, 40]
    assert [m.step for m in client.get_metric_history(run_id, "val/leak_free_majority_accuracy")] == [20, 40]
    # readable metadata: the per-client table, sizes in MB, the curve drawn inline on the asset page
    assert isinstance(metadata["heldout_per_client"], dg.TableMetadataValue)
    assert list(metadata)[0] == "curve"  # Dagster shows metadata in insertion order: the curve on top
    result = json.loads((pathlib.Path(metadata["run_dir"].value) / "result.json").read_text())
    assert metadata["heldout_masked_accuracy"].value == round(result["heldout_leak_free_masked_accuracy"], 4)
    assert metadata["checkpoint_mb"].value > 0 and metadata["train_audio_h"].value > 0
    assert len(metadata["curve"].value) < 1000 and "data:image/svg+xml" in metadata["curve"].value


def test_export_parity_and_readme_example(evaluated, tmp_path) -> None:
    out, _, instance = evaluated
    (folder,) = (out / "export").iterdir()
    spec = json.loads((folder / "encoder.json").read_text())
    assert spec["parity"]["max_abs_diff"] <= 1e-4 and spec["output"]["frame_rate_hz"] == 50
    check = instance.event_log_storage.get_latest_asset_check_execution_by_key(
        [dg.AssetCheckKey(dg.AssetKey("encoder_export"), "onnx_matches_pytorch")]
    )[dg.AssetCheckKey(dg.AssetKey("encoder_export"), "onnx_matches_pytorch")]
    assert check.status.value == "SUCCEEDED" and check.event.dagster_event.event_specific_data.passed
    # the export is an MLflow model (ONNX flavour, signature, encoder.json beside it) in the run of the checkpoint
    from speech_assets.train.tracking import download_onnx_model

    exported = instance.fetch_materializations(dg.AssetKey("encoder_export"), limit=1).records[0]
    trained = instance.fetch_materializations(dg.AssetKey("pretrained_checkpoint"), limit=1).records[0]
    model_uri = exported.asset_materialization.metadata["mlflow_model"].value
    onnx_file, extras = download_onnx_model(model_uri, f"sqlite:///{out / 'mlflow.db'}", tmp_path / "model")
    assert (
        json.loads(extras["encoder.json"].read_text()) == spec
        and onnx_file.read_bytes() == (folder / "encoder.onnx").read_bytes()
    )
    from mlflow.tracking import MlflowClient

    logged = MlflowClient(f"sqlite:///{out / 'mlflow.db'}").get_logged_model(model_uri.removeprefix("models:/"))
    assert logged.source_run_id == trained.asset_materialization.metadata["mlflow_run_id"].value
    # the user guide's example, as written, on a FLAC file of the corpus
    readme = (REPO / "docs" / "USER_GUIDE.md").read_text()
    example = re.search(r"<!-- onnx-example -->\n```python\n(.*?)```", readme, re.S).group(1)
    assert len(example.splitlines()) <= 20
    script = tmp_path / "embed.py"
    script.write_text(example)
    flac = next(SAMPLE_CORPUS.rglob("*.flac"))
    proc = subprocess.run(
        [sys.executable, str(script), str(folder), str(flac)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f", {spec['preset']['dim']})" in proc.stdout


def test_export_parity_is_run_again_and_catches_a_drifted_export(evaluated, tmp_path) -> None:
    """onnx_matches_pytorch runs both exported files again on shard utterances: an ONNX or
    TorchScript file that no longer computes what the checkpoint does fails it, whatever
    number the exporter recorded."""
    import onnx
    from onnx import numpy_helper

    from speech_assets.defs.export import export_parity, onnx_matches_pytorch
    from speech_assets.defs.resources import PipelineSettings, StoragePaths
    from speech_assets.model.export import load_torchscript

    out = evaluated[0]
    (exported,) = (out / "export").iterdir()
    card = json.loads((exported / "encoder.json").read_text())["output"]
    # [export] layer = -1 (the last) names the folder after its index (issue 46: it was "-layer-1")
    assert exported.name.endswith(f"-layer{card['layers']}") and card["layer"] == card["layers"]
    paths = StoragePaths(corpus=str(SAMPLE_CORPUS), data_dir=str(out), mlflow_tracking_uri="sqlite://")
    shards = [
        paths.shard_file(s) for s in sorted(pq.read_table(paths.layout.clients_file).column("speaker_id").to_pylist())
    ]
    folder = tmp_path / "export"
    shutil.copytree(exported, folder)
    sound = export_parity(folder, shards, 4)
    assert sound.passed, sound.description
    assert sound.metadata["utterances"].value == 4 and sound.metadata["torchscript_max_abs_diff"].value <= 1e-4

    model = onnx.load(str(folder / "encoder.onnx"))
    weight = max(
        (t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT), key=lambda t: np.prod(t.dims)
    )
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) + np.float32(0.05), weight.name))
    onnx.save(model, str(folder / "encoder.onnx"))
    drifted = export_parity(folder, shards, 4)
    assert not drifted.passed and "ONNX differs" in drifted.description and "TorchScript" not in drifted.description

    shutil.copyfile(exported / "encoder.onnx", folder / "encoder.onnx")
    traced = load_torchscript(folder / "encoder.pt")
    with torch.no_grad():
        for parameter in traced.parameters():
            parameter.add_(0.05)
    torch.jit.save(traced, str(folder / "encoder.pt"))
    drifted = export_parity(folder, shards, 4)
    assert not drifted.passed and "TorchScript differs" in drifted.description

    # as Dagster runs it: the latest materialization names the folder (and its recorded diff, 0)
    with dg.instance_for_test() as instance:
        instance.report_runless_asset_event(
            dg.AssetMaterialization(
                "encoder_export",
                metadata={
                    "description": dg.MetadataValue.path(str(folder / "encoder.json")),
                    "max_abs_diff": 0.0,
                },
            )
        )
        result = onnx_matches_pytorch(
            dg.build_asset_check_context(instance=instance), paths=paths, settings=PipelineSettings()
        )
    assert not result.passed and "TorchScript differs" in result.description


def test_distillation_builds_no_model_in_the_dagster_process(distilled) -> None:
    """The teacher's shape comes from its run's record and the speeds from the worker's result."""
    assert distilled == []


def test_distilled_student_is_smaller_and_faster(evaluated) -> None:
    _, _, instance = evaluated
    event = (
        instance.fetch_materializations(dg.AssetKey("distilled_checkpoint"), limit=1).records[0].asset_materialization
    )
    meta = {k: v.value for k, v in event.metadata.items()}
    assert meta["student_parameters"] < meta["teacher_parameters"]
    # both timed on the same utterances; which is faster is a wall-clock figure (a loaded machine
    # can reverse it), so the test holds the figures' consistency, not their order
    assert meta["student_audio_s_per_s"] > 0 and meta["teacher_audio_s_per_s"] > 0
    assert meta["speedup"] == pytest.approx(meta["student_audio_s_per_s"] / meta["teacher_audio_s_per_s"], rel=0.01)
    state = torch.load(meta["checkpoint"], map_location="cpu", weights_only=True)
    assert state["kind"] == "distilled" and state["teacher_sha256"]


def test_every_model_reaches_the_stats_database_the_report_and_lineage(evaluated, capsys) -> None:
    """After the model assets ran: each checkpoint in `checkpoints` and `training_runs` with its
    kind, the export's parity and the student's speed-up in the database and the report, and
    `speech-assets lineage` naming each checkpoint's kind, step, commit, MLflow and Dagster runs."""
    from speech_assets import cli

    out, defs, instance = evaluated
    materialize_in_process(defs, instance, "dataset_stats")  # again: whatever ran since the fixture is in it
    folders = {"centralised": "training", "distilled": "distill", "iteration2": "training_iter2"}
    ran = {kind for kind, folder in folders.items() if list((out / folder).glob("*/result.json"))}
    assert {"centralised", "distilled"} <= ran
    with duckdb.connect(str(out / "stats.duckdb"), read_only=True) as con:
        rows = con.execute(
            "SELECT kind, step, sha256, mlflow_run_id, manifest_hash, git_commit, dagster_run_id, path FROM checkpoints"
        ).fetchall()
        assert {r[0] for r in con.execute("SELECT kind FROM training_runs").fetchall()} == ran
        (parity,) = con.execute("SELECT max_abs_diff FROM exports").fetchall()
        (speedup,) = con.execute("SELECT speedup FROM distillation").fetchall()
    assert {r[0] for r in rows} == ran and all(
        r[1] and len(r[2]) == 64 and r[3] and len(r[4]) == 64 and r[5] and r[6] for r in rows
    )
    distilled = instance.fetch_materializations(dg.AssetKey("distilled_checkpoint"), limit=1).records[0]
    assert 0 <= parity[0] < 1e-4
    assert speedup[0] == pytest.approx(distilled.asset_materialization.metadata["speedup"].value)
    page = (out / "report" / "index.html").read_text()
    assert "Export parity" in page and "Distilled student" in page and all(f"<td>{kind}</td>" in page for kind in ran)
    for kind, step, sha, run_id, _, commit, dagster_run, path in rows:
        assert cli.main(["lineage", path]) == 0
        printed = capsys.readouterr().out
        for shown in (f"kind              {kind}", f"step              {step}", sha, commit, run_id, dagster_run):
            assert shown in printed, (kind, shown)


# fine-tuning at test budgets: one labelled budget, one seed, pretrained and scratch (two runs), at
# `lr` (no lr grid: the choice on the dev set is tested in speech_assets_tests/evaluation/test_finetune_plan.py)
FINETUNE = {
    "labelled_minutes": [1.0],
    "seeds": [0],
    "lr_grid": [],
    "max_steps": 200,
    "freeze_steps": 50,
    "checkpoint_every": 100,
    "batch_seconds": 8.0,
}


@pytest.fixture(scope="module")
def finetuned(trained):
    out, defs, instance = trained
    materialize_in_process(defs, instance, "finetuned_asr", run_config={"ops": {"finetuned_asr": {"config": FINETUNE}}})
    return trained


def _finetune_run(out, init: str):
    """(config, result) of the fine-tuning run of ``init`` (pretrained or scratch)."""
    for result_file in (out / "finetune" / "runs").glob("*/result.json"):
        result = json.loads(result_file.read_text())
        if result["init"] == init:
            return json.loads((result_file.parent / "config.json").read_text()), result
    raise AssertionError(f"no {init} run")


def test_finetuning_lowers_ctc_loss_and_beats_an_untrained_head(finetuned) -> None:
    from speech_assets.evaluation.finetune import (
        TranscribedDataset,
        build_model,
        log_probabilities,
        score_rows,
        transcribed_index,
    )
    from speech_assets.model.encoders import load_encoder
    from speech_assets.train.config import FinetuneConfig

    out, _, instance = finetuned
    config, result = _finetune_run(out, "pretrained")
    lines = (pathlib.Path(config["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    curve = [step for step in map(json.loads, lines) if "loss" in step]  # the dev evaluations' lines aside
    assert curve[-1]["loss"] < 0.8 * curve[0]["loss"], curve
    assert result["init"] == "pretrained" and result["steps_trained"] <= FINETUNE["max_steps"]
    # the dev set chose the step: the best of its evaluations (a tie: the earliest)
    best_step, best_cer = min(result["dev_history"], key=lambda h: (h[1], h[0]))
    assert result["step"] == best_step and result["dev_cer"] == pytest.approx(best_cer)
    # the same encoder with the head it started from (untrained), on the same held-out utterances
    labelled = json.loads(pathlib.Path(config["labelled"]).read_text())
    start = FinetuneConfig.from_dict(config)
    model, _, cmvn = build_model(start)
    index = transcribed_index(start.shards, labelled["heldout"])
    heldout = TranscribedDataset(index, index.utterances, cmvn, labelled["heldout"])
    untrained = score_rows(
        {"heldout": heldout}, {"heldout": log_probabilities(model.eval(), heldout, torch.device("cpu"))}
    )
    tuned = next(r for r in result["scores"] if r["split"] == "heldout" and r["decoder"] == "greedy")
    assert tuned["cer"] < untrained[0]["cer"] and tuned["cer"] < 0.95, (tuned, untrained)
    # what was fine-tuned is the pretrained encoder: its weights moved after the frozen steps
    pretrained = load_encoder(start.encoder).model.state_dict()
    final = load_encoder(result["checkpoint"]).model.state_dict()
    assert not torch.equal(final["encoder.layers.0.linear1.weight"], pretrained["encoder.layers.0.linear1.weight"])
    assert torch.equal(final["frontend.conv1.weight"], pretrained["frontend.conv1.weight"])  # frozen throughout


def test_finetune_results_table_verdict_and_labelled_split(finetuned) -> None:
    out, _, instance = finetuned
    table = pq.read_table(out / "finetune" / "results.parquet")
    assert table.column_names[:9] == [
        "model",
        "labelled_minutes",
        "seed",
        "decoder",
        "split",
        "cer",
        "wer",
        "utterances",
        "steps",
    ]
    rows = table.to_pylist()
    assert {r["model"] for r in rows} == {"pretrained", "scratch"}
    assert {r["split"] for r in rows} == {"train", "dev", "heldout"}
    for init in ("pretrained", "scratch"):
        _, result = _finetune_run(out, init)
        chosen = {(r["steps"], r["dev_cer"], r["lr"]) for r in rows if r["model"] == init}
        assert chosen == {(result["step"], result["dev_cer"], result["lr"])}
    assert {r["text_overlap"] for r in rows} == {0}
    assert {r["decoder"] for r in rows} == {"greedy", "beam_3gram"}  # flashlight-text is a dependency
    event = instance.fetch_materializations(dg.AssetKey("finetuned_asr"), limit=1).records[0].asset_materialization
    verdict = event.metadata["verdict"].value
    # Dagster shows metadata in insertion order: the verdict, then the curves, above the tables (kills
    # the curves placed after the results, where they were the asset's 5th and 6th rows)
    names = list(event.metadata)
    curves = [n for n in ("wer_curve", "curve", "training_curve") if n in names]
    assert names[0] == "verdict" and curves and names[1 : 1 + len(curves)] == curves
    assert re.search(
        r"^- pretrained: 1 min: CER .* vs scratch .*"
        r"(beats scratch|loses to scratch|too small to tell|did not train \(labelled CER .*\): not measured)",
        verdict,
        re.M,
    ), verdict
    assert (
        "| scratch |" in event.metadata["results"].value
        and event.metadata["input_versions"].value["pretrained_checkpoint"]
    )
    clients = pq.read_table(out / "clients" / "clients.parquet").to_pylist()
    heldout = {r["speaker_id"] for r in clients if r["heldout"]}
    for init in ("pretrained", "scratch"):
        config, result = _finetune_run(out, init)
        labelled = json.loads(pathlib.Path(config["labelled"]).read_text())
        speakers = {u.split("-")[0] for u in labelled["train"]}
        assert labelled["train"] and not speakers & heldout
        assert {u.split("-")[0] for u in labelled["heldout"]} <= heldout
    # pretrained and scratch read the same labelled utterances
    assert _finetune_run(out, "pretrained")[0]["labelled"] != _finetune_run(out, "scratch")[0]["labelled"]
    assert json.loads(pathlib.Path(_finetune_run(out, "pretrained")[0]["labelled"]).read_text()) == json.loads(
        pathlib.Path(_finetune_run(out, "scratch")[0]["labelled"]).read_text()
    )


def _transcribe_in_process(args: list[str], data_dir: pathlib.Path, capsys) -> subprocess.CompletedProcess:
    """`speech-assets transcribe ARGS` through the CLI's main in this process: an interpreter start-up
    (torch, onnxruntime) less per call once a real command has run."""
    from speech_assets import cli

    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPEECH_ASSETS_DATA_DIR", str(data_dir))
        code = cli.main(["transcribe", *args])
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, printed.out, printed.err)


def test_recogniser_export_parity_and_transcribe(finetuned, tmp_path, capsys) -> None:
    import soundfile as sf

    from speech_assets.features.audio import decode

    out, _, instance = finetuned
    folder = out / "finetune" / "recogniser"
    spec = json.loads((folder / "recogniser.json").read_text())
    assert spec["parity"]["max_abs_diff"] <= 1e-4 and spec["parity"]["utterances"] > 0
    assert spec["vocabulary"][0] == "" and len(spec["vocabulary"]) == 29 and spec["cmvn"]["kind"] == "utterance"
    assert spec["featurisation"]["vad"]["aggressiveness"] == 2
    assert spec["audio_parity"]["same_text"] == spec["audio_parity"]["utterances"] > 0  # from the audio files
    good = sorted(SAMPLE_CORPUS.rglob("*.flac"))[:2]
    audio, rate = decode(good[0])
    wrong_rate = tmp_path / "slow-8k.wav"
    sf.write(
        wrong_rate, __import__("torchaudio").functional.resample(torch.from_numpy(audio[0]), rate, 8000).numpy(), 8000
    )
    corrupt = tmp_path / "corrupt.flac"
    corrupt.write_bytes(b"fLaC" + bytes(range(256)) * 4)
    env = {**__import__("os").environ, "SPEECH_ASSETS_DATA_DIR": str(out)}
    command = [
        sys.executable,
        "-m",
        "speech_assets.cli",
        "transcribe",
        str(good[0]),
        str(corrupt),
        str(wrong_rate),
        str(good[1]),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split("\t")[0] for line in lines] == [str(good[0]), str(corrupt), str(wrong_rate), str(good[1])]
    assert lines[1].startswith(f"{corrupt}\terror: unreadable: ")
    for line in (lines[0], lines[2], lines[3]):
        utt, text, seconds = line.split("\t")
        assert float(seconds) > 0.5 and set(text) <= set(" 'ABCDEFGHIJKLMNOPQRSTUVWXYZ"), line
    # the resampled copy reads like the original (the pipeline resamples the same way)
    assert lines[2].split("\t")[2] == lines[0].split("\t")[2]
    machine = _transcribe_in_process([str(good[0]), "--json"], out, capsys)
    assert machine.returncode == 0, machine.stderr[-3000:]
    row = json.loads(machine.stdout)
    assert row["id"] == str(good[0]) and row["error"] is None and row["text"] == lines[0].split("\t")[1]
    missing = _transcribe_in_process([str(good[0]), "--model", str(tmp_path)], out, capsys)
    assert missing.returncode == 1 and "no recogniser" in missing.stderr
    # the same recogniser, registered in MLflow by finetuned_asr, read back by its model URI
    event = instance.fetch_materializations(dg.AssetKey("finetuned_asr"), limit=1).records[0].asset_materialization
    registered = event.metadata["registered_model"].value
    assert re.fullmatch(r"models:/speech_assets_recogniser/\d+", registered), registered
    for uri in (registered, "models:/speech_assets_recogniser/latest"):
        by_uri = _transcribe_in_process([str(good[0]), "--model", uri], out, capsys)
        assert by_uri.returncode == 0 and by_uri.stdout == lines[0] + "\n", by_uri.stderr[-3000:]
    # the exported run's LM and lexicon travel with the model: beam decoding spells only labelled words
    assert spec["beam"]["lm"] == "3gram.arpa" and (folder / spec["beam"]["lexicon"]).is_file()
    lexicon = {line.split(" ", 1)[0] for line in (folder / spec["beam"]["lexicon"]).read_text().splitlines()}
    beam = _transcribe_in_process([str(good[0]), "--decoder", "beam"], out, capsys)
    assert beam.returncode == 0, beam.stderr[-3000:]
    utt, text, seconds = beam.stdout.strip().split("\t")
    assert utt == str(good[0]) and set(text.split()) <= lexicon and seconds == lines[0].split("\t")[2]


def test_killed_finetuning_resumes_bit_exactly(finetuned, alone, tmp_path) -> None:
    """A fine-tuning worker killed with SIGKILL mid-run continues from its last checkpoint to the
    same weights as a run that was never interrupted (the `alone` fixture's, the same config)."""
    import os
    import signal
    import time

    from speech_assets.runtime.faults import FAULTS_ENV, fault

    (folder, _) = _small_runs(finetuned[0], lambda init: tmp_path / init)
    path = folder / "config.json"
    command = [sys.executable, "-m", "speech_assets.evaluation.finetune", "--config", str(path)]
    env = _without_pipes()
    marker = tmp_path / "held"
    worker = subprocess.Popen(
        command, env={**env, FAULTS_ENV: fault("train.step", "hold", step=6, marker=marker)}, cwd=REPO
    )
    deadline = time.monotonic() + 300
    while not marker.is_file() and worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.is_file(), "the worker never reached step 6"
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    assert not (folder / "final.pt").exists()
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((folder / "result.json").read_text())
    assert result["init"] == "pretrained" and result["resumed_from_step"] == 4
    assert result["checkpoint_sha256"] == alone["pretrained"]


def test_finetuned_asr_trains_its_runs_in_one_launch(finetuned) -> None:
    """The asset launched torchrun once for both runs (pretrained and scratch): one batch folder
    naming both run folders (two at once, a process each, on a machine with two cores), each run
    with its own config, log, result and provenance."""
    from speech_assets.train.autoconfig import available_cores
    from speech_assets.train.config import FinetuneBatch

    out, _, instance = finetuned
    batches = sorted((out / "finetune" / "batches").glob("*/config.json"))
    assert len(batches) == 1, batches
    batch = FinetuneBatch.from_json(batches[0])
    folders = {pathlib.Path(_finetune_run(out, init)[1]["checkpoint"]).parent for init in ("pretrained", "scratch")}
    assert {pathlib.Path(r) for r in batch.runs} == folders
    assert batch.parallel == (available_cores() >= 2)
    for folder in folders:
        assert json.loads((folder / "provenance.json").read_text())["checkpoint_sha256"]
        assert (folder / "train.log").read_text().count("fine-tuning (") == 1  # its own run's log only


def test_every_model_in_every_view_after_finetuned_asr(finetuned, capsys) -> None:
    """The asset's own fine-tuning runs (pretrained and scratch, 1 min, seed 0) in `checkpoints` and
    `training_runs` (kind finetuned, init, budget, seed), `speech-assets stats` and `lineage`, and
    their MLflow runs (mode finetuned, init, labelled_minutes, seed). Mutations killed (each seen
    failing): the asset's run config without its budget (``budget_minutes``: no
    ``labelled_minutes`` tag); `dataset_stats` reading no fine-tuning run folder."""
    from mlflow.tracking import MlflowClient

    from speech_assets import cli

    out, defs, instance = finetuned
    materialize_in_process(defs, instance, "dataset_stats")
    with duckdb.connect(str(out / "stats.duckdb"), read_only=True) as con:
        rows = con.execute(
            "SELECT t.init, t.labelled_minutes, t.seed, c.sha256, c.mlflow_run_id, c.dagster_run_id, c.path "
            "FROM training_runs t JOIN checkpoints c USING (run_dir) WHERE t.kind = 'finetuned' ORDER BY t.init"
        ).fetchall()
    assert [row[:3] for row in rows] == [("pretrained", 1.0, 0), ("scratch", 1.0, 0)]
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    for init, _, _, sha, run_id, dagster_run, path in rows:
        assert sha == _finetune_run(out, init)[1]["checkpoint_sha256"] and dagster_run
        tags = client.get_run(run_id).data.tags
        assert (tags["mode"], tags["init"], tags["labelled_minutes"], tags["seed"]) == ("finetuned", init, "1", "0")
        assert cli.main(["lineage", path]) == 0
        inputs = capsys.readouterr().out.split("inputs (data versions):")[1].split("config:")[0]
        assert ("pretrained_checkpoint" in inputs) == (init == "pretrained"), inputs
    assert cli.main(["stats", "--db", str(out / "stats.duckdb")]) == 0
    printed = capsys.readouterr().out
    assert all(f"finetuned model ({init}, 1 min labelled, seed 0" in printed for init in ("pretrained", "scratch"))


SMALL_FINETUNE = {"max_steps": 10, "freeze_steps": 4, "checkpoint_every": 4, "decoders": ["greedy"], "threads": 1}


def _small_runs(out, folder_of) -> list[pathlib.Path]:
    """The pretrained and the scratch run of the fixture at 10 steps, one thread, in new folders."""
    from speech_assets.train.config import FinetuneConfig

    folders = []
    for init in ("pretrained", "scratch"):
        config, _ = _finetune_run(out, init)
        folder = folder_of(init)
        folder.mkdir(parents=True)
        run = {**config, **SMALL_FINETUNE, "run_dir": str(folder), "mlflow_tracking_uri": None}
        FinetuneConfig.from_dict(run).to_json(folder / "config.json")
        folders.append(folder)
    return folders


def _without_pipes() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}


@pytest.fixture(scope="module")
def alone(finetuned, tmp_path_factory) -> dict[str, str]:
    """init -> the checkpoint hash of the small run launched alone (one process)."""
    root = tmp_path_factory.mktemp("alone")
    shas = {}
    for folder in _small_runs(finetuned[0], lambda init: root / init):
        command = [sys.executable, "-m", "speech_assets.evaluation.finetune", "--config", str(folder / "config.json")]
        proc = subprocess.run(command, env=_without_pipes(), cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads((folder / "result.json").read_text())
        shas[result["init"]] = result["checkpoint_sha256"]
    assert len(set(shas.values())) == 2
    return shas


@pytest.mark.parametrize("parallel", [False, True], ids=["one-after-another", "two-at-once"])
def test_a_batch_trains_each_run_as_alone_and_resumes_after_a_kill(finetuned, alone, tmp_path, parallel) -> None:
    """Runs trained in one launch, one after another in one process or two at once (a process
    each, under torchrun), give the weights each gives launched alone; a launch killed with
    SIGKILL mid-run continues from the last checkpoint and does not train a finished run again."""
    import os
    import signal
    import time

    from speech_assets.layout import RunFiles
    from speech_assets.runtime.faults import FAULTS_ENV, fault
    from speech_assets.train import launch
    from speech_assets.train.config import FinetuneBatch

    folders = _small_runs(finetuned[0], lambda init: tmp_path / init)
    batch_file = tmp_path / "batch" / "config.json"
    batch_file.parent.mkdir()
    FinetuneBatch(str(batch_file.parent), [str(f) for f in folders], batch_seconds=8.0, parallel=parallel).to_json(
        batch_file
    )
    env = _without_pipes()
    if parallel:
        command = launch.build_torchrun_command(batch_file, 2, 0, module="speech_assets.evaluation.finetune")
        env = launch.torchrun_env(env, nproc=2)
    else:
        command = [sys.executable, "-m", "speech_assets.evaluation.finetune", "--config", str(batch_file)]
    marker = tmp_path / "held"
    # held at step 6, after the step-4 checkpoint: the first run (each process's first, two at once)
    held = {**env, FAULTS_ENV: fault("train.step", "hold", step=6, marker=marker)}
    worker = subprocess.Popen(command, env=held, cwd=REPO, start_new_session=True)
    interrupted = folders if parallel else folders[:1]
    deadline = time.monotonic() + 600
    while worker.poll() is None and time.monotonic() < deadline:
        if marker.is_file() and all(RunFiles(f).checkpoint(4).is_file() for f in interrupted):
            break
        time.sleep(0.2)
    assert marker.is_file(), "the launch never reached step 6"
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    assert not any((f / "result.json").exists() for f in folders)
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((f / "result.json").read_text()) for f in folders]
    assert [r["resumed_from_step"] for r in results] == ([4, 4] if parallel else [4, None])
    assert {r["init"]: r["checkpoint_sha256"] for r in results} == alone
    assert "fine-tuning (scratch)" in (folders[1] / "train.log").read_text()  # each run logs to its own folder
    summary = json.loads((batch_file.parent / "result.json").read_text())
    assert [r["checkpoint_sha256"] for r in summary["runs"]] == [r["checkpoint_sha256"] for r in results][
        : 1 if parallel else 2
    ]
    # launched again: both finished, nothing trains, nothing is rewritten
    stamps = [(f / "final.pt").stat().st_mtime_ns for f in folders]
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(f / "final.pt").stat().st_mtime_ns for f in folders] == stamps


@pytest.mark.parametrize(
    "change, said",
    [
        ({"runs": []}, "distinct run folders"),
        ({"batch_seconds": 0.0}, "batch_seconds must be > 0"),
        ({"unknown": 1}, "unknown FinetuneBatch fields"),
    ],
)
def test_a_bad_batch_is_refused(tmp_path, change: dict, said: str) -> None:
    from speech_assets.train.config import FinetuneBatch

    path = tmp_path / "batch.json"
    path.write_text(
        json.dumps({"run_dir": str(tmp_path), "runs": [str(tmp_path / "a")], "batch_seconds": 8.0, **change})
    )
    with pytest.raises(ValueError, match=said):
        FinetuneBatch.from_json(path)


def test_a_batch_refuses_a_run_whose_config_names_another_folder(tmp_path) -> None:
    """A run folder's config.json must train in that folder: a batch never writes elsewhere."""
    from speech_assets.train.config import FinetuneBatch, FinetuneConfig

    (tmp_path / "a").mkdir()
    FinetuneConfig(
        run_dir=str(tmp_path / "elsewhere"), shards=[], cmvn="", clients={}, encoder="e.pt", labelled="l.json"
    ).to_json(tmp_path / "a" / "config.json")
    batch = FinetuneBatch(str(tmp_path / "batch"), [str(tmp_path / "a")], batch_seconds=8.0)
    with pytest.raises(ValueError, match="names another run folder"):
        batch.run_config(str(tmp_path / "a"))


def test_finetuning_check_passes_and_catches_a_non_finite_loss(finetuned, tmp_path) -> None:
    from speech_assets.defs.model_checks import finetuning_is_sound
    from speech_assets.defs.resources import PipelineSettings, StoragePaths
    from speech_assets.evaluation.finetune_results import read_rows, verdict_markdown, verdicts

    out, _, instance = finetuned
    key = dg.AssetCheckKey(dg.AssetKey("finetuned_asr"), "finetuning_is_sound")
    check = instance.event_log_storage.get_latest_asset_check_execution_by_key([key])[key]
    # the sample holds out one speaker: the verdict is indicative only, and the check warns in its words
    evaluation = check.event.dagster_event.event_specific_data
    assert check.status.value == "FAILED" and not evaluation.passed  # Dagster's FAILED: a WARN, yellow
    assert evaluation.severity == dg.AssetCheckSeverity.WARN and "indicative only" in evaluation.description
    _, result = _finetune_run(out, "pretrained")
    broken = tmp_path / "run"
    shutil.copytree(pathlib.Path(result["checkpoint"]).parent, broken)
    with open(broken / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"step": 999, "loss": float("nan")}) + "\n")
    paths = StoragePaths(corpus=str(SAMPLE_CORPUS), data_dir=str(out), mlflow_tracking_uri="sqlite://")
    with dg.instance_for_test() as fresh:
        fresh.report_runless_asset_event(
            dg.AssetMaterialization(
                "finetuned_asr", metadata={"run_dirs": dg.MetadataValue.json({"pretrained/1min/seed0": str(broken)})}
            )
        )
        verdict = finetuning_is_sound(
            dg.build_asset_check_context(instance=fresh), paths=paths, settings=PipelineSettings()
        )
    assert not verdict.passed and "pretrained/1min/seed0: metrics.jsonl loss: 1 of" in verdict.description
    # the check states the verdict the CLI prints, word for word
    lines = verdicts(read_rows(out / "finetune" / "results.parquet"), min_heldout_speakers=3)
    assert verdict.metadata["verdict"].value == verdict_markdown(lines)
    assert all(line in verdict.description for line in lines)
