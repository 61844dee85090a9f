"""bench/gpu.sh: its dependency check, its report's targets and the parsing of a CUDA trace (quick),
and ``--smoke``: the whole script on the CPU with `tiny`, one report (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash") or "bash"  # by its path: one test gives the script a PATH of its own
CPU_BACKENDS = {"flash_cpu", "math", "efficient"}


def bench_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = os.environ | {"OUT": str(tmp_path / "out"), "PY": sys.executable, "PYTHONPATH": str(REPO)} | env
    return subprocess.run(
        [BASH, "bench/gpu.sh", *args], cwd=REPO, env=environment, capture_output=True, text=True, timeout=1800
    )


def test_gpu_bench_refuses_to_start_without_a_dependency(tmp_path: Path) -> None:
    """A python module the sections import that fails to import (here torch), or no nvidia-smi on a
    GPU run: one line names it and the script exits 2 before any section runs."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "torch.py").write_text("raise ImportError('not installed here')\n")
    missing = run_script(tmp_path, "--smoke", PYTHONPATH=f"{fake}{os.pathsep}{REPO}")
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert missing.stderr.strip().splitlines() == [
        "!! gpu.sh: missing dependency: python module torch (ImportError: not installed here)"
    ]
    assert not (tmp_path / "out").exists() and "==" not in missing.stdout

    tools = tmp_path / "bin"  # a PATH with `timeout` and no nvidia-smi
    tools.mkdir()
    (tools / "timeout").symlink_to(shutil.which("timeout") or "/usr/bin/timeout")
    no_driver = run_script(tmp_path, PATH=str(tools))
    assert no_driver.returncode == 2, no_driver.stdout + no_driver.stderr
    assert "nvidia-smi is not on PATH" in no_driver.stderr and len(no_driver.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_gpu_bench_limits_fit_seven_minutes() -> None:
    """The GPU run's section limits, the report's and the dependency check's add up to at most 420 s."""
    script = (REPO / "bench" / "gpu.sh").read_text()
    limits = next(line for line in script.splitlines() if line.strip().startswith("LIMITS=(10 "))
    check = next(line for line in script.splitlines() if line.startswith("CHECK_LIMIT="))
    total = sum(int(n) for n in limits.split("(")[1].split(")")[0].split()) + int(check.split("=")[1])
    assert total <= 420, total


def gpu_out(tmp_path: Path, mfu: float, busy: float, syncs: int) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    (out / "machine.json").write_text(json.dumps({"smoke": 0, "device": "NVIDIA H200"}))
    alone = {"attention": "sdpa", "batch_seconds": 400.0, "audio_seconds_per_second": 1000.0}
    (out / "model.json").write_text(json.dumps([alone | {"attention": "reference"}, alone]))
    new = {"variant": "new", "preset": "base", "precision": "bf16", "batch_seconds": 400.0}
    new |= {"audio_seconds_per_second": 900.0, "mfu": mfu, "kernel_busy_share": busy, "host_syncs": syncs}
    old = new | {"variant": "old", "audio_seconds_per_second": 600.0}
    finetune = new | {"variant": "finetune", "audio_seconds_per_second": 500.0}
    (out / "trainer.json").write_text(json.dumps([old, new, finetune]))
    return out


def test_gpu_report_judges_the_targets(tmp_path: Path) -> None:
    """PASS and MISS on a GPU run's rows (MFU, kernel-busy, trainer / model alone, fine-tuning /
    pretraining, host syncs); the old/new speed-up from the trainer's rows."""
    report = bench_module("gpu_report").build(gpu_out(tmp_path, mfu=0.31, busy=0.5, syncs=1))
    statuses = [(t["value"], t["status"]) for t in report["targets"]]
    assert statuses == [(0.31, "PASS"), (0.5, "MISS"), (0.9, "PASS"), (500 / 900, "MISS"), (1, "MISS")]
    assert report["trainer_old_vs_new"]["speedup"] == 1.5


def event(name: str, start: float, end: float, cuda: bool = True) -> SimpleNamespace:
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=kind, time_range=SimpleNamespace(start=start, end=end))


