"""Wall time of the probe stage alone (``compare_encoders``), as ``downstream_probe`` runs it.

    python bench/probe_stage.py --data-dir data/out                     # this checkout
    python bench/probe_stage.py --data-dir data/out --code /other/checkout  # the same inputs, other code

Reads a built data dir (the sample build with a trained ``training/*/final.pt`` is enough), then
probes fbank, a random encoder and the pretrained encoder under three names (standing in for the
demo's pretrained, federated and distilled encoders: five models, as the demo probes) with the
``[probe]`` settings of pipeline.toml (steps, lrs, seeds, utterance limits), in one process with
``--threads`` torch threads. ``--code`` imports the evaluation code from another checkout (e.g. the
commit before a change) so that both sides time the same utterances on the same machine: run the
two back to back and compare their ratio, not the absolute figures, on a shared machine (the CPU
seconds suffer least from other jobs). Prints one line of JSON: wall and CPU seconds, each model's
mean held-out CER and the steps and learning rates the probes stopped at.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=REPO / "data" / "out")
    parser.add_argument("--code", type=Path, default=REPO, help="checkout whose speech_assets package is timed")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, str(args.code.resolve()))

    import pyarrow.parquet as pq
    import torch

    from speech_assets.corpus.clients import read_clients
    from speech_assets.evaluation.compare import (
        FBANK,
        RANDOM,
        ProbeModel,
        compare_encoders,
        split_utterances,
        summarise,
    )
    from speech_assets.evaluation.encoders import load_utterances
    from speech_assets.evaluation.probe_options import ProbeOptions
    from speech_assets.features.cmvn import UtteranceCmvn, from_record
    from speech_assets.model.encoders import load_encoder, random_encoder
    from speech_assets.model.presets import ModelPreset

    torch.set_num_threads(args.threads)
    data = args.data_dir.resolve()
    settings = tomllib.loads((REPO / "pipeline.toml").read_text())["probe"]
    (checkpoint,) = sorted(data.glob("training/*/final.pt"))[-1:]
    encoder = load_encoder(checkpoint)
    normaliser = from_record(encoder.checkpoint.get("normalisation")) or UtteranceCmvn()
    label = "utterance" if isinstance(normaliser, UtteranceCmvn) else "global"

    def model(name: str, loaded) -> ProbeModel:
        return ProbeModel(
            name,
            loaded.sha256 if loaded else "",
            label,
            lambda x: normaliser.apply(x, "logmel"),
            loaded.model if loaded else None,
        )

    random = random_encoder(ModelPreset(**encoder.checkpoint["preset"]), seed=settings["seed"])
    models = [model(FBANK, None), model(RANDOM, random)] + [
        model(name, encoder) for name in ("pretrained", "federated", "distilled")
    ]
    clients = read_clients(data / "clients" / "clients.parquet")
    held = {a.speaker_id for a in clients if a.heldout}
    manifest = pq.read_table(data / "manifest" / "manifest.parquet", columns=["utt_id", "transcript"]).to_pydict()
    shards = [
        data / "features" / "shards" / f"{a.speaker_id}.parquet" for a in sorted(clients, key=lambda a: a.speaker_id)
    ]
    utterances = load_utterances(shards, dict(zip(manifest["utt_id"], manifest["transcript"], strict=True)))
    train, test = split_utterances(
        utterances, held, settings["max_train_utterances"], settings["max_eval_utterances"], settings["seed"]
    )
    options = ProbeOptions(
        probe=settings["probe"],
        steps=settings["steps"],
        batch_size=settings["batch_size"],
        lr=settings["lr"],
        hidden=settings["hidden"],
        seeds=tuple(settings["seeds"]),
        lrs=tuple(settings["lrs"]),
    )
    # a first tiny probe pays the lazy imports and first-call costs (bytecode compiled where
    # PYTHONDONTWRITEBYTECODE is set: seconds) outside the measurement
    compare_encoders(train[:4], test[:2], models[:1], ProbeOptions(steps=2, seeds=(0,)))
    started, cpu = time.perf_counter(), time.process_time()
    results = compare_encoders(train, test, models, options)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    print(
        json.dumps(
            {
                "code": str(args.code),
                "seconds": round(seconds, 1),
                "cpu_seconds": round(cpu, 1),
                "threads": args.threads,
                "train": len(train),
                "heldout": len(test),
                "heldout_speakers": len(held),
                "cer": {m: round(s.cer.mean, 3) for m, s in summarise(results).items()},
                "steps": sorted({r.steps for r in results}),
                "lr": sorted({r.lr for r in results}),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
