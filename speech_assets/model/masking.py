"""HuBERT span masking (random starts, fixed-length spans, overlaps allowed: about 57 % of frames
at ``p = 0.08``, ``l = 10``), and which masked frames are *leak-free* (:func:`leak_free`): their
label's whole receptive field in the audio is hidden from the model."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn


def span_mask(
    lengths: torch.Tensor,
    mask_prob: float,
    mask_length: int,
    generator: torch.Generator,
    min_spans: int = 1,
) -> torch.Tensor:
    """``(B, max(lengths))`` bool span mask for 50 Hz ``lengths (B,)``, never ``True`` on padding: each
    row gets ``floor(mask_prob * L + u)``, ``u ~ U[0, 1)``, distinct span starts (at least ``min_spans``)."""
    if not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"mask_prob must be in [0, 1], got {mask_prob}")
    if mask_length < 1:
        raise ValueError(f"mask_length must be >= 1, got {mask_length}")
    lengths_list = [int(n) for n in lengths.tolist()]
    mask = torch.zeros(len(lengths_list), max(lengths_list, default=0), dtype=torch.bool)
    for row, length in enumerate(lengths_list):
        if length == 0:
            continue
        span = min(mask_length, length)
        candidates = length - span + 1
        draw = float(torch.rand((), generator=generator))
        num_spans = min(max(int(mask_prob * length + draw), min_spans), candidates)
        if num_spans == 0:
            continue
        starts = torch.randperm(candidates, generator=generator)[:num_spans]
        mask[row, (starts[:, None] + torch.arange(span)).reshape(-1)] = True
    return mask


def leak_free(mask: torch.Tensor, radius: int) -> torch.Tensor:
    """``(B, L)`` bool: masked frames whose whole window ``[j - radius, j + radius]`` is masked
    (positions outside ``[0, L)`` and padding count as unmasked)."""
    if mask.ndim != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask must be (B, L) bool, got {tuple(mask.shape)} {mask.dtype}")
    if radius < 0:
        raise ValueError(f"radius must be >= 0, got {radius}")
    # Masked frames in each window from a running count: counts[:, i] = masked among the first i
    # padded positions, so window j (padded positions j .. j + 2R) holds counts[j + 2R + 1] - counts[j].
    counts = F.pad(F.pad(mask.to(torch.int32), (radius, radius)).cumsum(dim=-1), (1, 0))
    width = 2 * radius + 1
    return (counts[:, width:] - counts[:, : mask.shape[1]]) == width


def conv_geometry(frontend: nn.Module) -> tuple[int, int, int]:
    """``(kernel, stride, padding)`` in input frames of ``frontend``'s ``Conv1d`` layers composed in
    registration order (assumes nothing else mixes frames, true of ``ConvSubsampler``)."""
    kernel, stride, padding = 1, 1, 0
    for layer in frontend.modules():
        if isinstance(layer, nn.Conv1d):
            if layer.dilation[0] != 1 or not isinstance(layer.padding, tuple):
                raise ValueError(f"unsupported convolution {layer}")
            kernel += (layer.kernel_size[0] - 1) * stride
            padding += layer.padding[0] * stride
            stride *= layer.stride[0]
    return kernel, stride, padding


def label_radius(
    *,
    win_length: int,
    hop_length: int,
    delta_window: int,
    delta_orders: int,
    kernel: int,
    stride: int,
    padding: int = 0,
) -> int:
    """Radius ``R`` in 50 Hz frames such that label ``j``'s receptive field lies inside masked model
    frames iff ``mask[j - R .. j + R]`` are all masked (:func:`leak_free`).

    Label ``j`` is MFCC frame ``c = stride * j``, whose chained deltas reach ``n * delta_orders``
    frames either side (``n = (delta_window - 1) // 2``); frames ``|t - c| <= (win - 1) // hop``
    share samples with it, so the label's audio spans log-mel frames ``|t - c| <= K``, ``K = n *
    delta_orders + (win - 1) // hop``; model frame ``m`` sees log-mel frames ``[stride * m -
    padding, stride * m - padding + kernel - 1]``. For this pipeline ``K = 6`` and ``R = 3``
    (CMVN's corpus-level sums are not local, so not counted).
    """
    if min(win_length, hop_length, kernel, stride) < 1 or delta_window < 3 or delta_orders < 0 or padding < 0:
        raise ValueError("window, hop, kernel and stride must be >= 1, delta window >= 3, orders and padding >= 0")
    reach = (delta_window - 1) // 2 * delta_orders + (win_length - 1) // hop_length
    return max((reach + kernel - 1 - padding) // stride, (reach + padding) // stride)


def pipeline_label_radius(frontend: nn.Module | None = None) -> int:
    """:func:`label_radius` of this package's features and ``frontend`` (default ``ConvSubsampler``): 3."""
    from speech_assets.features.featurize import compute_deltas
    from speech_assets.features.shards import HOP_LENGTH, MFCC_DIM, N_MFCC, WIN_LENGTH
    from speech_assets.model.hubert import ConvSubsampler

    if frontend is None:
        frontend = ConvSubsampler(1, 1, 1, 0.0)
    kernel, stride, padding = conv_geometry(frontend)
    return label_radius(
        win_length=WIN_LENGTH,
        hop_length=HOP_LENGTH,
        # the extractor calls compute_deltas with its default window; MFCC rows are [c, Δc, ΔΔc]
        delta_window=inspect.signature(compute_deltas).parameters["win_length"].default,
        delta_orders=MFCC_DIM // N_MFCC - 1,
        kernel=kernel,
        stride=stride,
        padding=padding,
    )
