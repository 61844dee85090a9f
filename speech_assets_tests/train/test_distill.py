"""Distillation: the layer-prediction loss (a pure function), the student's shape, speed, and runs on
the training engine (exact resume, bf16 autocast on the CPU, no host read in a step)."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from speech_assets.model.hubert import HubertPretrainModel, padding_mask
from speech_assets.model.presets import get_preset
from speech_assets.model.speed import forward_speed
from speech_assets.runtime.faults import FAULTS_ENV, fault
from speech_assets.train.checkpoint import list_checkpoints, load_checkpoint
from speech_assets.train.distill import (
    Distillation,
    DistillConfig,
    LayerPredictor,
    build_student,
    default_teacher_layers,
    distill,
    encoder_parameters,
    layer_prediction_loss,
    teacher_targets,
)
from speech_assets.train.trainer import train
from speech_assets_tests.support.training_data import SyntheticCorpus
from speech_assets_tests.train.test_sync_census import CPU, _census


def test_loss_is_l1_minus_log_sigmoid_cosine_over_valid_frames() -> None:
    generator = torch.Generator().manual_seed(0)
    predictions = torch.randn(2, 3, 5, 4, generator=generator)  # (B, H, L, D)
    targets = torch.randn(2, 3, 5, 4, generator=generator)
    padding = padding_mask(torch.tensor([5, 2]), 5)
    loss, parts = layer_prediction_loss(predictions, targets, padding, cosine_weight=0.5)
    assert loss.shape == () and parts["l1"].shape == parts["cosine"].shape == (3,)
    # by hand, over the 7 valid frames
    valid = ~padding
    expected = 0.0
    for head in range(3):
        p, t = predictions[:, head][valid], targets[:, head][valid]  # (7, 4)
        cos = F.cosine_similarity(p, t, dim=-1)
        expected += (p - t).abs().mean() - 0.5 * F.logsigmoid(cos).mean()
        assert parts["cosine"][head] == pytest.approx(float(cos.mean()), abs=1e-6)
    assert float(loss) == pytest.approx(float(expected), abs=1e-5)
    # padded frames do not count; a perfect prediction costs only -log sigmoid(1) per head
    garbage = predictions.clone()
    garbage[1, :, 2:] = 1e6
    assert float(layer_prediction_loss(garbage, targets, padding, 0.5)[0]) == pytest.approx(float(loss), abs=1e-4)
    perfect, _ = layer_prediction_loss(targets, targets, padding)
    assert float(perfect) == pytest.approx(-3 * float(F.logsigmoid(torch.tensor(1.0))), abs=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        layer_prediction_loss(predictions, targets[:, :2], padding)


def test_loss_gradient_moves_predictions_towards_targets() -> None:
    torch.manual_seed(0)
    targets = torch.randn(1, 2, 6, 8)
    predictions = (0.1 * torch.randn(1, 2, 6, 8)).requires_grad_()
    padding = torch.zeros(1, 6, dtype=torch.bool)
    optimizer = torch.optim.Adam([predictions], lr=0.05)
    first = None
    for _ in range(200):
        loss, _ = layer_prediction_loss(predictions, targets, padding)
        first = first if first is not None else float(loss.detach())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    floor = -2 * float(F.logsigmoid(torch.tensor(1.0)))  # two heads, perfect predictions
    assert float(loss.detach()) - floor < 0.3 * (first - floor)


def test_student_predicts_every_chosen_teacher_layer() -> None:
    assert default_teacher_layers(12) == [4, 8, 12] and default_teacher_layers(4) == [1, 3, 4]
    torch.manual_seed(0)
    teacher = HubertPretrainModel(get_preset("tiny"), {"c": 5}).eval()
    config = DistillConfig(
        run_dir="unused", teacher="unused", shards=["x"], cmvn="x", clients={}, dim=32, layers=2, heads=4, ffn_dim=64
    )
    student = build_student(config, teacher, [1, 3, 4])
    assert student.clients == ["layer_01", "layer_03", "layer_04"] and student.preset.dim == 32
    feats, lengths = torch.randn(2, 41, 80), torch.tensor([41, 30])
    predictions, padding = LayerPredictor(student)(feats, lengths)
    targets = teacher_targets(teacher, feats, lengths, [1, 3, 4])
    assert predictions.shape == targets.shape == (2, 3, 21, 128) and padding.shape == (2, 21)
    assert not targets.requires_grad
    assert encoder_parameters(student) < encoder_parameters(teacher)
    # a quarter of the width, half the depth: on the same 4 x 3 s utterances, best of 5 rounds
    # each, the student encodes 2.7-4.5x the teacher's audio per second (measured on a loaded
    # 2-core machine), so it must at least be faster
    rng = np.random.default_rng(0)
    feats_np = [rng.random((300, 80), dtype=np.float32) for _ in range(4)]
    speeds = forward_speed({"teacher": teacher, "student": student}, feats_np, repeats=5)
    assert set(speeds) == {"teacher", "student"} and speeds["student"] > speeds["teacher"] > 0


@pytest.fixture(scope="module")
def teacher(small_corpus: SyntheticCorpus, tmp_path_factory: pytest.TempPathFactory) -> str:
    result = train(small_corpus.config(tmp_path_factory.mktemp("teacher") / "run", max_steps=2, log_every=1))
    assert result is not None
    return result["checkpoint"]


def _config(corpus: SyntheticCorpus, teacher: str, run_dir: Path, **overrides: object) -> DistillConfig:
    values = {
        "max_steps": 6,
        "checkpoint_every": 4,
        "log_every": 2,
        "batch_seconds": 8.0,
        "grad_accum": 2,
        "warmup_steps": 2,
        "precision": "fp32",
        "device": "cpu",
        "threads": 1,
        "dim": 32,
        "layers": 1,
        "heads": 2,
        "ffn_dim": 64,
        "max_frames": 200,
    }
    values.update(overrides)
    return DistillConfig(
        run_dir=str(run_dir), teacher=teacher, shards=corpus.shards, cmvn=corpus.cmvn, clients=corpus.clients, **values
    )  # type: ignore[arg-type]


def test_a_stopped_distillation_resumes_to_the_same_weights(
    small_corpus: SyntheticCorpus, teacher: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight = distill(_config(small_corpus, teacher, tmp_path / "straight"))
    interrupted = _config(small_corpus, teacher, tmp_path / "resumed")
    monkeypatch.setenv(FAULTS_ENV, fault("train.step", "preempt", step=3))  # preempted there
    assert distill(interrupted) is None
    monkeypatch.delenv(FAULTS_ENV)
    assert not (tmp_path / "resumed" / "final.pt").exists()
    assert [step for step, _ in list_checkpoints(tmp_path / "resumed")] == [3]
    resumed = distill(interrupted)
    assert straight is not None and resumed is not None
    assert resumed["resumed_from_step"] == 3 and straight["resumed_from_step"] is None
    assert resumed["step"] == straight["step"] == 6
    a = load_checkpoint(tmp_path / "straight" / "final.pt")
    b = load_checkpoint(tmp_path / "resumed" / "final.pt")
    assert a["kind"] == "distilled" and a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert (
        straight["checkpoint_sha256"] == resumed["checkpoint_sha256"]
        and straight["final_loss"] == resumed["final_loss"]
    )
    # another student cannot continue this run
    with pytest.raises(ValueError, match="another model"):
        distill(_config(small_corpus, teacher, tmp_path / "resumed", dim=16, max_steps=8))


def test_distillation_trains_in_bf16_on_the_cpu(small_corpus: SyntheticCorpus, teacher: str, tmp_path: Path) -> None:
    result = distill(_config(small_corpus, teacher, tmp_path / "bf16", precision="bf16", max_steps=2, grad_accum=1))
    assert result is not None and result["precision"] == "bf16" and np.isfinite(result["final_loss"])
    weights = load_checkpoint(result["checkpoint"])["model"]
    assert all(t.dtype == torch.float32 for t in weights.values() if t.is_floating_point())  # fp32 master weights


def test_distill_sync_census_of_steps(small_corpus: SyntheticCorpus, teacher: str, tmp_path: Path) -> None:
    """Steps 3-4 (two micro-batches each, one loader worker, as on a GPU) after two of warm-up: neither
    the teacher's targets, the student nor the loss read a tensor's value on the host (the student
    is told from host data whether its batch is padded) outside the metrics window."""
    config = _config(small_corpus, teacher, tmp_path / "census", max_steps=4, checkpoint_every=100, num_workers=1)
    (tmp_path / "census").mkdir()  # the worker context makes it in a real run
    run = Distillation(config, CPU)
    run.engine.run(run.objective, run.stream, replace(config, max_steps=2))
    _, syncs = _census(run, config)
    assert run.step == 4
    assert not syncs, f"host reads in distillation steps 3-4: {dict(syncs)}"
