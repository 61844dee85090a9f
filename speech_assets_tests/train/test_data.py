from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from speech_assets.features.cmvn import Cmvn
from speech_assets.model.loss import IGNORE_INDEX
from speech_assets.train.data import (
    DurationBucketSampler,
    UtteranceDataset,
    _unit_hash,
    align_labels,
    build_index,
    collate,
    crop_start,
    eval_batches,
    heldout_speakers,
    heldout_split,
)
from speech_assets.train.engine import Distributed
from speech_assets.train.trainer import Trainer
from speech_assets_tests.support.training_data import SyntheticCorpus, write_corpus

CPU = Distributed(0, 0, 1, 1, torch.device("cpu"))


def _index(corpus: SyntheticCorpus, max_frames: int = 1500):
    return build_index(corpus.shards, {n: c.labels for n, c in corpus.clients.items()}, max_frames)


def test_index_keeps_labelled_utterances_of_their_client(corpus: SyntheticCorpus) -> None:
    index = _index(corpus)
    assert index.clients == ["client_a", "client_b"]
    assert len(index.utterances) == 48
    assert index.unlabelled == corpus.unlabelled == 4
    for ref in index.utterances:
        assert ref.utt_id.startswith(index.clients[ref.client])
        assert ref.utt_id in index.labels[ref.client]
        assert ref.utt_id.startswith(ref.speaker_id + "-") and ref.speaker_id != ref.utt_id


def test_heldout_split_holds_out_whole_speakers(corpus: SyntheticCorpus) -> None:
    utterances = _index(corpus).utterances
    train, heldout = heldout_split(utterances, 0.15)
    _, again_heldout = heldout_split(list(reversed(utterances)), 0.15)
    assert {u.utt_id for u in heldout} == {u.utt_id for u in again_heldout}
    assert len(train) + len(heldout) == len(utterances) and heldout
    train_speakers, heldout_speakers = {u.speaker_id for u in train}, {u.speaker_id for u in heldout}
    assert train_speakers.isdisjoint(heldout_speakers)
    # every client keeps a training speaker, so every head trains
    assert {u.client for u in train} == {u.client for u in utterances}
    assert heldout_split(utterances, 0.0)[1] == []


def test_heldout_speakers_follow_the_hash_with_two_fixups() -> None:
    speakers = {f"spk{i:03d}": f"client_{i % 4}" for i in range(400)}
    held = heldout_speakers(speakers, 0.1)
    # membership is the hash threshold (no client is wholly held out at this size)
    assert held == {s for s in speakers if _unit_hash(s) < 0.1}
    assert 0.06 < len(held) / len(speakers) < 0.14
    # ... and does not depend on the rest of the corpus
    fewer = {s: c for s, c in speakers.items() if s < "spk200"}
    assert heldout_speakers(fewer, 0.1) == {s for s in held if s < "spk200"}
    # a client whose speakers would all be held out keeps its largest-hash speaker in training
    everyone = heldout_speakers(speakers, 1.0)
    kept = set(speakers) - everyone
    assert len(kept) == 4 and {speakers[s] for s in kept} == {f"client_{i}" for i in range(4)}
    for s in kept:
        assert _unit_hash(s) == max(_unit_hash(t) for t, c in speakers.items() if c == speakers[s])
    # nothing below the threshold: the smallest hash among clients of >= 2 speakers is held out
    tiny = {"a": "c1", "b": "c1", "z": "c2"}
    smallest = min(("a", "b"), key=_unit_hash)
    assert heldout_speakers(tiny, 1e-12) == {smallest}
    assert heldout_speakers({"a": "c1", "z": "c2"}, 1e-12) == set()  # every client has one speaker
    assert heldout_speakers(tiny, 0.0) == set()


