"""The CTC probe learns a tiny synthetic task, picks the informative layer, and scores with jiwer."""

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from speech_assets.evaluation.probe import (
    CtcProbe,
    _schedule,
    collate_layers,
    dev_split,
    layer_norm,
    padded,
    score,
    train_probes,
    transcribe,
    utterance_errors,
)
from speech_assets.evaluation.probe_options import ProbeOptions
from speech_assets.evaluation.text import ALPHABET, VOCAB_SIZE, decode_greedy, encode, normalise
from speech_assets.train.objectives import ctc_loss

WORDS = ["CAT", "DOG", "BIRD", "FISH", "COW", "OWL"]


def train_probe(
    features: Sequence[torch.Tensor],
    texts: Sequence[str],
    options: ProbeOptions,
    seed: int = 0,
    *,
    stop_at: int | None = None,
    every: int = 0,
    on_checkpoint: Callable[[int, CtcProbe], None] | None = None,
) -> CtcProbe:
    """The reference :func:`train_probes` must match: one probe trained alone on ``features`` with CTC
    against ``texts``. ``stop_at`` ends training early on the schedule over ``options.steps``;
    ``on_checkpoint(step, probe)`` sees it (in eval mode) every ``every`` steps and at the end."""
    targets = [torch.tensor(encode(text), dtype=torch.long) for text in texts]
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        probe = CtcProbe(features[0].shape[0], features[0].shape[2], options.probe, options.hidden)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=options.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, options.steps))
    order: list[int] = []
    total = options.steps if stop_at is None else max(1, min(stop_at, options.steps))
    probe.train()
    for step in range(1, total + 1):
        if len(order) < options.batch_size:
            order += torch.randperm(len(features), generator=generator).tolist()
        batch, order = order[: options.batch_size], order[options.batch_size :]
        layers, lengths = collate_layers([features[i] for i in batch])
        loss = ctc_loss(probe(layers, lengths), lengths, padded([targets[i] for i in batch]))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(probe.parameters(), 5.0)
        optimizer.step()
        scheduler.step()
        if on_checkpoint is not None and ((every and step % every == 0) or step == total):
            on_checkpoint(step, probe.eval())
            probe.train()
    return probe.eval()


def synthetic(count: int, seed: int, layers: int = 3, dim: int = 16) -> tuple[list[torch.Tensor], list[str]]:
    """Utterances of 2-3 words; each character is 3-5 frames of its own prototype (+ noise) in
    layer 1 only, with 2 frames of "silence" between words; the other layers are pure noise."""
    rng = np.random.default_rng(seed)
    prototypes = np.random.default_rng(123).normal(0, 1, (VOCAB_SIZE, dim))
    features, texts = [], []
    for _ in range(count):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 4))))
        frames = []
        for token in encode(text):
            frames += [prototypes[token]] * int(rng.integers(3, 6))
            if ALPHABET[token - 1] == " ":
                frames += [prototypes[0]] * 2
        signal = np.stack(frames) + rng.normal(0, 0.3, (len(frames), dim))
        stack = rng.normal(0, 1, (layers, len(frames), dim))
        stack[1] = signal
        features.append(torch.tensor(stack, dtype=torch.float32))
        texts.append(text)
    return features, texts


def test_text_round_trip() -> None:
    assert normalise("  it's  a\tCAT! ") == "IT'S A CAT"
    ids = encode("AB B")
    assert VOCAB_SIZE == 29 and 0 not in ids
    # CTC: repeats merge unless a blank separates them
    assert decode_greedy([0, ids[0], ids[0], 0, ids[1], 0, ids[2], ids[3], ids[3], 0]) == "AB B"
    assert decode_greedy([ids[1], 0, ids[1]]) == "BB"


