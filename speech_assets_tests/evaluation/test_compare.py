"""compare_encoders probes each model through its own normalisation over several seeds; the
summary, the table and the standing lines say who wins, and when the rows cannot tell."""

import math
import re
import zlib

import numpy as np
import pytest
import torch

from speech_assets.evaluation.compare import (
    FBANK,
    RANDOM,
    RESULT_COLUMNS,
    HeldoutErrors,
    Paired,
    ProbeModel,
    ProbeResult,
    compare_encoders,
    leaderboard,
    leaderboard_rows,
    markdown_table,
    paired,
    paired_bootstrap,
    probe_features,
    read_results,
    results_table,
    standing,
    summarise,
    utterances_table,
)
from speech_assets.evaluation.encoders import Utterance
from speech_assets.evaluation.probe_options import ProbeOptions
from speech_assets.evaluation.text import ALPHABET, VOCAB_SIZE, encode
from speech_assets.layout import ProbeFiles
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
        found.append(
            Utterance(
                f"{speakers[i % len(speakers)]}-{seed}-{i}", speakers[i % len(speakers)], feats.astype(np.float32), text
            )
        )
    return found


def per_utterance(x: np.ndarray) -> np.ndarray:
    return (x - x.mean(0)) / (x.std(0) + 1e-5)


def noise(x: np.ndarray) -> np.ndarray:
    """Pure noise of ``x``'s shape, deterministic per utterance: nothing of the text is left."""
    return np.random.default_rng(int(abs(x).sum() * 1000) % 2**32).normal(size=x.shape)


def row(
    model: str, seed: int, cer: float, utterances: int = 40, split: str = "heldout", speakers: int = 4
) -> ProbeResult:
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
    options = ProbeOptions(steps=60, batch_size=8, lr=2e-2, lrs=(), seeds=(0, 1))
    seen = []
    results = compare_encoders(train, test, models, options, on_model=seen.append)
    # features once per model, whatever the number of seeds
    assert calls["pretrained"] == len(train) + len(test)
    assert [(r.model, r.seed) for r in seen] == [(m.name, s) for m in models for s in (0, 1)]
    assert len(results) == 3 * 2 * 2 and all(r.split == "heldout" for r in seen)
    for r in results:  # the train rows: the utterances the probes trained on (one speaker is development)
        assert r.normalisation == {"pretrained": "utterance"}.get(r.model, "noise")
        assert (r.utterances, r.speakers) == ((24, 2) if r.split == "heldout" else (32, 2))
    held = summarise(results)
    assert held["pretrained"].cer.mean < 0.5 and held[FBANK].cer.mean > 0.8, markdown_table(results)
    assert paired(results, "pretrained", FBANK).verdict == "better" == paired(results, "pretrained", RANDOM).verdict
    assert paired(results, FBANK, "pretrained").verdict == "worse"
    (line,) = standing(results, min_speakers=2)
    assert line.startswith("pretrained: held-out CER ") and line.endswith(
        "on 24 utterances of 2 held-out speakers: better than fbank and random"
    ), line
    # each held-out row carries every utterance's edit counts; their sums are the row's CER
    for r in seen:
        assert r.errors.utt_ids == tuple(u.utt_id for u in test) and r.errors.speaker_ids == tuple(
            u.speaker_id for u in test
        )
        assert r.errors.char_errors.sum() / r.errors.chars.sum() == pytest.approx(r.cer)
        assert r.errors.word_errors.sum() / r.errors.words.sum() == pytest.approx(r.wer)


