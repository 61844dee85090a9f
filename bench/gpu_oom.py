"""Out-of-memory back-off on a GPU, through the real launcher (``python -m speech_assets.train --launch``).

    python bench/gpu_oom.py [--batch-seconds 12000] [--utterances 1600]

Writes a synthetic corpus (real shard and label formats), asks for a per-device batch far larger
than the GPU holds, and lets the launcher do what it does in the asset: the rank that hits
``torch.cuda.OutOfMemoryError`` leaves ``oom.json`` and exits, the launcher halves the batch and
doubles the accumulation, and tries again (at most ``MAX_OOM_RETRIES`` times). Reports each
attempt's batch and whether the run finished.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from train import synthetic_config  # noqa: E402  (bench/train.py's corpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--batch-seconds", type=float, default=12000.0)
    parser.add_argument("--utterances", type=int, default=1600)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_oom_") as folder:
        root = Path(folder)
        config = replace(
            synthetic_config(root, args.utterances),
            run_dir=str(root / "run"),
            preset=args.preset,
            device="cuda",
            precision="bf16",
            nproc=1,
            max_steps=args.steps,
            warmup_steps=1,
            batch_seconds=args.batch_seconds,
            grad_accum=1,
            checkpoint_every=args.steps,
            log_every=1,
            heldout_fraction=0.02,
            mlflow_tracking_uri=None,
        )
        path = root / "config.json"
        config.to_json(path)
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "speech_assets.train", "--launch", "--config", str(path)],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        log = done.stdout + done.stderr
        retries = re.findall(r"retrying with batch ([\d.]+) s and grad_accum (\d+)", log)
        result_file = Path(config.run_dir) / "result.json"
        row = {
            "returncode": done.returncode,
            "first_batch_seconds": args.batch_seconds,
            "retries": [{"batch_seconds": float(b), "grad_accum": int(a)} for b, a in retries],
            "finished": result_file.is_file(),
            "wall_s": time.perf_counter() - start,
            "result": json.loads(result_file.read_text()) if result_file.is_file() else None,
        }
        print(json.dumps(row, indent=1))
        if done.returncode != 0 or not retries:
            print(log[-6000:])
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
