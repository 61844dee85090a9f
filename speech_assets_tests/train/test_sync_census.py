"""Nothing in a training step waits for the device: a census of the host reads of real steps under
torch.profiler, and batches that the loader really pins (the copy to a GPU can then overlap)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

# the function DataLoader(pin_memory=True)'s pinning thread applies to every batch
from torch.utils.data._utils.pin_memory import pin_memory as loader_pin

from speech_assets.features.cmvn import Cmvn
from speech_assets.testing.training_data import SyntheticCorpus
from speech_assets.train.data import Batch, UtteranceDataset, build_index, collate
from speech_assets.train.engine import REPORT_RANGE, Distributed
from speech_assets.train.launch import plan_for
from speech_assets.train.trainer import Trainer

CPU = Distributed(0, 0, 1, 1, torch.device("cpu"))
# Reads of a tensor's value on the host: on a GPU each one waits for every kernel queued before it.
HOST_SYNCS = {"aten::nonzero", "aten::_unique2", "aten::unique_dim", "aten::_local_scalar_dense", "aten::item"}
# Host reads allowed only where they are not on model tensors: the metrics window (one read per
# log_every steps), the loader's own bookkeeping (batches are built in its worker processes) and
# AdamW's step counters (host tensors unless the optimizer is fused or capturable).
EXEMPT_RANGES = (REPORT_RANGE, "enumerate(DataLoader)", "Optimizer.step#")


def _tensor_fields(batch: Batch) -> dict[str, torch.Tensor]:
    values = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return {name: value for name, value in values.items() if isinstance(value, torch.Tensor)}


def _host_syncs(events: Iterable) -> Counter[str]:
    found: Counter[str] = Counter()
    for event in events:
        if event.name not in HOST_SYNCS:
            continue
        parent, chain = event.cpu_parent, []
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        if not any(name.startswith(EXEMPT_RANGES) for name in chain):
            found[f"{event.name} under {' < '.join(chain[:3]) or 'the loop'}"] += 1
    return found


def test_sync_census_of_training_steps_between_log_steps(small_corpus: SyntheticCorpus, tmp_path: Path) -> None:
    """Real steps of the tiny preset with two clients (one loader worker, as on a GPU): apart from
    the metrics window every ``log_every`` steps nothing reads a tensor's value on the host (no
    ``nonzero``, ``unique``, ``item``), so on a GPU the step never waits for the device."""
    config = small_corpus.config(
        tmp_path / "run", max_steps=6, log_every=2, checkpoint_every=100, heldout_fraction=0.0, num_workers=1
    )
    (tmp_path / "run").mkdir()  # the worker context makes it in a real run
    trainer = Trainer(config, CPU, plan_for(config, nproc=1))
    assert {u.client for u in trainer.train_set.utterances} == {0, 1}
    # steps 1-2 first: loader worker started, optimizer state allocated
    trainer.engine.run(trainer.objective, trainer.stream, replace(config, max_steps=2))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.engine.run(trainer.objective, trainer.stream, config)
    assert trainer.step == 6
    events = prof.events()
    assert any(event.name in ("aten::linear", "aten::addmm") for event in events)  # the profiler saw the steps
    syncs = _host_syncs(events)
    assert not syncs, f"host syncs in training steps 3-6: {dict(syncs)}"
    assert sum(1 for event in events if event.name == REPORT_RANGE) == 2  # steps 4 and 6
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 4, 6]


def test_pinned_batch_from_the_loaders_pin_path(small_corpus: SyntheticCorpus, monkeypatch: pytest.MonkeyPatch) -> None:
    """DataLoader(pin_memory=True) pins a batch only through its ``pin_memory()``: every tensor
    field must come back pinned, and the other fields unchanged."""
    index = build_index(small_corpus.shards, {n: c.labels for n, c in small_corpus.clients.items()}, 1500)
    dataset = UtteranceDataset(index, index.utterances, Cmvn.load(small_corpus.cmvn), max_frames=1500)
    batch = collate([dataset[i] for i in range(4)])
    fields = _tensor_fields(batch)
    assert {"feats", "lengths", "targets", "clients"} <= set(fields)
    if not torch.cuda.is_available():
        # page-locked memory needs an accelerator: record what would be pinned instead
        pinned_ids: set[int] = set()

        def pin(tensor: torch.Tensor) -> torch.Tensor:
            pinned_ids.add(id(tensor))
            return tensor.clone()

        monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
        result = loader_pin(batch)
        assert isinstance(result, Batch) and result is not batch
        assert pinned_ids == {id(tensor) for tensor in fields.values()}, "not every tensor field was pinned"
    else:
        result = loader_pin(batch)
        assert isinstance(result, Batch)
        assert all(tensor.is_pinned() for tensor in _tensor_fields(result).values())
    assert {name: torch.equal(t, fields[name]) for name, t in _tensor_fields(result).items()} == dict.fromkeys(
        fields, True
    )
    others = {f.name for f in dataclasses.fields(batch)} - set(fields)
    assert all(getattr(result, name) == getattr(batch, name) for name in others)
