"""Fine-tuning that judges fairly, on real tiny runs of the worker: a from-scratch baseline that
trains every parameter from step 0, and model selection on a dev set (the best step's checkpoint
kept, early stopping after ``patience`` evaluations without improvement)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from speech_assets.evaluation.finetune import (
    CtcTraining,
    FineTuning,
    Selection,
    build_model,
    finetune,
    oov_rate,
    text_overlap,
)
from speech_assets.evaluation.finetune_results import DID_NOT_TRAIN_CER
from speech_assets.layout import RunFiles
from speech_assets.runtime.faults import FAULTS_ENV, fault
from speech_assets.train.checkpoint import list_checkpoints, load_checkpoint
from speech_assets_tests.evaluation.test_finetune_ddp import labelled_run
from speech_assets_tests.train.test_sync_census import CPU


def with_dev_speaker(config, tmp_path: Path):
    """``config`` with one training speaker's utterances moved from the labelled set to the dev set."""
    from speech_assets.evaluation.finetune import transcribed_index

    texts = json.loads(Path(config.labelled).read_text())
    index = transcribed_index(config.shards, texts["train"])
    speaker = sorted({u.speaker_id for u in index.utterances})[0]
    dev = {u.utt_id: texts["train"].pop(u.utt_id) for u in index.utterances if u.speaker_id == speaker}
    path = tmp_path / "labelled_dev.json"
    path.write_text(json.dumps({**texts, "dev": dev}))
    return replace(config, labelled=str(path))


def test_baseline_trains_front_end_and_every_encoder_layer_from_step_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the pretrained-model settings (a freeze phase, a frozen front end) are asked for: scratch ignores them
    config = replace(
        labelled_run(tmp_path), init="scratch", freeze_steps=3, freeze_frontend=True, run_dir=str(tmp_path / "s")
    )
    start = {k: v.clone() for k, v in build_model(config)[0].state_dict().items()}
    monkeypatch.setenv(FAULTS_ENV, fault("train.step", "preempt", step=1))  # preempted there
    assert finetune(config) is None
    monkeypatch.delenv(FAULTS_ENV)
    step1 = load_checkpoint(RunFiles(config.run_dir).checkpoint(1))["model"]
    names = [k for k in start if k.startswith(("frontend.", "encoder.layers."))]
    layers = {k.split(".")[2] for k in names if k.startswith("encoder.layers.")}
    assert any(k.startswith("frontend.") for k in names) and len(layers) == len(build_model(config)[0].encoder.layers)
    unchanged = [k for k in names if start[k].is_floating_point() and torch.equal(start[k], step1[k])]
    assert not unchanged, f"from step 0 the baseline must train every parameter; unchanged after step 1: {unchanged}"


