"""No masked output can see the 100 Hz frame its own label was computed from.

Labels are 50 Hz: label ``j`` is the k-means cluster of 100 Hz frame ``2j``. What each output
sees is measured by perturbing one input frame at a time and watching which outputs move,
through the whole model (subsampler, mask embedding, positional convolution, Transformer), not
by trusting a formula.
"""

import pytest
import torch
from torch import nn

from speech_assets.model.hubert import HubertPretrainModel, output_lengths, padding_mask
from speech_assets.model.masking import span_mask
from speech_assets.model.presets import get_preset

FRAMES = 101  # odd: the last output pairs a real frame with the appended zero frame


def influence(model: HubertPretrainModel, feats: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(T, L)`` bool: perturbing input frame ``t`` changes output ``j``'s hidden state."""
    frames = feats.shape[1]
    batch = feats.repeat(frames + 1, 1, 1)  # row 0 unperturbed, row t + 1 with frame t perturbed
    generator = torch.Generator().manual_seed(0)
    rows = torch.arange(frames)
    batch[rows + 1, rows] += 10 * torch.randn(frames, feats.shape[2], generator=generator)
    lengths = torch.full((frames + 1,), frames)
    with torch.no_grad():
        hidden = model.encode(batch, lengths, mask.expand(frames + 1, -1)).hidden
    return (hidden[1:] - hidden[:1]).abs().amax(dim=-1) > 1e-5


def label_leaks(seen: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """Masked outputs ``j`` whose hidden state depends on input frame ``2j`` (their label's frame)."""
    return [j for j in torch.nonzero(mask).flatten().tolist() if seen[2 * j, j]]


@pytest.fixture(scope="module")
def model() -> HubertPretrainModel:
    torch.manual_seed(0)
    return HubertPretrainModel(get_preset("tiny"), {"c": 8}).eval()


def _masks() -> list[torch.Tensor]:
    length = (FRAMES + 1) // 2
    handmade = torch.zeros(length, dtype=torch.bool)
    handmade[[0, 7, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 40, length - 1]] = (
        True  # isolated frames, a span, both ends
    )
    drawn = [span_mask(torch.tensor([length]), 0.08, 10, torch.Generator().manual_seed(s))[0] for s in range(3)]
    return [handmade, *drawn]


@pytest.mark.parametrize("mask", _masks())
def test_no_masked_output_sees_its_label_frame(model: HubertPretrainModel, mask: torch.Tensor) -> None:
    feats = torch.randn(1, FRAMES, 80, generator=torch.Generator().manual_seed(1))
    seen = influence(model, feats, mask[None])
    assert seen.any(dim=0).all(), "every output must depend on some input (the measurement works)"
    assert label_leaks(seen, mask) == []
    # Stronger: a masked output sees only frames that belong to unmasked outputs.
    owner = torch.arange(FRAMES) // 2
    for j in torch.nonzero(mask).flatten().tolist():
        assert not mask[owner[seen[:, j]]].any(), f"masked output {j} sees a masked output's frames"
    # Without the mask every output sees its own frames: masking is what hides them.
    unmasked = influence(model, feats, torch.zeros_like(mask)[None])
    assert all(unmasked[2 * j, j] for j in range(mask.shape[0]))


class OverlappingSubsampler(nn.Module):
    """The previous frontend (kernel 3 stride 2, then kernel 3 stride 1): outputs see about
    +-3 input frames, so the unmasked neighbour of a masked output sees its label's frame."""

    def __init__(self, channels: int, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(80, channels, kernel_size=3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3, stride=1, padding=1)
        self.projection = nn.Linear(channels, dim)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = feats.masked_fill(padding_mask(lengths, feats.shape[1])[..., None], 0.0)
        x = torch.relu(self.conv2(torch.relu(self.conv1(feats.transpose(1, 2)))))
        return self.projection(x.transpose(1, 2)), output_lengths(lengths)


def test_the_measurement_catches_an_overlapping_subsampler() -> None:
    torch.manual_seed(0)
    leaky = HubertPretrainModel(get_preset("tiny"), {"c": 8}).eval()
    leaky.frontend = OverlappingSubsampler(128, 128)
    feats = torch.randn(1, FRAMES, 80, generator=torch.Generator().manual_seed(1))
    mask = _masks()[0]
    leaks = label_leaks(influence(leaky, feats, mask[None]), mask)
    # isolated masked frames and the edges of the span leak; the span's interior does not
    assert {7, 20, 29, 40} <= set(leaks) and not set(leaks) & set(range(22, 28))
