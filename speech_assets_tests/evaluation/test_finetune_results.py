"""The fine-tuning verdict (issue 44): a model that never trained cannot lose or be beaten, and one
held-out speaker makes it "indicative only", in the same words in the asset's metadata, its
check and `speech-assets finetune` (all three call :func:`verdicts`); the tables show dev CER,
lr, the OOV rate beside the beam decoder's WER, the text overlap, and whether the probe has run.
Tiny results written here in the format finetuned_asr writes."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speech_assets.evaluation.finetune_results import (
    OPTIONAL_COLUMNS,
    SCHEMA,
    markdown_tables,
    overlap_problems,
    read_rows,
    results_table,
    text_notes,
    verdict_markdown,
    verdicts,
)


def rows(
    heldout: dict[str, list[float]],
    labelled: dict[str, list[float]],
    speakers: int | None = 4,
    overlap: int | None = 0,
    utterances: int = 40,
) -> list[dict]:
    """Per model and seed: its held-out and labelled-set ("train") CER, greedy and beam rows, and
    the per-run columns (dev CER, lr, held-out speakers, text overlap, OOV rate)."""
    return [
        {
            "model": model,
            "labelled_minutes": 5.0,
            "seed": seed,
            "decoder": decoder,
            "split": split,
            "cer": cer,
            "wer": min(1.0, 2 * cer),
            "utterances": utterances,
            "steps": 400,
            "labelled_seconds": 300.0,
            "checkpoint_sha256": "x",
            "dev_cer": held + 0.01,
            "lr": 1.5e-3,
            "heldout_speakers": speakers,
            "text_overlap": overlap,
            "oov_rate": 0.375,
        }
        for model, values in heldout.items()
        for seed, (held, own) in enumerate(zip(values, labelled[model], strict=True))
        for decoder in ("greedy", "beam_3gram")
        for split, cer in (("heldout", held), ("train", own))
    ]


# scratch stuck on CTC's blank plateau: CER 1.0 held out and on its own labelled utterances
STUCK_SCRATCH = rows(
    {"pretrained": [0.50, 0.52, 0.51], "scratch": [1.0, 1.0, 1.0]},
    {"pretrained": [0.20, 0.22, 0.21], "scratch": [1.0, 1.0, 1.0]},
)


def test_verdict_baseline_trains_or_says_baseline_did_not_train() -> None:
    (line,) = verdicts(STUCK_SCRATCH)
    assert "baseline did not train (labelled CER 1.000 >= 0.95): not measured" in line, line
    assert "beats" not in line and "loses" not in line and "x)" not in line, line  # no win, no ratio
    # the same CERs with a scratch model that trained: a comparison, and here a win
    trained = rows(
        {"pretrained": [0.50, 0.52, 0.51], "scratch": [1.0, 1.0, 1.0]},
        {"pretrained": [0.20, 0.22, 0.21], "scratch": [0.40, 0.42, 0.41]},
    )
    (line,) = verdicts(trained)
    assert "beats scratch" in line and "not measured" not in line, line


def test_verdict_baseline_trains_but_the_model_did_not() -> None:
    stuck = rows(
        {"pretrained": [0.97, 0.98, 0.99], "scratch": [0.60, 0.61, 0.62]},
        {"pretrained": [0.96, 0.97, 0.98], "scratch": [0.30, 0.31, 0.32]},
    )
    (line,) = verdicts(stuck)
    assert "model did not train (labelled CER 0.970 >= 0.95): not measured" in line, line
    assert "loses" not in line and "baseline did not train" not in line, line
    both = rows(
        {"pretrained": [0.97, 0.98], "scratch": [1.0, 1.0]}, {"pretrained": [0.96, 0.97], "scratch": [1.0, 1.0]}
    )
    (line,) = verdicts(both)
    assert "model and baseline did not train (labelled CER 0.965 and 1.000 >= 0.95): not measured" in line, line


def test_finetune_indicative_below_min_heldout_speakers() -> None:
    heldout = {"pretrained": [0.30, 0.31, 0.29], "scratch": [0.60, 0.62, 0.58]}
    labelled = {"pretrained": [0.1, 0.1, 0.1], "scratch": [0.2, 0.2, 0.2]}
    (line,) = verdicts(rows(heldout, labelled, speakers=1))
    assert line.endswith("beats scratch (indicative only: 1 held-out speaker, fewer than 3)"), line
    (line,) = verdicts(rows(heldout, labelled, speakers=2), min_heldout_speakers=2)
    assert line.endswith("beats scratch"), line
    (line,) = verdicts(rows(heldout, labelled, speakers=2), min_heldout_speakers=4)
    assert line.endswith("(indicative only: 2 held-out speakers, fewer than 4)"), line
    (line,) = verdicts(rows(heldout, labelled, speakers=None))  # not recorded: no claim either way
    assert "indicative" not in line, line
    # a baseline that did not train is still not measured, and still indicative only
    (line,) = verdicts([{**r, "heldout_speakers": 1} for r in STUCK_SCRATCH])
    assert "baseline did not train" in line and line.endswith("(indicative only: 1 held-out speaker, fewer than 3)")


def test_finetune_indicative_tables_show_dev_cer_lr_oov_overlap_and_the_probe(tmp_path: Path) -> None:
    tables = markdown_tables(STUCK_SCRATCH)
    assert "| model | seeds | held-out CER | held-out WER | labelled CER | dev CER | lr | step |" in tables
    assert "| held-out CER | held-out WER | held-out OOV rate | labelled CER |" in tables  # beam: OOV beside WER
    assert "| pretrained | 3 | 0.510 ± 0.010 | 1.000 ± 0.000 | 0.210 ± 0.010 | 0.520 ± 0.010 | 0.0015 | 400 |" in tables
    assert tables.count("| frozen probe: not run yet |") == 2  # one per decoder's table
    assert tables.count("text overlap: 0 labelled or dev utterances whose transcript is a held-out one") == 2
    assert "held-out OOV rate against the beam decoder's lexicon (the labelled words; mean over runs): 5 min 0.375" in (
        tables
    )
    probed = markdown_tables(STUCK_SCRATCH, {"pretrained": "0.700 ± 0.010"})
    assert "| frozen probe: pretrained | | 0.700 ± 0.010 |" in probed and "not run yet" not in probed
    # every row of a table has as many cells as its header
    for table in tables.split("**")[2::2]:
        lines = [line for line in table.splitlines() if line.startswith("|")]
        assert len({line.count("|") for line in lines}) == 1, lines
    # unrecorded per-run columns (results from before them): n/a, and no overlap or OOV line
    old = [{**r, **dict.fromkeys(OPTIONAL_COLUMNS)} for r in STUCK_SCRATCH]
    assert text_notes(old) == [] and "text overlap" not in markdown_tables(old) and "| n/a |" in markdown_tables(old)


def test_finetune_indicative_old_results_read_with_none_but_not_without_old_columns(tmp_path: Path) -> None:
    current = tmp_path / "results.parquet"
    pq.write_table(results_table(STUCK_SCRATCH), current)
    assert read_rows(current) == STUCK_SCRATCH
    before = tmp_path / "before.parquet"  # a results file from before the per-run columns
    pq.write_table(results_table(STUCK_SCRATCH).drop_columns(list(OPTIONAL_COLUMNS)), before)
    again = read_rows(before)
    assert all(r[name] is None for r in again for name in OPTIONAL_COLUMNS) and len(again) == len(STUCK_SCRATCH)
    assert verdicts(again) == verdicts(STUCK_SCRATCH)  # 4 held-out speakers: not indicative either way
    broken = tmp_path / "broken.parquet"
    pq.write_table(pa.Table.from_pylist(STUCK_SCRATCH).drop_columns(["steps"]), broken)
    with pytest.raises(ValueError, match=r"lack the columns \['steps'\]"):
        read_rows(broken)
    assert set(OPTIONAL_COLUMNS) < set(SCHEMA.names)


def test_finetune_indicative_overlap_problems_name_each_run() -> None:
    assert overlap_problems(STUCK_SCRATCH) == []
    found = overlap_problems(
        rows({"pretrained": [0.5], "scratch": [0.6]}, {"pretrained": [0.2], "scratch": [0.3]}, 4, 2)
    )
    assert found == [
        f"{m}/5min/seed0: 2 labelled or dev utterances whose transcript is a held-out one (text overlap must be 0)"
        for m in ("pretrained", "scratch")
    ]


def test_finetune_cli_baseline_trains_verdict_is_the_functions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`speech-assets finetune` prints the tables, :func:`verdicts`' lines judged with the settings'
    [probe] min_heldout_speakers, and the text overlap and OOV rate."""
    from speech_assets.cli import main

    settings = tmp_path / "pipeline.toml"
    settings.write_text("[probe]\nmin_heldout_speakers = 2\n")
    monkeypatch.setenv("SPEECH_ASSETS_SETTINGS", str(settings))
    monkeypatch.setenv("SPEECH_ASSETS_DATA_DIR", str(tmp_path / "data"))  # no probe results there
    found = [{**r, "heldout_speakers": 1} for r in STUCK_SCRATCH]
    results = tmp_path / "results.parquet"
    pq.write_table(results_table(found), results)
    assert main(["finetune", "--results", str(results)]) == 0
    out = capsys.readouterr().out
    (line,) = verdicts(found, min_heldout_speakers=2)
    assert line.startswith("pretrained: 5 min: CER 0.510 ± 0.010 vs scratch 1.000 ± 0.000, baseline did not train")
    assert line.endswith("(indicative only: 1 held-out speaker, fewer than 2)")
    assert f"\n{line}\n" in out and "beats scratch" not in out, out
    assert "frozen probe: not run yet" in out and "\ntext overlap: 0 labelled or dev utterances" in out, out
    assert (
        "\nheld-out OOV rate against the beam decoder's lexicon (the labelled words; mean over runs): 5 min 0.375"
        in (out)
    )


