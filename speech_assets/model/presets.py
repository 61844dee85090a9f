"""Model sizes and analytic cost estimates (FLOPs, activation memory) used by autoconfig and bench."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from speech_assets.features.shards import N_MELS


@dataclass(frozen=True)
class ModelPreset:
    """Hyper-parameters of a :class:`~speech_assets.model.hubert.HubertPretrainModel`."""

    name: str
    dim: int
    layers: int
    heads: int
    ffn_dim: int
    conv_channels: int
    pos_kernel: int
    pos_groups: int
    dropout: float = 0.1
    input_dim: int = N_MELS

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def train_flops_per_frame(self, mean_frames: float, ks: list[int]) -> float:
        """Training FLOPs per 50 Hz output frame (backward twice the forward, except the first
        convolution's, whose input needs no gradient); ``mean_frames``: mean 50 Hz length, ``ks``:
        the heads' codebook sizes. Within 1 % of ``FlopCounterMode`` corrected for grouped convolutions."""
        d, c = self.dim, self.conv_channels
        first = 2 * (self.input_dim * 2 * c)  # kernel 2, stride 2: one 50 Hz frame per output
        frontend = 2 * (c * c) + 2 * (c * d)  # kernel 1, then the projection
        position = 2 * d * (d // self.pos_groups) * self.pos_kernel
        per_layer = 2 * (4 * d * d + 2 * d * self.ffn_dim) + 2 * 2 * mean_frames * d
        head = 2 * d * (sum(ks) / max(len(ks), 1))
        return 2.0 * first + 3.0 * (frontend + position + self.layers * per_layer + head)

    def activation_bytes_per_frame(self, bytes_per_element: int) -> float:
        """Rough activation memory kept for backward per 50 Hz frame (Korthikanti et al.:
        about 34 * dim bytes per token per layer at 16-bit with memory-efficient attention)."""
        per_layer = 17 * self.dim * bytes_per_element
        frontend = 4 * (self.conv_channels + self.dim) * bytes_per_element + 2 * self.input_dim * 4
        return self.layers * per_layer + frontend


PRESETS: dict[str, ModelPreset] = {
    # ~1M parameters: CPU and CI. No dropout: a model this small underfits, and CPU dropout
    # costs about a quarter of the step time.
    "tiny": ModelPreset(
        name="tiny", dim=128, layers=4, heads=4, ffn_dim=512, conv_channels=128, pos_kernel=31, pos_groups=8, dropout=0
    ),
    # HuBERT Base encoder width/depth (768 wide, 12 layers, 12 heads), ~95M parameters.
    "base": ModelPreset(
        name="base", dim=768, layers=12, heads=12, ffn_dim=3072, conv_channels=512, pos_kernel=128, pos_groups=16
    ),
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
