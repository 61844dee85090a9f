import pytest
import torch
import torch.nn.functional as F

from speech_assets.model.hubert import HubertPretrainModel, count_parameters, output_lengths
from speech_assets.model.loss import IGNORE_INDEX, masked_prediction_loss
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
    assert out.logits.shape == (2, (frames + 1) // 2, 7)
    assert torch.isfinite(out.logits[0]).all() and torch.isfinite(out.logits[1, :, :5]).all()
    assert torch.all(out.logits[1, :, 5:] == -torch.inf)  # client b's head has k = 5


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
    assert model.heads[0].weight.grad.abs().sum() > 0
    # an absent client's head gets an exact zero gradient (DDP sees every parameter used)
    assert torch.all(model.heads[1].weight.grad == 0) and torch.all(model.heads[1].bias.grad == 0)


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


KS3 = {"a": 7, "b": 5, "c": 11}  # three clients of different k: the batched heads pad to 11


def _three_client_case() -> tuple[HubertPretrainModel, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = HubertPretrainModel(get_preset("tiny"), KS3)
    lengths = torch.tensor([80, 80, 80, 80, 80, 80])
    clients = torch.tensor([2, 0, 1, 0, 2, 1])  # not grouped: rows find their head by index
    mask = span_mask(output_lengths(lengths), 0.08, 10, torch.Generator().manual_seed(3))
    targets = torch.stack([torch.randint(0, list(KS3.values())[c], (40,)) for c in clients.tolist()])
    targets[0, -3:] = IGNORE_INDEX
    data = {"feats": torch.randn(6, 80, 80), "lengths": lengths, "clients": clients, "mask": mask}
    return model, data | {"targets": targets}


def _looped_heads_loss(model: HubertPretrainModel, data: dict[str, torch.Tensor], weight: float) -> torch.Tensor:
    """The heads and loss before they were batched, kept as the reference: a Python loop over the
    clients present (``unique().tolist()``, ``nonzero``), each head on its rows, fp32 cross-entropy."""
    hidden = model.encode(data["feats"], data["lengths"], data["mask"], padded=False).hidden
    clients, targets, mask = data["clients"], data["targets"], data["mask"]
    sums = torch.zeros(4)
    for client in torch.unique(clients).tolist():
        rows = torch.nonzero(clients == client).squeeze(1)
        logits = model.heads[client](hidden[rows])
        t, m = targets[rows], mask[rows]
        ce = F.cross_entropy(logits.float().transpose(1, 2), t, ignore_index=IGNORE_INDEX, reduction="none")
        valid = t != IGNORE_INDEX
        sums = sums + torch.stack([ce[valid & m].sum(), (valid & m).sum(), ce[valid & ~m].sum(), (valid & ~m).sum()])
    return sums[0] / sums[1] + weight * sums[2] / sums[3]


def _batched_heads_loss(model: HubertPretrainModel, data: dict[str, torch.Tensor], weight: float) -> torch.Tensor:
    out = model(data["feats"], data["lengths"], data["clients"], data["mask"], padded=False)
    return masked_prediction_loss(out.logits, data["targets"], data["mask"], weight).loss


@pytest.mark.parametrize("weight", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_heads_match_the_looped_heads_loss_and_gradients(weight: float, dtype: torch.dtype) -> None:
    """Three clients of different k: the one batched product gives the per-client loop's loss and
    gradients, exactly in fp32 and within bf16's precision under bf16 autocast."""
    model, data = _three_client_case()
    params = list(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        new, old = _batched_heads_loss(model, data, weight), _looped_heads_loss(model, data, weight)
    assert new.dtype == torch.float32
    new_grads, old_grads = torch.autograd.grad(new, params), torch.autograd.grad(old, params)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(new, old, rtol=tolerance, atol=tolerance)
    for a, b in zip(new_grads, old_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * max(float(b.abs().max()), 1e-3))


def test_batched_heads_step_reads_nothing_on_the_host() -> None:
    """A census of one CPU training step (forward with only the ``clients`` tensor, loss, backward,
    AdamW): no ``nonzero``, ``unique``, ``item``, ``tolist``, ``cpu`` or ``numpy`` finds the heads."""
    from torch.profiler import ProfilerActivity, profile

    from speech_assets_tests.support.census import HostReads, host_syncs

    model, data = _three_client_case()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with profile(activities=[ProfilerActivity.CPU]) as prof, HostReads():
        _batched_heads_loss(model, data, 1.0).backward()
        optimizer.step()
    events = prof.events()
    assert sum(event.name == "aten::baddbmm" for event in events) == 1  # every head in one product
    assert not host_syncs(events)
