"""bench/gpu.sh --smoke: the whole GPU benchmark script on the CPU with `tiny`, one report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_bench_smoke_runs_every_section_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = os.environ | {"OUT": str(out), "PY": sys.executable, "PYTHONPATH": str(REPO)}
    completed = subprocess.run(
        ["bash", "bench/gpu.sh", "--smoke"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    sections = report["sections"]
    assert {name: sections[name].get("rc") for name in ("machine", "model", "compile", "trainer")} == dict.fromkeys(
        ("machine", "model", "compile", "trainer"), 0
    ), completed.stdout[-3000:]
    assert all("needs CUDA" in sections[name]["skipped"] for name in ("fp16", "ddp", "oom"))
    assert report["machine"]["smoke"] == 1
    rows = report["model"]
    assert {(r["attention"], r["batch_seconds"]) for r in rows} == {
        (a, b) for a in ("reference", "sdpa") for b in (8.0, 4.0)
    }
    for row in rows:
        assert row["audio_seconds_per_second"] > 0 and 0 < row["position_conv_share"] < 1
        assert row["attention_kernels"] and "fused_adamw" in row and "mfu" in row and "sync_warnings" in row
    assert [entry["batch_seconds"] for entry in report["old_vs_new"]] == [8.0, 4.0]
    compiled = [r for r in report["compile"] if r.get("compiled")]
    assert compiled and 1 <= compiled[0]["compiled_graphs"] <= 3
    trainer = report["trainer_vs_model"]
    assert trainer["trainer_audio_seconds_per_second"] > 0 and trainer["model_alone_audio_seconds_per_second"] > 0
    assert trainer["epoch_at_end"] == 0  # the corpus is sized so that no timed step crosses an epoch
    assert "== report" in completed.stdout and "skipped" in completed.stdout