def test_probe_learns_a_synthetic_task_and_weights_the_informative_layer() -> None:
    torch.manual_seed(0)
    train_feats, train_texts = synthetic(48, seed=0)
    test_feats, test_texts = synthetic(16, seed=1)
    untrained = CtcProbe(3, 16)
    before = score(test_texts, transcribe(untrained, test_feats))
    options = ProbeOptions(probe="linear", steps=300, batch_size=8, lr=1e-2)
    probe = train_probe(train_feats, train_texts, options)
    hypotheses = transcribe(probe, test_feats)
    after = score(test_texts, hypotheses)
    assert before.cer > 0.8
    assert after.cer < 0.15 and after.wer < 0.5, hypotheses[:3]
    weights = probe.layer_weights
    assert pytest.approx(sum(weights)) == 1.0 and max(weights) == weights[1]
    # same seed, same data -> the same probe; another seed -> another one
    again = train_probe(train_feats, train_texts, options)
    assert all(torch.equal(a, b) for a, b in zip(probe.state_dict().values(), again.state_dict().values(), strict=True))
    other = train_probe(train_feats, train_texts, options, seed=1)
    assert not torch.equal(probe.output.weight, other.output.weight)


def test_bilstm_probe_shapes_and_padding() -> None:
    probe = CtcProbe(2, 8, probe="bilstm", hidden=4).eval()
    items = [torch.randn(2, 11, 8), torch.randn(2, 5, 8)]
    layers, lengths = collate_layers(items)
    assert layers.shape == (2, 2, 11, 8) and lengths.tolist() == [11, 5]
    with torch.no_grad():
        batched = probe(layers, lengths)
        alone = probe(*collate_layers(items[1:]))
    assert batched.shape == (2, 11, VOCAB_SIZE)
    torch.testing.assert_close(batched[1, :5], alone[0], rtol=1e-5, atol=1e-6)  # padding does not leak
    with pytest.raises(ValueError, match="probe\n  Input should be 'linear' or 'bilstm'"):
        ProbeOptions(probe="transformer")


@pytest.mark.parametrize(("seeds", "ok"), [([0, 1, 2], (0, 1, 2)), ((7,), (7,)), ((), None), ((1, 1), None)])
def test_probe_options_seeds(seeds, ok) -> None:
    if ok is None:
        with pytest.raises(ValueError, match="seeds must be distinct"):
            ProbeOptions(seeds=seeds)
    else:
        assert ProbeOptions(seeds=seeds).seeds == ok  # a settings list becomes a tuple


@pytest.mark.parametrize(
    ("lrs", "ok"), [([0.002, 0.01], (0.002, 0.01)), ((), ()), ((0.01, 0.01), None), ((0.0,), None)]
)
def test_probe_options_lrs(lrs, ok) -> None:
    if ok is None:
        with pytest.raises(ValueError, match="lrs must be distinct"):
            ProbeOptions(lrs=lrs)
    else:
        assert ProbeOptions(lrs=lrs).lrs == ok


@pytest.mark.parametrize(
    ("speakers", "dev_speakers"),
    [
        (["a", "b", "c", "d", "e", "a", "b", "c", "d", "e"], {"a"}),  # 5 speakers: one is development
        ([f"s{i:02d}" for i in range(10)] * 2, {"s00", "s05"}),  # 10: two, spread over the sorted names
        (["b", "a", "b", "a"], {"a"}),  # 2: one each side
    ],
)
def test_dev_split_holds_out_whole_speakers(speakers, dev_speakers) -> None:
    fit, dev = dev_split(speakers)
    assert {speakers[i] for i in dev} == dev_speakers
    assert not {speakers[i] for i in fit} & dev_speakers and sorted(fit + dev) == list(range(len(speakers)))
    assert dev_split(speakers) == (fit, dev)  # deterministic


def test_dev_split_of_one_speaker_takes_every_fifth_utterance() -> None:
    fit, dev = dev_split(["a"] * 12)
    assert dev == [0, 5, 10] and fit == [i for i in range(12) if i not in dev]