def test_trace_names_the_attention_kernel_not_a_convolution() -> None:
    """Kernel names by backend: cuDNN's SDPA kernel (which also says "flash") is cuDNN; a cuDNN
    convolution is no attention kernel (issue 44's report named one); busy time is the union of
    the kernels' intervals, copies left out."""
    trace = bench_module("gpu_trace")
    events = [
        event("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64", 0, 10),
        event("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>(Flash_fwd_params)", 5, 20),
        event("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_params>", 12, 18),
        event("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", 30, 40),
        event("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", 35, 45),
        event("aten::_scaled_dot_product_flash_attention", 0, 1, cuda=False),
        event("Memcpy HtoD (Pinned -> Device)", 50, 60),  # the next batch's copy: no kernel
    ]
    kernels = trace.attention_kernels(events)
    assert list(kernels) == ["flash", "cudnn", "efficient"]  # the most launched first
    assert not any("implicit_gemm" in name for names in kernels.values() for name in names)
    assert trace.attention_backends(events) == ["flash"]
    assert trace.kernel_busy_us(events) == 20 + 15  # [0, 20] and [30, 45]


@pytest.mark.slow
def test_gpu_bench_smoke_runs_every_section_and_reports(tmp_path: Path) -> None:
    completed = run_script(tmp_path, "--smoke")
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    sections = report["sections"]
    assert {name: sections[name].get("rc") for name in ("machine", "model", "compile", "trainer")} == dict.fromkeys(
        ("machine", "model", "compile", "trainer"), 0
    ), completed.stdout[-3000:]
    assert all("needs CUDA" in sections[name]["skipped"] for name in ("fp16", "ddp", "oom"))
    assert report["machine"]["smoke"] == 1
    rows = report["model"]
    assert {(r["attention"], r["batch_seconds"]) for r in rows} == {("reference", 24.0), ("sdpa", 24.0)}
    for row in rows:
        assert row["audio_seconds_per_second"] > 0 and 0 < row["position_conv_share"] < 1
        assert row["attention_kernel"] in CPU_BACKENDS and "mfu" in row and "sync_warnings" in row
    compiled = [r for r in report["compile"] if r.get("compiled")]
    assert compiled and 1 <= compiled[0]["compiled_graphs"] <= 3

    trainer = {row["variant"]: row for row in report["trainer"]}
    assert set(trainer) == {"old", "new", "finetune"}
    finetune = trainer.pop("finetune")
    assert "error" not in finetune and finetune["heads"] == "CTC" and finetune["audio_seconds_per_second"] > 0
    assert finetune["census_ops"] > 0 and isinstance(finetune["host_syncs"], int)  # counted, whatever they are
    assert report["finetune_vs_pretraining"]["ratio"] > 0
    for variant, row in trainer.items():
        assert "error" not in row, row
        # the trainer's own step: attention backend, no MFU or kernel-busy on a CPU, a census that
        # saw the step's matmuls and found no host read (the old reference loop: its one read of the
        # rows' clients, which the old collate had handed on the host)
        assert row["attention_kernel"] in CPU_BACKENDS and row["mfu"] is None and row["kernel_busy_share"] is None
        assert row["census_ops"] > 0 and row["host_syncs"] == (variant == "old"), row["host_sync_sites"]
        assert row["audio_seconds_per_second"] > 0 and 0 <= row["padded_batch_share"] <= 1
        assert row["crop_batches"] == (variant == "new")
    assert trainer["old"]["heads"] == "reference loop (bench)" and trainer["new"]["heads"] == "the model's"
    # old: today's padded batches (2-16 s utterances); new: cropped to the shortest, never padded
    assert trainer["old"]["padded_batch_share"] > 0 and trainer["new"]["padded_batch_share"] == 0
    table = report["trainer_old_vs_new"]
    assert table["old"]["host_syncs"] == 1 and table["new"]["host_syncs"] == 0 and table["speedup"] > 0
    assert report["trainer_vs_model"]["ratio"] > 0
    assert [t["status"] for t in report["targets"]] == ["UNMEASURED"] * 4 + ["PASS"]
    assert "== report" in completed.stdout and "target trainer MFU" in completed.stdout
