"""The synthetic learnable corpus (:func:`~speech_assets_tests.support.training_data.write_corpus`) in the
pipeline's layout a federated client reads (:class:`~speech_assets.federated.client_data.ClientData`),
and a Grid that answers the ServerApp's messages in process with the real ClientApp functions:
a whole federated run (server loop, Flower strategy, clients) without a SuperLink or SuperNodes.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from flwr.app import Context, Error, Message, Metadata, RecordDict

from speech_assets.features.cmvn import ShardStats
from speech_assets.features.shards import ShardFiles, iter_shard
from speech_assets.federated import client_app
from speech_assets.federated.config import FederatedConfig
from speech_assets_tests.support.training_data import write_corpus


@dataclass
class FederatedCorpus:
    """``data_dir`` in the pipeline layout; ``k`` per client; the held-out speakers (the first
    speaker of every client) and the training ones."""

    data_dir: Path
    k: dict[str, int]
    heldout_speakers: list[str]
    train_speakers: list[str]

    def config(self, root: Path, name: str, **settings: object) -> FederatedConfig:
        """A small real run on this corpus in ``root / name``: one round of 2 local FedAvg steps,
        fp32, 4 s batches, bounded waits, every client; ``settings`` override any of it."""
        values = {
            "rounds": 1,
            "local_steps": 2,
            "strategy": "fedavg",
            "client_lr": 5e-3,
            "precision": "fp32",
            "batch_seconds": 4.0,
            "heldout_speakers": self.heldout_speakers,
            "train_speakers": self.train_speakers,
            "connect_timeout_s": 5,
            "round_timeout_s": 600,
        } | settings
        return FederatedConfig(run_dir=str(root / name), run_name=name, clients=sorted(self.k), **values)


def write_federated_corpus(
    root: Path,
    clients: Mapping[str, int] = {"client_a": 8, "client_b": 12},
    speakers_per_client: int = 3,
    **options: object,
) -> FederatedCorpus:
    """:func:`write_corpus` under ``root``, moved into the layout :meth:`ClientData.resolve` reads:
    ``features/shards/<speaker>.parquet`` (+ its ``.stats.npz`` partial sums) and
    ``kmeans/<client>/{labels.parquet, quality.json}``."""
    corpus = write_corpus(root, clients, speakers_per_client=speakers_per_client, **options)  # type: ignore[arg-type]
    shards_dir = root / "features" / "shards"
    shards_dir.mkdir(parents=True, exist_ok=True)
    speakers = []
    for shard in map(Path, corpus.shards):
        speaker = shard.stem
        files = ShardFiles.of(shards_dir, speaker)
        stats = ShardStats()
        for record in iter_shard(shard):
            stats.add(speaker, "logmel", record.logmel)
            stats.add(speaker, "mfcc", record.mfcc)
        shutil.move(shard, files.shard)
        stats.save(files.stats)
        speakers.append(speaker)
    for client, targets in corpus.clients.items():
        (Path(targets.labels).parent / "quality.json").write_text(json.dumps({"k": targets.k}) + "\n")
    (root / "shards").rmdir()
    heldout = sorted(s for s in speakers if s.endswith("-spk0"))
    return FederatedCorpus(
        root, {c: t.k for c, t in corpus.clients.items()}, heldout, sorted(set(speakers) - set(heldout))
    )


@contextlib.contextmanager
def serverapp_identity() -> Iterator[None]:
    """What a ServerApp process is given by Flower before a strategy can build its messages."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)  # noqa: SLF001
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved  # noqa: SLF001


class InProcessGrid:
    """The Grid calls the ServerApp's :class:`~speech_assets.federated.server_app.Server` makes,
    each message answered at once by the ClientApp (train, evaluate or query) for the
    node it is addressed to (``nodes``: ``{node id: client id}``, every client's data under
    ``data_dir``, its state under ``state_root/<client id>``, every node's identity key pair under
    ``state_root/node-keys``)."""

    def __init__(self, nodes: Mapping[int, str], data_dir: Path, state_root: Path, threads: int = 1) -> None:
        from speech_assets.federated.auth import make_node_key

        self.nodes = dict(nodes)
        # every node's identity key pair, as the launcher makes them (NodeKeys: <client>.key/.pub)
        self.node_keys = state_root / "node-keys"
        for client in self.nodes.values():
            make_node_key(self.node_keys, client)
        self.node_config = {
            node: {
                "client-id": client,
                "data-dir": str(data_dir),
                "state-root": str(state_root / client),
                "threads": threads,
                "device": "cpu",
                "node-keys": str(self.node_keys),
            }
            for node, client in self.nodes.items()
        }
        self.outbox: list[Message] = []
        self.received: list[Message] = []  # every reply the server was sent, for tests to inspect

    def get_node_ids(self) -> list[int]:
        return sorted(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            node = message.metadata.dst_node_id
            sent = Message(
                metadata=Metadata(
                    run_id=1,
                    message_id=uuid.uuid4().hex,
                    src_node_id=0,
                    dst_node_id=node,
                    reply_to_message_id="",
                    group_id="",
                    created_at=0.0,
                    ttl=3600.0,
                    message_type=message.metadata.message_type,
                ),
                content=message.content,
            )
            context = Context(
                run_id=1, node_id=node, node_config=self.node_config[node], state=RecordDict(), run_config={}
            )
            try:
                answer = client_app.app(sent, context)
            except Exception as error:  # what a SuperNode sends back when its ClientApp raised
                answer = Message(Error(code=1, reason=f"{type(error).__name__}: {error}"), reply_to=sent)
            self.received.append(answer)
            self.outbox.append(answer)
            ids.append(sent.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        wanted = set(message_ids)
        found = [m for m in self.outbox if m.metadata.reply_to_message_id in wanted]
        self.outbox = [m for m in self.outbox if m not in found]
        return found


def run_in_process(
    corpus: FederatedCorpus,
    root: Path,
    name: str,
    grid: type[InProcessGrid] = InProcessGrid,
    node: Mapping[str, object] | None = None,
    **settings: object,
) -> tuple[object, InProcessGrid, FederatedConfig]:
    """A whole real run of ``corpus.config(root, name, **settings)`` (held-out evaluation after the
    last round only, unless ``settings`` say otherwise) by the ServerApp's round loop on a
    ``grid`` (an :class:`InProcessGrid` or a subclass playing a deviating server) whose nodes
    1, 2, ... are the corpus's clients, their state under ``root / "state"``; every client's node
    config updated with ``node`` (its own settings). Returns the result (or the
    ``FederatedRunError`` that stopped the run), the grid and the config."""
    from speech_assets.federated.server_app import FederatedRunError, Server

    config = corpus.config(root, name, **({"evaluate_every": 5} | settings))
    used = grid({n: c for n, c in enumerate(config.clients, start=1)}, corpus.data_dir, root / "state")
    for entry in used.node_config.values():
        entry.update(node or {})
    with serverapp_identity():
        try:
            result: object = Server(used, config).run()  # type: ignore[arg-type]
        except FederatedRunError as error:
            result = error
    return result, used, config