def test_the_probe_verdict_on_one_heldout_speaker_is_indicative_only() -> None:
    train = utterances(36, seed=0, speakers=["s1", "s2", "s3"])
    test = utterances(24, seed=1, speakers=["h1"])
    models = [ProbeModel(FBANK, "", "noise", noise), ProbeModel("pretrained", "abc", "utterance", per_utterance)]
    results = compare_encoders(train, test, models, ProbeOptions(steps=60, batch_size=8, lr=2e-2, lrs=(), seeds=(0, 1)))
    (line,) = standing(results)
    assert line.endswith(
        "on 24 utterances of 1 held-out speaker: better than fbank (indicative only: 1 held-out speaker, fewer than 3)"
    ), line
    (pretrained,) = (s for s in leaderboard(results) if s.model == "pretrained")
    assert pretrained.indicative is not None and pretrained.against[FBANK].verdict == "better"


def test_seeds_change_the_probe_not_the_data() -> None:
    train = utterances(12, seed=0, speakers=["s1"])
    test = utterances(4, seed=1, speakers=["h1"])
    model = ProbeModel(FBANK, "", "utterance", per_utterance)
    results = compare_encoders(train, test, [model], ProbeOptions(steps=3, seeds=(5, 6)))
    by_seed = {r.seed: r for r in results if r.split == "heldout"}
    assert set(by_seed) == {5, 6} and by_seed[5].utterances == by_seed[6].utterances == 4
    # the first seed chooses the stopping step on the development utterances, the others train to it
    assert by_seed[5].steps == by_seed[6].steps
    alone = compare_encoders(train, test, [model], ProbeOptions(steps=3, seeds=(6,)))
    first = compare_encoders(train, test, [model], ProbeOptions(steps=3, seeds=(6, 5)))
    assert [r.row() for r in alone] == [
        r.row() for r in first if r.seed == 6
    ]  # a first seed is a first seed, alone or not
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
    ((lr, steps),) = chosen  # one choice per model, shared by its seeds and splits
    # 1e-5 learns nothing in 60 steps; development CER every 60 // 8 steps and at the last
    assert lr == 2e-2 and steps in (*range(7, 60, 7), 60)
    assert summarise(results)["pretrained"].cer.mean < 0.5, markdown_table(results)
    # the held-out test speakers take no part in the choice
    again = compare_encoders(train, other_test, [model], options)
    assert {(r.lr, r.steps) for r in again} == chosen
    assert "| pretrained | utterance | 0.02 | 2 |" in markdown_table(results)
    # a single lr is used as given; the stopping step is still the development split's
    (fixed,) = {
        (r.lr, r.steps) for r in compare_encoders(train, test, [model], ProbeOptions(steps=5, lrs=(3e-3,), seeds=(0,)))
    }
    assert fixed[0] == 3e-3 and 1 <= fixed[1] <= 5
    # one training utterance cannot be split: the first lr, all steps
    (alone,) = {
        (r.lr, r.steps)
        for r in compare_encoders(train[:1], test, [model], ProbeOptions(steps=4, lrs=(1e-3, 1e-2), seeds=(0,)))
    }
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
    models = [
        ProbeModel(FBANK, "", "global", per_utterance),
        ProbeModel(RANDOM, loaded.sha256, "utterance", per_utterance, loaded.model),
    ]
    results = compare_encoders(train, test, models, ProbeOptions(steps=2, seeds=(0, 1)))
    table = results_table(results)
    assert tuple(table.column_names) == RESULT_COLUMNS
    assert {len(r.layer_weights) for r in results if r.model == RANDOM} == {get_preset("tiny").layers + 1}
    import pyarrow.parquet as pq

    pq.write_table(table, tmp_path / "results.parquet")
    back = read_results(tmp_path / "results.parquet")
    assert [r.row() for r in back] == [r.row() for r in results]
    assert all(r.errors is None for r in back)  # no utterances.parquet beside it: no per-utterance errors
    pq.write_table(utterances_table(results), ProbeFiles.beside(tmp_path / "results.parquet").utterances)
    back = read_results(tmp_path / "results.parquet")
    assert [r.row() for r in back] == [r.row() for r in results]
    for a, b in zip(back, results, strict=True):
        assert (a.errors is None) == (b.errors is None) == (a.split == "train")
        if a.errors is not None:
            assert (a.errors.utt_ids, a.errors.speaker_ids) == (b.errors.utt_ids, b.errors.speaker_ids)
            for name in ("char_errors", "chars", "word_errors", "words"):
                np.testing.assert_array_equal(getattr(a.errors, name), getattr(b.errors, name))
    assert standing(back) == standing(results)
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
    assert (
        table[2]
        == "| pretrained | utterance | n/a | 3 | 0.500 ± 0.100 | 0.700 ± 0.100 | 0.100 | 40 | 4 | layer 0: 1.00 |"
    )
    assert table[3].startswith("| fbank | utterance | n/a | 1 | 0.700 | 0.900 | n/a |")
    with pytest.raises(ValueError, match="repeat"):
        summarise([row(FBANK, 0, 0.5), row(FBANK, 0, 0.6)])


