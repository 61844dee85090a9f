"""Differential privacy of the shared encoder (off unless ``dp_noise_multiplier > 0``).

Client-level DP with client-side clipping, built from Flower's own pieces:

- each client clips its update (its encoder minus the global one) to ``dp_clipping_norm`` with
  Flower's ``fixedclipping_mod`` (the ClientApp applies it when the round's config carries the
  clipping norm);
- the server takes the *uniformly* weighted mean of the clipped updates and adds Gaussian noise of
  standard deviation ``dp_noise_multiplier * dp_clipping_norm / n`` to it, with Flower's
  ``DifferentialPrivacyClientSideFixedClipping`` around a uniform ``FedAvg`` (n = the clients
  whose update is in the mean);
- only then does the run's strategy (FedAdam, FedAvg, FedProx) take its step, from that one noisy
  mean: post-processing, so the guarantee holds whatever the server optimiser does (Flower's
  wrapper around FedAdam would add the noise after FedAdam's step, where it does not).

Every release is composed in Flower's ``RdpAccountant`` (Google's dp-accounting) as a Gaussian
mechanism without sampling amplification (Flower's accounting for fixed clipping requires it; the
seeded sampling of clients would allow a smaller epsilon, not claimed here). The accountant's state
travels in each round's record, so a resumed run goes on counting where it stopped.

The noise comes from numpy's global generator (Flower's ``add_gaussian_noise_inplace``): it must
be unpredictable, so a re-run round draws other noise and DP runs do not repeat bit for bit.
"""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg

from speech_assets.federated.config import FederatedConfig

# the metric every DP reply carries as its (equal) weight for the uniform mean
UNIFORM_WEIGHT = "uniform-weight"


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

    def noisy_mean(self, round_number: int, arrays: ArrayRecord, replies: list[Message], nodes: Any) -> ArrayRecord:
        """The uniform mean of ``replies``' encoders (each already within the clipping norm of
        ``arrays``, the global encoder) plus Gaussian noise; composes one release. ``nodes``: one
        node id per reply, as a strategy samples them (``get_node_ids``)."""
        n = len(replies)
        for reply in replies:
            reply.content["metrics"][UNIFORM_WEIGHT] = 1.0
        inner = FedAvg(fraction_train=1.0, min_train_nodes=n, min_available_nodes=n, weighted_by_key=UNIFORM_WEIGHT)
        mechanism = DifferentialPrivacyClientSideFixedClipping(
            inner, self.config.dp_noise_multiplier, self.config.dp_clipping_norm, n, accountant=self.accountant
        )
        # registers the round's pending privacy event (the messages themselves are not sent)
        mechanism.configure_train(round_number, arrays, ConfigRecord(), nodes)
        noisy, _ = mechanism.aggregate_train(round_number, replies)
        for reply in replies:
            del reply.content["metrics"][UNIFORM_WEIGHT]
        if noisy is None:
            raise ValueError(f"round {round_number}: the DP mechanism refused to aggregate {n} replies")
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
