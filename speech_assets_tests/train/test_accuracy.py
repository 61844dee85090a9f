"""One held-out masked accuracy: every view of a model shows the leak-free figure, under one name."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import unquote

import pytest

from speech_assets.train import accuracy

LEAK_FREE, LEAK_FREE_MAJORITY = 0.037, 0.021  # what every view must show
ALL_FRAMES, ALL_FRAMES_MAJORITY = 0.051, 0.033  # the leaky figure: never shown as the model's score


def centralised_run(run: Path) -> Path:
    """A finished centralised run folder: result.json and metrics.jsonl with two evaluations."""
    run.mkdir(parents=True)
    rows = [{"step": s, "loss": 5.0 - s / 100, "masked_accuracy": 0.02, "lr": 1e-3} for s in (10, 20, 30, 40)]
    for row, free, plain in ((rows[1], 0.030, 0.045), (rows[3], LEAK_FREE, ALL_FRAMES)):
        row |= {
            "val/leak_free_masked_accuracy": free,
            "val/leak_free_majority_accuracy": LEAK_FREE_MAJORITY,
            "val/masked_accuracy": plain,
            "val/majority_accuracy": ALL_FRAMES_MAJORITY,
        }
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = {
        "step": 40,
        "final_loss": 4.6,
        "heldout_loss": 4.7,
        "heldout_leak_free_masked_accuracy": LEAK_FREE,
        "heldout_leak_free_majority_accuracy": LEAK_FREE_MAJORITY,
        "heldout_masked_accuracy": ALL_FRAMES,
        "heldout_majority_accuracy": ALL_FRAMES_MAJORITY,
        "chance_accuracy": 0.01,
        "checkpoint": str(run / "final.pt"),
        "checkpoint_sha256": "1" * 64,
        "mlflow_run_id": "c" * 32,
        "step_unit": "step",
    }
    (run / "result.json").write_text(json.dumps(result))
    return run / "result.json"


def test_one_accuracy_in_every_view_of_a_run(tmp_path: Path) -> None:
    """The summary of `speech-assets stats`, the report (its summary and its training-runs table),
    the asset's metadata, its curve and the beats_majority_class check all show 0.037, the
    leak-free held-out masked accuracy, and none shows the all-frames 0.051 as it. Kills: any view
    reading ``heldout_masked_accuracy`` (all masked frames), today's summary and report."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from speech_assets.corpus.rejects import REJECTS_SCHEMA
    from speech_assets.defs import model_checks, torchrun
    from speech_assets.stats import database, report

    result_file = centralised_run(tmp_path / "training" / "run")
    run = result_file.parent
    manifest, rejects = tmp_path / "manifest.parquet", tmp_path / "rejects.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"utt_id": "s1-c-0", "speaker_id": "s1", "chapter_id": "c", "path": "/x.flac", "duration_s": 2.0}]
        ),
        manifest,
    )
    pq.write_table(pa.Table.from_pylist([], schema=REJECTS_SCHEMA), rejects)
    inputs = database.StatsInputs(
        manifest=manifest,
        manifest_rejects=rejects,
        shards=[],
        shard_rejects=[],
        clients=tmp_path / "no-clients.parquet",
        kmeans_quality=[],
        training_results=[result_file],
    )
    db = tmp_path / "stats.duckdb"
    database.build_database(db, inputs)

    (line,) = [line for line in database.summary(db).splitlines() if line.startswith("centralised model")]
    assert f"held-out masked accuracy {LEAK_FREE:.3f} (majority class {LEAK_FREE_MAJORITY:.3f}" in line
    assert f"{ALL_FRAMES}" not in line

    page = report.write_report(db, tmp_path / "report" / "index.html").read_text()
    summary = page.split("<h2>Summary</h2>", 1)[1].split("</section>", 1)[0]
    assert f"held-out masked accuracy {LEAK_FREE:.3f} (majority class {LEAK_FREE_MAJORITY:.3f})" in summary
    runs = page.split("<h2>Training runs</h2>", 1)[1].split("</section>", 1)[0]
    assert "<th>heldout_masked_accuracy</th>" in runs and f"<td>{LEAK_FREE}</td>" in runs
    assert str(ALL_FRAMES) not in summary + runs

    check = model_checks.above_majority_class(run)
    assert check.passed and check.metadata["heldout_masked_accuracy"].value == LEAK_FREE

    metadata = torchrun.run_metadata(
        run, {"heldout_masked_accuracy": ALL_FRAMES, "steps": 40}, json.loads(result_file.read_text())
    )
    assert (
        metadata["heldout_masked_accuracy"] == LEAK_FREE and metadata["heldout_majority_accuracy"] == LEAK_FREE_MAJORITY
    )
    assert metadata["all_frames_masked_accuracy"] == ALL_FRAMES  # the leak's measure, named apart
    assert f"held-out masked accuracy {LEAK_FREE:.3g}" in unquote(metadata["curve"].value)
    assert list(metadata)[:2] == ["curve", "training_curve"]  # the curve first on the asset's page
    assert accuracy.curve_points([json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()])[-1] == (
        40,
        LEAK_FREE,
        LEAK_FREE_MAJORITY,
    )


def test_one_accuracy_for_a_federation_round_by_round() -> None:
    """A federation's per-round table and curve show the leak-free accuracy as the held-out masked
    accuracy; the all-frames one only as ``all_frames_masked_accuracy``. Kills: the round table's
    ``heldout_masked_accuracy`` column holding the all-frames figure (today's)."""
    from speech_assets.defs.federated import round_rows, round_series

    lines = [
        {
            "round": 1,
            "train_loss": 3.0,
            "heldout_masked_accuracy": ALL_FRAMES,
            "majority_accuracy": ALL_FRAMES_MAJORITY,
            "heldout_leak_free_masked_accuracy": LEAK_FREE,
            "heldout_leak_free_majority_accuracy": LEAK_FREE_MAJORITY,
            "bytes_up": 1e6,
            "bytes_down": 2e6,
            "round_seconds": 3.21,
        }
    ]
    (row,) = round_rows(lines, {"1": ["client_00"]})
    assert row["heldout_masked_accuracy"] == LEAK_FREE and row["heldout_majority_accuracy"] == LEAK_FREE_MAJORITY
    assert row["all_frames_masked_accuracy"] == ALL_FRAMES and "majority_accuracy" not in row
    assert round_series(lines) == {accuracy.LABEL: [(1, LEAK_FREE)], "majority class": [(1, LEAK_FREE_MAJORITY)]}
    assert accuracy.metadata({"heldout_masked_accuracy": ALL_FRAMES}) == {"heldout_masked_accuracy": "not measured"}


@pytest.mark.parametrize("missing", [accuracy.ACCURACY, accuracy.MAJORITY])
def test_one_accuracy_is_never_the_all_frames_one_in_its_place(missing: str) -> None:
    """Without leak-free frames the held-out masked accuracy is not measured, not the all-frames
    figure. Kills: a fallback to ``heldout_masked_accuracy`` (today's check and curve)."""
    record = {
        accuracy.ACCURACY: LEAK_FREE,
        accuracy.MAJORITY: LEAK_FREE_MAJORITY,
        "heldout_masked_accuracy": ALL_FRAMES,
        "heldout_majority_accuracy": ALL_FRAMES_MAJORITY,
    }
    assert accuracy.heldout_accuracy(record) == accuracy.HeldoutAccuracy(LEAK_FREE, LEAK_FREE_MAJORITY)
    assert accuracy.heldout_accuracy({**record, missing: None}) is None
