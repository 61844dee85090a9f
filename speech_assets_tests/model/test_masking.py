import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speech_assets.features.featurize import FeatureExtractor
from speech_assets.features.shards import HOP_LENGTH, WIN_LENGTH
from speech_assets.model.hubert import ConvSubsampler, output_lengths
from speech_assets.model.masking import conv_geometry, label_radius, leak_free, pipeline_label_radius, span_mask
from speech_assets.targets.kmeans import to_model_rate


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


# --- leak-free frames --------------------------------------------------------------------------


def _row(length: int, *spans: tuple[int, int]) -> torch.Tensor:
    """``(1, length)`` bool mask with ``[start, stop)`` spans set."""
    mask = torch.zeros(1, length, dtype=torch.bool)
    for start, stop in spans:
        mask[0, start:stop] = True
    return mask


R = 3


@pytest.mark.parametrize(
    ("mask", "radius", "expected"),
    [
        (_row(30, (10, 10 + 2 * R + 1)), R, [10 + R]),  # exactly 2R + 1: its centre only
        (_row(30, (10, 10 + 2 * R)), R, []),  # one shorter: none
        (_row(30, (10, 22)), R, list(range(13, 19))),  # longer: all but R at each end
        (_row(30, (0, 2 * R)), R, []),  # at the start, outside counts as unmasked
        (_row(30, (0, 2 * R + 1)), R, [R]),
        (_row(30, (30 - 2 * R - 1, 30)), R, [30 - R - 1]),  # at the end
        (_row(30, (0, 30)), R, list(range(R, 30 - R))),  # all masked: edges still not
        (_row(30, (5, 10), (11, 20)), R, [14, 15, 16]),  # one unmasked frame splits the windows
        (_row(30, (5, 10), (10, 20)), R, list(range(8, 17))),  # adjacent spans merge
        (_row(5, (0, 5)), R, []),  # shorter than a window
        (_row(30, (4, 9), (20, 21)), 0, [4, 5, 6, 7, 8, 20]),  # radius 0: the mask itself
        (_row(30, (4, 9)), 1, [5, 6, 7]),  # radius 1: the old "interior" frames
    ],
)
def test_leak_free_frames(mask: torch.Tensor, radius: int, expected: list[int]) -> None:
    found = leak_free(mask, radius)
    assert found.shape == mask.shape and found.dtype == torch.bool
    assert torch.nonzero(found[0]).flatten().tolist() == expected


def test_leak_free_rows_are_independent_and_padding_counts_as_unmasked() -> None:
    lengths = torch.tensor([12, 20, 0])
    mask = torch.arange(20)[None, :] < lengths[:, None]  # every valid frame masked, padding not
    found = leak_free(mask, R)
    assert torch.nonzero(found[0]).flatten().tolist() == list(range(R, 12 - R))
    assert torch.nonzero(found[1]).flatten().tolist() == list(range(R, 20 - R))
    assert not found[2].any()
    drawn = span_mask(torch.tensor([90, 140, 37]), 0.08, 10, torch.Generator().manual_seed(3))
    assert torch.equal(leak_free(drawn, R), torch.cat([leak_free(row[None], R) for row in drawn]))
    assert not (leak_free(drawn, R) & ~drawn).any()
    assert leak_free(torch.zeros(0, 0, dtype=torch.bool), R).shape == (0, 0)


@pytest.mark.parametrize(
    ("mask", "radius"),
    [
        (torch.ones(10, dtype=torch.bool), R),  # not (B, L)
        (torch.ones(2, 10, dtype=torch.int64), R),  # not bool
        (torch.ones(2, 10, dtype=torch.bool), -1),
    ],
)
def test_leak_free_rejects_bad_arguments(mask: torch.Tensor, radius: int) -> None:
    with pytest.raises(ValueError):
        leak_free(mask, radius)


# --- the radius: derived, then measured --------------------------------------------------------

PIPELINE = {"win_length": 400, "hop_length": 160, "delta_window": 5, "delta_orders": 2}


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        (PIPELINE | {"kernel": 2, "stride": 2}, 3),  # this package: K = 4 + 2 = 6 log-mel frames
        (PIPELINE | {"kernel": 7, "stride": 2, "padding": 3}, 4),  # overlapping kernels see further
        (PIPELINE | {"delta_orders": 0, "kernel": 2, "stride": 2}, 1),  # no deltas: overlap only
        (PIPELINE | {"delta_orders": 0, "win_length": 160, "kernel": 2, "stride": 2}, 0),  # nothing shared
        (PIPELINE | {"kernel": 1, "stride": 1}, 6),  # a 100 Hz model
    ],
)
def test_label_radius_formula(recipe: dict[str, int], expected: int) -> None:
    assert label_radius(**recipe) == expected