def scored(model: str, seed: int, char_errors, speakers: int = 4, chars: int = 20) -> ProbeResult:
    """A held-out row with its per-utterance errors: ``char_errors`` (one per utterance) out of
    ``chars`` reference characters each, the utterances spread over ``speakers`` speakers."""
    errors = np.asarray(char_errors, dtype=np.int64)
    count = len(errors)
    lengths = np.full(count, chars, dtype=np.int64)
    cer = float(errors.sum() / lengths.sum())
    held = HeldoutErrors(
        tuple(f"u{i}" for i in range(count)),
        tuple(f"h{i % speakers}" for i in range(count)),
        errors,
        lengths,
        errors // 4,
        lengths // 4,
    )
    return ProbeResult(
        model,
        "",
        "linear",
        [1.0],
        "heldout",
        cer,
        cer + 0.2,
        count,
        400,
        seed,
        "utterance",
        min(speakers, count),
        errors=held,
    )


def system(
    model: str, rate: float, noise: float = 1.0, seeds: int = 3, utterances: int = 40, speakers: int = 4
) -> list[ProbeResult]:
    """``seeds`` rows of a system with ``rate`` of 20 characters wrong per utterance on average:
    the same utterances are hard for every system (a shared per-utterance difficulty), plus
    ``noise`` characters of its own per utterance and seed."""
    difficulty = np.random.default_rng(7).normal(0, 3, utterances)
    own = np.random.default_rng(zlib.crc32(model.encode()))
    return [
        scored(
            model, seed, np.clip(np.rint(20 * rate + difficulty + own.normal(0, noise, utterances)), 0, 40), speakers
        )
        for seed in range(seeds)
    ]


def test_paired_bootstrap_says_better_on_a_clearly_better_system_and_no_evidence_on_noise() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 60, 200)
    baseline = rng.binomial(lengths, 0.5)
    better = np.maximum(baseline - rng.integers(2, 6, 200), 0)  # a few characters fewer on every utterance
    difference, low, high = paired_bootstrap(better, baseline, lengths)
    assert difference == pytest.approx((better - baseline).sum() / lengths.sum())
    assert low <= difference <= high < 0 and Paired("x", difference, low, high).verdict == "better"
    assert Paired("x", *paired_bootstrap(baseline, better, lengths)).verdict == "worse"
    # two draws of the same system: the interval straddles 0
    same_a, same_b = rng.binomial(lengths, 0.5), rng.binomial(lengths, 0.5)
    difference, low, high = paired_bootstrap(same_a, same_b, lengths)
    assert low < 0 < high and Paired("x", difference, low, high).verdict == "no evidence"
    assert paired_bootstrap(same_a, same_b, lengths) == (difference, low, high)  # deterministic
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_bootstrap(same_a, same_b[:-1], lengths)
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_bootstrap([], [], [])


