"""Fine-tuning runs in every view (issue 46): two real tiny CTC fine-tuning runs (pretrained and
from scratch) laid out and tracked as `finetuned_asr` leaves them (run folders under
``finetune/runs/``, config, provenance, a real MLflow store), then the real DuckDB database,
`speech-assets stats`, `speech-assets lineage`, the report and the MLflow runs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from speech_assets.defs.resources import StoragePaths
from speech_assets.defs.stats import _inputs
from speech_assets.evaluation.finetune import finetune
from speech_assets.layout import RunFiles
from speech_assets.stats.database import build_database
from speech_assets.train.provenance import record_provenance
from speech_assets_tests.evaluation.test_finetune_ddp import labelled_run

GIT, DAGSTER_RUN = "a" * 40, "d0d0d0d0-0000-4000-8000-000000000046"


def _finetuned(tmp_path: Path, paths: StoragePaths) -> dict[str, dict]:
    """{init: result.json} of a pretrained and a scratch run, each in its own folder under
    ``finetune/runs/`` with its config and provenance written as the asset writes them."""
    base = labelled_run(tmp_path)
    speakers = sorted(Path(shard).stem for shard in base.shards)
    versions = {
        "pretrained_checkpoint": "e" * 64,
        "manifest": "9" * 64,
        "client_partitions": "p" * 64,
        **{f"vad_features/{s}": "f" * 64 for s in speakers},
        "labelled": "l" * 64,
    }
    results = {}
    for init, seed in (("pretrained", 0), ("scratch", 1)):
        run_dir = paths.layout.finetune.runs / f"run-{init}"
        run_dir.mkdir(parents=True)
        config = replace(
            base,
            run_dir=str(run_dir),
            init=init,
            seed=seed,
            budget_minutes=1.0,
            max_steps=2,
            freeze_steps=1,
            checkpoint_every=2,
            data_versions=versions,
            git_sha=GIT,
            mlflow_tracking_uri=paths.mlflow_tracking_uri,
            mlflow_artifact_location=paths.mlflow_artifact_location,
        )
        config.to_json(RunFiles(run_dir).config)
        result = finetune(config)
        assert result is not None
        record_provenance(
            run_dir,
            result["checkpoint_sha256"],
            git_sha=GIT,
            mlflow_run_id=result["mlflow_run_id"],
            dagster_run_id=DAGSTER_RUN,
        )
        results[init] = result
    return results


def test_every_model_in_every_view_finetuning_runs(tmp_path: Path, capsys) -> None:
    """Mutations killed (each seen failing): fine-tuning run folders left out of the stats inputs
    (``model_results`` without ``finetuned``) or of ``CHECKPOINT_KINDS``; ``checkpoint_kind``
    calling a CTC checkpoint ``centralised``; a scratch run's lineage listing
    ``pretrained_checkpoint`` as an input (``run_inputs`` keeping the encoder); the stats line
    without init, budget and seed; MLflow ``mode`` ``centralised`` for fine-tuning."""
    from mlflow.tracking import MlflowClient

    from speech_assets import cli
    from speech_assets.stats.report import write_report

    out = tmp_path / "out"
    paths = StoragePaths(corpus=str(tmp_path), data_dir=str(out), mlflow_tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    paths.layout.manifest.root.mkdir(parents=True)
    pq.write_table(
        pa.table({"utt_id": ["a-1-0"], "speaker_id": ["a"], "duration_s": [1.0]}), paths.layout.manifest.manifest
    )
    pq.write_table(
        pa.table({n: pa.array([], pa.string()) for n in ("utt_id", "path", "stage", "reason", "detail")}),
        paths.layout.manifest.rejects,
    )
    results = _finetuned(tmp_path, paths)
    build_database(paths.layout.stats_db, _inputs(paths))

    with duckdb.connect(str(paths.layout.stats_db), read_only=True) as con:
        checkpoints = con.execute(
            "SELECT init, step, step_unit, sha256, mlflow_run_id, manifest_hash, git_commit, dagster_run_id, path "
            "FROM checkpoints WHERE kind = 'finetuned' ORDER BY init"
        ).fetchall()
        runs = con.execute(
            "SELECT init, preset, labelled_minutes, seed, steps, final_loss, heldout_cer, mlflow_run_id "
            "FROM training_runs WHERE kind = 'finetuned' ORDER BY init"
        ).fetchall()
    assert [row[:3] for row in checkpoints] == [("pretrained", 2, "step"), ("scratch", 2, "step")]
    for row, init in zip(checkpoints, ("pretrained", "scratch"), strict=True):
        result = results[init]
        assert row[3:] == (
            result["checkpoint_sha256"],
            result["mlflow_run_id"],
            "9" * 64,
            GIT,
            DAGSTER_RUN,
            result["checkpoint"],
        )
    assert [row[:5] for row in runs] == [
        ("pretrained", "ctc-pretrained", 1.0, 0, 2),
        ("scratch", "ctc-scratch", 1.0, 1, 2),
    ]
    assert all(row[5] is not None and 0 <= row[6] and row[7] for row in runs)

    assert cli.main(["stats", "--db", str(paths.layout.stats_db)]) == 0
    printed = capsys.readouterr().out
    for init, seed in (("pretrained", 0), ("scratch", 1)):
        line = next(line for line in printed.splitlines() if line.startswith(f"finetuned model ({init},"))
        assert line.startswith(f"finetuned model ({init}, 1 min labelled, seed {seed}, lr 0.002): 2 steps"), line
        assert "held-out CER" in line and results[init]["mlflow_run_id"] in line

    for init in ("pretrained", "scratch"):
        assert cli.main(["lineage", results[init]["checkpoint"]]) == 0
        shown = capsys.readouterr().out
        inputs = shown.split("inputs (data versions):")[1].split("config:")[0]
        assert "kind              finetuned" in shown and f"init              {init}" in shown
        assert "labelled          1 min, seed" in shown and DAGSTER_RUN in shown and GIT in shown
        assert "manifest" in inputs and "vad_features/" in inputs
        # a scratch run trained random weights: no encoder input, only the architecture it took
        assert ("pretrained_checkpoint" in inputs) == (init == "pretrained"), shown
        assert ("architecture of" in shown) == (init == "scratch")
        assert cli.main(["lineage", results[init]["checkpoint"], "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["kind"], report["init"], report["labelled_minutes"]) == ("finetuned", init, 1.0)

    page = write_report(paths.layout.stats_db, paths.layout.report.index).read_text()
    assert "ctc-pretrained" in page and "ctc-scratch" in page and "<td>finetuned</td>" in page

    client = MlflowClient(paths.mlflow_tracking_uri)
    for init, seed in (("pretrained", 0), ("scratch", 1)):
        tags = client.get_run(results[init]["mlflow_run_id"]).data.tags
        assert (tags["mode"], tags["init"], tags["labelled_minutes"], tags["seed"]) == (
            "finetuned",
            init,
            "1",
            str(seed),
        )
        assert ("input.pretrained_checkpoint" in tags) == (init == "pretrained")
