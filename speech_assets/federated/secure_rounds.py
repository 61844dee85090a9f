"""Secure aggregation in the round loop: the messages of :mod:`secure_aggregation`'s protocol,
on the server (:class:`SecureRounds`) and on the client (:func:`mask_reply`,
:func:`answer_secure_query`).

1. Key-up: the server's ``query`` to a node it does not know yet (``Server.identify``) is
   answered with the client id and the client's X25519 public key for this run (derived from a
   32-byte secret the client keeps in its state root, 0600, never sent).
2. A train message of a secure round carries the public keys of every client sampled in the
   round and a fresh nonce; the client trains, clips (DP) and masks its update
   (``mask_update``): the train reply holds ``uint32`` masked values in place of the encoder.
3. Clients sampled but silent (or refused) are dropped once the replies are in; only then does
   the server ask the survivors (``query``, kind ``secagg-unmask``) for the net masks they shared
   with the dropped ones, sums and unmasks (``unmask_sum``) and divides by the number of
   survivors: the mean update. A masked reply that arrives after that decision is never used.

Why not Flower's SecAgg+: in Flower 1.42 ``SecAggPlusWorkflow`` and ``secaggplus_mod`` exist only
on the legacy path (a legacy ``Strategy`` with ``configure_fit``/``aggregate_fit``, a
``ClientManager``, ``FitIns``/``FitRes`` records in the legacy layout); it owns the whole fit
stage, so the Message-API strategies (FedAdam, FedProx), the server's reply checks, the seeded
sampling and the resumable round records would all have to be rebuilt around it. The primitives
here are maintained libraries' (``cryptography``'s X25519, HKDF and ChaCha20; Flower's
quantization); what this adds is the message flow.

What the server can no longer check: an individual update's norm and values (it only sees them
masked). Each value is clipped to ``±secagg_clipping_range`` by the quantization, so one client can
move the mean by at most that per value; with DP the clipping norm bounds it too. Threat model: an
honest-but-curious server (see :mod:`secure_aggregation`); Bonawitz's self-masks and secret
sharing, which also protect against a server that lies about drop-outs, are not implemented.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from speech_assets.federated.config import FederatedConfig, NodeConfig
from speech_assets.federated.messages import ARRAYS, CLIENT_RECORD, ArraySpec, check_masked, content_problem
from speech_assets.federated.secure_aggregation import (
    DEFAULT_TARGET_RANGE,
    KEY_BYTES,
    ClientKeys,
    SecAggParams,
    dropped_masks,
    load_or_create_secret,
    mask_update,
    round_context,
    unmask_sum,
)

if TYPE_CHECKING:
    from speech_assets.federated.server_app import Server

# keys of a secure round's ConfigRecord (train and unmask messages)
SECAGG_NONCE, SECAGG_PEERS, SECAGG_RANGE, SECAGG_TARGET = "secagg-nonce", "secagg-peers", "secagg-range", "secagg-target"
SECAGG_DROPPED, SECAGG_SHAPES, KIND = "secagg-dropped", "secagg-shapes", "kind"
UNMASK = "secagg-unmask"
# the record of an identify reply that holds the public key
KEY_RECORD, PUBLIC_KEY = "secagg", "public-key"
SECRET_FILE = "secagg.key"


def masked_spec(spec: ArraySpec) -> ArraySpec:
    """The arrays of a masked train reply: the encoder's names and shapes, as ``uint32``."""
    return {name: ("uint32", shape) for name, (_, shape) in spec.items()}