def test_stopping_early_is_the_same_probe_as_the_full_run_at_that_step() -> None:
    features, texts = synthetic(24, seed=0)
    options = ProbeOptions(steps=20, batch_size=4, lr=1e-2)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    full = train_probe(
        features,
        texts,
        options,
        every=5,
        on_checkpoint=lambda step, p: seen.__setitem__(step, {k: v.clone() for k, v in p.state_dict().items()}),
    )
    assert sorted(seen) == [5, 10, 15, 20] and not full.training
    early = train_probe(features, texts, options, stop_at=10)
    for key, value in early.state_dict().items():
        torch.testing.assert_close(value, seen[10][key])
    assert not torch.equal(seen[10]["output.weight"], seen[20]["output.weight"])


def test_scores_are_corpus_level_edit_rates() -> None:
    result = score(["AB CD", "EF"], ["AB CD", ""])
    assert result.cer == pytest.approx(2 / 7) and result.wer == pytest.approx(1 / 3) and result.utterances == 2


@pytest.mark.parametrize(
    ("references", "hypotheses"),
    [
        (["AB CD", "EF"], ["AB CD", ""]),
        (["THE CAT SAT", "A DOG"], ["THE BAT SAT ON", "DOG"]),
        (["IT'S A CAT"], ["ITS A CAT"]),
    ],
)
def test_per_utterance_errors_sum_to_the_corpus_scores(references, hypotheses) -> None:
    char_errors, chars, word_errors, words = utterance_errors(references, hypotheses)
    corpus = score(references, hypotheses)
    assert char_errors.shape == chars.shape == words.shape == (len(references),)
    assert char_errors.sum() / chars.sum() == pytest.approx(corpus.cer)
    assert word_errors.sum() / words.sum() == pytest.approx(corpus.wer)


def test_probes_trained_together_are_the_probes_trained_alone() -> None:
    features, texts = synthetic(16, seed=0)
    options = ProbeOptions(steps=12, batch_size=4)
    together = train_probes(features, texts, options, seed=3, lrs=(1e-3, 1e-2))
    assert [(t.lr, t.step) for t in together] == [(1e-3, 12), (1e-2, 12)]
    # features normalised once up front: the same probes
    normed = train_probes([layer_norm(f) for f in features], texts, options, seed=3, lrs=(1e-3, 1e-2), normalised=True)
    for t, n in zip(together, normed, strict=True):
        alone = train_probe(features, texts, replace(options, lr=t.lr), seed=3)
        for key, value in alone.state_dict().items():
            torch.testing.assert_close(t.probe.state_dict()[key], value)
            torch.testing.assert_close(n.probe.state_dict()[key], value)


def test_a_probe_stops_once_its_development_cer_stalls_and_keeps_its_best_step() -> None:
    features, texts = synthetic(24, seed=0)
    dev = synthetic(8, seed=1)
    options = ProbeOptions(steps=60, batch_size=4, lr=3e-2)
    curve: dict[int, float] = {}
    train_probe(
        features,
        texts,
        options,
        every=5,
        on_checkpoint=lambda step, p: curve.__setitem__(step, score(dev[1], transcribe(p, dev[0])).cer),
    )
    best, stale = (
        None,
        0,
    )  # the rule: keep the first step of the lowest CER; stop after 2 evaluations without a lower one
    for step in sorted(curve):
        if best is None or curve[step] < curve[best]:
            best, stale = step, 0
        elif (stale := stale + 1) >= 2:
            break
    (kept,) = train_probes(features, texts, options, lrs=(3e-2,), dev=dev, every=5, patience=2)
    assert (
        (kept.lr, kept.step) == (3e-2, best) and kept.dev_cer == pytest.approx(curve[best]) and not kept.probe.training
    )
    at_best = train_probe(features, texts, options, stop_at=best)
    for key, value in at_best.state_dict().items():
        torch.testing.assert_close(kept.probe.state_dict()[key], value)
