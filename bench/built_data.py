"""What the scale benchmarks read from a data dir the graph built."""

from __future__ import annotations

from pathlib import Path

from speech_assets.train.config import TrainConfig


def newest_training_config(data: Path) -> TrainConfig:
    """The config of the newest ``training/<run>/`` in ``data`` (its shards, CMVN, client targets)."""
    configs = sorted(data.glob("training/*/config.json"), key=lambda p: p.stat().st_mtime)
    if not configs:
        raise SystemExit(f"no training run in {data}: materialize pretrained_checkpoint first")
    return TrainConfig.from_json(configs[-1])