@pytest.mark.parametrize("bad", [{"hop_length": 0}, {"delta_window": 1}, {"stride": 0}, {"padding": -1}])
def test_label_radius_rejects_bad_arguments(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        label_radius(**(PIPELINE | {"kernel": 2, "stride": 2} | bad))


def test_pipeline_radius_reads_the_code() -> None:
    assert pipeline_label_radius() == 3
    assert conv_geometry(ConvSubsampler(80, 8, 8, 0.0)) == (2, 2, 0)
    assert conv_geometry(OverlappingFrontend()) == (7, 2, 3)
    # labels sit on every stride-th 100 Hz frame, one per output frame
    assert to_model_rate(np.arange(9)).tolist() == [0, 2, 4, 6, 8]


class OverlappingFrontend(nn.Module):
    """Kernel 3 stride 2 then kernel 3 stride 1 (padded): output ``m`` sees frames ``2m-3 .. 2m+3``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(80, 8, kernel_size=3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(8, 8, kernel_size=3, stride=1, padding=1)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.pad(feats.transpose(1, 2), (0, 1))  # as ConvSubsampler: (T + 1) // 2 outputs
        return torch.relu(self.conv2(torch.relu(self.conv1(x)))).transpose(1, 2), output_lengths(lengths)


FRAMES = 48  # 100 Hz frames of the test waveform


@pytest.fixture(scope="module")
def audio_dependence() -> tuple[np.ndarray, np.ndarray]:
    """Perturb each block of ``gcd(win, hop)`` samples of a random waveform in turn:
    ``(blocks, T)`` bool for log-mel and for MFCC frames that change."""
    block = math.gcd(WIN_LENGTH, HOP_LENGTH)  # frames start and end on block boundaries
    samples = WIN_LENGTH + (FRAMES - 1) * HOP_LENGTH
    rng = np.random.default_rng(0)
    wave = (0.1 * rng.standard_normal(samples)).astype(np.float32)
    extract = FeatureExtractor()
    logmel, mfcc = (a.copy() for a in extract(wave))
    assert logmel.shape[0] == FRAMES
    blocks = samples // block
    logmel_dep, mfcc_dep = np.zeros((blocks, FRAMES), bool), np.zeros((blocks, FRAMES), bool)
    for b in range(blocks):
        moved = wave.copy()
        moved[b * block : (b + 1) * block] += (0.3 * rng.standard_normal(block)).astype(np.float32)
        new_logmel, new_mfcc = extract(moved)
        logmel_dep[b] = np.abs(new_logmel - logmel).max(axis=1) > 1e-4
        mfcc_dep[b] = np.abs(new_mfcc - mfcc).max(axis=1) > 1e-4
    return logmel_dep, mfcc_dep


def frontend_dependence(frontend: nn.Module) -> np.ndarray:
    """``(T, L)`` bool: perturbing log-mel frame ``t`` changes frontend output ``m``."""
    feats = torch.randn(1, FRAMES, 80, generator=torch.Generator().manual_seed(1))
    batch = feats.repeat(FRAMES + 1, 1, 1)
    rows = torch.arange(FRAMES)
    batch[rows + 1, rows] += 10 * torch.randn(FRAMES, 80, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out, _ = frontend.eval()(batch, torch.full((FRAMES + 1,), FRAMES))
    return ((out[1:] - out[:1]).abs().amax(dim=-1) > 1e-6).numpy()


@pytest.mark.parametrize("make_frontend", [lambda: ConvSubsampler(80, 16, 16, 0.0), OverlappingFrontend])
def test_radius_is_exactly_how_far_a_label_reaches(audio_dependence, make_frontend) -> None:
    torch.manual_seed(0)
    frontend = make_frontend()
    logmel_dep, mfcc_dep = audio_dependence
    front = frontend_dependence(frontend)
    labels = mfcc_dep[:, ::2]  # (blocks, L): label j is MFCC frame 2j
    # leaks[j, m]: some audio block feeds both label j and model frame m
    leaks = (labels.T.astype(int) @ logmel_dep.astype(int) @ front.astype(int)) > 0
    length = leaks.shape[0]
    reach = max(abs(m - j) for j, m in zip(*np.nonzero(leaks), strict=True))
    radius = pipeline_label_radius(frontend)
    assert reach == radius  # a smaller R would leave a visible frame that shares the label's audio
    # leak_free(mask, R) at j (away from the edges) iff every frame that shares j's audio is masked
    for seed in range(20):
        mask = span_mask(torch.tensor([length]), 0.08, 10, torch.Generator().manual_seed(seed))
        found = leak_free(mask, radius)[0]
        for j in range(radius, length - radius):
            hidden = bool(mask[0, torch.from_numpy(np.nonzero(leaks[j])[0])].all())
            assert bool(found[j]) == hidden, (seed, j)
