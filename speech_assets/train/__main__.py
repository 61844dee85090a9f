"""``python -m speech_assets.train --config CONFIG.json [--launch]``.

Without ``--launch`` this process trains, alone or as one torchrun rank; with it, it auto-configures
and starts torchrun (or one process), retrying CUDA out-of-memory failures.
"""

from __future__ import annotations

import argparse
import logging
import sys

from speech_assets.train.config import TrainConfig
from speech_assets.train.launch import launch
from speech_assets.train.trainer import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speech_assets.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TrainConfig JSON file")
    parser.add_argument("--launch", action="store_true", help="auto-configure and start torchrun (OOM retries)")
    args = parser.parse_args(argv)
    config = TrainConfig.from_json(args.config)
    if args.launch:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s launch %(levelname)s %(message)s")
        return launch(config)
    train(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
