"""Distillation pieces: the layer-prediction loss (a pure function), the student's shape, speed."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from speech_assets.evaluation.distill import (
    DistillConfig,
    LayerPredictor,
    build_student,
    default_teacher_layers,
    encoder_parameters,
    layer_prediction_loss,
    teacher_targets,
)
from speech_assets.evaluation.speed import forward_speed
from speech_assets.model import HubertPretrainModel, get_preset
from speech_assets.model.hubert import padding_mask


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
    feats_np = [np.random.default_rng(0).random((120, 80), dtype=np.float32)] * 2
    speeds = forward_speed({"teacher": teacher, "student": student}, feats_np, repeats=1)
    assert set(speeds) == {"teacher", "student"} and min(speeds.values()) > 0
