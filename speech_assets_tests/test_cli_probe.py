"""`speech-assets probe` prints the probe's table over seeds and each encoder's standing."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from speech_assets.cli import main
from speech_assets.evaluation.compare import ProbeResult, results_table


def rows(model: str, cers: list[float], normalisation: str = "utterance") -> list[ProbeResult]:
    return [
        ProbeResult(model, "sha-" + model, "linear", [0.2, 0.8], split, cer + (0.0 if split == "heldout" else -0.3),
                    cer + 0.1, 40 if split == "heldout" else 200, 400, seed, normalisation, 4 if split == "heldout" else 20)
        for seed, cer in enumerate(cers) for split in ("train", "heldout")
    ]  # fmt: skip


def test_probe_prints_the_table_and_the_standing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    results = rows("fbank", [0.72, 0.73, 0.71], "global") + rows("random", [0.97, 0.96, 0.98]) + rows("pretrained", [0.60, 0.61, 0.62])
    results += rows("distilled", [0.70, 0.74, 0.78])
    (tmp_path / "probe").mkdir()
    pq.write_table(results_table(results), tmp_path / "probe" / "results.parquet")
    monkeypatch.setenv("SPEECH_ASSETS_DATA_DIR", str(tmp_path))  # found like `speech-assets stats` finds its data dir
    assert main(["probe"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| model | normalisation | probe lr | seeds | held-out CER |")
    assert out[2] == "| pretrained | utterance | n/a | 3 | 0.610 ± 0.010 | 0.710 ± 0.010 | 0.310 ± 0.010 | 40 | 4 | layer 1: 0.80 |"
    assert out[3].startswith("| fbank | global | n/a | 3 | 0.720 ± 0.010 |")
    assert out[-2] == (
        "pretrained: held-out CER 0.610 ± 0.010 over 3 seeds, 0.85x fbank (0.720 ± 0.010), 0.63x random (0.970 ± 0.010) "
        "on 40 utterances of 4 held-out speakers: beats both"
    )
    assert out[-1].startswith("distilled: held-out CER 0.740 ± 0.040 over 3 seeds, 1.03x fbank")
    assert out[-1].endswith("beats random; too small to tell against fbank (|difference| 0.020 <= 2 x combined std 0.041)")


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
    assert "| fbank | utterance | n/a | 2 |" in capsys.readouterr().out
