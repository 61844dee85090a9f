"""The training step's data path: batches built whole by persistent loader workers (rows grouped by
client, span masks drawn there), metrics written off the training thread. (The census of host
syncs and pinned batches: test_sync_census.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
import torch

from speech_assets.features.cmvn import Cmvn
from speech_assets.model.hubert import HubertPretrainModel, output_lengths
from speech_assets.model.masking import span_mask
from speech_assets.model.presets import get_preset
from speech_assets.runtime.faults import FAULTS_ENV, fault
from speech_assets.train.data import (
    Batch,
    BatchBuilder,
    BatchRequest,
    UtteranceDataset,
    build_index,
    collate,
    mask_generator,
)
from speech_assets.train.engine import BackgroundWriter, BatchStream
from speech_assets.train.objectives import MaskedPrediction
from speech_assets.train.sampling import BlockShuffleSampler
from speech_assets_tests.support.training_data import SyntheticCorpus


def _dataset(corpus: SyntheticCorpus, max_frames: int = 1500) -> UtteranceDataset:
    index = build_index(corpus.shards, {n: c.labels for n, c in corpus.clients.items()}, max_frames)
    return UtteranceDataset(index, index.utterances, Cmvn.load(corpus.cmvn), max_frames=max_frames)


def _mixed_indices(dataset: UtteranceDataset, count: int) -> list[int]:
    """``count`` utterances of both clients, interleaved (client 1 first): collate must regroup them."""
    by_client = {0: [], 1: []}
    for i, ref in enumerate(dataset.utterances):
        by_client[ref.client].append(i)
    return [i for pair in zip(by_client[1], by_client[0], strict=False) for i in pair][:count]


def _reference_mask(lengths: torch.Tensor, seed: int, *parts: int | str) -> torch.Tensor:
    """The objective's mask as drawn on the host before masks moved to the loader."""
    return span_mask(output_lengths(lengths), 0.08, 10, mask_generator(seed, *parts))


def test_collate_groups_rows_by_client_and_draws_the_objectives_mask(small_corpus: SyntheticCorpus) -> None:
    dataset = _dataset(small_corpus)
    examples = [dataset[i] for i in _mixed_indices(dataset, 6)]
    objective = MaskedPrediction(
        HubertPretrainModel(get_preset("tiny"), {n: c.k for n, c in small_corpus.clients.items()}),
        torch.device("cpu"),
        seed=5,
        mask_prob=0.08,
        mask_length=10,
        unmasked_weight=0.0,
        rank=1,
        key=("k", 2),
    )
    batch = collate(examples, objective.masking, (7, 1))
    assert batch.clients.tolist() == [0, 0, 0, 1, 1, 1]
    # rows of one client keep their order
    want = [e for e in examples if e.client == 0] + [e for e in examples if e.client == 1]
    for row, example in enumerate(want):
        n = example.feats.shape[0]
        assert int(batch.lengths[row]) == n and torch.equal(batch.feats[row, :n], example.feats)
        assert torch.equal(batch.targets[row, : example.labels.shape[0]], example.labels)
    # the mask is the one the objective drew on the host for this batch, step and micro-batch
    assert batch.mask is not None and batch.masked_for == (objective.masking, 7, 1)
    assert torch.equal(batch.mask, _reference_mask(batch.lengths, 5, "k", 2, 7, 1, 1))
    assert torch.equal(batch.mask, objective.masking.draw(batch.lengths, "k", 2, 7, 1, 1))
    # through the loader's batch builder (what a worker runs) the same
    built = BatchBuilder(dataset)[
        BatchRequest(tuple(_mixed_indices(dataset, 6)), epoch=0, position=0, slot=(7, 1), masking=objective.masking)
    ]
    assert torch.equal(built.mask, batch.mask) and torch.equal(built.feats, batch.feats)


def _worker_pids() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def test_loader_workers_survive_epoch_boundaries(small_corpus: SyntheticCorpus) -> None:
    dataset = _dataset(small_corpus, max_frames=200)
    sampler = BlockShuffleSampler(
        [(u.shard, u.row_group) for u in dataset.utterances], dataset.seconds, 8.0, num_workers=2
    )
    per_epoch = len(sampler.batches(0))
    before = _worker_pids()
    stream = BatchStream(dataset, sampler, seed=0)
    seen: list[tuple[int, Batch]] = []
    pids: list[set[int]] = []
    for _ in range(2 * per_epoch + 1):
        seen.append((stream.epoch, next(stream)))
        pids.append(_worker_pids() - before)
    assert stream.epoch == 2 and stream.position == 1
    assert stream._loader is not None and not stream._loader.pin_memory  # pinned for a CUDA device only
    assert len(pids[0]) == 2 and all(p == pids[0] for p in pids)  # the same two workers all along
    # every epoch read in order, crops moved with the epoch (utterances are longer than 200 frames)
    again = BatchStream(dataset, sampler, seed=0)
    for epoch in range(2):
        dataset.set_epoch(epoch)
        for position, indices in enumerate(sampler.batches(epoch)):
            want = collate([dataset[i] for i in indices])
            assert torch.equal(seen[epoch * per_epoch + position][1].feats, want.feats)
    # a stream resumed mid-epoch gives what the first one gave from there
    again.load_state({**stream.state(), "epoch": 1, "position": 2})
    assert torch.equal(next(again).feats, seen[per_epoch + 2][1].feats)
    for used in (stream, again):  # left to the garbage collector, each worker waits out a 5 s join
        used.close()
    assert not _worker_pids() - before


