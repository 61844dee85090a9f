"""The encoder without its heads, exported to TorchScript and ONNX, with a parity check.

ONNX goes through ``torch.onnx.export(dynamo=True)`` (the TorchScript-based exporter is
deprecated), TorchScript through ``torch.jit.trace``; batch and time are dynamic axes in both.
:class:`LogMelFrontend` is the featurisation as its own ONNX graph, so that transcription needs
only onnxruntime and numpy.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from speech_assets.layout import ExportFiles, RecogniserFiles
from speech_assets.model.batches import pad
from speech_assets.model.hubert import HubertPretrainModel

if TYPE_CHECKING:
    from speech_assets.features.cmvn import Normaliser
    from speech_assets.model.encoders import LoadedEncoder

INPUT_NAMES = ("feats", "lengths")
FRONTEND_INPUT_NAMES = ("audio", "audio_lengths")
OUTPUT_NAMES = ("hidden", "hidden_lengths")
RECOGNISER_OUTPUT_NAMES = ("log_probs", "output_lengths")


def resolve_layer(model: HubertPretrainModel, layer: int) -> int:
    """The index of the layer ``layer`` names in ``model`` (``-1``: the last), what an export is named after."""
    depth = len(model.encoder.layers)
    if layer == -1:
        return depth
    if not 0 <= layer <= depth:
        raise ValueError(f"layer must be in [0, {depth}] or -1, got {layer}")
    return layer


class ExportableEncoder(nn.Module):
    """``feats (B, T, 80)``, ``lengths (B,)`` -> ``hidden (B, L, D)`` of ``layer`` (padded frames zero),
    ``hidden_lengths (B,)``; ``layer`` 0 is the Transformer's input, the last includes the final LayerNorm."""

    def __init__(self, model: HubertPretrainModel, layer: int = -1) -> None:
        super().__init__()
        self.layer = resolve_layer(model, layer)
        self.model = model
        self.eval()

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, out_lengths, padding = self.model.embed(feats, lengths, None)
        for layer in self.model.encoder.layers[: self.layer]:
            x = layer(x, src_key_padding_mask=padding)
        if self.layer == len(self.model.encoder.layers) and self.model.encoder.norm is not None:
            x = self.model.encoder.norm(x)
        return x.masked_fill(padding[..., None], 0.0), out_lengths


class ExportableRecogniser(nn.Module):
    """``feats (B, T, 80)``, ``lengths (B,)`` -> CTC ``log_probs (B, L, V)`` float32 of the model's
    first head on its last layer (padded frames zero), ``output_lengths (B,)``."""

    def __init__(self, model: HubertPretrainModel) -> None:
        super().__init__()
        self.encoder = ExportableEncoder(model, -1)
        self.head = model.heads[0]
        self.eval()

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, out_lengths = self.encoder(feats, lengths)
        log_probs = torch.log_softmax(self.head(hidden), dim=-1)
        padding = torch.arange(hidden.shape[1], device=hidden.device)[None, :] >= out_lengths[:, None]
        return log_probs.masked_fill(padding[..., None], 0.0), out_lengths


