import pytest
import torch

from speech_assets.model import span_mask


def test_masked_fraction_matches_hubert_defaults() -> None:
    lengths = torch.full((400,), 500)
    mask = span_mask(lengths, 0.08, 10, torch.Generator().manual_seed(0))
    # Starts at rate p, spans of 10, overlaps allowed: P(frame masked) ~ 1 - (1 - p)^10 ~ 0.566.
    assert mask.float().mean().item() == pytest.approx(1 - 0.92**10, abs=0.02)
    starts = (mask[:, 1:] & ~mask[:, :-1]).sum() + mask[:, 0].sum()
    assert starts.item() <= 0.08 * 500 * 400 + 400  # runs merge, never more runs than starts


def test_mask_never_covers_padding_and_every_sequence_gets_a_span() -> None:
    lengths = torch.tensor([0, 3, 10, 11, 57, 200])
    mask = span_mask(lengths, 0.08, 10, torch.Generator().manual_seed(1))
    assert mask.shape == (6, 200)
    for row, length in enumerate(lengths.tolist()):
        assert not mask[row, length:].any()
        assert mask[row, :length].any() == (length > 0)
    assert mask[1, :3].all()  # shorter than a span: the span shrinks to the sequence


def test_masks_are_reproducible_from_the_generator() -> None:
    lengths = torch.tensor([90, 140])
    first = span_mask(lengths, 0.08, 10, torch.Generator().manual_seed(7))
    second = span_mask(lengths, 0.08, 10, torch.Generator().manual_seed(7))
    other = span_mask(lengths, 0.08, 10, torch.Generator().manual_seed(8))
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        span_mask(torch.tensor([10]), 1.5, 10, torch.Generator())
    with pytest.raises(ValueError):
        span_mask(torch.tensor([10]), 0.08, 0, torch.Generator())