def test_background_writer_keeps_every_line_and_reports_a_failed_call(tmp_path: Path) -> None:
    from speech_assets.train.engine import append_line

    writer = BackgroundWriter()
    path = tmp_path / "metrics.jsonl"
    for step in range(200):
        writer.submit(append_line, path, json.dumps({"step": step}))
    writer.flush()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == list(range(200))

    def broken(*_: object) -> None:
        raise OSError("MLflow is down")

    writer.submit(broken)
    writer.submit(append_line, path, json.dumps({"step": 200}))  # still written after the failure
    with pytest.raises(RuntimeError, match="MLflow is down"):
        writer.close()
    assert json.loads(path.read_text().splitlines()[-1]) == {"step": 200}


def test_a_run_stops_its_loader_workers_when_it_ends(small_corpus: SyntheticCorpus, tmp_path: Path) -> None:
    """The persistent loader workers end with the run, not at a later garbage collection (which
    waits out torch's 5 s join for each of them)."""
    from speech_assets.train.trainer import train

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    config = small_corpus.config(tmp_path / "run", max_steps=2, batch_seconds=8.0, max_frames=200, num_workers=2)
    assert train(config) is not None
    left = [p for p in me.children(recursive=True) if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]


def test_resume_with_persistent_loader_workers_is_bit_exact(
    small_corpus: SyntheticCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two loader workers that live across epochs, masks drawn in them, a preemption mid-epoch:
    the resumed run ends with the uninterrupted run's weights."""
    from speech_assets.train.checkpoint import load_checkpoint
    from speech_assets.train.trainer import train

    settings = {
        "max_steps": 6,
        "grad_accum": 2,
        "checkpoint_every": 4,
        "log_every": 2,
        "batch_seconds": 8.0,
        "max_frames": 200,
        "num_workers": 2,
    }
    straight = train(small_corpus.config(tmp_path / "straight", **settings))
    interrupted = small_corpus.config(tmp_path / "resumed", **settings)
    monkeypatch.setenv(FAULTS_ENV, fault("train.step", "preempt", step=2))  # preempted there
    assert train(interrupted) is None
    monkeypatch.delenv(FAULTS_ENV)
    stopped = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "step_00000002.pt")["sampler"]
    assert 0 < stopped["position"] < stopped["batches_in_epoch"]  # mid-epoch
    resumed = train(interrupted)
    assert straight is not None and resumed is not None and resumed["resumed_from_step"] == 2
    assert load_checkpoint(tmp_path / "straight" / "checkpoints" / "step_00000006.pt")["sampler"]["epoch"] >= 1
    assert straight["checkpoint_sha256"] == resumed["checkpoint_sha256"]
    lines = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    # each step's line once, and each held-out evaluation's (on a line of its own, or the step's)
    assert [line["step"] for line in lines if "loss" in line] == [2, 4, 6]
    evaluated = [line["step"] for line in lines if any(key.startswith("val/") for key in line)]
    assert len(evaluated) == len(set(evaluated)) and {4, 6} <= set(evaluated), evaluated


def test_a_batch_says_on_the_host_whether_it_is_padded_and_the_model_agrees(small_corpus: SyntheticCorpus) -> None:
    """The loader's ``padded`` flag is what the model would read from ``lengths``; with it the
    model skips the attention mask (CUDA's flash path) without reading lengths from the device."""
    dataset = _dataset(small_corpus)
    examples = [dataset[i] for i in _mixed_indices(dataset, 6)]
    model = HubertPretrainModel(get_preset("tiny"), {n: c.k for n, c in small_corpus.clients.items()}).eval()
    same = [examples[0]] * 3
    for group, padded in ((examples, True), (same, False)):
        batch = collate(group)
        assert batch.padded is padded
        with torch.no_grad():
            told = model.encode(batch.feats, batch.lengths, padded=batch.padded).hidden
            read = model.encode(batch.feats, batch.lengths).hidden
        assert torch.equal(told, read)
