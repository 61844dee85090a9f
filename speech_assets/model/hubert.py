"""HuBERT-style masked-prediction model over log-mel features.

``feats (B, T, 80)`` at 100 Hz -> :class:`ConvSubsampler` -> ``(B, L, D)`` at 50 Hz, ``L = (T + 1) // 2``
-> masked frames replaced by a learned embedding -> + :class:`ConvPositionalEmbedding` -> pre-LN
Transformer -> one linear head per client (its k-means codebook is its own) -> ``logits (B, L, K_max)``.

:class:`SdpaEncoder` has ``nn.TransformerEncoder``'s parameter names and initial weights, but
attends through ``F.scaled_dot_product_attention`` with no mask when the batch has no padding
(the flash/cuDNN kernels). Padded positions are zeroed before every convolution and excluded from
attention, so an utterance's outputs do not depend on what it is batched with.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from speech_assets.model.presets import ModelPreset


def output_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """50 Hz output lengths for 100 Hz input lengths: ``(T + 1) // 2``."""
    return torch.div(lengths + 1, 2, rounding_mode="floor")


def padding_mask(lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """``(B, max_length)`` bool, ``True`` on padding."""
    positions = torch.arange(max_length, device=lengths.device)
    return positions[None, :] >= lengths[:, None]


class ConvSubsampler(nn.Module):
    """Non-overlapping pairs of 100 Hz frames -> one 50 Hz frame of ``dim``.

    Output ``j`` sees input frames ``2j`` and ``2j + 1`` only, so masking it hides frame ``2j``
    (its label's frame) from every other output too; overlapping kernels would leak it.
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
        feats = feats.masked_fill(padding_mask(lengths, feats.shape[1])[..., None], 0.0)
        # One zero frame always appended: T + 1 frames give exactly (T + 1) // 2 pairs for any T,
        # with no shape-dependent branch (the ONNX export has a dynamic time axis).
        x = F.pad(feats.transpose(1, 2), (0, 1))
        x = self.activation(self.conv1(x))
        x = self.activation(self.conv2(x)).transpose(1, 2)
        return self.dropout(self.projection(self.norm(x))), output_lengths(lengths)


class ConvPositionalEmbedding(nn.Module):
    """Grouped convolution over time as a relative positional embedding (wav2vec 2.0)."""

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
class PretrainOutput:
    """``logits (B, L, K_max)``: each row's own client's head, ``-inf`` beyond that client's ``k``."""

    encoder: EncoderOutput
    logits: torch.Tensor


ATTENTION_IMPLEMENTATIONS = ("sdpa", "reference")


class SdpaEncoderLayer(nn.Module):
    """Pre-LN Transformer layer attending through ``F.scaled_dot_product_attention``.

    A reference ``nn.TransformerEncoderLayer`` is built and its modules kept, so the parameter
    names, initial weights and RNG draws are the reference layer's.
    """

    def __init__(self, dim: int, heads: int, ffn_dim: int, dropout: float) -> None:
        super().__init__()
        reference = reference_layer(dim, heads, ffn_dim, dropout)
        self.self_attn = reference.self_attn
        self.linear1, self.linear2 = reference.linear1, reference.linear2
        self.norm1, self.norm2 = reference.norm1, reference.norm2
        self.heads, self.attention_dropout = heads, dropout
        self.dropout = nn.Dropout(dropout)

    def attend(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """``keep (B, 1, 1, L)`` bool marks the keys to attend (``None``: all, which lets CUDA pick flash or cuDNN)."""
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
        return self.block(x, key_mask(src_key_padding_mask))


def reference_layer(dim: int, heads: int, ffn_dim: int, dropout: float) -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(
        dim, heads, ffn_dim, dropout=dropout, activation="gelu", batch_first=True, norm_first=True
    )


def key_mask(padding: torch.Tensor | None) -> torch.Tensor | None:
    """``(B, 1, 1, L)`` bool, ``True`` on the keys to attend."""
    return None if padding is None else ~padding[:, None, None, :]


class SdpaEncoder(nn.Module):
    """``layers`` copies of one :class:`SdpaEncoderLayer` and a final LayerNorm, as ``nn.TransformerEncoder``."""

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
    """Whether a batch padded to ``frames`` has padding at 50 Hz; ``True`` unless it can be known
    without a device sync or a data-dependent branch in a traced graph."""
    if lengths.device.type != "cpu" or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return True
    return bool(output_lengths(lengths).min() < (frames + 1) // 2) if lengths.numel() else False


class HubertPretrainModel(nn.Module):
    """Shared encoder plus one head per client (codebook sizes ``client_ks``), clients sorted by name.

    ``attention``: ``"sdpa"`` or ``"reference"`` (``nn.TransformerEncoder``): same state-dict keys.
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
            reference = reference_layer(preset.dim, preset.heads, preset.ffn_dim, preset.dropout)
            self.encoder = nn.TransformerEncoder(
                reference, preset.layers, norm=nn.LayerNorm(preset.dim), enable_nested_tensor=False
            )
        self.heads = nn.ModuleList(nn.Linear(preset.dim, client_ks[name]) for name in self.clients)

    def embed(
        self, feats: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Transformer's input ``(B, L, D)``, 50 Hz ``lengths (B,)`` and ``padding (B, L)``."""
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
        """Encode CMVN-normalised ``feats (B, T, 80)``; ``mask (B, L)`` marks the 50 Hz frames to replace
        by the mask embedding. ``padded``: whether the batch has padding, when the caller knows it
        from host data (``None``: :func:`has_padding`)."""
        x, out_lengths, padding = self.embed(feats, lengths, mask)
        if padded is None:
            padded = has_padding(lengths, feats.shape[1])
        masked = self.attention == "reference" or padded
        hidden = self.encoder(x, src_key_padding_mask=padding if masked else None)
        return EncoderOutput(hidden=hidden, lengths=out_lengths, padding=padding)

    def compile_encoder(self, **options: object) -> None:
        """``torch.compile`` the Transformer in place (parameter names unchanged), dynamic by default."""
        self.encoder.compile(**({"dynamic": True} | options))

    def hidden_states(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[list[torch.Tensor], EncoderOutput]:
        """``layers + 1`` tensors ``(B, L, D)``: the Transformer's input, then the residual stream after
        each layer, the last after the final LayerNorm (pre-LN layers leave the others
        unnormalised); and :meth:`encode`'s output."""
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
        padded: bool | None = None,
    ) -> PretrainOutput:
        """Encode and predict each row with its client's head (``clients (B,)``); a head absent from
        the batch gets an exact zero gradient, so DDP sees every parameter used."""
        encoded = self.encode(feats, lengths, mask, padded)
        return PretrainOutput(encoder=encoded, logits=self.head_logits(encoded.hidden, clients))

    def head_logits(self, hidden: torch.Tensor, clients: torch.Tensor) -> torch.Tensor:
        """All heads as one batched product, with no host read: the heads' weights stacked into
        ``(C, K_max, D)`` (zero rows, biases ``-inf`` beyond a client's ``k``: softmax and argmax
        never pick them, and they get no gradient) and gathered per row by ``clients``."""
        k_max = max(head.out_features for head in self.heads)
        weight = torch.stack([F.pad(h.weight, (0, 0, 0, k_max - h.out_features)) for h in self.heads])
        bias = torch.stack([F.pad(h.bias, (0, k_max - h.out_features), value=-torch.inf) for h in self.heads])
        clients = clients.to(hidden.device, non_blocking=True)
        return torch.baddbmm(bias[clients][:, None, :], hidden, weight[clients].transpose(1, 2))


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
