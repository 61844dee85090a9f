"""Differential privacy of the shared encoder (off unless ``dp_noise_multiplier > 0``).

Client-level DP with client-side clipping, on Flower's pieces:

- each client clips its update (its encoder minus the global one) to ``dp_clipping_norm`` with
  Flower's ``fixedclipping_mod`` (the ClientApp applies it when the round's config carries the
  clipping norm); the server refuses an update whose norm exceeds the clipping norm by more than
  :data:`~speech_assets.federated.config.DP_NORM_TOLERANCE` (float rounding), and scales the
  ones it accepts to at most the clipping norm exactly, so the sensitivity is what the
  accountant assumes;
- the server releases :meth:`Privacy.noisy_mean`: the sum of the accepted updates divided by
  the number of clients *sampled* (:func:`mean_over_sampled`: a sampled client that did not reply,
  or whose reply was refused, counts as a zero update; Flower's strict behaviour, without
  which the sensitivity would depend on who replied), plus Gaussian noise of standard deviation
  ``dp_noise_multiplier * dp_clipping_norm / sampled`` (Flower's ``compute_stdv``);
- only then does the run's strategy (FedAdam, FedAvg, FedProx) take its step, from that one noisy
  mean: post-processing, so the guarantee holds whatever the server optimiser does.

Every release is composed in Flower's ``RdpAccountant`` (Google's dp-accounting) as a Gaussian
mechanism without sampling amplification (the seeded sampling of clients would allow a smaller
epsilon, not claimed here). The accountant's state travels in each round's record, which is
durable before the noisy encoder is sent anywhere, so a resumed run goes on counting where it
stopped and never draws a released round again.

The noise comes from the operating system's CSPRNG (``os.urandom``), never from a seeded or a
global generator: the run's seed is a logged parameter, and numpy's global generator is seeded
from it (the initial encoder, the clients' dropout in process), so noise drawn from either would
be known to anyone who read the run's params. :func:`secure_gaussian` turns 53-bit uniforms into
normals with the Box-Muller transform. What the guarantee does not cover is in docs/PRIVACY.md.
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
    """``(count,)`` float64 draws of N(0, ``std``²) from ``os.urandom`` (Box-Muller on pairs of
    53-bit uniforms; |z| is bounded by sqrt(2 ln 2^53) ≈ 8.6 standard deviations)."""
    pairs = (count + 1) // 2
    bits = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(2, pairs) >> np.uint64(11)
    u1 = (bits[0].astype(np.float64) + 1.0) * 2.0**-53  # (0, 1]: log is finite
    u2 = bits[1].astype(np.float64) * 2.0**-53
    radius = np.sqrt(-2.0 * np.log(u1))
    angle = 2.0 * math.pi * u2
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count] * std


def mean_over_sampled(update_sum: Mapping[str, np.ndarray], sampled: int) -> NDArrays:
    """The DP mean update: ``update_sum`` (the sum of the clipped updates that arrived, any shape
    per tensor) divided by the number of clients ``sampled`` for the round, float64. A sampled
    client whose update is not in the sum counts as a zero update, so one client changes the mean
    by at most ``clipping_norm / sampled`` whoever replied: the sensitivity the noise is for."""
    if sampled < 1:
        raise ValueError(f"a DP mean needs at least one sampled client (got {sampled})")
    return {name: np.asarray(value, dtype=np.float64) / sampled for name, value in update_sum.items()}


class Privacy:
    """The DP mechanism and its accountant for one run (see the module docstring)."""

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

    def stdv(self, sampled: int) -> float:
        """The noise's standard deviation on the mean of ``sampled`` clients."""
        return compute_stdv(self.config.dp_noise_multiplier, self.config.dp_clipping_norm, sampled)

    def noisy_mean(self, update_sum: Mapping[str, np.ndarray], sampled: int) -> NDArrays:
        """:func:`mean_over_sampled` plus N(0, :meth:`stdv`²) on every value, float32 (shapes of
        ``update_sum``); composes one release in the accountant. Each update in ``update_sum``
        must be within the clipping norm."""
        std = self.stdv(sampled)
        noisy = {
            name: (mean + secure_gaussian(mean.size, std).reshape(mean.shape)).astype(np.float32)
            for name, mean in mean_over_sampled(update_sum, sampled).items()
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
        """``{epsilon, delta, releases, noise_multiplier, clipping_norm}`` so far."""
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