def _sound_finetuning(data: Path) -> dict[str, str]:
    """A finetuned_asr output folder that is sound but for its results: one run folder with a finite
    loss per model and a recogniser whose ONNX parity is recorded within tolerance."""
    from speech_assets.layout import DataLayout, RecogniserFiles, RunFiles

    runs = {}
    for model in ("pretrained", "scratch"):
        files = RunFiles(data / "finetune" / "runs" / model)
        files.result.parent.mkdir(parents=True)
        files.metrics.write_text(json.dumps({"step": 1, "loss": 2.9}) + "\n")
        files.result.write_text(json.dumps({"loss": 2.9}))
        runs[f"{model}/5min/seed0"] = str(files.result.parent)
    card = RecogniserFiles(DataLayout(data).finetune.recogniser).card
    card.parent.mkdir(parents=True)
    card.write_text(json.dumps({"parity": {"max_abs_diff": 1e-6}}))
    return runs


def test_finetune_check_baseline_trains_states_the_verdict_and_fails_on_text_overlap(tmp_path: Path) -> None:
    """The check on finetuned_asr states the CLI's verdict word for word (not measured where the
    baseline did not train: soundness is not the verdict), warns where the verdict is indicative
    only and passes where it is not (both outcomes), and fails on text overlap. Kills: the check
    green beside an "indicative only" verdict (its pass not judged from the verdict lines)."""
    from speech_assets.defs.model_checks import finetuning_is_sound
    from speech_assets.defs.resources import PipelineSettings, StoragePaths
    from speech_assets.layout import DataLayout

    data = tmp_path / "data"
    runs = _sound_finetuning(data)
    paths = StoragePaths(corpus=str(tmp_path), data_dir=str(data), mlflow_tracking_uri="sqlite://")
    results = DataLayout(data).finetune.results
    found = [{**r, "heldout_speakers": 1} for r in STUCK_SCRATCH]
    with dg.instance_for_test() as instance:
        instance.report_runless_asset_event(
            dg.AssetMaterialization("finetuned_asr", metadata={"run_dirs": dg.MetadataValue.json(runs)})
        )
        context = dg.build_asset_check_context(instance=instance)
        pq.write_table(results_table(found), results)
        result = finetuning_is_sound(context, paths=paths, settings=PipelineSettings())
        lines = verdicts(found, min_heldout_speakers=3)
        # one held-out speaker: "indicative only" is the check's warning, in the verdict's words
        assert not result.passed and result.severity == dg.AssetCheckSeverity.WARN
        assert result.description == "\n".join(lines) and "baseline did not train" in result.description
        assert "indicative only: 1 held-out speaker, fewer than 3" in result.description
        assert result.metadata["verdict"].value == verdict_markdown(lines)
        assert result.metadata["text_overlap"].value == 0 and result.metadata["heldout_speakers"].value == 1

        enough = [{**r, "heldout_speakers": 3} for r in STUCK_SCRATCH]
        pq.write_table(results_table(enough), results)
        result = finetuning_is_sound(context, paths=paths, settings=PipelineSettings())
        assert result.passed and result.description == "\n".join(verdicts(enough, min_heldout_speakers=3))
        assert "indicative only" not in result.description

        pq.write_table(results_table([{**r, "text_overlap": 3} for r in found]), results)
        result = finetuning_is_sound(context, paths=paths, settings=PipelineSettings())
        assert not result.passed and result.severity == dg.AssetCheckSeverity.ERROR
        assert "pretrained/5min/seed0: 3 labelled or dev utterances" in result.description
        assert result.metadata["text_overlap"].value == 3
