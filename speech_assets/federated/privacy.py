"""Client-level differential privacy of the shared encoder (off unless ``dp_noise_multiplier > 0``),
on Flower's pieces (clipping, ``compute_stdv``, ``RdpAccountant``); the mechanism and what it does
not cover are in docs/ARCHITECTURE.md and docs/PRIVACY.md.

The noise comes from ``os.urandom``, never a seeded or global generator: the run's seed is a logged
parameter and numpy's global generator is seeded from it, so their noise would be known to anyone
who read the run's params.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.serverapp import GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod
from flwr.supercore.differential_privacy import compute_stdv

from speech_assets.federated.config import FederatedConfig

NDArrays = dict[str, np.ndarray]


def secure_gaussian(count: int, std: float) -> np.ndarray:
    """``(count,)`` draws of N(0, ``std``²): Box-Muller on pairs of 53-bit uniforms from ``os.urandom``
    (|z| is bounded by sqrt(2 ln 2^53) ≈ 8.6 standard deviations)."""
    pairs = (count + 1) // 2
    bits = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(2, pairs) >> np.uint64(11)
    u1 = (bits[0].astype(np.float64) + 1.0) * 2.0**-53  # (0, 1]: log is finite
    u2 = bits[1].astype(np.float64) * 2.0**-53
    radius = np.sqrt(-2.0 * np.log(u1))
    angle = 2.0 * math.pi * u2
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count] * std


class Privacy:
    def __init__(self, config: FederatedConfig, state: dict[str, Any] | None = None) -> None:
        self.config = config
        self.accountant = RdpAccountant(
            PrivacyConfig(
                target_delta=config.dp_delta,
                population_size=len(config.clients),
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                sampling_method=SamplingMethod.NO_AMPLIFICATION,
            )
        )
        if state:
            self.accountant.load_state_dict(state)

    def noisy_mean(self, update_sum: Mapping[str, np.ndarray], sampled: int) -> NDArrays:
        """``update_sum`` (of clipped updates) over the ``sampled`` clients plus Gaussian noise, float32;
        composes one release in the accountant. A sampled client that did not reply is a zero update,
        so the sensitivity is ``clipping_norm / sampled`` whoever replied."""
        if sampled < 1:
            raise ValueError(f"a DP mean needs at least one sampled client (got {sampled})")
        std = compute_stdv(self.config.dp_noise_multiplier, self.config.dp_clipping_norm, sampled)
        noisy = {
            name: (
                np.asarray(total, dtype=np.float64) / sampled + secure_gaussian(total.size, std).reshape(total.shape)
            ).astype(np.float32)
            for name, total in update_sum.items()
        }
        self.accountant.compose(
            GaussianPrivacyEvent(
                noise_multiplier=self.config.dp_noise_multiplier,
                sample_size=sampled,
                population_size=len(self.config.clients),
            )
        )
        return noisy

    def spent(self) -> dict[str, Any]:
        spent = self.accountant.get_privacy_spent()
        return {
            "epsilon": float(spent.epsilon),
            "delta": float(spent.delta),
            "releases": int(spent.num_releases),
            "noise_multiplier": self.config.dp_noise_multiplier,
            "clipping_norm": self.config.dp_clipping_norm,
            "accounting": f"{spent.accounting_method}, no sampling amplification",
        }

    def state(self) -> dict[str, Any]:
        return self.accountant.state_dict()
