"""HuBERT-style masked-prediction model over log-mel features.

Pipeline (shapes for a batch of ``B`` utterances, ``T`` input frames at 100 Hz):

``feats (B, T, 80)`` -> :class:`ConvSubsampler` -> ``(B, L, D)`` with ``L = (T + 1) // 2`` (50 Hz,
non-overlapping pairs of input frames)
-> masked frames replaced by a learned embedding -> + :class:`ConvPositionalEmbedding`
-> pre-LN Transformer encoder -> ``hidden (B, L, D)`` -> one linear head per client
-> ``logits (B_c, L, K_c)`` for the rows of each client ``c``.

The Transformer is :class:`SdpaEncoder` (``attention="sdpa"``, the default): the same pre-LN
layers as ``nn.TransformerEncoder`` with the same parameter names (checkpoints load either way)
and the same initial weights, but attention through ``F.scaled_dot_product_attention`` with no
mask at all when the batch has no padding (the flash/cuDNN kernels) and a boolean key mask
otherwise (never an additive float mask). ``attention="reference"`` keeps ``nn.TransformerEncoder``.

The encoder is shared; every client has its own head because its k-means codebook (and so the
meaning of its cluster ids) is its own. Padded positions are zeroed before every convolution
and excluded from attention, so an utterance's outputs do not depend on what it is batched with.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from speech_assets.model.presets import ModelPreset


def output_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """50 Hz output lengths ``(B,)`` for 100 Hz input lengths ``(B,)``: ``(T + 1) // 2``."""
    return torch.div(lengths + 1, 2, rounding_mode="floor")


