"""compare_encoders probes each model through its own normalisation over several seeds; the
summary, the table and the standing lines say who wins, and when the rows cannot tell."""

import math

import numpy as np
import pytest
import torch

from speech_assets.evaluation.compare import (
    FBANK,
    RANDOM,
    RESULT_COLUMNS,
    ProbeModel,
    ProbeResult,
    beats,
    compare_encoders,
    markdown_table,
    probe_features,
    read_results,
    results_table,
    standing,
    summarise,
)
from speech_assets.evaluation.encoders import Utterance
from speech_assets.evaluation.probe import ProbeOptions
from speech_assets.evaluation.text import ALPHABET, VOCAB_SIZE, encode
from speech_assets.model.encoders import random_encoder
from speech_assets.model.presets import get_preset

WORDS = ["CAT", "DOG", "BIRD", "FISH", "COW", "OWL"]


def utterances(count: int, seed: int, speakers: list[str]) -> list[Utterance]:
    """Utterances of 2-3 words as raw "log-mel" ``(T, 80)``: each character is 3-5 frames of its
    own prototype plus noise, 2 frames of "silence" between words, offset by a per-utterance level
    (what CMVN removes)."""
    rng = np.random.default_rng(seed)
    prototypes = np.random.default_rng(123).normal(0, 1, (VOCAB_SIZE, 80))
    found = []
    for i in range(count):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 4))))
        frames = []
        for token in encode(text):
            frames += [prototypes[token]] * int(rng.integers(3, 6))
            if ALPHABET[token - 1] == " ":
                frames += [prototypes[0]] * 2
        feats = np.stack(frames) + rng.normal(0, 0.3, (len(frames), 80)) + rng.normal(0, 2)
        found.append(Utterance(f"{speakers[i % len(speakers)]}-{seed}-{i}", speakers[i % len(speakers)], feats.astype(np.float32), text))
    return found


def per_utterance(x: np.ndarray) -> np.ndarray:
    return (x - x.mean(0)) / (x.std(0) + 1e-5)


def noise(x: np.ndarray) -> np.ndarray:
    """Pure noise of ``x``'s shape, deterministic per utterance: nothing of the text is left."""
    return np.random.default_rng(int(abs(x).sum() * 1000) % 2**32).normal(size=x.shape)


def row(model: str, seed: int, cer: float, utterances: int = 40, split: str = "heldout", speakers: int = 4) -> ProbeResult:
    return ProbeResult(model, "", "linear", [1.0], split, cer, cer + 0.2, utterances, 400, seed, "utterance", speakers)


def test_an_informative_model_beats_pure_noise_over_seeds() -> None:
    train = utterances(48, seed=0, speakers=["s1", "s2", "s3"])
    test = utterances(24, seed=1, speakers=["h1", "h2"])
    calls = {"pretrained": 0}

    def counted(x: np.ndarray) -> np.ndarray:
        calls["pretrained"] += 1
        return per_utterance(x)

    models = [
        ProbeModel(FBANK, "", "noise", noise),
        ProbeModel("pretrained", "abc", "utterance", counted),
        ProbeModel(RANDOM, "def", "noise", noise),
    ]
    options = ProbeOptions(steps=60, batch_size=8, lr=2e-2, seeds=(0, 1))
    seen = []
    results = compare_encoders(train, test, models, options, on_model=seen.append)
    # features once per model, whatever the number of seeds
    assert calls["pretrained"] == len(train) + len(test)
    assert [(r.model, r.seed) for r in seen] == [(m.name, s) for m in models for s in (0, 1)]
    assert len(results) == 3 * 2 * 2 and all(r.split == "heldout" for r in seen)
    for r in results:
        assert r.normalisation == {"pretrained": "utterance"}.get(r.model, "noise")
        assert (r.utterances, r.speakers) == ((24, 2) if r.split == "heldout" else (48, 3))
    held = summarise(results)
    assert held["pretrained"].cer.mean < 0.5 and held[FBANK].cer.mean > 0.8, markdown_table(results)
    assert beats(results, "pretrained", FBANK) is True and beats(results, "pretrained", RANDOM) is True
    assert beats(results, FBANK, "pretrained") is False
    (line,) = standing(results)
    assert line.startswith("pretrained: held-out CER ") and line.endswith("on 24 utterances of 2 held-out speakers: beats both"), line


def test_seeds_change_the_probe_not_the_data() -> None:
    train = utterances(12, seed=0, speakers=["s1"])
    test = utterances(4, seed=1, speakers=["h1"])
    model = ProbeModel(FBANK, "", "utterance", per_utterance)
    results = compare_encoders(train, test, [model], ProbeOptions(steps=3, seeds=(5, 6)))
    by_seed = {r.seed: r for r in results if r.split == "heldout"}
    assert set(by_seed) == {5, 6} and by_seed[5].utterances == by_seed[6].utterances == 4
    again = compare_encoders(train, test, [model], ProbeOptions(steps=3, seeds=(6,)))
    assert [r.row() for r in again] == [r.row() for r in results if r.seed == 6]  # a seed is a seed, alone or not
    with pytest.raises(ValueError, match="unique"):
        compare_encoders(train, test, [model, model], ProbeOptions(steps=1, seeds=(0,)))
    with pytest.raises(ValueError, match="both sides"):
        compare_encoders(train, [], [model], ProbeOptions(steps=1))


