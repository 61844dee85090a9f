import pytest
import torch

from speech_assets.model.hubert import HubertPretrainModel, count_parameters, output_lengths
from speech_assets.model.loss import masked_prediction_loss
from speech_assets.model.masking import span_mask
from speech_assets.model.presets import PRESETS, get_preset

KS = {"a": 7, "b": 5}


@pytest.fixture(scope="module")
def model() -> HubertPretrainModel:
    torch.manual_seed(0)
    return HubertPretrainModel(get_preset("tiny"), KS).eval()


@pytest.mark.parametrize("frames", [1, 2, 7, 100, 101])
def test_output_rate_is_half_the_input_rate(model: HubertPretrainModel, frames: int) -> None:
    feats = torch.randn(2, frames, 80)
    lengths = torch.tensor([frames, max(frames // 2, 1)])
    out = model(feats, lengths, torch.tensor([0, 1]))
    expected = (lengths + 1) // 2
    assert out.encoder.hidden.shape == (2, (frames + 1) // 2, get_preset("tiny").dim)
    assert torch.equal(out.encoder.lengths, expected)
    assert torch.equal(out.encoder.padding, torch.arange((frames + 1) // 2)[None] >= expected[:, None])
    shapes = {o.client: (tuple(o.rows.tolist()), tuple(o.logits.shape)) for o in out.logits}
    assert shapes == {0: ((0,), (1, (frames + 1) // 2, 7)), 1: ((1,), (1, (frames + 1) // 2, 5))}


def test_outputs_do_not_depend_on_batch_padding(model: HubertPretrainModel) -> None:
    torch.manual_seed(1)
    short, long = torch.randn(1, 37, 80), torch.randn(1, 120, 80)
    batch = torch.zeros(2, 120, 80)
    batch[0, :37], batch[1] = short[0], long[0]
    batch[0, 37:] = 100.0  # garbage in the padding must be ignored
    lengths = torch.tensor([37, 120])
    mask = span_mask(output_lengths(lengths), 0.08, 10, torch.Generator().manual_seed(0))
    together = model.encode(batch, lengths, mask)
    alone = model.encode(short, lengths[:1], mask[:1, :19])
    torch.testing.assert_close(together.hidden[0, :19], alone.hidden[0], rtol=1e-4, atol=1e-5)


def test_masked_frames_are_replaced_by_the_mask_embedding(model: HubertPretrainModel) -> None:
    feats = torch.randn(1, 60, 80)
    lengths = torch.tensor([60])
    mask = torch.zeros(1, 30, dtype=torch.bool)
    mask[0, 10:20] = True
    changed = feats.clone()
    # 50 Hz output i sees 100 Hz frames 2i and 2i+1 only, so frames 20..39 reach only the
    # masked outputs 10..19: with the mask, the change is invisible.
    changed[0, 20:40] += 5 * torch.randn(20, 80)
    torch.testing.assert_close(model.encode(feats, lengths, mask).hidden, model.encode(changed, lengths, mask).hidden)
    assert not torch.allclose(model.encode(feats, lengths).hidden, model.encode(changed, lengths).hidden)


def test_each_head_gets_gradients_only_from_its_clients_samples() -> None:
    torch.manual_seed(0)
    model = HubertPretrainModel(get_preset("tiny"), KS)
    lengths = torch.tensor([80, 64, 50])
    clients = torch.tensor([0, 1, 0])
    mask = span_mask(output_lengths(lengths), 0.08, 10, torch.Generator().manual_seed(3))
    targets = torch.randint(0, 5, (3, 40))

    def head_grads(feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = model(feats, lengths, clients, mask)
        masked_prediction_loss(out.logits, targets, mask).loss.backward()
        return model.heads[0].weight.grad.clone(), model.heads[1].weight.grad.clone()

    feats = torch.randn(3, 80, 80)
    a0, b0 = head_grads(feats)
    changed = feats.clone()
    changed[1] = torch.randn(80, 80)  # the only client-"b" sample
    a1, b1 = head_grads(changed)
    torch.testing.assert_close(a0, a1, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(b0, b1)

    model.zero_grad(set_to_none=True)
    out = model(feats[[0, 2]], lengths[[0, 2]], clients[[0, 2]], mask[[0, 2]])
    masked_prediction_loss(out.logits, targets[[0, 2]], mask[[0, 2]]).loss.backward()
    assert model.heads[0].weight.grad is not None
    assert model.heads[1].weight.grad is None


def test_presets() -> None:
    with torch.device("meta"):
        tiny = count_parameters(HubertPretrainModel(PRESETS["tiny"], {"c": 100}))
        base = count_parameters(HubertPretrainModel(PRESETS["base"], {"c": 500}))
    assert 0.7e6 < tiny < 1.3e6
    assert 85e6 < base < 100e6
    assert (PRESETS["base"].dim, PRESETS["base"].layers, PRESETS["base"].heads) == (768, 12, 12)
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("huge")


def test_hidden_states_end_with_the_encoder_output(model: HubertPretrainModel) -> None:
    feats, lengths = torch.randn(2, 90, 80), torch.tensor([90, 61])
    with torch.no_grad():
        states, encoded = model.hidden_states(feats, lengths)
        reference = model.encode(feats, lengths)
    assert len(states) == get_preset("tiny").layers + 1
    assert all(state.shape == (2, 45, get_preset("tiny").dim) for state in states)
    valid = ~reference.padding
    torch.testing.assert_close(states[-1][valid], reference.hidden[valid], rtol=1e-4, atol=1e-5)
    assert torch.equal(encoded.lengths, reference.lengths)
