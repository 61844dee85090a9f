"""Training data path: read amplification and throughput, the old order against the new, in one run.

    python bench/loader.py --data /big/disk/out                 # a built data dir (shards, targets)
    python bench/loader.py --data /big/disk/out --speakers 60 --seconds 60 --train-rate 230

*before*: the whole corpus shuffled (``data.DurationBucketSampler``) over shards with 256-row
row groups (the previous shard layout, rewritten from the same shards into a temp dir) and an
8-group cache. *after*: ``sampling.BlockShuffleSampler`` (blocks dealt to ranks, shuffled windows
of 16 blocks) over the shards as built (32-row groups) with a one-window cache. Both read the
same utterances in one process through ``UtteranceDataset`` and ``collate`` (CMVN, crop, labels,
padding): what the trainer's loader does. Read amplification = log-mel bytes decompressed / log-mel
bytes delivered. Targets: amplification <= 1.5, >= 2,000 s of audio per second, and >= 5x what
training consumes (``--train-rate``, audio seconds per second of the tiny model's 2-process CPU
run; default: the newest ``training/*/result.json`` in the data dir).

``--formats``: the *after* path again over the same shards rewritten as format 1 (float32 blobs)
and as format 2 (float16 blobs, what the graph writes since issue 24): throughput, bytes
decompressed and the block cache's size at the end, per format. From the graph's format-2 shards
the format-1 rewrite holds their float16 values, byte for byte what the former
``$SPEECH_ASSETS_SHARD_FORMAT=1`` built; float32 values need format-1 shards from before issue 24.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from speech_assets.features.cmvn import Cmvn  # noqa: E402
from speech_assets.features.shards import iter_shard, write_shard  # noqa: E402
from speech_assets.train.data import DurationBucketSampler, UtteranceDataset, build_index, collate  # noqa: E402
from speech_assets.train.sampling import BlockShuffleSampler  # noqa: E402

WINDOW = 16


def relayout(shards: list[str], folder: Path, rows: int) -> list[str]:
    out = []
    for shard in shards:
        target = folder / Path(shard).name
        pq.write_table(pq.read_table(shard), target, compression="zstd", compression_level=1, row_group_size=rows)
        out.append(str(target))
    return out


def rewrite(shards: list[str], folder: Path, version: int) -> list[str]:
    """``shards`` written again as format ``version`` (32-row groups, the writer's settings)."""
    return [str(write_shard(folder / Path(s).name, list(iter_shard(s)), version=version)) for s in shards]


def measure(
    name: str, shards: list[str], labels: dict[str, str], cmvn: Cmvn, batches_of, cache: int, budget_s: float
) -> dict:
    index = build_index(shards, labels, max_frames=1500)
    dataset = UtteranceDataset(index, index.utterances, cmvn, 1500, cached_row_groups=cache)
    batches = batches_of(index, dataset)
    started, audio, count = time.perf_counter(), 0.0, 0
    for batch in batches:
        audio += collate([dataset[i] for i in batch]).seconds
        count += 1
        if time.perf_counter() - started > budget_s:
            break
    wall = time.perf_counter() - started
    return {
        "path": name,
        "batches": count,
        "audio_s": round(audio, 1),
        "audio_s_per_s": round(audio / wall, 1),
        "read_amplification": round(dataset.bytes_decompressed / max(dataset.bytes_delivered, 1), 2),
        "GB_decompressed": round(dataset.bytes_decompressed / 1e9, 2),
        "cache_MB_at_end": round(sum(m.nbytes for group in dataset._cache.values() for m in group) / 1e6, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a data dir built by the graph")
    parser.add_argument("--speakers", type=int, default=60, help="shards read (the first N speakers)")
    parser.add_argument("--seconds", type=float, default=60.0, help="time budget per path")
    parser.add_argument("--batch-seconds", type=float, default=60.0)
    parser.add_argument("--train-rate", type=float, default=None, help="audio s/s consumed by training")
    parser.add_argument("--formats", action="store_true", help="also the new path on format-1 and format-2 rewrites")
    args = parser.parse_args()

    clients = pq.read_table(args.data / "clients" / "clients.parquet").to_pylist()
    speakers = sorted(r["speaker_id"] for r in clients)[: args.speakers]
    shards = [str(args.data / "features" / "shards" / f"{s}.parquet") for s in speakers]
    labels = {c: str(args.data / "kmeans" / c / "labels.parquet") for c in sorted({r["client_id"] for r in clients})}
    cmvn = Cmvn.load(args.data / "cmvn" / "cmvn.npz")

    def old_order(index, dataset):
        return DurationBucketSampler(dataset.seconds, args.batch_seconds, seed=0).batches(0)

    def new_order(index, dataset):
        blocks = [(u.shard, u.row_group) for u in dataset.utterances]
        return BlockShuffleSampler(blocks, dataset.seconds, args.batch_seconds, seed=0, window_blocks=WINDOW).batches(0)

    with tempfile.TemporaryDirectory(dir=args.data) as tmp:
        before_shards = relayout(shards, Path(tmp), 256)
        before = measure(
            "before: whole-corpus shuffle, 256-row groups, 8-group cache",
            before_shards,
            labels,
            cmvn,
            old_order,
            8,
            args.seconds,
        )
    after = measure(
        "after: block-local windows, 32-row groups, window cache",
        shards,
        labels,
        cmvn,
        new_order,
        WINDOW + 1,
        args.seconds,
    )

    train_rate = args.train_rate
    if train_rate is None:
        results = sorted((args.data / "training").glob("*/result.json"), key=lambda p: p.stat().st_mtime)
        train_rate = json.loads(results[-1].read_text()).get("audio_seconds_per_second") if results else None
    print(
        f"machine: {platform.processor() or platform.machine()}, {len(speakers)} shards, batch "
        f"{args.batch_seconds:.0f} s"
    )
    for row in (before, after):
        print(json.dumps(row))
    if args.formats:
        with tempfile.TemporaryDirectory(dir=args.data) as tmp:
            rows = {}
            for version, dtype in ((1, "float32"), (2, "float16")):
                (Path(tmp) / f"v{version}").mkdir()
                rewritten = rewrite(shards, Path(tmp) / f"v{version}", version)
                rows[version] = measure(
                    f"after, format {version} ({dtype})", rewritten, labels, cmvn, new_order, WINDOW + 1, args.seconds
                )
                print(json.dumps(rows[version]))
        print(
            f"format 2 vs 1: throughput {rows[2]['audio_s_per_s'] / max(rows[1]['audio_s_per_s'], 1e-9):.2f}x, "
            f"bytes decompressed {rows[2]['GB_decompressed'] / max(rows[1]['GB_decompressed'], 1e-9):.2f}x, "
            f"cache {rows[2]['cache_MB_at_end'] / max(rows[1]['cache_MB_at_end'], 1e-9):.2f}x"
        )
    print(
        f"speed-up {after['audio_s_per_s'] / max(before['audio_s_per_s'], 1e-9):.1f}x, "
        f"amplification {before['read_amplification']} -> {after['read_amplification']} (target <= 1.5)"
    )
    if train_rate:
        print(
            f"training consumes {train_rate:.0f} s/s: loader headroom "
            f"{after['audio_s_per_s'] / train_rate:.1f}x (target >= 5x); "
            f"absolute {after['audio_s_per_s']:.0f} s/s (target >= 2,000)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
