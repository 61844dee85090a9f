"""The exported encoder: ONNX (onnxruntime) and TorchScript agree with eager PyTorch, for any
batch and length, on every output layer."""

import numpy as np
import pytest
import torch

from speech_assets.model.export import ExportableEncoder, export_all
from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.model.presets import get_preset


@pytest.fixture(scope="module")
def model() -> HubertPretrainModel:
    torch.manual_seed(0)
    return HubertPretrainModel(get_preset("tiny"), {"client_00": 8}).eval()


def _utterances(*frames: int) -> list[np.ndarray]:
    generator = np.random.default_rng(0)
    return [generator.standard_normal((n, 80)).astype(np.float32) for n in frames]


def test_onnx_and_torchscript_match_pytorch_with_dynamic_batch_and_time(model, tmp_path) -> None:
    # an inner layer (the end-to-end test exports the last); lengths unlike the tracing example's,
    # odd and even, one far longer: the axes are dynamic. The exporter takes a while: one case.
    parity = export_all(model, tmp_path, 2, _utterances(301, 40, 97))
    assert (tmp_path / "encoder.onnx").stat().st_size > 0 and (tmp_path / "encoder.pt").stat().st_size > 0
    assert parity.onnx_max_abs_diff <= 1e-4 and parity.torchscript_max_abs_diff <= 1e-4
    assert parity.utterances == 3 and parity.frames == (301 + 1) // 2 + 40 // 2 + (97 + 1) // 2


def test_output_layer_is_the_one_asked_for(model) -> None:
    feats = torch.from_numpy(np.stack(_utterances(50, 50)))
    lengths = torch.tensor([50, 31])
    states, encoded = model.hidden_states(feats, lengths)
    with torch.no_grad():
        last, out_lengths = ExportableEncoder(model, -1)(feats, lengths)
        second, _ = ExportableEncoder(model, 2)(feats, lengths)
    assert torch.equal(out_lengths, encoded.lengths)
    valid = ~encoded.padding
    assert torch.allclose(last[valid], states[-1][valid], atol=1e-5)
    assert torch.allclose(second[valid], states[2][valid], atol=1e-5)
    assert (last[~valid] == 0).all()  # padded frames are zero, as encoder.json says
    with pytest.raises(ValueError, match="layer must be"):
        ExportableEncoder(model, 9)


def test_export_folder_is_named_after_the_layer_it_holds(model, tmp_path) -> None:
    """Issue 46: ``[export] layer = -1`` (the last) made ``<sha>-layer-1`` for layer 4. Mutations
    killed: ``resolve_layer`` leaving -1 as it is; ``ExportFiles.folder_name`` accepting a
    negative layer."""
    from speech_assets.layout import DataLayout, ExportFiles
    from speech_assets.model.export import resolve_layer

    depth = len(model.encoder.layers)
    assert [resolve_layer(model, layer) for layer in (-1, 0, 2, depth)] == [depth, 0, 2, depth]
    for wrong in (-2, depth + 1):
        with pytest.raises(ValueError, match="layer must be"):
            resolve_layer(model, wrong)
    assert ExportableEncoder(model, -1).layer == depth
    sha = "ab" * 32
    folder = DataLayout(tmp_path).export(sha, resolve_layer(model, -1)).root
    assert folder.name == f"{sha[:16]}-layer{depth}" == f"{sha[:16]}-layer4"
    with pytest.raises(ValueError, match="not -1"):
        ExportFiles.folder_name(sha, -1)