def test_dataset_items_are_normalised_and_aligned(corpus: SyntheticCorpus) -> None:
    index = _index(corpus, max_frames=200)
    dataset = UtteranceDataset(index, index.utterances, Cmvn.load(corpus.cmvn), max_frames=200)
    lengths = []
    for i in range(len(dataset)):
        example = dataset[i]
        frames = example.feats.shape[0]
        lengths.append(frames)
        assert example.feats.shape == (frames, 80) and frames <= 200
        assert example.labels.shape == ((frames + 1) // 2,)
        assert example.labels.dtype == torch.long
        assert int(example.labels.min()) >= 0 and int(example.labels.max()) < 12
    assert max(lengths) == 200  # long utterances were cropped
    feats = torch.cat([dataset[i].feats for i in range(len(dataset))])
    assert abs(float(feats.mean())) < 0.3 and 0.7 < float(feats.std()) < 1.3
    batch = collate([dataset[0], dataset[1], dataset[2]])
    assert batch.feats.shape[0] == 3 and batch.targets.shape[1] == (batch.feats.shape[1] + 1) // 2
    assert batch.seconds == pytest.approx(sum(lengths[:3]) / 100)
    short = int(batch.lengths.argmin())
    assert torch.all(batch.targets[short, (int(batch.lengths[short]) + 1) // 2 :] == IGNORE_INDEX)


def test_align_labels_tolerates_one_frame_only() -> None:
    labels = np.arange(50, dtype=np.int16)
    assert align_labels(labels, 100, "u").tolist() == list(range(50))  # (100 + 1) // 2 = 50
    assert align_labels(labels, 101, "u")[-1] == IGNORE_INDEX  # 51 expected: padded
    assert len(align_labels(labels, 97, "u")) == 49  # cropped
    with pytest.raises(ValueError, match="labels for"):
        align_labels(labels, 120, "u")


def test_crop_start_is_even_deterministic_and_moves_with_the_epoch() -> None:
    assert crop_start("u", 100, 200) == 0 and crop_start("u", 100, 200, seed=3, epoch=9) == 0
    starts = {crop_start(f"utt{i}", 2501, 1500) for i in range(50)}
    assert all(s % 2 == 0 and 0 <= s <= 1001 for s in starts)
    assert len(starts) > 10
    assert crop_start("utt1", 2501, 1500, seed=1, epoch=4) == crop_start("utt1", 2501, 1500, seed=1, epoch=4)
    by_epoch = {crop_start("utt1", 2501, 1500, epoch=e) for e in range(20)}
    assert len(by_epoch) > 10 and all(s % 2 == 0 for s in by_epoch)
    assert [crop_start("utt1", 2501, 1500, seed=0, epoch=e) for e in range(5)] != [
        crop_start("utt1", 2501, 1500, seed=1, epoch=e) for e in range(5)
    ]


def test_dataset_crops_follow_set_epoch(corpus: SyntheticCorpus) -> None:
    index = _index(corpus, max_frames=100)
    dataset = UtteranceDataset(index, index.utterances, Cmvn.load(corpus.cmvn), max_frames=100, seed=0)
    longest = 0  # every synthetic utterance is >= 150 frames: all are cropped
    first = dataset[longest]
    dataset.set_epoch(1)
    second = dataset[longest]
    dataset.set_epoch(0)
    assert torch.equal(dataset[longest].feats, first.feats)
    assert first.feats.shape == second.feats.shape == (100, 80)
    assert not torch.equal(first.feats, second.feats)
    assert second.labels.shape == (50,)


def test_sampler_buckets_by_duration_and_splits_evenly_across_ranks() -> None:
    rng = np.random.default_rng(0)
    seconds = rng.uniform(1.0, 15.0, size=500).tolist()
    samplers = [DurationBucketSampler(seconds, 60.0, num_replicas=3, rank=r, seed=5) for r in range(3)]
    for epoch in (0, 1):
        per_rank = [s.batches(epoch) for s in samplers]
        assert len({len(b) for b in per_rank}) == 1
        flat = [i for batches in per_rank for batch in batches for i in batch]
        assert len(flat) == len(set(flat))  # no utterance twice in an epoch
        assert len(flat) > 0.95 * len(seconds)  # only the remainder batches are dropped
        padded = useful = 0.0
        for batches in per_rank:
            for batch in batches:
                longest = max(seconds[i] for i in batch)
                assert len(batch) * longest <= 60.0
                padded += len(batch) * longest
                useful += sum(seconds[i] for i in batch)
        assert useful / padded > 0.9  # little padding
    assert samplers[0].batches(0) == DurationBucketSampler(seconds, 60.0, num_replicas=3, rank=0, seed=5).batches(0)
    assert samplers[0].batches(0) != samplers[0].batches(1)


def test_sampler_edge_cases() -> None:
    # An utterance longer than the cap gets a batch of its own; fewer batches than ranks repeat.
    assert sorted(map(len, DurationBucketSampler([20.0, 1.0], 10.0).batches(0))) == [1, 1]
    assert len(DurationBucketSampler([20.0, 1.0], 10.0, num_replicas=4, rank=3).batches(0)) == 1
    with pytest.raises(ValueError):
        DurationBucketSampler([], 10.0)


def test_eval_batches_cover_everything_once() -> None:
    seconds = [3.0, 1.0, 2.0, 9.0, 4.0]
    batches = [eval_batches(seconds, 6.0, 2, rank) for rank in range(2)]
    assert sorted(i for rank in batches for batch in rank for i in batch) == [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCorpus:
    """2 clients x 2 speakers x 5 utterances of 2-16 s: the real spread of pretraining lengths."""
    return write_corpus(tmp_path_factory.mktemp("long"), utterances_per_speaker=5, seconds=(2.0, 16.0), seed=3)


def _trainer(corpus: SyntheticCorpus, run_dir: Path, **overrides: object) -> Trainer:
    config = corpus.config(run_dir, batch_seconds=40.0, heldout_fraction=0.0, num_workers=0, **overrides)
    run_dir.mkdir()
    return Trainer(config, CPU)


def _attention_masks(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor | None]:
    """The ``attn_mask`` of every SDPA call during one real training step."""
    seen: list[torch.Tensor | None] = []
    real = F.scaled_dot_product_attention

    def recording(*args, attn_mask=None, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(attn_mask)
        return real(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    trainer.engine.run(trainer.objective, trainer.stream, replace(trainer.config, max_steps=1))
    assert trainer.step == 1 and seen
    return seen


def test_unmasked_batch_crops_to_the_shortest_with_aligned_labels(
    long_corpus: SyntheticCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's loader (BlockShuffleSampler) yields batches of equal lengths, not padded, each row
    a window at an even offset of its utterance with its labels from the same offset, ``seconds`` the
    cropped audio; a training step's attention then gets no mask."""
    trainer = _trainer(long_corpus, tmp_path / "run")
    dataset, requests = trainer.train_set, trainer.stream.sampler.batches(0)
    assert len(requests) >= 3 and any(len(r) > 1 for r in requests)
    for indices in requests:
        batch = next(trainer.stream)
        frames = min(dataset[i].feats.shape[0] for i in indices)
        assert batch.lengths.tolist() == [frames] * len(indices) and batch.padded is False
        assert batch.seconds == pytest.approx(len(indices) * frames / 100)
        whole = {e.utt_id: e for e in (dataset[i] for i in indices)}
        rows = sorted(whole.values(), key=lambda e: e.client)  # collate's order
        for row, example in enumerate(rows):
            starts = [s for s in range(0, example.feats.shape[0] - frames + 1, 2)]
            start = next(s for s in starts if torch.equal(example.feats[s : s + frames], batch.feats[row]))
            labels = example.labels[start // 2 : start // 2 + (frames + 1) // 2]
            assert torch.equal(batch.targets[row], labels)
    assert set(_attention_masks(trainer, monkeypatch)) == {None}


def test_unmasked_batch_off_pads_as_before(
    long_corpus: SyntheticCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``crop_batches=False``: the loader's batches are the whole utterances padded (collate of the
    sampler's batches, as before cropping) and attention takes a key mask."""
    trainer = _trainer(long_corpus, tmp_path / "run", crop_batches=False)
    dataset, padded = trainer.train_set, []
    for indices in trainer.stream.sampler.batches(0):
        batch, expected = next(trainer.stream), collate([dataset[i] for i in indices])
        assert all(torch.equal(a, b) for a, b in zip(batch.tensors().values(), expected.tensors().values()))
        assert (batch.seconds, batch.padded) == (expected.seconds, expected.padded)
        padded.append(batch.padded)
    assert any(padded)
    assert all(mask is not None for mask in _attention_masks(trainer, monkeypatch))