def test_a_gain_of_one_character_per_utterance_is_better_and_the_same_rate_is_no_evidence() -> None:
    results = system("pretrained", 0.45, noise=0.5) + system(FBANK, 0.50, noise=0.5) + system(RANDOM, 0.5, noise=0.5)
    board = {s.model: s for s in leaderboard(results)}
    assert board["pretrained"].against[FBANK].verdict == "better" == paired(results, "pretrained", FBANK).verdict
    assert board["pretrained"].verdict == "better than fbank and random" and board["pretrained"].indicative is None
    assert board[FBANK].verdict == "baseline" and board[RANDOM].against[FBANK].verdict == "no evidence"
    assert (
        paired(results, RANDOM, FBANK).verdict == "no evidence"
        and paired(results, FBANK, "pretrained").verdict == "worse"
    )


@pytest.mark.parametrize(
    ("pretrained", "speakers", "min_speakers", "verdict", "word"),
    [
        pytest.param(0.30, 4, 3, "better than fbank and random", "better", id="clear-win"),
        pytest.param(0.90, 4, 3, "worse than fbank and random", "worse", id="clear-loss"),
        pytest.param(0.70, 4, 3, "better than random; worse than fbank", "mixed", id="mixed"),
        pytest.param(
            0.60, 4, 3, "better than random; no evidence against fbank", "better than random", id="same-as-fbank"
        ),
        pytest.param(
            0.30,
            1,
            3,
            "better than fbank and random (indicative only: 1 held-out speaker, fewer than 3)",
            "better*",
            id="one-speaker",
        ),
        pytest.param(0.30, 2, 2, "better than fbank and random", "better", id="two-speakers-enough-when-set"),
    ],
)
def test_the_verdict_and_when_it_is_indicative_only(
    pretrained: float, speakers: int, min_speakers: int, verdict: str, word: str
) -> None:
    results = system("pretrained", pretrained, speakers=speakers) + system(FBANK, 0.6, speakers=speakers)
    results += system(RANDOM, 0.8, speakers=speakers)
    (line,) = standing(results, min_speakers)
    assert line.startswith("pretrained: held-out CER ") and " over 3 seeds, fbank " in line, line
    assert line.endswith(f" on 40 utterances of {speakers} held-out speaker{'s' if speakers > 1 else ''}: {verdict}"), (
        line
    )
    board = leaderboard(results, min_speakers)
    assert [s.model for s in board] == sorted((s.model for s in board), key=lambda m: summarise(results)[m].cer.mean)
    rows = {r["encoder"]: r for r in leaderboard_rows(board)}
    # the table's cell is a short word (the caveat is said once beside it), the line the whole verdict
    assert rows["pretrained"]["verdict"] == word and rows[FBANK]["vs fbank"] == "—"
    assert re.fullmatch(r"[+-]\d\.\d{3}\xa0\[[+-]\d\.\d{3},\xa0[+-]\d\.\d{3}\]", rows["pretrained"]["vs fbank"])
    assert re.fullmatch(r"\d\.\d{3}\xa0±\xa0\d\.\d{3}", rows["pretrained"]["CER"])


def test_too_few_utterances_or_no_per_utterance_scores_say_so() -> None:
    few = system("pretrained", 0.3, utterances=12) + system(FBANK, 0.6, utterances=12)
    (line,) = standing(few)
    assert line.endswith("better than fbank (indicative only: 12 held-out utterances, fewer than 20)"), line
    bare = [row("pretrained", s, 0.3) for s in range(3)] + [
        row(FBANK, s, 0.6) for s in range(3)
    ]  # rows written before the errors were kept
    (line,) = standing(bare)
    assert (
        line.endswith("no per-utterance scores to compare: rematerialize downstream_probe")
        and paired(bare, "pretrained", FBANK) is None
    )
    assert standing([row(FBANK, 0, 0.5)]) == []
    (alone,) = standing(system("pretrained", 0.3))
    assert alone.endswith("no baseline (fbank, random) to compare with")
    with pytest.raises(ValueError, match="different held-out utterances"):
        paired(system("pretrained", 0.3) + system(FBANK, 0.6, utterances=41), "pretrained", FBANK)
