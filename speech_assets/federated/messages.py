"""What may travel from a client to the server, checked on both sides: by the client before it
sends (:func:`check_outgoing`: a head, a codebook or statistics attached by a bug stops there), by
the server again (:func:`content_problem`, :func:`update_problem`). :class:`NodeBinding` ties each
reply to the SuperNode that sent it, so a node cannot answer as another client.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM  # the key of the clipping norm in a DP round

from speech_assets.federated.history import EVALUATION_METRICS

ARRAYS, METRICS, CLIENT_RECORD, CLIENT_ID = "arrays", "metrics", "client", "client-id"
TRAIN_METRICS = ("num-examples", "train-loss", "masked-accuracy", "seconds", "audio-seconds", "steps")
EVAL_METRICS = tuple(metric for metric, _ in EVALUATION_METRICS.values())
METRICS_OF = {"train": TRAIN_METRICS, "evaluate": EVAL_METRICS}
COUNTS = ("steps", *(metric for metric, kind in EVALUATION_METRICS.values() if kind is int))
FRACTIONS = {name for name in (*TRAIN_METRICS, *EVAL_METRICS) if name.endswith("accuracy")}
# the leak-free masked frames are a subset of the masked ones (``num-examples`` of an evaluate
# reply); with none, their accuracies travel as 0.0 (a metric must be a number)
LEAK_FREE_FRAMES = "leak-free-frames"
LEAK_FREE_FRACTIONS = ("heldout-leak-free-masked-accuracy", "leak-free-majority-accuracy")
# the weight the server adds to each accepted reply for Flower's aggregation (weighted_by_key)
SERVER_WEIGHT = "server-weight"
# in a DP round's config: whether the client sends its training metrics (absent: it sends none)
SHARE_CLIENT_METRICS = "share-client-metrics"

ArraySpec = dict[str, tuple[str, tuple[int, ...]]]


class OutgoingRefused(ValueError):
    """The client will not send this reply: it carries more (or other) than it may."""


def array_spec(record: ArrayRecord) -> ArraySpec:
    return {name: (str(np.dtype(array.dtype)), tuple(int(d) for d in array.shape)) for name, array in record.items()}


def train_metrics(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The metrics a train reply to a round of ``config`` carries: none under DP unless shared."""
    withheld = KEY_CLIPPING_NORM in config and not config.get(SHARE_CLIENT_METRICS, False)
    return () if withheld else TRAIN_METRICS


