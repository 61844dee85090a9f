"""The analytic training FLOPs of a preset against torch's FLOP counter."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.model.presets import get_preset

KS = {"a": 100, "b": 300}


def cpu_attention(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def cpu_attention_backward(grad_out, query, key, value, *args, **kwargs) -> int:
    # Model FLOPs, as MFU counts them: twice the forward. sdpa_backward_flop_count also counts
    # the flash kernels' recomputation of the attention scores.
    return 2 * sdpa_flop_count(query, key, value)


# The CPU kernels of scaled_dot_product_attention are not in the counter's registry.
CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_attention_backward,
}


def grouped_weight_gradient_overcount(preset, frames: int) -> float:
    """What FlopCounterMode adds to the positional convolution's weight gradient: it counts it as
    an ungrouped convolution, ``groups`` times the real work."""
    d, groups = preset.dim, preset.pos_groups
    return 2 * d * d * preset.pos_kernel * frames * (groups - 1) / groups


def padded_head_overcount(preset, frames_per_client: int) -> float:
    """The heads run as one product padded to the largest ``k`` (forward and twice backward): the
    padded classes are no model FLOPs, which the analytic count leaves out."""
    k_max = max(KS.values())
    return 3 * 2 * preset.dim * sum(k_max - k for k in KS.values()) * frames_per_client


# base's shape with two layers (the cost per layer does not depend on how many there are).
@pytest.mark.parametrize("name", ["tiny", "base"])
def test_analytic_flops_match_the_flop_counter(name: str) -> None:
    preset = dataclasses.replace(get_preset(name), dropout=0.0, layers=2)
    torch.manual_seed(0)
    model = HubertPretrainModel(preset, KS)
    batch, time = 2, 400  # equal lengths: every frame is a useful frame
    feats, lengths, clients = torch.randn(batch, time, 80), torch.full((batch,), time), torch.tensor([0, 1])
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        output = model(feats, lengths, clients)
        output.logits.clamp(min=-1e4).mean().backward()  # the padded classes are -inf
    frames = batch * time // 2
    counted = counter.get_total_flops() - grouped_weight_gradient_overcount(preset, frames)
    counted -= padded_head_overcount(preset, time // 2)
    analytic = preset.train_flops_per_frame(time // 2, list(KS.values())) * frames
    assert counted == pytest.approx(analytic, rel=0.01)
