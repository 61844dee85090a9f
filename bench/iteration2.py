"""HuBERT iteration 2 against iteration 1 at the same budget: target quality and probe CER.

    python bench/iteration2.py                                   # the committed sample
    python bench/iteration2.py --corpus /big/ls25 --steps 1000   # a bigger corpus

On a fresh SQLite instance and data dir, in process (one real Dagster run per asset, as a run
worker executes them): manifest -> vad_features -> cmvn_stats -> client_partitions ->
kmeans_targets -> pretrained_checkpoint (iteration 1, ``--steps``) -> kmeans_targets_iter2 ->
pretrained_checkpoint_iter2 (``--steps``, same settings) -> downstream_probe (``--probe-steps``
per model: fbank, random, iteration 1, iteration 2). Prints the target quality of both iterations
(K, perplexity / K, mean segment length) and the probe table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=REPO / "data" / "sample")
    parser.add_argument("--steps", type=int, default=300, help="training steps of each iteration")
    parser.add_argument("--probe-steps", type=int, default=400)
    args = parser.parse_args()

    import dagster as dg
    import pyarrow.parquet as pq

    from speech_assets.definitions import build_definitions
    from speech_assets.defs.resources import PipelineSettings, StoragePaths
    from speech_assets.train.accuracy import heldout_accuracy
    from speech_assets_tests.support.local_runs import materialize_data_stages, materialize_in_process

    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores; corpus {args.corpus}")
    with tempfile.TemporaryDirectory(prefix="bench_iter2_") as folder:
        root = Path(folder)
        home = root / "dagster_home"
        home.mkdir()
        (home / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
        out = root / "out"
        paths = StoragePaths(
            corpus=str(args.corpus), data_dir=str(out), mlflow_tracking_uri=f"sqlite:///{out / 'mlflow.db'}"
        )
        defs = build_definitions(paths, PipelineSettings.load(REPO / "pipeline.toml"))
        train = {"preset": "tiny", "max_steps": args.steps, "checkpoint_every": args.steps}
        with dg.DagsterInstance.from_config(str(home)) as instance:
            started = time.perf_counter()
            clients = materialize_data_stages(defs, instance)
            materialize_in_process(
                defs,
                instance,
                "pretrained_checkpoint",
                run_config={"ops": {"pretrained_checkpoint": {"config": train}}},
            )
            materialize_in_process(defs, instance, "kmeans_targets_iter2", clients)
            iter2 = {k: v for k, v in train.items() if k != "preset"}
            materialize_in_process(
                defs,
                instance,
                "pretrained_checkpoint_iter2",
                run_config={"ops": {"pretrained_checkpoint_iter2": {"config": iter2}}},
            )
            materialize_in_process(
                defs,
                instance,
                "downstream_probe",
                run_config={"ops": {"downstream_probe": {"config": {"steps": args.probe_steps}}}},
            )
            print(f"built and evaluated in {time.perf_counter() - started:.0f} s")
        print("\n| client | iteration | K | perplexity / K | mean segment (frames) | label rate |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        for client in sorted(clients):
            for name, folder_name in (("1 (MFCC)", "kmeans"), ("2 (encoder layer)", "kmeans_iter2")):
                quality = json.loads((out / folder_name / client / "quality.json").read_text())
                rate = quality.get("label_rate_hz", 100)  # iteration 1 labels the 100 Hz input frames
                print(
                    f"| {client} | {name} | {quality['k']} | {quality['perplexity'] / quality['k']:.3f} | "
                    f"{quality['mean_segment_length']:.2f} | {rate} Hz |"
                )
        print("\n| model | held-out CER | held-out WER | utterances | probe steps |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for row in pq.read_table(out / "probe" / "results.parquet").to_pylist():
            if row["split"] == "heldout":
                print(
                    f"| {row['model']} | {row['cer']:.3f} | {row['wer']:.3f} | {row['utterances']} | {row['steps']} |"
                )
        for name, folder_name in (("iteration 1", "training"), ("iteration 2", "training_iter2")):
            (result,) = [json.loads(p.read_text()) for p in (out / folder_name).glob("*/result.json")]
            print(
                f"{name}: {heldout_accuracy(result) or 'held-out masked accuracy not measured'}, {result['step']} steps"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
