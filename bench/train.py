"""Training throughput: seconds of audio per second (and model FLOP utilisation on GPUs).

    python bench/train.py                                   # tiny, CPU, 1 and 2 processes
    python bench/train.py --config data/out/training/x/launch_config.json   # on real shards
    python bench/train.py --device cuda --preset base --precision bf16 --nproc 1 8 --batch-seconds 300

Each configuration trains ``--steps`` steps in a fresh run directory through the real entry
point (``python -m speech_assets.train``, under torchrun for more than one process) and reads
``audio_seconds_per_second`` from ``result.json`` (the first step of the run is excluded); it also
reports the CPU seconds the run's processes used and the epoch the last step was in. Without
``--config`` the data is a synthetic corpus in the real shard/label formats with LibriSpeech-like
utterance lengths, large enough by default that no step of the largest ``--nproc`` starts a new
epoch (an epoch start restarts the loader's reading order and would be timed with the steps).
MFU = achieved model FLOPs (analytic estimate from the preset, forward + backward, useful frames
only) / (processes x peak dense bf16 FLOPs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from speech_assets.layout import RunFiles  # noqa: E402
from speech_assets.model.speed import profile_model  # noqa: E402
from speech_assets.train.autoconfig import (  # noqa: E402
    peak_bf16_flops,
    profile_dataset,
    profile_hardware,
)
from speech_assets.train.config import TrainConfig  # noqa: E402
from speech_assets.train.launch import build_torchrun_command, torchrun_env  # noqa: E402


def peak_flops(gpu_name: str | None, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    return peak_bf16_flops(gpu_name)


def synthetic_config(root: Path, utterances: int) -> TrainConfig:
    from speech_assets_tests.support.training_data import write_corpus

    corpus = write_corpus(
        root / "corpus",
        speakers_per_client=4,
        utterances_per_speaker=max(1, utterances // 8),
        seconds=(2.0, 16.0),
        unlabelled_per_shard=0,
    )
    return corpus.config(root / "unused")


def corpus_utterances(steps: int, batch_seconds: float, nproc: int) -> int:
    """Synthetic utterances (2-16 s, mean about 9 s) for ``steps`` steps on ``nproc`` processes
    within one epoch: three times the audio the steps take, for padding and the held-out share."""
    return max(160, int(3 * (steps + 1) * batch_seconds * nproc / 9.0) // 8 * 8 + 8)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished children (torchrun's workers included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(base: TrainConfig, nproc: int, root: Path) -> dict[str, Any]:
    config = replace(base, run_dir=str(root / f"nproc{nproc}"), nproc=nproc, mlflow_tracking_uri=None)
    config_path = root / f"config_nproc{nproc}.json"
    config.to_json(config_path)
    if nproc == 1:
        command = [sys.executable, "-m", "speech_assets.train", "--config", str(config_path)]
    else:
        command = build_torchrun_command(config_path, nproc, max_restarts=0)
    env = torchrun_env() | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cpu_before = cpu_seconds()
    completed = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    if completed.returncode != 0:
        raise RuntimeError(f"nproc {nproc} failed:\n{completed.stderr[-4000:]}")
    files = RunFiles(config.run_dir)
    result = json.loads(files.result.read_text())
    last = json.loads(files.metrics.read_text().splitlines()[-1])
    return result | {"cpu_seconds": cpu_seconds() - cpu_before, "last_epoch": last.get("epoch")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="TrainConfig JSON whose shards/cmvn/clients to use")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default=None, help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-seconds", type=float, default=16.0, help="per device and micro-batch")
    parser.add_argument("--utterances", type=int, default=None, help="synthetic corpus size (default: one epoch)")
    parser.add_argument("--threads", type=int, default=None, help="threads per process (default: cores / nproc)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the GPU's peak bf16 TFLOP/s")
    parser.add_argument("--json-out", help="also write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_train_") as folder:
        root = Path(folder)
        utterances = args.utterances or corpus_utterances(args.steps, args.batch_seconds, max(args.nproc))
        base = TrainConfig.from_json(args.config) if args.config else synthetic_config(root, utterances)
        base = replace(
            base,
            preset=args.preset,
            device=args.device,
            precision=args.precision or ("bf16" if args.device == "cuda" else "fp32"),
            max_steps=args.steps,
            warmup_steps=max(1, args.steps // 10),
            batch_seconds=args.batch_seconds,
            grad_accum=1,
            checkpoint_every=args.steps,
            log_every=args.steps,
            heldout_fraction=0.02,
            threads=args.threads,
        )
        data = profile_dataset(base.shards)
        model = profile_model(base.preset, len(base.clients), [c.k for c in base.clients.values()], data.mean_seconds)
        hw = profile_hardware()
        peak = peak_flops(hw.gpu_name, args.peak_tflops) if args.device == "cuda" else None
        print(
            f"machine: {platform.processor() or platform.machine()}, {hw.cpu_cores} cores, "
            f"{hw.gpu_count}x {hw.gpu_name or 'no GPU'}; load average {os.getloadavg()[0]:.2f}"
        )
        print(
            f"model {base.preset} ({model.parameters / 1e6:.2f}M params), {base.precision} on {args.device}; "
            f"data {data.utterances} utterances, mean {data.mean_seconds:.1f} s; batch {args.batch_seconds:g} s "
            f"per process, {args.steps} steps, threads {args.threads or 'auto'}; "
            f"~{model.train_flops_per_second / 1e9:.2f} GFLOP per second of audio"
        )
        rows = []
        for nproc in args.nproc:
            result = run_once(base, nproc, root)
            speed = float(result["audio_seconds_per_second"] or 0.0)
            achieved = speed * model.train_flops_per_second
            row = {
                "nproc": nproc,
                "audio_seconds_per_second": speed,
                "achieved_tflops": achieved / 1e12,
                "cpu_seconds": result["cpu_seconds"],
                "load_average": os.getloadavg()[0],
                "precision": base.precision,
                "batch_seconds": args.batch_seconds,
                "steps": args.steps,
                "final_loss": result.get("final_loss"),
                "epoch_at_end": result["last_epoch"],  # 0: no step crossed an epoch
                "corpus_seconds": data.total_seconds,
            }
            if peak:
                row["mfu"] = achieved / (nproc * peak)
            rows.append(row)
            mfu = f", MFU {row['mfu']:.1%}" if "mfu" in row else ""
            print(
                f"nproc {nproc}: {speed:.1f} s of audio per second ({achieved / 1e9:.1f} GFLOP/s{mfu}); "
                f"{result['cpu_seconds']:.1f} CPU s; last step in epoch {result['last_epoch']:g}; "
                f"load average {row['load_average']:.2f}"
            )
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
