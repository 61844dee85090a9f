import pytest
import torch
import torch.nn.functional as F

from speech_assets.model.hubert import ClientLogits
from speech_assets.model.loss import IGNORE_INDEX, masked_prediction_loss, summarize


def _case() -> tuple[list[ClientLogits], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    logits = [
        ClientLogits(0, torch.tensor([0, 2]), torch.randn(2, 6, 4, requires_grad=True)),
        ClientLogits(1, torch.tensor([1]), torch.randn(1, 6, 3, requires_grad=True)),
    ]
    targets = torch.tensor(
        [[0, 1, 2, 3, 0, IGNORE_INDEX], [2, 1, 0, 2, 1, 0], [3, 3, 1, 0, IGNORE_INDEX, IGNORE_INDEX]]
    )
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 1, 1, 0, 0, 0], [1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    return logits, targets, mask


def _manual(logits: list[ClientLogits], targets: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    losses = []
    for group in logits:
        t, s = targets[group.rows], select[group.rows] & (targets[group.rows] != IGNORE_INDEX)
        losses.append(F.cross_entropy(group.logits[s], t[s], reduction="none"))
    return torch.cat(losses).mean()


def test_loss_is_the_mean_cross_entropy_over_masked_frames_only() -> None:
    logits, targets, mask = _case()
    out = masked_prediction_loss(logits, targets, mask)
    torch.testing.assert_close(out.loss, _manual(logits, targets, mask))
    out.loss.backward()
    for group in logits:
        unmasked = ~mask[group.rows] | (targets[group.rows] == IGNORE_INDEX)
        assert torch.all(group.logits.grad[unmasked] == 0)
        assert torch.any(group.logits.grad[~unmasked] != 0)
    stats = summarize(out.stats)
    assert stats["masked_frames"] == 7 and stats["unmasked_frames"] == 8


def test_unmasked_weight_adds_the_unmasked_mean() -> None:
    logits, targets, mask = _case()
    out = masked_prediction_loss(logits, targets, mask, unmasked_weight=0.5)
    expected = _manual(logits, targets, mask) + 0.5 * _manual(logits, targets, ~mask)
    torch.testing.assert_close(out.loss, expected)


def test_accuracy_counts() -> None:
    logits, targets, mask = _case()
    for group in logits:  # make every prediction right
        with torch.no_grad():
            t = targets[group.rows].clamp(min=0)
            group.logits.copy_(F.one_hot(t, group.logits.shape[-1]).float() * 10)
    stats = summarize(masked_prediction_loss(logits, targets, mask).stats)
    assert stats["masked_accuracy"] == 1.0 and stats["unmasked_accuracy"] == 1.0
    assert stats["masked_loss"] < 1e-3


def test_shape_mismatch_is_an_error() -> None:
    logits, targets, mask = _case()
    with pytest.raises(ValueError):
        masked_prediction_loss(logits, targets, mask[:, :5])
