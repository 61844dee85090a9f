"""Fine-tuning without host stalls: a census of the host reads of real CTC steps (the counting of
speech_assets_tests/train/test_sync_census.py), with masks drawn by a loader worker as on a GPU."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from speech_assets.evaluation import finetune
from speech_assets.evaluation.finetune import FineTuning
from speech_assets_tests.evaluation.test_finetune_ddp import labelled_run
from speech_assets_tests.train.test_sync_census import CPU, _census


def test_finetune_sync_census_of_ctc_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 3 (encoder frozen) and 4 (trained) of a tiny run, after two steps of warm-up: nothing
    reads a tensor's value on the host (no ``nonzero`` of the valid targets, no ``item`` of a mask
    draw, no CTC lengths copied off the device) outside the metrics window."""
    config = replace(
        labelled_run(tmp_path), max_steps=4, freeze_steps=3, log_every=2, mask_prob=0.2, channel_mask_prob=0.2
    )
    Path(config.run_dir).mkdir()  # the worker context makes it in a real run
    monkeypatch.setattr(finetune, "default_workers", lambda job: 1)  # a loader worker builds the batches
    tuning = FineTuning(CPU, config)
    assert tuning.stream.sampler.num_workers == 1
    tuning.engine.run(tuning.objective, tuning.stream, replace(config, max_steps=2))
    _, syncs = _census(tuning, config)
    assert tuning.step == 4
    assert not syncs, f"host reads in fine-tuning steps 3-4: {dict(syncs)}"