def test_the_probe_lr_and_stopping_step_are_chosen_on_training_speakers_only() -> None:
    train = utterances(40, seed=0, speakers=["s1", "s2", "s3", "s4", "s5"])
    test = utterances(12, seed=1, speakers=["h1", "h2"])
    other_test = utterances(12, seed=2, speakers=["h3"])
    model = ProbeModel("pretrained", "abc", "utterance", per_utterance)
    options = ProbeOptions(steps=60, batch_size=8, lrs=(1e-5, 2e-2), seeds=(0, 1))
    results = compare_encoders(train, test, [model], options)
    chosen = {(r.lr, r.steps) for r in results}
    (lr, steps), = chosen  # one choice per model, shared by its seeds and splits
    assert lr == 2e-2 and steps in (15, 30, 45, 60)  # 1e-5 learns nothing in 60 steps
    assert summarise(results)["pretrained"].cer.mean < 0.5, markdown_table(results)
    # the held-out test speakers take no part in the choice
    again = compare_encoders(train, other_test, [model], options)
    assert {(r.lr, r.steps) for r in again} == chosen
    assert "| pretrained | utterance | 0.02 | 2 |" in markdown_table(results)
    # a single lr is used as given, with all steps
    (fixed,) = {(r.lr, r.steps) for r in compare_encoders(train, test, [model], ProbeOptions(steps=5, lrs=(3e-3,), seeds=(0,)))}
    assert fixed == (3e-3, 5)
    # one training utterance cannot be split: the first lr, all steps
    (alone,) = {(r.lr, r.steps) for r in compare_encoders(train[:1], test, [model], ProbeOptions(steps=4, lrs=(1e-3, 1e-2), seeds=(0,)))}
    assert alone == (1e-3, 4)


def test_each_model_reads_the_log_mel_through_its_own_normalisation() -> None:
    utts = utterances(3, seed=2, speakers=["s1"])
    plain = ProbeModel(FBANK, "", "none", lambda x: x)
    scaled = ProbeModel("scaled", "", "scaled", lambda x: 2 * x)
    for u, a, b in zip(utts, probe_features(plain, utts), probe_features(scaled, utts), strict=True):
        assert a.shape == (1, u.feats.shape[0], 80) and a.dtype == torch.float32
        torch.testing.assert_close(a, torch.from_numpy(u.feats)[None])
        torch.testing.assert_close(b, 2 * a)
    encoder = random_encoder(get_preset("tiny"), seed=0).model
    per_utt = probe_features(ProbeModel("random", "", "utterance", per_utterance, encoder), utts)
    raw = probe_features(ProbeModel("random", "", "none", lambda x: x, encoder), utts)
    layers = get_preset("tiny").layers + 1
    for u, a, b in zip(utts, per_utt, raw, strict=True):
        assert a.shape == (layers, (u.feats.shape[0] + 1) // 2, get_preset("tiny").dim)
        assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="normalise turned"):
        probe_features(ProbeModel("bad", "", "bad", lambda x: x[:, :40]), utts)


def test_rows_of_a_real_encoder_round_trip_through_parquet(tmp_path) -> None:
    train = utterances(6, seed=0, speakers=["s1", "s2"])
    test = utterances(3, seed=1, speakers=["h1"])
    loaded = random_encoder(get_preset("tiny"), seed=0)
    models = [ProbeModel(FBANK, "", "global", per_utterance), ProbeModel(RANDOM, loaded.sha256, "utterance", per_utterance, loaded.model)]
    results = compare_encoders(train, test, models, ProbeOptions(steps=2, seeds=(0, 1)))
    table = results_table(results)
    assert tuple(table.column_names) == RESULT_COLUMNS
    assert {len(r.layer_weights) for r in results if r.model == RANDOM} == {get_preset("tiny").layers + 1}
    import pyarrow.parquet as pq

    pq.write_table(table, tmp_path / "results.parquet")
    back = read_results(tmp_path / "results.parquet")
    assert [r.row() for r in back] == [r.row() for r in results]
    pq.write_table(table.drop(["seed"]), tmp_path / "old.parquet")
    with pytest.raises(ValueError, match="seed"):
        read_results(tmp_path / "old.parquet")


