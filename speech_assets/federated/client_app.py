"""The Flower ClientApp: one client's local round and held-out evaluation.

The SuperNode's ``--node-config`` says who this client is and where its data is
(:class:`~speech_assets.federated.config.NodeConfig`); the message brings the global encoder
(an ``ArrayRecord`` of the encoder's tensors) and the round's instructions (a ``ConfigRecord``,
:class:`~speech_assets.federated.config.LocalConfig`). A train reply carries the locally trained
encoder, a ``MetricRecord`` (``num-examples`` = training utterances, the FedAvg weight;
``train-loss``, ``masked-accuracy``, ``seconds``, ``audio-seconds``, ``steps``) and the client id;
an evaluate reply only the metrics (``num-examples`` = masked held-out frames; ``leak-free-frames``
and the accuracies on them, 0.0 when there are none) and the client id.
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


TRAIN_METRICS = {"num-examples": "num_examples", "train-loss": "train_loss", "masked-accuracy": "masked_accuracy",
                 "seconds": "seconds", "audio-seconds": "audio_seconds", "steps": "steps"}  # fmt: skip
EVALUATE_METRICS = {"num-examples": "masked_frames", "utterances": "utterances", "heldout-loss": "loss",
                    "heldout-masked-accuracy": "masked_accuracy", "majority-accuracy": "majority_accuracy",
                    "leak-free-frames": "leak_free_frames", "heldout-leak-free-masked-accuracy": "leak_free_masked_accuracy",
                    "leak-free-majority-accuracy": "leak_free_majority_accuracy"}  # fmt: skip


def reply(kind: str, received: ArrayRecord, result: TrainResult | EvalResult, client_id: str) -> RecordDict:
    """A ``train`` or ``evaluate`` reply: the result's metrics, the client id and, after a local
    round, its encoder; checked against the encoder ``received`` from the server."""
    names = TRAIN_METRICS if kind == "train" else EVALUATE_METRICS
    # a metric must be a finite number: an accuracy over no (leak-free) frames travels as 0.0
    values = {name: 0.0 if (value := getattr(result, field)) is None else value for name, field in names.items()}
    content = {"metrics": MetricRecord(values),
               CLIENT_RECORD: ConfigRecord({CLIENT_ID: client_id})}  # fmt: skip
    if kind == "train":
        content["arrays"] = ArrayRecord(result.encoder)  # type: ignore[union-attr,arg-type]
    return check_outgoing(RecordDict(content), kind, array_spec(received), client_id)  # type: ignore[arg-type]


def train_reply(received: ArrayRecord, result: TrainResult, client_id: str) -> RecordDict:
    return reply("train", received, result, client_id)


def evaluate_reply(received: ArrayRecord, result: EvalResult, client_id: str) -> RecordDict:
    return reply("evaluate", received, result, client_id)


def _answer(message: Message, context: Context, kind: str) -> Message:
    client, round_number, node = _client(message, context)
    received = message.content["arrays"]
    run = client.train_round if kind == "train" else client.evaluate  # type: ignore[attr-defined]
    result = run(round_number, received.to_torch_state_dict())  # type: ignore[attr-defined]
    return Message(reply(kind, received, result, node.client_id), reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
    return _answer(message, context, "train")


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    return _answer(message, context, "evaluate")