# ----------------------------------------------------------------------------------- server
class SecureRounds:
    """The server's side: the clients' public keys, each round's peers and nonce, unmasking."""

    def __init__(self, config: FederatedConfig) -> None:
        self.config = config
        self.params = SecAggParams(config.secagg_range(), DEFAULT_TARGET_RANGE)
        self.params.check_clients(config.sample_size)
        self.public_keys: dict[str, bytes] = {}
        self.nonce = b""
        self.peers: dict[str, bytes] = {}
        self.dropped: list[str] = []
        self.survivors = 0

    def has_key(self, client: str) -> bool:
        return client in self.public_keys

    def learn_key(self, client: str, content: RecordDict) -> str | None:
        """Store ``client``'s public key from its identify reply; why it is refused, else ``None``."""
        record = content.config_records.get(KEY_RECORD)
        key = record.get(PUBLIC_KEY) if record is not None else None
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            return f"no {KEY_BYTES}-byte public key in the identify reply"
        self.public_keys[client] = key
        return None

    def configure(self, local: ConfigRecord, round_number: int, clients: Collection[str | None]) -> None:
        """Put the round's peers (every sampled client that is reachable, with its key) and a
        fresh nonce into the train config."""
        self.nonce = os.urandom(16)
        self.peers = {c: self.public_keys[c] for c in sorted(c for c in clients if c is not None)}
        self.dropped, self.survivors = [], 0
        local[SECAGG_NONCE] = self.nonce
        local[SECAGG_PEERS] = json.dumps({c: key.hex() for c, key in self.peers.items()}, sort_keys=True)
        local[SECAGG_RANGE] = self.params.clipping_range
        local[SECAGG_TARGET] = self.params.target_range

    def accept(self, good: list[Message], server: Server, failures: list[dict[str, Any]]) -> list[Message]:
        """The masked train replies that carry exactly the masked encoder, the metrics and the
        client id (their values cannot be checked: they are masked)."""
        accepted = []
        spec = masked_spec(server.expected)
        for reply in good:
            problem = content_problem(reply.content, "train", spec, self.config.clients, server.train_names)
            if problem is None and server.client_of(reply) not in self.peers:
                problem = "not among this round's peers"
            if problem:
                failures.append(server.failure(reply, "train", problem))
            else:
                accepted.append(reply)
        return accepted

    def mean_update(
        self, round_number: int, good: list[Message], server: Server, failures: list[dict[str, Any]]
    ) -> dict[str, np.ndarray]:
        """The mean of the survivors' updates: the dropped set is fixed first (peers without an
        accepted masked reply), then the survivors reveal their masks with them."""
        masked = {server.client_of(r): {n: a.numpy() for n, a in r.content[ARRAYS].items()} for r in good}
        self.dropped = sorted(set(self.peers) - set(masked))
        self.survivors = len(masked)
        revealed: dict[str, dict[str, np.ndarray]] = {}
        if self.dropped:
            revealed = self.reveal(round_number, sorted(masked), server, failures)
        total = unmask_sum(masked, revealed, self.params)
        return {name: (value / len(masked)).astype(np.float32) for name, value in total.items()}

    def reveal(
        self, round_number: int, survivors: list[str], server: Server, failures: list[dict[str, Any]]
    ) -> dict[str, dict[str, np.ndarray]]:
        nodes = {c: server.binding.node_of(c) for c in survivors}
        shapes = {name: list(shape) for name, (_, shape) in server.expected.items()}
        config = ConfigRecord({
            KIND: UNMASK, "secure-aggregation": True, "run-name": self.config.run_name, "server-round": round_number,
            SECAGG_NONCE: self.nonce, SECAGG_PEERS: json.dumps({c: k.hex() for c, k in self.peers.items()}, sort_keys=True),
            SECAGG_DROPPED: ",".join(self.dropped), SECAGG_SHAPES: json.dumps(shapes, sort_keys=True),
        })  # fmt: skip
        messages = [
            Message(RecordDict({"config": config}), dst_node_id=int(node), message_type=MessageType.QUERY)
            for node in nodes.values()
            if node is not None
        ]
        good, reveal_failures = server.exchange(messages, round_number, "unmask")
        failures.extend(reveal_failures)
        revealed = {server.client_of(r): {n: a.numpy() for n, a in r.content[ARRAYS].items()} for r in good if ARRAYS in r.content}
        missing = sorted(set(survivors) - set(revealed))
        if missing:
            server.fail(round_number, f"round {round_number}: survivors {missing} did not reveal their masks with the "
                        f"dropped clients {self.dropped}; the sum cannot be unmasked", self.dropped, failures)  # fmt: skip
        return revealed

    def record(self, round_number: int) -> dict[str, Any]:
        return {"round": round_number, "peers": sorted(self.peers), "survivors": self.survivors, "dropped": self.dropped,
                "clipping_range": self.params.clipping_range, "target_range": self.params.target_range}  # fmt: skip


# ----------------------------------------------------------------------------------- client
@functools.lru_cache(maxsize=64)
def client_keys(state_root: str, run_name: str) -> ClientKeys:
    """This client's key pair for ``run_name``, from the secret in its state root (made once)."""
    root = Path(state_root)
    root.mkdir(parents=True, exist_ok=True)
    return ClientKeys.derive(load_or_create_secret(root / SECRET_FILE), run_name)


def _peers(config: ConfigRecord) -> dict[str, bytes]:
    return {c: bytes.fromhex(k) for c, k in json.loads(str(config[SECAGG_PEERS])).items()}


def _context(config: ConfigRecord) -> bytes:
    return round_context(str(config["run-name"]), int(config["server-round"]), bytes(config[SECAGG_NONCE]))  # type: ignore[arg-type]


def mask_reply(out: Message, message: Message, node: NodeConfig) -> Message:
    """Replace the train reply's encoder by its masked update (encoder minus the one received)."""
    config = message.content["config"]
    received = message.content[ARRAYS]
    trained = out.content[ARRAYS]
    update = {name: trained[name].numpy().astype(np.float64) - received[name].numpy() for name in received}
    params = SecAggParams(float(config[SECAGG_RANGE]), int(config[SECAGG_TARGET]))  # type: ignore[arg-type]
    keys = client_keys(str(node.root), str(config["run-name"]))
    masked = mask_update(update, node.client_id, keys, _peers(config), params, _context(config))
    out.content[ARRAYS] = ArrayRecord({name: Array(masked[name]) for name in received})
    return check_masked(out, node.client_id)


def answer_secure_query(config: ConfigRecord, node: NodeConfig, content: RecordDict) -> None:
    """Add this client's public key (identify) or its net masks with the dropped peers (unmask)."""
    keys = client_keys(str(node.root), str(config["run-name"]))
    if config.get(KIND) == UNMASK:
        shapes = {name: tuple(shape) for name, shape in json.loads(str(config[SECAGG_SHAPES])).items()}
        dropped = [c for c in str(config[SECAGG_DROPPED]).split(",") if c]
        masks = dropped_masks(node.client_id, keys, _peers(config), dropped, shapes, _context(config))
        content[ARRAYS] = ArrayRecord({name: Array(masks[name]) for name in sorted(masks)})
    else:
        content[KEY_RECORD] = ConfigRecord({PUBLIC_KEY: keys.public_bytes()})