def metrics_problem(metrics: Mapping[str, Any], names: Sequence[str], *, withhold: bool = False) -> str | None:
    """Why a metrics record is refused (other keys, a value not finite, negative, not whole for a
    count, above 1 for a fraction, leak-free figures inconsistent). ``withhold``: the reason names
    no value (under DP a client's metrics are recorded nowhere)."""

    def show(value: Any) -> Any:
        return "withheld" if withhold else value

    if set(metrics) != set(names):
        return f"metrics must be exactly {sorted(names)} (got {sorted(metrics)[:10]})"
    for name in names:
        value = metrics[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"metric {name} is not a finite number ({show(f'{value!r:.40}')})"
        if value < 0:
            return f"metric {name} is negative ({show(value)})"
        if name in COUNTS and value != int(value):
            return f"metric {name} is not a whole number ({show(value)})"
        if name in FRACTIONS and value > 1:
            return f"metric {name} is above 1 ({show(value)})"
    if LEAK_FREE_FRAMES in names:
        frames = metrics[LEAK_FREE_FRAMES]
        if frames > metrics["num-examples"]:
            return f"metric {LEAK_FREE_FRAMES} ({show(frames)}) exceeds num-examples ({show(metrics['num-examples'])})"
        if frames == 0 and any(metrics[n] != 0 for n in LEAK_FREE_FRACTIONS):
            got = [metrics[n] for n in LEAK_FREE_FRACTIONS]
            return f"leak-free accuracies must be 0 with no leak-free frames (got {show(got)})"
    return None


def content_problem(
    content: RecordDict,
    phase: str,
    encoder: ArraySpec,
    clients: Collection[str] | None = None,
    metrics: Sequence[str] | None = None,
    *,
    withhold: bool = False,
) -> str | None:
    """Why a ``phase`` ("train" or "evaluate") reply may not cross to the server: the privacy
    boundary. ``encoder``: the spec of the global encoder sent down; ``metrics``: the names the
    reply must carry (default: all of the phase's)."""
    allowed = {ARRAYS, METRICS, CLIENT_RECORD} if phase == "train" else {METRICS, CLIENT_RECORD}
    extra = sorted(set(content.keys()) - allowed)
    if extra:
        return f"unexpected records {extra}"
    client = content.config_records.get(CLIENT_RECORD)
    if client is None or set(client) != {CLIENT_ID} or not isinstance(client[CLIENT_ID], str):
        return f"no {CLIENT_RECORD!r} record holding only a {CLIENT_ID!r}"
    if clients is not None and client[CLIENT_ID] not in clients:
        return f"client id {client[CLIENT_ID]!r:.80} is not taking part"
    record = content.metric_records.get(METRICS)
    if record is None:
        return f"no {METRICS!r} record"
    if problem := metrics_problem(record, METRICS_OF[phase] if metrics is None else metrics, withhold=withhold):
        return problem
    if phase == "train":
        arrays = content.array_records.get(ARRAYS)
        if arrays is None:
            return "no encoder"
        spec = array_spec(arrays)
        if spec != encoder:
            unexpected = sorted(set(spec) - set(encoder))
            missing = sorted(set(encoder) - set(spec))
            changed = sorted(n for n in set(spec) & set(encoder) if spec[n] != encoder[n])
            return (
                f"arrays are not exactly the encoder's (unexpected: {unexpected[:5]}, missing: {missing[:5]}, "
                f"other dtype or shape: {changed[:5]})"
            )
    elif content.array_records:
        return "an evaluate reply carries arrays"
    return None


def check_outgoing(
    content: RecordDict, phase: str, encoder: ArraySpec, client_id: str, metrics: Sequence[str] | None = None
) -> RecordDict:
    """The client's own check of its reply, before it leaves; raises :class:`OutgoingRefused`."""
    problem = content_problem(content, phase, encoder, clients=[client_id], metrics=metrics)
    if problem:
        raise OutgoingRefused(f"client {client_id} refuses to send its {phase} reply: {problem}")
    return content


def check_masked(out: Message, client_id: str) -> Message:
    """The client's check of a masked train reply before it leaves: only ``uint32`` arrays."""
    spec = array_spec(out.content[ARRAYS]) if ARRAYS in out.content.array_records else {}
    if any(dtype != "uint32" for dtype, _ in spec.values()):
        raise OutgoingRefused(f"client {client_id} refuses to send an unmasked update in a secure round")
    sent = out.content.metric_records.get(METRICS)
    check_outgoing(out.content, "train", spec, client_id, metrics=TRAIN_METRICS if sent else ())
    return out


def update_problem(
    update: Mapping[str, np.ndarray],
    current: Mapping[str, np.ndarray],
    bound: float,
    bound_name: str = "max_update_norm",
    *,
    withhold_norm: bool = False,
) -> tuple[float | None, str | None]:
    """``(norm, why refused)`` of a client's encoder against the global ``current``: refused when
    not finite or ``||update - current||_2 > bound``. ``withhold_norm``: under DP a client's exact
    norm goes nowhere, and the reason ends up on disk."""
    total = 0.0
    for name, base in current.items():
        value = np.asarray(update[name])
        if not np.isfinite(value).all():
            return None, f"{name} holds non-finite values"
        diff = value.astype(np.float64) - np.asarray(base, dtype=np.float64)
        total += float(np.dot(diff.ravel(), diff.ravel()))
    norm = math.sqrt(total)
    if not math.isfinite(norm) or norm > bound:
        shown = "" if withhold_norm else f" {norm:.4g}"
        return norm, f"update norm{shown} is beyond the bound {bound:.4g} ({bound_name})"
    return norm, None


def claimed_client(content: RecordDict) -> str | None:
    claimed = (content.config_records.get(CLIENT_RECORD) or {}).get(CLIENT_ID)
    return claimed if isinstance(claimed, str) else None


class NodeBinding:
    """Which client each SuperNode is: ``registered`` (node authentication) fixes it in advance,
    else a node is bound to the client its first accepted reply names (a remote SuperLink). A
    client id claimed twice counts once at most (never towards ``min_train_nodes``)."""

    def __init__(self, clients: Collection[str], registered: Mapping[int, str] | None = None) -> None:
        self.clients = set(clients)
        self.registered = dict(registered or {})
        self.node_client: dict[int, str] = dict(self.registered)

    def client_of(self, node: int) -> str | None:
        return self.node_client.get(node)

    def node_of(self, client: str) -> int | None:
        return next((n for n, c in self.node_client.items() if c == client), None)

    def problem(self, sent_to: int, reply: Message, connected: Collection[int]) -> tuple[str | None, str | None]:
        """``(claimed client, why refused)`` for one reply to a message sent to node ``sent_to``."""
        source = reply.metadata.src_node_id
        claimed = claimed_client(reply.content)
        if source != sent_to:
            return claimed, f"reply from node {source} to a message sent to node {sent_to}"
        if claimed is None:
            return None, f"no {CLIENT_RECORD!r} record with a {CLIENT_ID!r}"
        if claimed not in self.clients:
            return claimed, f"claims client id {claimed!r:.80}, which is not taking part"
        if self.registered and source not in self.registered:
            return claimed, f"node {source} is not a registered SuperNode"
        bound = self.node_client.get(source)
        if bound is not None and bound != claimed:
            return claimed, f"node {source} is client {bound} but claims to be {claimed}"
        owner = self.node_of(claimed)
        if owner is not None and owner != source and (self.registered or owner in connected):
            return claimed, f"claims to be {claimed}, which is node {owner}"
        return claimed, None

    def bind(
        self, replies: Sequence[tuple[int, Message]], phase: str, connected: Collection[int]
    ) -> tuple[list[Message], list[dict[str, Any]]]:
        """The ``(node sent to, reply)`` replies bound to their node, and a failure for every other."""
        failures: list[dict[str, Any]] = []
        claims: list[tuple[int, str, Message]] = []
        for sent_to, reply in replies:
            claimed, problem = self.problem(sent_to, reply, connected)
            if problem:
                failures.append(self.failure(phase, sent_to, claimed, problem))
            else:
                claims.append((reply.metadata.src_node_id, str(claimed), reply))
        counts = Counter(client for _, client, _ in claims)
        accepted = []
        for node, client, reply in claims:
            if counts[client] > 1:
                failures.append(self.failure(phase, node, client, f"{counts[client]} replies claim to be {client}"))
                continue
            previous = self.node_of(client)
            if previous is not None and previous != node:
                del self.node_client[previous]  # that node is gone: the client came back as a new one
            self.node_client[node] = client
            accepted.append(reply)
        return accepted, failures

    def failure(self, phase: str, node: int, claimed: str | None, reason: str) -> dict[str, Any]:
        return {
            "phase": phase,
            "client_id": self.client_of(node),
            "claimed_client_id": claimed,
            "node_id": node,
            "reason": reason,
        }
