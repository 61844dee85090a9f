"""`speech-assets probe` prints the probe's leaderboard (mean ± std over seeds, the paired verdict
against fbank and random), each encoder's standing and how to read it."""

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from speech_assets.cli import main
from speech_assets.evaluation.compare import (
    HeldoutErrors,
    ProbeResult,
    leaderboard,
    leaderboard_table,
    results_table,
    utterances_table,
)
from speech_assets.layout import ProbeFiles


def rows(model: str, cers: list[float], normalisation: str = "utterance", speakers: int = 4) -> list[ProbeResult]:
    """Per seed a train and a held-out row; the held-out row with 40 utterances of 20 characters
    each, every one with round(20 * cer) errors, spread over ``speakers`` speakers."""
    found = []
    for seed, cer in enumerate(cers):
        errors = np.full(40, round(20 * cer), dtype=np.int64)
        errors[:seed] += 1  # the seeds differ a little
        held = HeldoutErrors(
            tuple(f"u{i}" for i in range(40)),
            tuple(f"h{i % speakers}" for i in range(40)),
            errors,
            np.full(40, 20),
            errors // 4,
            np.full(40, 5),
        )
        cer = float(errors.sum() / 800)
        found += [
            ProbeResult(
                model,
                "sha-" + model,
                "linear",
                [0.2, 0.8],
                "train",
                cer - 0.3,
                cer + 0.1,
                200,
                400,
                seed,
                normalisation,
                20,
            ),
            ProbeResult(
                model,
                "sha-" + model,
                "linear",
                [0.2, 0.8],
                "heldout",
                cer,
                cer + 0.1,
                40,
                400,
                seed,
                normalisation,
                speakers,
                errors=held,
            ),
        ]
    return found


def write(results: list[ProbeResult], folder: Path, min_speakers: int | None = None) -> Path:
    """results.parquet and utterances.parquet (and the leaderboard, judged with ``min_speakers``) in ``folder``."""
    folder.mkdir(exist_ok=True)
    pq.write_table(results_table(results), folder / "results.parquet")
    pq.write_table(utterances_table(results), ProbeFiles.beside(folder / "results.parquet").utterances)
    if min_speakers is not None:
        pq.write_table(
            leaderboard_table(leaderboard(results, min_speakers), min_speakers),
            ProbeFiles.beside(folder / "results.parquet").leaderboard,
        )
    return folder / "results.parquet"


def test_probe_prints_the_leaderboard_first_then_the_standing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = (
        rows("fbank", [0.70, 0.70, 0.70], "global")
        + rows("random", [0.95, 0.95, 0.95])
        + rows("pretrained", [0.60, 0.60, 0.60])
    )
    results += rows("distilled", [0.70, 0.70, 0.70])
    write(results, tmp_path / "probe")
    monkeypatch.setenv("SPEECH_ASSETS_DATA_DIR", str(tmp_path))  # found like `speech-assets stats` finds its data dir
    assert main(["probe"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0]
        == "| encoder | normalisation | CER | WER | vs fbank | vs random | verdict | seeds | utterances | speakers |"
    )
    assert out[2].startswith("| pretrained | utterance | 0.601 ± 0.001 | 0.701 ± 0.001 | -0.100 [")
    assert out[2].endswith("| better | 3 | 40 | 4 |"), out[2]  # a word; the whole verdict in the lines below
    assert out[3].startswith("| fbank | global | 0.701 ± 0.001 |") and out[3].endswith(
        "| — | -0.250 [-0.250, -0.250] | baseline | 3 | 40 | 4 |"
    ), out[3]
    assert "| distilled | utterance | 0.701 ± 0.001 | 0.801 ± 0.001 | +0.000 [+0.000, +0.000] |" in out[4]
    assert out[4].endswith("| better than random | 3 | 40 | 4 |"), out[4]
    lines = [line for line in out if line.startswith(("pretrained:", "distilled:"))]
    assert lines[0].startswith("pretrained: held-out CER 0.601 ± 0.001 over 3 seeds, fbank -0.100 [")
    assert lines[0].endswith("on 40 utterances of 4 held-out speakers: better than fbank and random")
    assert out[-1].startswith("Verdict: each encoder's character errors on every held-out utterance")
    assert "| probe lr |" not in "\n".join(out)  # the details only on request
    assert main(["probe", "--details"]) == 0
    assert "| pretrained | utterance | n/a | 3 | 0.601 ± 0.001 |" in capsys.readouterr().out


def test_probe_says_indicative_only_with_the_minimum_the_run_judged_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = rows("fbank", [0.7, 0.7], speakers=2) + rows("pretrained", [0.5, 0.5], speakers=2)
    default = write(results, tmp_path / "default")  # no leaderboard file: the default minimum, 3
    assert main(["probe", "--results", str(default)]) == 0
    out = capsys.readouterr().out
    assert "| better* |" in out and out.count("indicative only") == 1  # the line's; the table says "*"
    assert "Indicative only here (* beside a verdict): 2 held-out speakers, fewer than 3." in out
    judged = write(results, tmp_path / "judged", min_speakers=2)  # the run's setting was 2
    assert main(["probe", "--results", str(judged)]) == 0
    out = capsys.readouterr().out
    assert "| better | 2 | 40 | 2 |" in out and "indicative" not in out


def test_probe_without_usable_results_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--results", str(tmp_path / "missing.parquet")]) == 1
    assert "no probe results" in capsys.readouterr().err
    old = results_table(rows("fbank", [0.7])).drop(["seed", "normalisation", "speakers"])  # before seeds existed
    pq.write_table(old, tmp_path / "old.parquet")
    assert main(["probe", "--results", str(tmp_path / "old.parquet")]) == 1
    assert "rematerialize downstream_probe" in capsys.readouterr().err
    before_lr = results_table(rows("fbank", [0.7, 0.8])).drop(["lr"])  # before the per-model lr: still reads
    pq.write_table(before_lr, tmp_path / "before_lr.parquet")
    assert main(["probe", "--results", str(tmp_path / "before_lr.parquet")]) == 0
    assert "| fbank | utterance | 0.7" in capsys.readouterr().out
