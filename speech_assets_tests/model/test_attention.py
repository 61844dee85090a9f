"""The scaled-dot-product-attention encoder against nn.TransformerEncoder with the same weights."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from speech_assets.model.encoders import load_encoder
from speech_assets.model.hubert import HubertPretrainModel, SdpaEncoder, has_padding
from speech_assets.model.presets import get_preset
from speech_assets.train.checkpoint import save_checkpoint

KS = {"a": 7, "b": 5}
# base's width, heads and positional convolution with two layers: the parity of a layer does not
# depend on how many follow it, and twelve would only make the test slower
BASE_2 = dataclasses.replace(get_preset("base"), layers=2)


def pair(preset=None, **kwargs) -> tuple[HubertPretrainModel, HubertPretrainModel]:
    """The reference and the SDPA model built from the same seed (so with the same weights)."""
    preset = preset or get_preset("tiny")
    torch.manual_seed(0)
    reference = HubertPretrainModel(preset, KS, attention="reference", **kwargs)
    torch.manual_seed(0)
    new = HubertPretrainModel(preset, KS, **kwargs)
    # every parity test compares against torch's own Transformer, never the SDPA encoder with itself
    assert type(reference.encoder) is nn.TransformerEncoder and isinstance(new.encoder, SdpaEncoder)
    return reference, new


class SdpaCalls(TorchFunctionMode):
    """Records the dtype of q and the mask of every scaled_dot_product_attention call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.dtype, torch.Tensor | None]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append((args[0].dtype, kwargs.get("attn_mask")))
        return func(*args, **kwargs)


def test_attention_parity_reference_is_nn_transformer_encoder() -> None:
    """Kills the mutation "``attention='reference'`` builds the SDPA encoder too" (then every
    parity test compares the SDPA encoder with itself and passes): the reference is torch's own
    ``nn.TransformerEncoder`` of ``nn.TransformerEncoderLayer``s, and its forward runs through them."""
    reference, new = pair()
    assert type(reference.encoder) is nn.TransformerEncoder
    assert not isinstance(reference.encoder, SdpaEncoder) and not isinstance(new.encoder, nn.TransformerEncoder)
    layers = list(reference.encoder.layers)
    assert len(layers) == get_preset("tiny").layers
    assert all(type(layer) is nn.TransformerEncoderLayer for layer in layers)
    ran: list[int] = []
    hooks = [
        layer.register_forward_hook(lambda module, args, out, i=i: ran.append(i)) for i, layer in enumerate(layers)
    ]
    try:
        reference.eval()
        with torch.no_grad():
            reference.encode(torch.randn(2, 41, 80), torch.tensor([41, 30]))
    finally:
        for hook in hooks:
            hook.remove()
    assert ran == list(range(len(layers))), "the reference forward did not run through nn.TransformerEncoderLayer"


def test_attention_parity_same_parameters_and_initial_weights() -> None:
    reference, new = pair()
    assert isinstance(new.encoder, SdpaEncoder)
    ref_state, new_state = reference.state_dict(), new.state_dict()
    assert list(ref_state) == list(new_state)
    assert all(torch.equal(ref_state[key], new_state[key]) for key in ref_state)


@pytest.mark.parametrize("preset", [get_preset("tiny"), BASE_2], ids=["tiny", "base-2-layers"])
@pytest.mark.parametrize("mode", ["train", "eval", "eval-no-grad"])
def test_attention_parity_outputs_and_gradients(preset, mode: str) -> None:
    # dropout off in train mode (tiny has none; base's would draw different numbers)
    preset = dataclasses.replace(preset, dropout=0.0)
    reference, new = pair(preset)
    feats = torch.randn(3, 161, 80, generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([161, 120, 33])
    mask = torch.zeros(3, 81, dtype=torch.bool)
    mask[:, 10:20] = True
    for model in (reference, new):
        model.train(mode == "train")
    with torch.set_grad_enabled(mode != "eval-no-grad"):
        outs = [model.encode(feats, lengths, mask).hidden for model in (reference, new)]
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5
    if mode == "train":
        grads = []
        for model, out in zip((reference, new), outs, strict=True):
            out.square().mean().backward()
            grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys() and grads[0]
        for name in grads[0]:
            assert (grads[0][name] - grads[1][name]).abs().max().item() <= 1e-5, name


def test_attention_parity_padding_invariance_and_mask_only_where_padding_remains() -> None:
    _, model = pair()
    model.eval()
    short, long = torch.randn(1, 37, 80), torch.randn(1, 120, 80)
    batch = torch.full((2, 120, 80), 100.0)  # garbage in the padding must be ignored
    batch[0, :37], batch[1] = short[0], long[0]
    with SdpaCalls() as padded:
        together = model.encode(batch, torch.tensor([37, 120])).hidden
    with SdpaCalls() as alone:
        hidden = model.encode(short, torch.tensor([37])).hidden
    torch.testing.assert_close(together[0, :19], hidden[0], rtol=1e-5, atol=1e-5)
    # a boolean key mask where padding remains, none at all (flash/cuDNN-eligible) where it does not
    assert padded.calls and all(m is not None and m.dtype == torch.bool for _, m in padded.calls)
    assert alone.calls and all(m is None for _, m in alone.calls)
    # lengths on a device cannot be read without a sync: the mask stays, as if padded
    assert has_padding(torch.tensor([37], device="meta"), 37)
    assert not has_padding(torch.tensor([37]), 37) and has_padding(torch.tensor([37, 35]), 37)


def test_attention_parity_bf16_under_autocast_with_no_float_mask() -> None:
    _, model = pair()
    feats, lengths = torch.randn(2, 90, 80), torch.tensor([90, 61])
    with SdpaCalls() as calls, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.encode(feats, lengths).hidden
    assert calls.calls and {dtype for dtype, _ in calls.calls} == {torch.bfloat16}
    assert all(m is None or m.dtype == torch.bool for _, m in calls.calls)
    assert torch.isfinite(out).all()


def test_attention_parity_loads_a_reference_checkpoint(tmp_path) -> None:
    """A final.pt written from the nn.TransformerEncoder model loads strictly into the SDPA model
    and gives the same outputs."""
    reference, _ = pair()
    state = {
        "format": 1,
        "step": 3,
        "model": reference.state_dict(),
        "preset": get_preset("tiny").to_dict(),
        "clients": KS,
    }
    save_checkpoint(tmp_path / "final.pt", state)
    loaded = load_encoder(tmp_path / "final.pt")
    assert isinstance(loaded.model.encoder, SdpaEncoder)
    feats, lengths = torch.randn(2, 70, 80), torch.tensor([70, 41])
    with torch.no_grad():
        expected = reference.eval().encode(feats, lengths).hidden
        got = loaded.model.encode(feats, lengths).hidden
    assert (expected - got).abs().max().item() <= 1e-5


def test_attention_parity_compiled_encoder_recompiles_a_bounded_number_of_times() -> None:
    torch._dynamo.reset()
    _, model = pair()
    model.compile_encoder(backend="eager")
    torch._dynamo.utils.counters.clear()
    for b, t in [(2, 60), (3, 90), (2, 130), (4, 201), (1, 77), (5, 150), (2, 44), (1, 31)]:
        lengths = torch.full((b,), t)
        lengths[-1] = t - 9 if b > 1 else t
        with torch.no_grad():
            model.encode(torch.randn(b, t, 80), lengths)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # one graph with the boolean mask, one without (b == 1): dynamic shapes cover every size
    assert 1 <= frames <= 3, dict(torch._dynamo.utils.counters["stats"])
    torch._dynamo.reset()
