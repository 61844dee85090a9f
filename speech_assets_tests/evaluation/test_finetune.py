"""CTC fine-tuning's pure parts: the labelled subset, the tri-stage schedule, the objective's
freezing and masks, the n-gram LM and beam decoder, the recogniser export and the CLI's file
handling. Real runs on the sample corpus: speech_assets_tests/defs/test_model_runs.py."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from speech_assets.evaluation.decoding import tuned_beam_decoder, unavailable, write_arpa
from speech_assets.evaluation.finetune import (
    Candidate,
    CtcForward,
    CtcMasking,
    CtcTraining,
    ctc_feasible,
    labelled_subset,
    tri_stage,
)
from speech_assets.evaluation.recognise import RecogniserError, Transcript, labelled_files, model_folder, vocabulary
from speech_assets.evaluation.text import ALPHABET, VOCAB_SIZE, encode
from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.model.presets import get_preset
from speech_assets.train.data import Batch
from speech_assets.train.objectives import ctc_loss


def corpus(seed: int = 0) -> list[Candidate]:
    """12 speakers x 10 utterances of 1-6 s."""
    rng = random.Random(seed)
    return [Candidate(f"{s:04d}-{u:02d}", f"{s:04d}", rng.uniform(1, 6)) for s in range(12) for u in range(10)]


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("minutes", [0.05, 0.5, 2.0, 5.0, 100.0])
def test_labelled_subset_never_holds_a_heldout_speaker(seed: int, minutes: float) -> None:
    candidates = corpus(seed)
    heldout = {"0003", "0007", "0011"}
    chosen = labelled_subset(candidates, heldout, minutes, seed)
    seconds = {c.utt_id: c.seconds for c in candidates}
    speakers = {c.utt_id: c.speaker_id for c in candidates}
    assert chosen and not {speakers[u] for u in chosen} & heldout
    available = sum(s for u, s in seconds.items() if speakers[u] not in heldout)
    total = sum(seconds[u] for u in chosen)
    # the budget is reached (all of it when there is less), and no utterance more than needed
    assert total >= min(minutes * 60, available) - 1e-9
    assert total - max(seconds[u] for u in chosen) < minutes * 60
    # a pure function of the candidates, whatever their order; nested across budgets
    shuffled = candidates[::-1]
    assert labelled_subset(shuffled, heldout, minutes, seed) == chosen
    assert set(labelled_subset(candidates, heldout, minutes / 2, seed)) <= set(chosen)


def test_labelled_subset_differs_by_seed_and_refuses_no_budget() -> None:
    candidates = corpus()
    assert labelled_subset(candidates, set(), 1.0, 0) != labelled_subset(candidates, set(), 1.0, 1)
    with pytest.raises(ValueError, match="must be > 0"):
        labelled_subset(candidates, set(), 0.0, 0)


def test_ctc_feasibility_counts_repeats() -> None:
    assert ctc_feasible(7, "AB") and not ctc_feasible(2, "AB")
    assert not ctc_feasible(5, "AA A") and ctc_feasible(9, "AA")  # a blank between repeated tokens
    assert not ctc_feasible(100, "...")  # nothing to transcribe


def test_tri_stage_warms_holds_and_decays_to_the_final_scale() -> None:
    factor = tri_stage(100, [0.1, 0.4, 0.5], 0.01, 0.05)
    assert factor(0) == pytest.approx(0.01) and factor(5) == pytest.approx(0.01 + 0.99 * 0.5)
    assert factor(10) == factor(49) == 1.0
    assert factor(100) == pytest.approx(0.05) and factor(75) == pytest.approx(math.sqrt(0.05))
    values = [factor(s) for s in range(50, 101)]
    assert values == sorted(values, reverse=True)


def tiny_batch(seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    feats = torch.randn(2, 60, 80, generator=generator)
    targets = torch.full((2, 30), -100, dtype=torch.long)
    for row, text in enumerate(["THE CAT", "A DOG"]):
        targets[row, : len(encode(text))] = torch.tensor(encode(text))
    return Batch(feats, torch.tensor([60, 48]), targets, torch.zeros(2, dtype=torch.long), 1.08)


def test_ctc_objective_freezes_the_encoder_then_trains_it() -> None:
    torch.manual_seed(0)
    model = HubertPretrainModel(get_preset("tiny"), {"ctc": VOCAB_SIZE})
    masking = CtcMasking(0, mask_prob=0.05, mask_length=3, channel_prob=0.05, channel_length=4)
    objective = CtcTraining(torch.device("cpu"), freeze_steps=2, masking=masking)
    forward = CtcForward(model)
    for step, frozen in ((1, True), (2, False)):
        model.zero_grad(set_to_none=True)
        loss, stats = objective(forward, tiny_batch(), step, 0)
        loss.backward()
        assert stats.tolist()[2] == float(frozen) and stats.tolist()[1] == pytest.approx(float(loss.detach()))
        assert model.heads[0].weight.grad is not None
        assert (model.encoder.layers[0].linear1.weight.grad is None) == frozen
    # masks are a pure function of (seed, step, rank, micro-batch)
    a, b = masking.masks(torch.tensor([60, 48]), 3, 0, 0), masking.masks(torch.tensor([60, 48]), 3, 0, 0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[1].shape == (2, 80)
    assert not torch.equal(a[0], masking.masks(torch.tensor([60, 48]), 4, 0, 0)[0])


def test_ctc_loss_ignores_padding_and_prefers_the_transcript() -> None:
    batch = tiny_batch()
    lengths = torch.tensor([30, 24])
    uniform = torch.full((2, 30, VOCAB_SIZE), -math.log(VOCAB_SIZE))
    peaked = uniform.clone()
    for row in range(2):
        tokens = batch.targets[row][batch.targets[row] >= 0].tolist()
        for i, token in enumerate(tokens):
            peaked[row, 2 * i] = -20.0
            peaked[row, 2 * i, token] = 0.0
    assert float(ctc_loss(peaked.log_softmax(-1), lengths, batch.targets)) < float(
        ctc_loss(uniform, lengths, batch.targets)
    )
    # the padded targets give the concatenated ones' loss, and so do the lengths handed on the host
    valid = batch.targets >= 0
    for log_probs in (peaked.log_softmax(-1), uniform):
        concatenated = F.ctc_loss(
            log_probs.transpose(0, 1), batch.targets[valid], lengths, valid.sum(1), zero_infinity=True
        )
        assert torch.equal(ctc_loss(log_probs, lengths, batch.targets), concatenated)
        assert torch.equal(ctc_loss(log_probs, lengths * 0, batch.targets, (lengths, valid.sum(1))), concatenated)


def read_arpa(path: Path) -> tuple[dict[tuple[str, ...], float], dict[tuple[str, ...], float]]:
    logp, backoff, order = {}, {}, 0
    for line in path.read_text().splitlines():
        if line.startswith("\\") and line.endswith("-grams:"):
            order = int(line[1])
        elif order and line and not line.startswith("\\"):
            parts = line.split("\t")
            gram = tuple(parts[1].split())
            logp[gram] = float(parts[0])
            if len(parts) > 2:
                backoff[gram] = float(parts[2])
    return logp, backoff


@pytest.mark.parametrize("order", [1, 2, 3])
def test_arpa_model_is_a_distribution_for_every_history(tmp_path: Path, order: int) -> None:
    sentences = ["THE CAT SAT", "THE DOG SAT DOWN", "A CAT RAN", "THE CAT RAN AWAY", "A DOG"]
    write_arpa(sentences, order, tmp_path / "lm.arpa")
    logp, backoff = read_arpa(tmp_path / "lm.arpa")

    def prob(history: tuple[str, ...], word: str) -> float:
        if (*history, word) in logp:
            return 10 ** logp[(*history, word)]
        if not history:
            return 10 ** logp[("<unk>",)]
        return 10 ** backoff.get(history, 0.0) * prob(history[1:], word)

    vocab = [w for (w, *rest) in logp if not rest and w != "<s>"]
    histories = {g[:-1] for g in logp if len(g) > 1} | {()}
    for history in histories:
        assert sum(prob(history, w) for w in vocab) == pytest.approx(1.0, abs=1e-4), history
    # the training data's own continuations are likelier than a word never seen there
    assert prob(("<s>", "THE")[-(order - 1) :] if order > 1 else (), "CAT") > prob((), "<unk>")


@pytest.mark.skipif(unavailable() is not None, reason="flashlight-text not installed")
def test_beam_decoder_with_the_training_lm_repairs_a_near_miss() -> None:
    decode, name, _ = tuned_beam_decoder(["THE CAT SAT", "THE DOG RAN", "A CAT RAN"], 3, (), (), (), ())
    assert name == "beam_3gram"
    assert decode([emissions("THE CAT RAN"), emissions("THE CAP SAT")]) == ["THE CAT RAN", "THE CAT SAT"]


def test_recogniser_export_matches_pytorch(tiny_recogniser) -> None:
    from speech_assets.model.export import ExportableRecogniser

    model, _, parity = tiny_recogniser
    assert parity.onnx_max_abs_diff <= 1e-4 and parity.torchscript_max_abs_diff <= 1e-4 and parity.frames == 60 + 39
    feats = np.random.default_rng(1).standard_normal((77, 80)).astype(np.float32)
    log_probs, lengths = ExportableRecogniser(model)(torch.from_numpy(feats)[None], torch.tensor([77]))
    assert log_probs.shape == (1, 39, VOCAB_SIZE) and torch.allclose(
        log_probs.exp().sum(-1), torch.ones(1, 39), atol=1e-5
    )


def test_vocabulary_folders_and_lines(tmp_path: Path) -> None:
    assert vocabulary()[0] == "" and "".join(vocabulary()) == ALPHABET
    (tmp_path / "a").mkdir()
    for name in ("a/x.flac", "a/y.WAV", "a/notes.txt", "b.ogg"):
        (tmp_path / name).write_bytes(b"")
    assert [path for _, path in labelled_files([tmp_path / "a", tmp_path / "b.ogg"])] == [
        tmp_path / "a/x.flac",
        tmp_path / "a/y.WAV",
        tmp_path / "b.ogg",
    ]
    with pytest.raises(RecogniserError, match="no recogniser"):
        model_folder(tmp_path)
    assert Transcript("u", "p", "HELLO", 1.234).line() == "u\tHELLO\t1.23"
    assert Transcript("u", "p", None, None, "unreadable: x").line() == "u\terror: unreadable: x"


def result_rows(cers: dict[str, list[float]], utterances: int = 40, minutes: float = 5.0) -> list[dict]:
    return [
        {
            "model": model,
            "labelled_minutes": minutes,
            "seed": seed,
            "decoder": decoder,
            "split": "heldout",
            "cer": cer,
            "wer": min(1.0, 2 * cer),
            "utterances": utterances,
            "steps": 100,
            "labelled_seconds": 300.0,
            "checkpoint_sha256": "x",
        }
        for model, values in cers.items()
        for seed, cer in enumerate(values)
        for decoder in ("greedy", "beam_3gram")
    ]


@pytest.mark.parametrize(
    ("cers", "utterances", "said"),
    [
        ({"pretrained": [0.30, 0.31, 0.29], "scratch": [0.60, 0.62, 0.58]}, 40, "beats scratch"),
        ({"pretrained": [0.70, 0.71, 0.69], "scratch": [0.60, 0.62, 0.58]}, 40, "loses to scratch"),
        ({"pretrained": [0.30, 0.60, 0.45], "scratch": [0.50, 0.40, 0.60]}, 40, "too small to tell (|difference|"),
        ({"pretrained": [0.30], "scratch": [0.60]}, 40, "too small to tell (pretrained has 1 seed"),
        ({"pretrained": [0.30, 0.31], "scratch": [0.60, 0.62]}, 8, "too small to tell (8 held-out utterances"),
    ],
)
def test_verdict_says_beats_loses_or_too_small_to_tell(cers: dict, utterances: int, said: str, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from speech_assets.evaluation.finetune_results import markdown_tables, read_rows, results_table, verdicts

    rows = result_rows(cers, utterances)
    pq.write_table(results_table(rows), tmp_path / "results.parquet")
    again = read_rows(tmp_path / "results.parquet")
    (line,) = verdicts(again)
    assert line.startswith("pretrained: 5 min: CER ") and said in line, line
    tables = markdown_tables(again, {"pretrained": "0.500 ± 0.010"})
    assert "greedy decoding" in tables and "beam_3gram decoding" in tables and "| frozen probe: pretrained |" in tables


def recogniser_folder(tiny_recogniser, folder: Path, lm_texts: list[str] | None) -> Path:
    """A recogniser folder as finetuned_asr exports one (a copy of the session's `tiny_recogniser`),
    with the beam decoder's LM and lexicon of ``lm_texts`` beside it when given."""
    import json
    import shutil

    from speech_assets.evaluation.decoding import write_lm_files
    from speech_assets.features.cmvn import UtteranceCmvn, describe
    from speech_assets.features.vad import VadConfig

    shutil.copytree(tiny_recogniser[1], folder)
    spec = {
        "vocabulary": vocabulary(),
        "cmvn": describe(UtteranceCmvn()),
        "featurisation": {"vad": VadConfig().as_dict()},
    }
    if lm_texts is not None:
        spec["beam"] = write_lm_files(lm_texts, 3, folder)
    (folder / "recogniser.json").write_text(json.dumps(spec))
    return folder


def emissions(text: str) -> np.ndarray:
    """``(2 S + 2, 29)`` log-probabilities that spell ``text`` best-path, blanks between tokens."""
    ids = encode(text)
    lp = np.full((2 * len(ids) + 2, VOCAB_SIZE), -8.0, np.float32)
    lp[:, 0] = -0.1
    for i, token in enumerate(ids):
        lp[2 * i + 1, token], lp[2 * i + 1, 0] = -0.05, -5.0
    return lp - np.log(np.exp(lp).sum(axis=1, keepdims=True))


@pytest.mark.skipif(unavailable() is not None, reason="flashlight-text not installed")
def test_transcribe_decodes_with_the_recogniser_lm_beside_it(tiny_recogniser, tmp_path: Path, capsys) -> None:
    import subprocess
    import sys

    from speech_assets.evaluation.recognise import Recogniser
    from speech_assets_tests.conftest import REPO, SAMPLE_CORPUS

    texts = ["THE CAT SAT", "THE DOG RAN", "A CAT RAN"]
    folder = recogniser_folder(tiny_recogniser, tmp_path / "rec", texts)
    # the LM and lexicon beside the model repair what greedy spells wrong
    assert Recogniser(folder, "beam").beam([emissions("THE CAP SAT")]) == ["THE CAT SAT"]
    assert Recogniser(folder).beam is None
    good = sorted(SAMPLE_CORPUS.rglob("*.flac"))[0]
    missing = tmp_path / "gone.flac"
    command = [sys.executable, "-m", "speech_assets.cli", "transcribe", str(good), str(missing), "--decoder", "beam"]
    proc = subprocess.run([*command, "--model", str(folder)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-3000:]  # the missing file: an error line, the other transcribed
    first, second = proc.stdout.splitlines()
    utt, text, seconds = first.split("\t")
    words = {w for t in texts for w in t.split()}
    assert utt == str(good) and float(seconds) > 0.5 and set(text.split()) <= words, first
    assert second == f"{missing}\terror: no such file: {missing}"
    # a recogniser exported without its LM: refused as a whole, before any file
    bare = recogniser_folder(tiny_recogniser, tmp_path / "bare", None)
    from speech_assets import cli

    capsys.readouterr()
    code = cli.main([*command[3:], "--model", str(bare)])  # in this process: the command above was real
    refused = capsys.readouterr()
    assert code == 1 and not refused.out, refused.err[-2000:]
    assert "records no n-gram LM" in refused.err


@pytest.mark.parametrize(
    ("beam", "said"),
    [
        (None, "records no n-gram LM"),
        ({"lm": "../3gram.arpa"}, "is not in"),
        ({"lexicon": "/etc/hostname"}, "is not in"),
        ({"lm": "absent.arpa"}, "is not in"),
        ({}, None),
    ],
)
def test_beam_recogniser_reads_only_its_own_lm_files(
    tiny_recogniser, tmp_path: Path, beam: dict | None, said: str | None
) -> None:
    import json

    from speech_assets.evaluation.recognise import Recogniser

    folder = recogniser_folder(tiny_recogniser, tmp_path / "rec", ["THE CAT SAT"] if beam is not None else None)
    (tmp_path / "3gram.arpa").write_text("outside the folder")
    if beam:
        spec = json.loads((folder / "recogniser.json").read_text())
        spec["beam"] |= beam
        (folder / "recogniser.json").write_text(json.dumps(spec))
    if said is None:
        if unavailable() is not None:
            pytest.skip("flashlight-text not installed")
        assert Recogniser(folder, "beam").beam([emissions("THE CAT SAT")]) == ["THE CAT SAT"]
        return
    with pytest.raises(RecogniserError, match=said):
        Recogniser(folder, "beam")
    assert Recogniser(folder).beam is None  # greedy needs none of it
    with pytest.raises(RecogniserError, match="unknown decoder"):
        Recogniser(folder, "viterbi")


def test_wer_curve_over_several_budgets_renders() -> None:
    from speech_assets.evaluation.finetune_results import wer_by_budget
    from speech_assets.stats import plots

    rows = [
        {"model": model, "labelled_minutes": minutes, "split": "heldout", "decoder": "greedy", "wer": wer}
        for model, minutes, wer in (("pretrained", 5.0, 0.9), ("pretrained", 20.0, 0.6), ("scratch", 5.0, 1.0))
    ]
    budgets, series = wer_by_budget(rows)
    assert budgets == [5.0, 20.0] and series["pretrained"] == [0.9, 0.6] and math.isnan(series["scratch"][1])
    # what finetuned_asr draws when it has several budgets
    assert plots.curves(budgets, series, "WER", "labelled minutes").startswith(b"\x89PNG")
