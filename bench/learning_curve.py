"""The learning signal at scale: held-out masked accuracy against the majority-class rate, per checkpoint.

    python bench/learning_curve.py --data /big/disk/scale_run/data --steps 1800 --every 300

Trains the tiny model with the settings of the data dir's newest training run (its shards, CMVN,
client targets, batch and held-out speakers) for ``--steps`` steps under ``torchrun`` with
``--nproc`` processes, keeping a checkpoint every ``--every`` steps, then evaluates each
checkpoint on the held-out speakers exactly as the trainer does at the end of a run
(``Trainer.score_heldout``: fixed masks, masked accuracy, and what always predicting each client's most
frequent training label would score on the same frames). Prints one row per checkpoint and a
markdown table for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from built_data import newest_training_config  # noqa: E402  (bench/)

from speech_assets.train.checkpoint import load_checkpoint  # noqa: E402
from speech_assets.train.config import TrainConfig  # noqa: E402
from speech_assets.train.launch import build_torchrun_command, torchrun_env  # noqa: E402


def evaluate(config: TrainConfig, checkpoint: Path, scratch: Path) -> dict:
    """``Trainer.score_heldout`` of ``checkpoint`` (a run folder holding only it, so the trainer resumes it)."""
    from speech_assets.train.engine import init_distributed
    from speech_assets.train.trainer import Trainer

    run_dir = scratch / checkpoint.stem
    (run_dir / "checkpoints").mkdir(parents=True)
    os.link(checkpoint, run_dir / "checkpoints" / checkpoint.name)
    single = replace(config, run_dir=str(run_dir), nproc=1, num_workers=0)
    job = init_distributed("cpu")
    trainer = Trainer(single, job)
    result = trainer.score_heldout() or {}
    return {"step": trainer.step, **{k: v for k, v in result.items() if not isinstance(v, dict)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a data dir built by the graph (with a training run)")
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--every", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()

    base = newest_training_config(args.data)
    with tempfile.TemporaryDirectory(dir=args.data, prefix="learning_curve_") as folder:
        root = Path(folder)
        config = replace(
            base,
            run_dir=str(root / "run"),
            max_steps=args.steps,
            checkpoint_every=args.every,
            keep_checkpoints=args.steps,
            log_every=50,
            nproc=args.nproc,
            mlflow_tracking_uri=None,
        )
        config_path = root / "config.json"
        config.to_json(config_path)
        print(
            f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores; "
            f"{len(config.shards)} shards, {len(config.clients)} clients, preset {config.preset}, {args.steps} steps"
        )
        started = time.perf_counter()
        command = build_torchrun_command(config_path, args.nproc, max_restarts=0)
        subprocess.run(
            command,
            env=torchrun_env(nproc=args.nproc) | {"PYTHONPATH": str(REPO)},
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        train_wall = time.perf_counter() - started
        result = json.loads((root / "run" / "result.json").read_text())
        print(
            f"trained in {train_wall:.0f} s ({result['audio_seconds_per_second']:.0f} s of audio per second, "
            f"{result['train_audio_seconds'] / 3600:.2f} h of audio seen)"
        )
        checkpoints = sorted((root / "run" / "checkpoints").glob("step_*.pt"))
        rows = []
        for checkpoint in checkpoints:
            assert load_checkpoint(checkpoint)["step"] > 0
            row = evaluate(config, checkpoint, root / "eval")
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
        print(
            "\n| step | held-out masked acc | majority-class rate | span-interior acc | interior majority | "
            "held-out loss |"
        )
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for row in rows:
            print(
                f"| {row['step']} | {row.get('masked_accuracy', float('nan')):.4f} | "
                f"{row.get('majority_accuracy', float('nan')):.4f} | "
                f"{row.get('interior_masked_accuracy', float('nan')):.4f} | "
                f"{row.get('interior_majority_accuracy', float('nan')):.4f} | "
                f"{row.get('loss', float('nan')):.3f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