class LogMelFrontend(nn.Module):
    """``audio (B, N)`` 16 kHz, ``audio_lengths (B,)`` -> the pipeline's log-mel ``feats (B, T, 80)`` with
    ``cmvn`` applied, ``lengths (B,)``. A frame's DC removal, pre-emphasis, window and DFT are linear
    in its samples, so they are one constant kernel of a strided Conv (no FFT operator needed)."""

    def __init__(self, cmvn: Normaliser | None = None) -> None:
        from speech_assets.features.cmvn import UtteranceCmvn
        from speech_assets.features.featurize import FeatureExtractor
        from speech_assets.features.shards import WIN_LENGTH

        super().__init__()
        fx, n = FeatureExtractor(), WIN_LENGTH
        eye = torch.eye(n, dtype=torch.float64)
        dc = eye - 1.0 / n if fx.remove_dc_offset else eye
        pre = eye - fx.preemphasis * torch.diag(torch.ones(n - 1, dtype=torch.float64), -1)
        pre[0, 0] = 1.0 - fx.preemphasis  # Kaldi: x[0] -= p * x[0]
        frame = fx.window.double()[:, None] * (pre @ dc)  # (400, 400): a frame's samples as windowed
        bins = torch.arange(fx.n_fft // 2 + 1, dtype=torch.float64)
        angle = 2 * torch.pi * torch.arange(n, dtype=torch.float64)[:, None] * bins / fx.n_fft
        dft = torch.cat([torch.cos(angle), -torch.sin(angle)], dim=1)  # (400, 2 F): re, im
        self.register_buffer("kernel", (frame.T @ dft).T.float()[:, None, :].contiguous())
        self.register_buffer("fbank", fx.fbanks[:, :80].T.contiguous())  # (80, F)
        self.log_floor, self.bins, self.hop = fx.log_floor, fx.n_fft // 2 + 1, 160
        self.utterance = cmvn is None or isinstance(cmvn, UtteranceCmvn)
        mean, std = (0.0, 1.0) if self.utterance else (cmvn.mean["logmel"], cmvn.std["logmel"])
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32))
        self.eval()

    def forward(self, audio: torch.Tensor, audio_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = torch.nn.functional.conv1d(audio[:, None, :], self.kernel, stride=self.hop)  # (B, 2 F, T)
        power = spec[:, : self.bins].square() + spec[:, self.bins :].square()
        feats = torch.log(torch.matmul(self.fbank, power) + self.log_floor).transpose(1, 2)  # (B, T, 80)
        lengths = torch.clamp((audio_lengths - self.kernel.shape[-1]) // self.hop + 1, min=0)
        valid = (torch.arange(feats.shape[1], device=feats.device)[None, :] < lengths[:, None])[..., None]
        if self.utterance:
            count = lengths.clamp(min=1)[:, None, None].to(feats.dtype)
            mean = (feats * valid).sum(1, keepdim=True) / count
            var = (((feats - mean) * valid) ** 2).sum(1, keepdim=True) / count
            feats = (feats - mean) / torch.sqrt(torch.clamp(var, min=1e-8))
        else:
            feats = (feats - self.mean) / self.std
        return feats.masked_fill(~valid, 0.0), lengths


def example_inputs(batch: int = 2, frames: int = 157, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs for tracing: batch and time above 1 (torch.export specialises sizes 0 and 1)."""
    generator = torch.Generator().manual_seed(seed)
    feats = torch.randn(batch, frames, 80, generator=generator)
    lengths = torch.tensor([frames - 17 * i for i in range(batch)], dtype=torch.long)
    return feats, lengths


def export_onnx(
    encoder: nn.Module,
    path: str | os.PathLike[str],
    opset: int | None = None,
    output_names: Sequence[str] = OUTPUT_NAMES,
    input_names: Sequence[str] = INPUT_NAMES,
    example: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write ``encoder`` as one self-contained ONNX file (weights inside) with dynamic batch and time."""
    batch, time = torch.export.Dim("batch"), torch.export.Dim("time", min=2 if example is None else 560)
    # grad mode on: nn.TransformerEncoderLayer's inference fast path is a fused op the
    # exporter cannot translate; the regular path is the same computation.
    with torch.enable_grad():
        program = torch.onnx.export(
            encoder,
            example_inputs() if example is None else example,
            dynamo=True,
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_shapes=({0: batch, 1: time}, {0: batch}),
            opset_version=opset,
            external_data=False,
            verbose=False,
        )
    assert program is not None
    program.save(str(path), external_data=False)


def export_torchscript(encoder: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write ``encoder`` traced to TorchScript (checked on a second batch and length)."""
    # torch.jit is deprecated (FutureWarning) but supported; the file is for LibTorch and older runtimes
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        traced = torch.jit.trace(encoder, example_inputs(), check_inputs=[example_inputs(3, 64, seed=1)])
        torch.jit.save(traced, str(path))


def load_torchscript(path: str | os.PathLike[str]) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.jit.load(str(path))


@dataclass(frozen=True)
class Parity:
    """Largest absolute difference from eager PyTorch over the valid frames of real utterances."""

    onnx_max_abs_diff: float
    torchscript_max_abs_diff: float
    utterances: int
    frames: int

    def record(self) -> dict[str, object]:
        return {
            "max_abs_diff": self.onnx_max_abs_diff,
            "torchscript_max_abs_diff": self.torchscript_max_abs_diff,
            "utterances": self.utterances,
            "frames": self.frames,
            "runtime": "onnxruntime CPUExecutionProvider, fp32",
        }


def check_parity(
    encoder: nn.Module,
    onnx_path: str | os.PathLike[str],
    torchscript_path: str | os.PathLike[str],
    feats: Sequence[np.ndarray],
    output_names: Sequence[str] = OUTPUT_NAMES,
) -> Parity:
    """The ONNX (onnxruntime, CPU) and TorchScript files against eager PyTorch on ``feats``, valid frames only."""
    import onnxruntime

    batch, lengths = pad(feats)
    with torch.no_grad():
        expected, expected_lengths = encoder(batch, lengths)
        ts_hidden, ts_lengths = load_torchscript(torchscript_path)(batch, lengths)
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    onnx_hidden, onnx_lengths = session.run(list(output_names), {"feats": batch.numpy(), "lengths": lengths.numpy()})
    if not (np.array_equal(onnx_lengths, expected_lengths.numpy()) and torch.equal(ts_lengths, expected_lengths)):
        raise AssertionError("exported encoders disagree on output lengths")
    valid = (torch.arange(expected.shape[1])[None] < expected_lengths[:, None]).numpy()
    reference = expected.numpy()[valid]
    return Parity(
        onnx_max_abs_diff=float(np.abs(onnx_hidden[valid] - reference).max()),
        torchscript_max_abs_diff=float(np.abs(ts_hidden.numpy()[valid] - reference).max()),
        utterances=len(feats),
        frames=int(valid.sum()),
    )


def export_all(
    model: HubertPretrainModel, folder: Path, layer: int, feats: Sequence[np.ndarray], opset: int | None = None
) -> Parity:
    """The ONNX and TorchScript exports of ``model``'s ``layer`` in ``folder`` (a temporary one), and their parity."""
    encoder, files = ExportableEncoder(model, layer), ExportFiles(folder)
    export_onnx(encoder, files.onnx, opset)
    export_torchscript(encoder, files.torch)
    return check_parity(encoder, files.onnx, files.torch, feats)


def export_recogniser(
    model: HubertPretrainModel,
    folder: Path,
    feats: Sequence[np.ndarray],
    opset: int | None = None,
    cmvn: Normaliser | None = None,
) -> Parity:
    """The exports of ``model`` with its CTC head, their parity, and the frontend of ``cmvn`` (None: per utterance)."""
    recogniser, files = ExportableRecogniser(model), RecogniserFiles(folder)
    audio = torch.randn(2, 16_000, generator=torch.Generator().manual_seed(0)) * 0.1, torch.tensor([16_000, 12_345])
    # opset 18 at least: what the dynamo exporter writes for the frontend's ops
    export_onnx(LogMelFrontend(cmvn), files.frontend, max(opset or 18, 18), INPUT_NAMES, FRONTEND_INPUT_NAMES, audio)
    export_onnx(recogniser, files.onnx, opset, RECOGNISER_OUTPUT_NAMES)
    export_torchscript(recogniser, files.torch)
    return check_parity(recogniser, files.onnx, files.torch, feats, RECOGNISER_OUTPUT_NAMES)


def parity_features(shards: Sequence[str | os.PathLike[str]], cmvn: Normaliser, count: int) -> list[np.ndarray]:
    """The first ``count`` utterances of ``shards`` as the exported encoder takes them (``cmvn`` applied)."""
    from speech_assets.features.shards import iter_shard

    found = []
    for shard in shards:
        for record in iter_shard(shard, features=("logmel",)):
            if record.logmel is not None and record.num_frames >= 2:  # the export's time axis starts at 2
                found.append(cmvn.apply(record.logmel, "logmel"))
            if len(found) == count:
                return found
    return found


def reverify_export(folder: Path, feats: Sequence[np.ndarray]) -> tuple[Parity | None, list[str]]:
    """``folder``'s exports against eager PyTorch on the checkpoint they name again, or what prevents it."""
    from speech_assets.model.encoders import load_encoder

    files = ExportFiles(folder)
    spec = json.loads(files.card.read_text())
    checkpoint = Path(spec["checkpoint"])
    if not checkpoint.is_file():
        return None, [f"the exported checkpoint {checkpoint} is gone: nothing to compare with"]
    loaded = load_encoder(checkpoint)
    if loaded.sha256 != spec["checkpoint_sha256"]:
        return None, [
            f"{checkpoint} holds other weights ({loaded.sha256[:12]}) than were exported "
            f"({spec['checkpoint_sha256'][:12]})"
        ]
    encoder = ExportableEncoder(loaded.model, int(spec["output"]["layer"]))
    try:
        return check_parity(encoder, files.onnx, files.torch, feats), []
    except AssertionError as error:
        return None, [str(error)]


def input_description(
    encoder: LoadedEncoder, cmvn: Normaliser, layer: int, parity: Parity, checkpoint: str
) -> dict[str, Any]:
    """``encoder.json``: everything a user needs to feed the exported encoder and read its output."""
    from speech_assets.features.cmvn import describe
    from speech_assets.features.featurize import FeatureExtractor

    exportable = ExportableEncoder(encoder.model, layer)
    record = describe(cmvn)
    how = (
        "(logmel - logmel.mean(0)) / sqrt(max(logmel.var(0), 1e-8)), per utterance"
        if record["kind"] == "utterance"
        else "(logmel - cmvn.mean) / cmvn.std"
    )
    return {
        "inputs": {
            "feats": f"float32 (batch, time, 80): log-mel at 100 Hz of 16 kHz mono audio (peak-normalised), CMVN "
            f"applied: {how}",
            "lengths": "int64 (batch,): valid frames per row",
        },
        "featurisation": {"feature": "logmel", **FeatureExtractor().describe()},
        "cmvn": {k: [round(v, 6) for v in value] if isinstance(value, list) else value for k, value in record.items()},
        "output": {
            "hidden": f"float32 (batch, (time + 1) // 2, {encoder.model.preset.dim}), padded frames zero",
            "hidden_lengths": "int64 (batch,)",
            "layer": exportable.layer,
            "layers": len(encoder.model.encoder.layers),
            "frame_rate_hz": 50,
            "input_frame_rate_hz": 100,
        },
        "files": {"onnx": ExportFiles.onnx.name, "torchscript": ExportFiles.torch.name},
        "checkpoint": checkpoint,
        "checkpoint_sha256": encoder.sha256,
        "preset": encoder.model.preset.to_dict(),
        "parity": parity.record(),
    }