def test_baseline_trains_pretrained_keeps_its_freeze(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the control: a pretrained run with the same settings leaves front end and encoder as they were
    config = replace(labelled_run(tmp_path), freeze_steps=3, freeze_frontend=True, run_dir=str(tmp_path / "p"))
    start = build_model(config)[0].state_dict()
    monkeypatch.setenv(FAULTS_ENV, fault("train.step", "preempt", step=1))  # preempted there
    finetune(config)
    monkeypatch.delenv(FAULTS_ENV)
    step1 = load_checkpoint(RunFiles(config.run_dir).checkpoint(1))["model"]
    assert torch.equal(start["frontend.conv1.weight"], step1["frontend.conv1.weight"])
    assert torch.equal(start["encoder.layers.0.linear1.weight"], step1["encoder.layers.0.linear1.weight"])


def test_dev_selected_step_is_the_best_and_patience_stops_a_rising_dev_cer() -> None:
    selection = Selection(patience=3)
    cers = [0.9, 0.6, 0.65, 0.7, 0.8, 0.5]
    stops = [selection.update(50 * (i + 1), cer) for i, cer in enumerate(cers)]
    assert stops == [False, False, False, False, True, False]  # three evaluations above the best at step 100
    assert (selection.best_step, selection.best_cer) == (300, 0.5)  # a later improvement still counts
    again = Selection(patience=3)
    for i, cer in enumerate(cers[:5]):
        again.update(50 * (i + 1), cer)
    assert (again.best_step, again.best_cer, again.stopped) == (100, 0.6, True)
    restored = Selection.from_dict(3, again.to_dict())
    assert restored == again
    nan = Selection(patience=1)
    assert not nan.update(50, float("nan")) and nan.best_step is None  # a NaN CER never counts as the best


def test_dev_selected_patience_waits_while_the_model_is_on_the_blank_plateau() -> None:
    # a from-scratch model emits blanks (dev CER 1.0) for hundreds of steps before it spells:
    # stopping it there would compare pretrained against a model that was never let to train
    selection = Selection(patience=2)
    assert not any(selection.update(100 * (i + 1), 1.0) for i in range(10))
    assert not selection.update(1100, 0.8) and not selection.update(1200, 0.85)
    assert selection.update(1300, 0.9) and selection.best_step == 1100


def test_dev_selected_run_keeps_the_best_checkpoint_and_stops_after_patience(tmp_path: Path) -> None:
    # the toy corpus's made-up sentences are learnt within a few steps and then dev CER stops
    # falling: the run keeps the best step and stops `patience` evaluations after it
    config = replace(
        with_dev_speaker(labelled_run(tmp_path), tmp_path),
        lr=5e-3,
        freeze_steps=0,
        max_steps=300,
        eval_every=5,
        patience=3,
        checkpoint_every=100,
        keep_checkpoints=1,
        log_every=50,
        run_dir=str(tmp_path / "dev"),
    )
    result = finetune(config)
    assert result is not None
    history = result["dev_history"]
    best_step, best_cer = min(history, key=lambda h: (h[1], h[0]))
    assert best_cer < DID_NOT_TRAIN_CER, history  # it learnt something: patience counts
    assert result["stopped_early"] is True and result["steps_trained"] < config.max_steps
    # the evaluation that runs out of patience is recorded one evaluation later: the run stops there
    assert result["step"] == best_step
    assert result["steps_trained"] == best_step + (config.patience + 1) * config.eval_every
    assert [step for step, _ in history] == list(range(5, result["steps_trained"] - 5 + 1, 5))
    assert result["dev_cer"] == pytest.approx(best_cer)
    assert {r["split"] for r in result["scores"]} == {"train", "dev", "heldout"}
    kept = [step for step, _ in list_checkpoints(config.run_dir)]
    assert best_step in kept and result["steps_trained"] in kept, kept  # the selected step survives pruning
    final = load_checkpoint(RunFiles(config.run_dir).final)
    best = load_checkpoint(RunFiles(config.run_dir).checkpoint(best_step))["model"]
    last = load_checkpoint(RunFiles(config.run_dir).checkpoint(result["steps_trained"]))["model"]
    assert final["step"] == best_step and all(torch.equal(final["model"][k], best[k]) for k in best)
    assert not all(torch.equal(last[k], best[k]) for k in best)  # the last step's weights are not what was kept
    assert result["speakers"]["dev"] and not set(result["speakers"]["dev"]) & set(result["speakers"]["train"])
    # a second materialization finds it finished; resuming the stopped run trains nothing more
    again = finetune(config)
    assert again["step"] == best_step and again["steps_trained"] == result["steps_trained"]


def test_dev_selected_run_on_a_rising_dev_cer_picks_the_earlier_step(tmp_path: Path) -> None:
    # a learning rate far too large: the first steps wreck the recogniser, so dev CER rises (or stays
    # at its worst) after the first evaluation and the earliest step is the one kept
    config = replace(
        with_dev_speaker(labelled_run(tmp_path), tmp_path),
        lr=50.0,
        stages=[0.0, 1.0, 0.0],
        freeze_steps=0,
        max_steps=12,
        eval_every=2,
        patience=3,
        checkpoint_every=100,
        keep_checkpoints=1,
        run_dir=str(tmp_path / "rise"),
    )
    result = finetune(config)
    history = result["dev_history"]
    best_step, best_cer = min(history, key=lambda h: (h[1], h[0]))
    assert result["step"] == best_step and result["dev_cer"] == pytest.approx(best_cer)
    assert result["steps_trained"] <= config.max_steps


def test_text_overlap_and_oov_rate() -> None:
    heldout = {"h1": "the cat sat", "h2": "a dog ran"}
    assert text_overlap(heldout, {"t1": "THE CAT  SAT", "t2": "the dog"}, {"d1": "a dog ran!"}) == 2
    assert text_overlap(heldout, {"t1": "the cat"}) == 0
    assert oov_rate(heldout, ["the cat", "a dog"]) == pytest.approx(2 / 6)
    assert oov_rate({}, ["x"]) is None


class SlowDev(FineTuning):
    """A dev evaluation that, but for the run's last, waits until a training step has finished and
    the next started while it runs, then keeps the weights it scores; ``events``: steps and
    evaluations in the order they began."""

    def score_dev(self, model):  # type: ignore[no-untyped-def]
        count = len(self.scored)
        self.events.append(("evaluation", count, "start"))
        steps = sum(event[0] == "step" for event in self.events)
        deadline = time.monotonic() + 60
        while count < self.evaluations - 1 and sum(e[0] == "step" for e in self.events) < steps + 2:
            assert time.monotonic() < deadline, f"no training step while evaluation {count} ran"
            time.sleep(0.01)
        self.scored.append({name: tensor.clone() for name, tensor in model.state_dict().items()})
        scored = super().score_dev(model)
        self.events.append(("evaluation", count, "end"))
        return scored


def test_eval_off_critical_path_trains_on_and_selects_as_a_synchronous_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dev CER of each checkpoint is scored on a snapshot of its weights in the background: the
    next steps train meanwhile, the kept weights are the snapshot that scored best, and the result
    is a synchronous evaluation's (same history, selected step, scores and final weights), also
    after a preemption that left an evaluation owed."""
    config = replace(
        with_dev_speaker(labelled_run(tmp_path), tmp_path),
        lr=5e-3,
        freeze_steps=0,
        max_steps=9,
        eval_every=3,
        patience=100,
        checkpoint_every=100,
        keep_checkpoints=10,
        log_every=3,
    )
    events: list[tuple] = []
    real = CtcTraining.__call__

    def step(self, model, batch, step, micro):  # type: ignore[no-untyped-def]
        events.append(("step", step + 1))
        return real(self, model, batch, step, micro)

    monkeypatch.setattr(CtcTraining, "__call__", step)
    results = {}
    for name, background in (("background", True), ("synchronous", False)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        kind = type(name, (SlowDev,), {"background_evaluation": background, "evaluations": 3 if background else 0})
        run = kind(CPU, replace(config, run_dir=str(run_dir)))
        run.scored, run.events = [], events if background else []
        results[name] = run.run()
        if background:
            slow = run
    background, synchronous = results["background"], results["synchronous"]
    for count in range(2):  # a step started while each evaluation but the last ran
        start, end = events.index(("evaluation", count, "start")), events.index(("evaluation", count, "end"))
        assert any(event[0] == "step" for event in events[start:end]), events
    history = background["dev_history"]
    assert [step for step, _ in history] == [3, 6, 9] and len(slow.scored) == 3
    best = min(range(3), key=lambda i: (history[i][1], i))
    final = load_checkpoint(RunFiles(tmp_path / "background").final)
    assert final["step"] == history[best][0] == background["step"]
    assert all(torch.equal(final["model"][k], slow.scored[best][k]) for k in final["model"])
    for i, (step, _) in enumerate(history):  # each snapshot is its step's weights
        weights = load_checkpoint(RunFiles(tmp_path / "background").checkpoint(step))["model"]
        assert all(torch.equal(weights[k], slow.scored[i][k]) for k in weights)
    same = ("dev_history", "step", "steps_trained", "dev_cer", "heldout_cer", "scores", "checkpoint_sha256")
    assert {k: background[k] for k in same} == {k: synchronous[k] for k in same}
    # preempted at step 6, whose evaluation was then owed: the resumed run scores it first, and ends as the others
    resumed = replace(config, run_dir=str(tmp_path / "resumed"))
    monkeypatch.setenv(FAULTS_ENV, fault("train.step", "preempt", step=6))
    assert finetune(resumed) is None
    monkeypatch.delenv(FAULTS_ENV)
    assert load_checkpoint(RunFiles(resumed.run_dir).checkpoint(6))["selection"]["history"] == history[:1]
    again = finetune(resumed)
    assert again is not None and again["resumed_from_step"] == 6
    assert {k: again[k] for k in same} == {k: background[k] for k in same}
