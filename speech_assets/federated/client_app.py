"""The Flower ClientApp: one client's local round and held-out evaluation.

The SuperNode's ``--node-config`` says who this client is and where its data is
(:class:`~speech_assets.federated.config.NodeConfig`); the message brings the global encoder
(an ``ArrayRecord`` of the encoder's tensors) and the round's instructions (a ``ConfigRecord``,
:class:`~speech_assets.federated.config.LocalConfig`). A train reply carries the locally trained
encoder, a ``MetricRecord`` (``num-examples`` = training utterances, the FedAvg weight;
``train-loss``, ``masked-accuracy``, ``seconds``, ``audio-seconds``, ``steps``) and the client id;
an evaluate reply only the metrics (``num-examples`` = masked held-out frames) and the client id.
The head, the codebook, the CMVN statistics and the data stay here: every reply is checked
before it leaves (:func:`~speech_assets.federated.messages.check_outgoing`), and the run name the
server sends must be a safe id before it names this client's state folder (under the state root
its SuperNode owns).
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from speech_assets.federated.client_data import ClientData
from speech_assets.federated.config import LocalConfig, NodeConfig
from speech_assets.federated.messages import CLIENT_ID, CLIENT_RECORD, array_spec, check_outgoing

if TYPE_CHECKING:
    from speech_assets.federated.local import EvalResult, TrainResult

log = logging.getLogger("speech_assets.federated")

app = ClientApp()


def _client(message: Message, context: Context) -> tuple[object, int, NodeConfig]:
    from speech_assets.federated.local import LocalClient

    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s client %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    node = NodeConfig.from_node_config(context.node_config)
    config = message.content["config"]
    local = LocalConfig.from_record(config)
    client = LocalClient(ClientData.resolve(node.data_dir, node.client_id), local, node)
    return client, int(config["server-round"]), node


def train_reply(received: ArrayRecord, result: TrainResult, client_id: str) -> RecordDict:
    """A local round's reply, checked against the encoder ``received`` from the server."""
    metrics = MetricRecord(
        {
            "num-examples": result.num_examples,
            "train-loss": result.train_loss,
            "masked-accuracy": result.masked_accuracy,
            "seconds": result.seconds,
            "audio-seconds": result.audio_seconds,
            "steps": result.steps,
        }
    )
    content = RecordDict(
        {"arrays": ArrayRecord(result.encoder), "metrics": metrics,  # type: ignore[arg-type]
         CLIENT_RECORD: ConfigRecord({CLIENT_ID: client_id})}  # fmt: skip
    )
    return check_outgoing(content, "train", array_spec(received), client_id)


def evaluate_reply(received: ArrayRecord, result: EvalResult, client_id: str) -> RecordDict:
    """An evaluation's reply, checked."""
    metrics = MetricRecord(
        {
            "num-examples": result.masked_frames,
            "utterances": result.utterances,
            "heldout-loss": result.loss,
            "heldout-masked-accuracy": result.masked_accuracy,
            "majority-accuracy": result.majority_accuracy,
        }
    )
    content = RecordDict({"metrics": metrics, CLIENT_RECORD: ConfigRecord({CLIENT_ID: client_id})})
    return check_outgoing(content, "evaluate", array_spec(received), client_id)


@app.train()
def train(message: Message, context: Context) -> Message:
    client, round_number, node = _client(message, context)
    received = message.content["arrays"]
    result = client.train_round(round_number, received.to_torch_state_dict())  # type: ignore[attr-defined]
    return Message(train_reply(received, result, node.client_id), reply_to=message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    client, round_number, node = _client(message, context)
    received = message.content["arrays"]
    result = client.evaluate(round_number, received.to_torch_state_dict())  # type: ignore[attr-defined]
    return Message(evaluate_reply(received, result, node.client_id), reply_to=message)
