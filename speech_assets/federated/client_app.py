"""The Flower ClientApp: a client's local round, held-out evaluation and ``query`` answers.

The SuperNode's ``--node-config`` (:class:`NodeConfig`) says who this client is and what it requires
of every round; the server cannot lower that. Under DP ``fixedclipping_mod`` clips the update and
the reply carries no metrics unless shared; secure aggregation then masks it. The head, codebook,
CMVN statistics and data stay here: every reply is checked before it leaves. A long-lived worker
keeps the datasets of :data:`CACHED_CLIENTS` clients; a model lives only while a message is handled.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from speech_assets.federated.client_data import ClientData
from speech_assets.federated.config import LocalConfig, NodeConfig
from speech_assets.federated.history import EVALUATION_METRICS
from speech_assets.federated.messages import CLIENT_ID, CLIENT_RECORD, array_spec, check_outgoing, train_metrics

if TYPE_CHECKING:
    from speech_assets.federated.local import EvalResult, LocalClient, TrainResult

log = logging.getLogger("speech_assets.federated")

# clients whose index and datasets a long-lived worker keeps (each a few MB; no model)
CACHED_CLIENTS = 16
# what changes from round to round and does not touch the data index
ROUND_KEYS = ("lr", "lr-end", "proximal-mu", "local-steps")
_CLIENTS: OrderedDict[str, LocalClient] = OrderedDict()


def _setup_logging() -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s client %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def local_client(node: NodeConfig, local: LocalConfig) -> LocalClient:
    """The LocalClient built for an earlier message of the same run and data settings, or a new one."""
    from speech_assets.federated.local import LocalClient

    record = {k: v for k, v in local.to_record().items() if k not in ROUND_KEYS}
    key = json.dumps([asdict(node), record], sort_keys=True)
    client = _CLIENTS.pop(key, None)
    if client is None:
        client = LocalClient(ClientData.resolve(node.data_dir, node.client_id), local, node)
    client.local = local
    _CLIENTS[key] = client
    while len(_CLIENTS) > CACHED_CLIENTS:
        _CLIENTS.popitem(last=False)
    return client


def reply(
    kind: str,
    received: ArrayRecord,
    result: TrainResult | EvalResult,
    client_id: str,
    config: ConfigRecord | None = None,
) -> RecordDict:
    """A checked reply: the metrics the round's ``config`` lets leave, the client id, after training the encoder."""
    names = {metric: column for column, (metric, _) in EVALUATION_METRICS.items()}  # EvalResult's fields
    if kind == "train":
        sent = train_metrics(config or {})
        names = {name: name.replace("-", "_") for name in sent}  # TrainResult's fields are the metrics' names
    # a metric must be a finite number: an accuracy over no (leak-free) frames travels as 0.0
    values = {name: 0.0 if (value := getattr(result, field)) is None else value for name, field in names.items()}
    content = {"metrics": MetricRecord(values), CLIENT_RECORD: ConfigRecord({CLIENT_ID: client_id})}
    if kind == "train":
        content["arrays"] = ArrayRecord(result.encoder)  # type: ignore[union-attr,arg-type]
    return check_outgoing(RecordDict(content), kind, array_spec(received), client_id, list(names))  # type: ignore[arg-type]


def _answer(message: Message, node: NodeConfig, kind: str) -> Message:
    _setup_logging()
    config = message.content["config"]
    client = local_client(node, LocalConfig.from_record(config))
    received = message.content["arrays"]
    client.log_metrics = kind != "train" or bool(train_metrics(config))
    run = client.train_round if kind == "train" else client.evaluate
    result = run(int(config["server-round"]), received.to_torch_state_dict())
    return Message(reply(kind, received, result, node.client_id, config), reply_to=message)


def answer_train(message: Message, context: Context, node: NodeConfig) -> Message:
    """A local round; its update clipped (DP) and masked (secure aggregation) as the round asks."""
    config = message.content["config"]
    check_required(config, node)

    def inner(msg: Message, _ctx: Context) -> Message:
        return _answer(msg, node, "train")

    if KEY_CLIPPING_NORM in config:
        # Flower's mod wants the config as the message's only ConfigRecord: the shares routed to
        # this client (secure aggregation) stand aside while it clips
        aside = {k: message.content.pop(k) for k in list(message.content.config_records) if k != "config"}
        try:
            out = fixedclipping_mod(message, context, inner)
        finally:
            for key, record in aside.items():
                message.content[key] = record
    else:
        out = inner(message, context)
    if not out.has_error() and secure_round(config):
        from speech_assets.federated.secure_rounds import mask_reply

        out = mask_reply(out, message, node)
    return out


class DowngradeRefused(ValueError):
    """A train message without a protection this client's own settings require."""


def check_required(config: ConfigRecord, node: NodeConfig) -> None:
    """Refuse, before training, a round without what this node's own settings require (never what
    the server says): a server that leaves out secure aggregation or DP, or sends a huge clipping
    norm, would get the update in the clear or (in effect) unclipped."""
    if node.require_secure_aggregation and not secure_round(config):
        raise DowngradeRefused(
            f"client {node.client_id} requires secure aggregation (require-secure-aggregation) and refuses "
            "a train message without it: its update would leave in the clear"
        )
    if node.require_dp and KEY_CLIPPING_NORM not in config:
        raise DowngradeRefused(
            f"client {node.client_id} requires differential privacy (require-dp) and refuses a train "
            "message without its clipping norm: its update would leave unclipped"
        )
    if KEY_CLIPPING_NORM in config and (node.require_dp or node.dp_max_clipping_norm):
        clip = config[KEY_CLIPPING_NORM]
        bound = node.dp_max_clipping_norm or math.inf
        # `not (0 < clip <= bound)` also refuses NaN, which compares false with everything
        if isinstance(clip, bool) or not isinstance(clip, int | float) or not 0 < clip <= bound:
            raise DowngradeRefused(
                f"client {node.client_id} refuses a clipping norm of {clip!r:.40}: it must be > 0 and at most its "
                f"dp-max-clipping-norm ({node.dp_max_clipping_norm or 'none'}); a larger one would leave its "
                "update barely clipped"
            )


def secure_round(config: ConfigRecord) -> bool:
    from speech_assets.federated.secure_rounds import SECAGG_NONCE

    return SECAGG_NONCE in config


def answer_query(message: Message, node: NodeConfig) -> Message:
    config = message.content["config"]
    # a long-lived worker imports torch now, before the first round is timed
    import speech_assets.federated.local  # noqa: F401

    content = RecordDict({CLIENT_RECORD: ConfigRecord({CLIENT_ID: node.client_id})})
    if config.get("secure-aggregation"):
        from speech_assets.federated.secure_rounds import answer_secure_query

        answer_secure_query(config, node, content)
    return Message(content, reply_to=message)


def build_client_app(nodes: Sequence[NodeConfig] | None = None) -> ClientApp:
    """In the simulation runtime node ``partition-id`` is ``nodes[partition-id]``; else ``--node-config``."""
    client_app = ClientApp()

    def node_of(context: Context) -> NodeConfig:
        if nodes is not None:
            return nodes[int(context.node_config["partition-id"])]
        return NodeConfig.from_node_config(context.node_config)

    client_app.train()(lambda message, context: answer_train(message, context, node_of(context)))
    client_app.evaluate()(lambda message, context: _answer(message, node_of(context), "evaluate"))
    client_app.query()(lambda message, context: answer_query(message, node_of(context)))
    return client_app


app = build_client_app()
