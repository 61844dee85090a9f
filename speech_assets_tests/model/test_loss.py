import pytest
import torch
import torch.nn.functional as F

from speech_assets.model.loss import IGNORE_INDEX, masked_prediction_loss, summarize

KS = torch.tensor([4, 3, 4])  # rows 0 and 2: a client with k = 4; row 1: k = 3 (its logits -inf past 3)


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 4)
    logits[1, :, 3] = -torch.inf
    targets = torch.tensor(
        [[0, 1, 2, 3, 0, IGNORE_INDEX], [2, 1, 0, 2, 1, 0], [3, 3, 1, 0, IGNORE_INDEX, IGNORE_INDEX]]
    )
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 1, 1, 0, 0, 0], [1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    return logits.requires_grad_(), targets, mask


def _manual(logits: torch.Tensor, targets: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    losses = []
    for row, k in enumerate(KS.tolist()):
        s = select[row] & (targets[row] != IGNORE_INDEX)
        losses.append(F.cross_entropy(logits[row, :, :k][s], targets[row][s], reduction="none"))
    return torch.cat(losses).mean()


def test_loss_is_the_mean_cross_entropy_over_masked_frames_only() -> None:
    logits, targets, mask = _case()
    out = masked_prediction_loss(logits, targets, mask)
    torch.testing.assert_close(out.loss, _manual(logits, targets, mask))
    out.loss.backward()
    unmasked = ~mask | (targets == IGNORE_INDEX)
    assert torch.all(logits.grad[unmasked] == 0) and torch.all(logits.grad[1, :, 3] == 0)
    assert torch.all(logits.grad[~unmasked].abs().sum(-1) != 0)
    stats = summarize(out.stats)
    assert stats["masked_frames"] == 7 and stats["unmasked_frames"] == 8


def test_unmasked_weight_adds_the_unmasked_mean() -> None:
    logits, targets, mask = _case()
    out = masked_prediction_loss(logits, targets, mask, unmasked_weight=0.5)
    expected = _manual(logits, targets, mask) + 0.5 * _manual(logits, targets, ~mask)
    torch.testing.assert_close(out.loss, expected)


def test_accuracy_counts() -> None:
    logits, targets, mask = _case()
    with torch.no_grad():  # make every prediction right
        logits.copy_(F.one_hot(targets.clamp(min=0), 4).float() * 10)
    stats = summarize(masked_prediction_loss(logits, targets, mask).stats)
    assert stats["masked_accuracy"] == 1.0 and stats["unmasked_accuracy"] == 1.0
    assert stats["masked_loss"] < 1e-3


def test_shape_mismatch_is_an_error() -> None:
    logits, targets, mask = _case()
    with pytest.raises(ValueError):
        masked_prediction_loss(logits, targets, mask[:, :5])