def padding_mask(lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """``(B, max_length)`` bool, ``True`` on padding (positions ``>= lengths[b]``)."""
    positions = torch.arange(max_length, device=lengths.device)
    return positions[None, :] >= lengths[:, None]


class ConvSubsampler(nn.Module):
    """Non-overlapping pairs of 100 Hz frames -> one 50 Hz frame, then a projection to ``dim``.

    ``(B, T, F)`` at 100 Hz -> ``(B, (T + 1) // 2, dim)`` at 50 Hz: a convolution with kernel 2 and
    stride 2 (an odd ``T`` gets one zero frame appended), a kernel-1 convolution, LayerNorm and a
    linear projection. Output ``j`` sees input frames ``2j`` and ``2j + 1`` and nothing else, so
    masking output ``j`` hides frame ``2j``, the frame its 50 Hz label was computed from, from
    every other output too (overlapping kernels let the unmasked neighbours see it; see
    docs/ARCHITECTURE.md).
    """

    def __init__(self, input_dim: int, channels: int, dim: int, dropout: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(input_dim, channels, kernel_size=2, stride=2)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=1)
        self.activation = nn.GELU()
        self.norm = nn.LayerNorm(channels)
        self.projection = nn.Linear(channels, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``feats (B, T, F)``, ``lengths (B,)`` -> ``(B, (T + 1) // 2, dim)``, ``out_lengths (B,)``."""
        feats = feats.masked_fill(padding_mask(lengths, feats.shape[1])[..., None], 0.0)
        # One zero frame always appended: T + 1 frames give exactly (T + 1) // 2 pairs for any T,
        # with no shape-dependent branch (the ONNX export has a dynamic time axis).
        x = F.pad(feats.transpose(1, 2), (0, 1))
        x = self.activation(self.conv1(x))
        x = self.activation(self.conv2(x)).transpose(1, 2)
        return self.dropout(self.projection(self.norm(x))), output_lengths(lengths)


class ConvPositionalEmbedding(nn.Module):
    """Grouped convolution over time used as a relative positional embedding (wav2vec 2.0).

    ``(B, L, D)`` -> ``(B, L, D)``; for even kernels the extra last frame is dropped.
    """

    def __init__(self, dim: int, kernel_size: int, groups: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, kernel_size=kernel_size, padding=kernel_size // 2, groups=groups)
        self.activation = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        y = self.conv(x.transpose(1, 2))[:, :, :length]
        return self.activation(y).transpose(1, 2)


@dataclass
class EncoderOutput:
    """``hidden (B, L, D)``, ``lengths (B,)`` (50 Hz), ``padding (B, L)`` bool (``True`` = pad)."""

    hidden: torch.Tensor
    lengths: torch.Tensor
    padding: torch.Tensor


@dataclass
class ClientLogits:
    """Predictions of one client's head for the batch rows that belong to it.

    ``client``: index into :attr:`HubertPretrainModel.clients`; ``rows (B_c,)``: batch rows;
    ``logits (B_c, L, K_c)``. ``span``: ``(start, stop)`` when the rows are the contiguous
    ``start:stop`` (then ``rows`` is their ``arange`` and a slice selects them with no device read).
    """

    client: int
    rows: torch.Tensor
    logits: torch.Tensor
    span: tuple[int, int] | None = None

    def select(self, values: torch.Tensor) -> torch.Tensor:
        """This client's rows of batch-major ``values (B, ...)``: ``(B_c, ...)``."""
        return values[self.span[0] : self.span[1]] if self.span is not None else values[self.rows]


@dataclass
class PretrainOutput:
    encoder: EncoderOutput
    logits: list[ClientLogits]


ATTENTION_IMPLEMENTATIONS = ("sdpa", "reference")


class SdpaEncoderLayer(nn.Module):
    """Pre-LN Transformer layer, ``(B, L, D)`` -> ``(B, L, D)``, with attention through
    ``F.scaled_dot_product_attention``.

    The parameters are those of ``nn.TransformerEncoderLayer(norm_first=True, activation="gelu")``
    under the same names (``self_attn.in_proj_weight``, ``self_attn.out_proj``, ``linear1``,
    ``linear2``, ``norm1``, ``norm2``): one is built and its modules are kept, so the initial
    weights and the RNG draws are the reference layer's too.
    """

    def __init__(self, dim: int, heads: int, ffn_dim: int, dropout: float) -> None:
        super().__init__()
        reference = nn.TransformerEncoderLayer(
            dim, heads, ffn_dim, dropout=dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.self_attn = reference.self_attn
        self.linear1, self.linear2 = reference.linear1, reference.linear2
        self.norm1, self.norm2 = reference.norm1, reference.norm2
        self.heads, self.attention_dropout = heads, dropout
        self.dropout = nn.Dropout(dropout)

    def attend(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """Self-attention of ``x (B, L, D)``; ``keep (B, 1, 1, L)`` bool marks the keys to attend
        (``None``: all, which lets CUDA pick the flash or cuDNN kernel)."""
        batch, length, dim = x.shape
        qkv = F.linear(x, self.self_attn.in_proj_weight, self.self_attn.in_proj_bias)
        q, k, v = qkv.view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        dropout = self.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout)
        return self.self_attn.out_proj(out.transpose(1, 2).reshape(batch, length, dim))

    def block(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        x = x + self.dropout(self.attend(self.norm1(x), keep))
        return x + self.dropout(self.linear2(self.dropout(F.gelu(self.linear1(self.norm2(x))))))

    def forward(self, x: torch.Tensor, src_key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x (B, L, D)``, ``src_key_padding_mask (B, L)`` bool (``True`` = pad) or ``None``."""
        return self.block(x, key_mask(src_key_padding_mask))


def key_mask(padding: torch.Tensor | None) -> torch.Tensor | None:
    """``(B, 1, 1, L)`` bool, ``True`` on the keys to attend, for ``padding (B, L)`` (``True`` = pad)."""
    return None if padding is None else ~padding[:, None, None, :]


class SdpaEncoder(nn.Module):
    """``layers`` copies of one :class:`SdpaEncoderLayer` (as ``nn.TransformerEncoder`` clones its
    layer) and a final LayerNorm ``norm``: ``(B, L, D)`` -> ``(B, L, D)``."""

    def __init__(self, layer: SdpaEncoderLayer, layers: int, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(layers))
        self.norm = norm

    def forward(self, x: torch.Tensor, src_key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        keep = key_mask(src_key_padding_mask)
        for layer in self.layers:
            x = layer.block(x, keep)
        return self.norm(x)


def has_padding(lengths: torch.Tensor, frames: int) -> bool:
    """Whether a batch of input ``lengths (B,)`` padded to ``frames`` has padding at 50 Hz.

    Answered ``True`` (keep the mask) unless it can be known without a device sync or a
    data-dependent branch in a traced graph: ``lengths`` on the host, eager mode.
    """
    if lengths.device.type != "cpu" or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return True
    return bool(output_lengths(lengths).min() < (frames + 1) // 2) if lengths.numel() else False


class HubertPretrainModel(nn.Module):
    """Shared encoder plus one prediction head per client (codebook sizes ``client_ks``).

    Clients are ordered by name; ``clients[i]`` is the client whose samples carry index ``i``.
    ``attention``: ``"sdpa"`` (:class:`SdpaEncoder`) or ``"reference"`` (``nn.TransformerEncoder``);
    both have the same state-dict keys and initial weights.
    """

    def __init__(self, preset: ModelPreset, client_ks: Mapping[str, int], attention: str = "sdpa") -> None:
        super().__init__()
        if not client_ks:
            raise ValueError("need at least one client codebook")
        if preset.dim % preset.heads:
            raise ValueError(f"dim {preset.dim} is not divisible by heads {preset.heads}")
        if attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention {attention!r} is not one of {ATTENTION_IMPLEMENTATIONS}")
        self.attention = attention
        self.preset = preset
        self.clients: list[str] = sorted(client_ks)
        self.frontend = ConvSubsampler(preset.input_dim, preset.conv_channels, preset.dim, preset.dropout)
        self.mask_embedding = nn.Parameter(torch.empty(preset.dim).uniform_())
        self.position = ConvPositionalEmbedding(preset.dim, preset.pos_kernel, preset.pos_groups)
        self.dropout = nn.Dropout(preset.dropout)
        self.encoder: nn.Module
        if attention == "sdpa":
            layer = SdpaEncoderLayer(preset.dim, preset.heads, preset.ffn_dim, preset.dropout)
            self.encoder = SdpaEncoder(layer, preset.layers, nn.LayerNorm(preset.dim))
        else:
            reference = nn.TransformerEncoderLayer(
                preset.dim,
                preset.heads,
                preset.ffn_dim,
                dropout=preset.dropout,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            self.encoder = nn.TransformerEncoder(
                reference, preset.layers, norm=nn.LayerNorm(preset.dim), enable_nested_tensor=False
            )
        self.heads = nn.ModuleList(nn.Linear(preset.dim, client_ks[name]) for name in self.clients)

    def embed(
        self, feats: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Transformer's input ``(B, L, D)``, 50 Hz ``lengths (B,)`` and ``padding (B, L)``
        (``lengths`` may be on the host: they are moved to ``feats``' device)."""
        x, out_lengths = self.frontend(feats, lengths.to(feats.device, non_blocking=True))
        padding = padding_mask(out_lengths, x.shape[1])
        if mask is not None:
            if mask.shape != padding.shape:
                raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(padding.shape)}")
            x = torch.where(mask[..., None], self.mask_embedding.to(x.dtype), x)
        x = x.masked_fill(padding[..., None], 0.0)
        return self.dropout(x + self.position(x)), out_lengths, padding

    def encode(
        self,
        feats: torch.Tensor,
        lengths: torch.Tensor,
        mask: torch.Tensor | None = None,
        padded: bool | None = None,
    ) -> EncoderOutput:
        """Encode ``feats (B, T, 80)`` (CMVN-normalised, 100 Hz) with valid ``lengths (B,)``.

        ``mask (B, L)`` bool marks 50 Hz frames to replace by the learned mask embedding
        (``L = (max T + 1) // 2``); ``None`` masks nothing. ``padded``: whether the batch has
        padding, when the caller knows it from host data (the loader's :class:`Batch`); ``None``
        decides from ``lengths`` (:func:`has_padding`). Without padding the attention takes no mask.
        """
        x, out_lengths, padding = self.embed(feats, lengths, mask)
        if padded is None:
            padded = has_padding(lengths, feats.shape[1])
        masked = self.attention == "reference" or padded
        hidden = self.encoder(x, src_key_padding_mask=padding if masked else None)
        return EncoderOutput(hidden=hidden, lengths=out_lengths, padding=padding)

    def compile_encoder(self, **options: object) -> None:
        """``torch.compile`` the Transformer in place (parameter names unchanged), with dynamic
        batch and time (one graph for every batch shape, one more for the mask-free case) unless
        ``options`` say otherwise (``backend``, ``mode``, ``dynamic``)."""
        self.encoder.compile(**({"dynamic": True} | options))

    def hidden_states(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[list[torch.Tensor], EncoderOutput]:
        """Every layer's output for unmasked ``feats (B, T, 80)``: ``layers + 1`` tensors ``(B, L, D)``.

        Entry 0 is the Transformer's input (subsampled features plus positional embedding),
        entry ``i`` the residual stream after layer ``i``; the last one is, like :meth:`encode`'s
        ``hidden``, after the final LayerNorm (pre-LN layers leave the residual stream
        unnormalised: normalise before comparing layers). Also returns :meth:`encode`'s output.
        """
        x, out_lengths, padding = self.embed(feats, lengths, None)
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x, src_key_padding_mask=padding)
            states.append(x)
        if self.encoder.norm is not None:
            states[-1] = self.encoder.norm(states[-1])
        return states, EncoderOutput(hidden=states[-1], lengths=out_lengths, padding=padding)

    def forward(
        self,
        feats: torch.Tensor,
        lengths: torch.Tensor,
        clients: torch.Tensor,
        mask: torch.Tensor | None = None,
        groups: Sequence[tuple[int, int, int]] | None = None,
        padded: bool | None = None,
    ) -> PretrainOutput:
        """Encode and predict: ``clients (B,)`` long selects each row's head.

        Returns the encoder output and, for every client present in the batch, its head's
        ``logits (B_c, L, K_c)`` over that client's rows only (other heads are not used, so they
        receive no gradient from this batch). ``groups``: ``(client, start, stop)`` when the rows
        are grouped by client (the training loader's batches): the heads then take slices and
        nothing waits for the device; without it the clients are read from ``clients``.
        ``padded``: as for :meth:`encode`.
        """
        encoded = self.encode(feats, lengths, mask, padded)
        outputs = []
        if groups is not None:
            for client, start, stop in groups:
                rows = torch.arange(start, stop, device=clients.device)
                logits = self.heads[client](encoded.hidden[start:stop])
                outputs.append(ClientLogits(client, rows, logits, (start, stop)))
            return PretrainOutput(encoder=encoded, logits=outputs)
        for client in torch.unique(clients).tolist():
            rows = torch.nonzero(clients == client).squeeze(1)
            outputs.append(ClientLogits(client, rows, self.heads[client](encoded.hidden[rows])))
        return PretrainOutput(encoder=encoded, logits=outputs)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