def test_summary_mean_spread_and_table() -> None:
    results = [row("pretrained", s, c) for s, c in ((0, 0.4), (1, 0.5), (2, 0.6))]
    results += [row(FBANK, 0, 0.7), row("pretrained", 0, 0.1, split="train")]
    held = summarise(results)
    s = held["pretrained"]
    assert s.seeds == (0, 1, 2) and s.cer.n == 3 and (s.cer.min, s.cer.max) == (0.4, 0.6)
    assert s.cer.mean == pytest.approx(0.5) and s.cer.std == pytest.approx(0.1)  # sample std (n - 1)
    assert s.wer.mean == pytest.approx(0.7) and (s.utterances, s.speakers, s.normalisation) == (40, 4, "utterance")
    assert held[FBANK].cer.n == 1 and math.isnan(held[FBANK].cer.std)
    assert summarise(results, "train")["pretrained"].cer.mean == pytest.approx(0.1)
    table = markdown_table(results).splitlines()
    assert table[0].startswith("| model | normalisation | probe lr | seeds | held-out CER |")
    assert table[2] == "| pretrained | utterance | n/a | 3 | 0.500 ± 0.100 | 0.700 ± 0.100 | 0.100 | 40 | 4 | layer 0: 1.00 |"
    assert table[3].startswith("| fbank | utterance | n/a | 1 | 0.700 | 0.900 | n/a |")
    with pytest.raises(ValueError, match="repeat"):
        summarise([row(FBANK, 0, 0.5), row(FBANK, 0, 0.6)])


def spread(model: str, mean: float, std: float, seeds: int = 3, utterances: int = 40) -> list[ProbeResult]:
    """``seeds`` rows whose CERs have exactly ``mean`` and sample std ``std``."""
    if seeds == 1:
        return [row(model, 0, mean, utterances)]
    offsets = np.linspace(-1, 1, seeds)
    offsets = offsets / offsets.std(ddof=1)
    return [row(model, s, mean + std * o, utterances) for s, o in enumerate(offsets)]


@pytest.mark.parametrize(
    ("pretrained", "fbank", "random", "verdict", "beats_fbank"),
    [
        pytest.param((0.60, 0.01), (0.72, 0.01), (0.97, 0.01), "beats both", True, id="clear-win"),
        pytest.param((0.90, 0.01), (0.72, 0.01), (0.80, 0.01), "loses to both", False, id="clear-loss"),
        pytest.param((0.75, 0.01), (0.72, 0.01), (0.97, 0.01), "beats random; loses to fbank", False, id="mixed"),
        pytest.param(
            (0.70, 0.03),
            (0.72, 0.03),
            (0.97, 0.01),
            "beats random; too small to tell against fbank (|difference| 0.020 <= 2 x combined std 0.042)",
            None,
            id="spread",
        ),
    ],
)
def test_standing_says_who_wins_and_when_it_cannot_tell(pretrained, fbank, random, verdict, beats_fbank) -> None:
    results = spread("pretrained", *pretrained) + spread(FBANK, *fbank) + spread(RANDOM, *random)
    (line,) = standing(results)
    assert line.startswith("pretrained: held-out CER ") and " over 3 seeds, " in line
    assert f"{pretrained[0] / fbank[0]:.2f}x fbank ({fbank[0]:.3f} ± {fbank[1]:.3f})" in line, line
    assert line.endswith(f" on 40 utterances of 4 held-out speakers: {verdict}"), line
    assert beats(results, "pretrained", FBANK) is beats_fbank


def test_standing_cannot_tell_on_few_utterances_or_one_seed() -> None:
    few = spread("pretrained", 0.3, 0.01, utterances=12) + spread(FBANK, 0.9, 0.01, utterances=12) + spread(RANDOM, 0.95, 0.01, utterances=12)
    (line,) = standing(few)
    assert "too small to tell against fbank (12 held-out utterances < 20)" in line
    assert "too small to tell against random (12 held-out utterances < 20)" in line and "beats" not in line
    assert beats(few, "pretrained", FBANK) is None
    single = spread("pretrained", 0.3, 0, seeds=1) + spread("distilled", 0.4, 0.01) + spread(FBANK, 0.9, 0.01)
    lines = standing(single)
    assert lines[0].startswith("pretrained: held-out CER 0.300 over 1 seed, 0.33x fbank (0.900 ± 0.010) on 40")
    assert lines[0].endswith("too small to tell against fbank (pretrained has 1 seed, no spread to compare with)")
    assert lines[1].endswith("(no random here): beats fbank") or lines[1].endswith(": beats fbank"), lines[1]
    assert beats(single, "pretrained", FBANK) is None and beats(single, "distilled", FBANK) is True
    assert standing([row(FBANK, 0, 0.5)]) == []
    (perfect,) = standing(spread("pretrained", 0.3, 0.01) + spread(FBANK, 0.0, 0.0))  # a baseline at CER 0: no ratio
    assert ", n/a x fbank (0.000 ± 0.000) " in perfect and perfect.endswith(": loses to fbank"), perfect
    (alone,) = standing(spread("pretrained", 0.3, 0.01))
    assert alone.endswith("no baseline (fbank, random) to compare with")
