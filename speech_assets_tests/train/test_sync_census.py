"""Nothing in a training step waits for the device: a census of the host reads of real steps under
torch.profiler, and batches that the loader really pins (the copy to a GPU can then overlap).

The census counts two kinds of host read. The profiler's aten ops (``nonzero``, ``unique``,
``item``, ``_local_scalar_dense``) show a read wherever it happens. Copies out of a tensor
(``.tolist()``, ``.numpy()``, ``.cpu()``, ``np.asarray``) dispatch no aten op at all on a CPU
tensor, so a census on CPU would miss them: :class:`HostReads` (a ``TorchFunctionMode``) wraps
each such call in a profiler range ``host::<method>``, which the census counts like an aten op.
``.to(...)`` counts as a host read when it takes a tensor off an accelerator to the CPU (on CPU,
where every ``.to`` stays on the host, it cannot tell a copy to the device from one back)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

# the function DataLoader(pin_memory=True)'s pinning thread applies to every batch
from torch.utils.data._utils.pin_memory import pin_memory as loader_pin

from speech_assets.features.cmvn import Cmvn
from speech_assets.train.data import Batch, UtteranceDataset, build_index, collate
from speech_assets.train.engine import REPORT_RANGE, Distributed
from speech_assets.train.trainer import Trainer
from speech_assets_tests.support.census import HOST_RANGE, HostReads, host_syncs, to_host
from speech_assets_tests.support.training_data import SyntheticCorpus

CPU = Distributed(0, 0, 1, 1, torch.device("cpu"))


def _tensor_fields(batch: Batch) -> dict[str, torch.Tensor]:
    values = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return {name: value for name, value in values.items() if isinstance(value, torch.Tensor)}


def _census(trainer: Trainer, config) -> tuple[list, Counter[str]]:  # type: ignore[no-untyped-def]
    """The profiler events of ``trainer``'s steps up to ``config.max_steps`` and the host reads
    outside the exempt ranges among them."""
    with profile(activities=[ProfilerActivity.CPU]) as prof, HostReads():
        trainer.engine.run(trainer.objective, trainer.stream, config)
    events = prof.events()
    assert any(event.name in ("aten::linear", "aten::addmm") for event in events)  # the profiler saw the steps
    return events, host_syncs(events)


def _census_trainer(small_corpus: SyntheticCorpus, tmp_path: Path, max_steps: int):  # type: ignore[no-untyped-def]
    config = small_corpus.config(
        tmp_path / "run", max_steps=max_steps, log_every=2, checkpoint_every=100, heldout_fraction=0.0, num_workers=1
    )
    (tmp_path / "run").mkdir()  # the worker context makes it in a real run
    trainer = Trainer(config, CPU)
    # steps 1-2 first: loader worker started, optimizer state allocated
    trainer.engine.run(trainer.objective, trainer.stream, replace(config, max_steps=2))
    return trainer, config


def test_sync_census_of_training_steps_between_log_steps(small_corpus: SyntheticCorpus, tmp_path: Path) -> None:
    """Real steps of the tiny preset with two clients (one loader worker, as on a GPU): apart from
    the metrics window every ``log_every`` steps nothing reads a tensor's value on the host (no
    ``nonzero``, ``unique``, ``item``, ``tolist``, ``numpy``, ``cpu``), so on a GPU the step never
    waits for the device."""
    trainer, config = _census_trainer(small_corpus, tmp_path, 6)
    assert {u.client for u in trainer.train_set.utterances} == {0, 1}
    events, syncs = _census(trainer, config)
    assert trainer.step == 6
    assert not syncs, f"host syncs in training steps 3-6: {dict(syncs)}"
    assert sum(1 for event in events if event.name == REPORT_RANGE) == 2  # steps 4 and 6
    # the census does see the window's one read (exempt): .tolist() of the totals
    reported = [e for e in events if e.name == HOST_RANGE + "tolist"]
    assert len(reported) >= 2 and all(e.cpu_parent is not None and e.cpu_parent.name == REPORT_RANGE for e in reported)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 4, 6]


# one host read planted in each of steps 3-7 (the objective sees the step count before the step)
PLANTED = {
    2: ("tolist", lambda loss: loss.detach().tolist()),
    3: ("cpu", lambda loss: loss.detach().cpu()),
    4: ("numpy", lambda loss: loss.detach().numpy()),
    5: ("__array__", lambda loss: np.asarray(loss.detach())),
    6: ("item", lambda loss: loss.item()),
}


def test_sync_census_counts_a_host_copy_planted_in_a_step(
    small_corpus: SyntheticCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kills the mutation "a ``.tolist()`` / ``.cpu()`` / ``.numpy()`` of the loss in a step" (the
    profiler alone sees no aten op for them on CPU, so the census let it through): each read
    planted in one of steps 3-7 is counted, once, under its own name."""
    trainer, config = _census_trainer(small_corpus, tmp_path, 7)
    objective = type(trainer.objective)
    real = objective.__call__

    def planted(self, model, batch, step, micro):  # type: ignore[no-untyped-def]
        loss, stats = real(self, model, batch, step, micro)
        if step in PLANTED:
            PLANTED[step][1](loss)
        return loss, stats

    monkeypatch.setattr(objective, "__call__", planted)
    _, syncs = _census(trainer, config)
    assert trainer.step == 7
    counted = Counter(key.split(" under ")[0] for key in syncs.elements())
    expected = Counter(HOST_RANGE + name for name, _ in PLANTED.values())
    assert counted - Counter({"aten::item": 1, "aten::_local_scalar_dense": 1}) == expected, dict(syncs)


def test_sync_census_sees_a_copy_off_an_accelerator_with_to() -> None:
    """``.to('cpu')`` (any spelling) of an accelerator tensor is a host copy; ``.to`` on the host,
    or to an accelerator, is not."""
    meta = torch.empty(3, device="meta")
    assert to_host(meta, ("cpu",), {}) and to_host(meta, (), {"device": torch.device("cpu")})
    assert to_host(meta, (torch.zeros(1),), {}) and to_host(meta, ("cpu", torch.float64), {})
    assert not to_host(meta, (torch.float64,), {}) and not to_host(meta, ("meta",), {})
    assert not to_host(torch.zeros(3), ("cpu",), {})


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
