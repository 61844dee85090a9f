"""Which files one client reads: its own k-means targets, its own speakers' shards and their CMVN
partial sums. Nothing else: not ``clients/clients.parquet``, not the global ``cmvn/``, not another
client's folder. Training normalises each utterance on its own, so no statistic crosses speakers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from speech_assets.features.shards import ShardFiles
from speech_assets.layout import DataLayout, TargetFiles


@dataclass(frozen=True)
class ClientData:
    client_id: str
    data_dir: Path
    k: int  # its codebook size (the width of its head)
    speakers: list[str]
    shards: list[Path]
    stats: list[Path]
    labels: Path

    @classmethod
    def resolve(cls, data_dir: str | os.PathLike[str], client_id: str) -> ClientData:
        root = Path(data_dir)
        targets = DataLayout(root).targets(client_id)
        kmeans_dir, labels, quality_file = targets.root, targets.labels, targets.quality
        if not labels.is_file() or not quality_file.is_file():
            raise FileNotFoundError(
                f"client {client_id}: no k-means targets under {kmeans_dir} (materialize kmeans_targets)"
            )
        k = int(json.loads(quality_file.read_text())["k"])
        speakers = sorted(set(pq.read_table(labels, columns=["speaker_id"]).column("speaker_id").to_pylist()))
        if not speakers:
            raise ValueError(f"client {client_id}: its labels file {labels} is empty")
        shards_dir = DataLayout(root).shards_dir
        files = [ShardFiles.of(shards_dir, speaker) for speaker in speakers]
        missing = [str(f.shard) for f in files if not f.shard.is_file() or not f.stats.is_file()]
        if missing:
            raise FileNotFoundError(f"client {client_id}: shards or their partial sums are missing: {missing}")
        return cls(client_id, root, k, speakers, [f.shard for f in files], [f.stats for f in files], labels)

    @property
    def files(self) -> list[Path]:
        return [self.labels, TargetFiles(self.labels.parent).quality, *self.shards, *self.stats]
