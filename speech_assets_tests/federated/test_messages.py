"""What crosses between clients and the server, without processes: the client's check of its own
reply, the binding of a reply to the node that sent it, the checks of an update's values, the
aggregation weights, and the deadlines of every wait on clients.

The Server runs against `ScriptedGrid`, a stand-in for Flower's Grid that delivers replies the
test writes (the real SuperLink path runs in test_federation.py)."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, Metadata, MetricRecord, RecordDict

from speech_assets.federated.client_app import reply
from speech_assets.federated.config import FederatedConfig, update_norm_bound
from speech_assets.federated.local import EvalResult, TrainResult
from speech_assets.federated.messages import (
    EVAL_METRICS,
    TRAIN_METRICS,
    NodeBinding,
    OutgoingRefused,
    array_spec,
    update_problem,
)
from speech_assets.federated.server_app import FederatedRunError, Server, make_strategy

CLIENTS = ["client_00", "client_01", "client_02"]


@pytest.fixture(autouse=True)
def serverapp_identity() -> Iterator[None]:
    """What a ServerApp process is given by Flower before the strategy builds its messages."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)  # noqa: SLF001
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved  # noqa: SLF001


def _config(run_dir: Path, **overrides: object) -> FederatedConfig:
    values: dict[str, object] = {
        "run_dir": str(run_dir),
        "run_name": run_dir.name,
        "clients": CLIENTS,
        "round_timeout_s": 2.0,
        "connect_timeout_s": 1.0,
        "evaluate_every": 1,
    }
    return FederatedConfig(**(values | overrides))  # type: ignore[arg-type]


def _encoder(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "frontend.w": rng.standard_normal((4, 3)).astype(np.float32),
        "frontend.b": rng.standard_normal(4).astype(np.float32),
    }


def _content(client: str | None, arrays: dict[str, np.ndarray] | None, metrics: dict[str, float]) -> RecordDict:
    content = RecordDict({"metrics": MetricRecord(metrics)})
    if client is not None:
        content["client"] = ConfigRecord({"client-id": client})
    if arrays is not None:
        content["arrays"] = ArrayRecord({k: torch.from_numpy(v) for k, v in arrays.items()})
    return content


def _train_metrics(**values: float) -> dict[str, float]:
    return {
        "num-examples": 10,
        "train-loss": 4.0,
        "masked-accuracy": 0.2,
        "seconds": 1.0,
        "audio-seconds": 9.0,
        "steps": 2,
    } | values


def _eval_metrics(**values: float) -> dict[str, float]:
    return {
        "num-examples": 50,
        "utterances": 2,
        "heldout-loss": 4.0,
        "heldout-masked-accuracy": 0.2,
        "majority-accuracy": 0.05,
        "leak-free-frames": 30,
        "heldout-leak-free-masked-accuracy": 0.15,
        "leak-free-majority-accuracy": 0.04,
    } | values


def _reply_to(message: Message, content: RecordDict, src: int | None = None) -> Message:
    """A reply as the SuperLink hands it to the ServerApp (``src`` defaults to the addressee)."""
    metadata = Metadata(
        run_id=1,
        message_id=uuid.uuid4().hex,
        src_node_id=message.metadata.dst_node_id if src is None else src,
        dst_node_id=0,
        reply_to_message_id=message.metadata.message_id,
        group_id="",
        created_at=0.0,
        ttl=60.0,
        message_type=message.metadata.message_type,
    )
    return Message(metadata=metadata, content=content)


class ScriptedGrid:
    """The Grid's calls the Server makes, with replies written by ``respond(message)`` (a list of
    replies, possibly empty: that node stays silent)."""

    def __init__(self, nodes: Iterable[int], respond: Callable[[Message], list[Message]]) -> None:
        self.nodes, self.respond = list(nodes), respond
        self.outbox: list[Message] = []
        self.sent: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            sent = Message(
                metadata=Metadata(
                    run_id=1,
                    message_id=uuid.uuid4().hex,
                    src_node_id=0,
                    dst_node_id=message.metadata.dst_node_id,
                    reply_to_message_id="",
                    group_id="",
                    created_at=0.0,
                    ttl=60.0,
                    message_type=message.metadata.message_type,
                ),
                content=message.content,
            )
            self.sent.append(sent)
            self.outbox.extend(self.respond(sent))
            ids.append(sent.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        wanted = set(message_ids)
        found = [m for m in self.outbox if m.metadata.reply_to_message_id in wanted]
        self.outbox = [m for m in self.outbox if m not in found]
        return found


def _honest(
    node_clients: dict[int, str], encoder: dict[str, np.ndarray], shift: float = 0.01
) -> Callable[[Message], list[Message]]:
    def respond(message: Message) -> list[Message]:
        client = node_clients[message.metadata.dst_node_id]
        if message.metadata.message_type == "train":
            arrays = {k: v + shift for k, v in encoder.items()}
            return [_reply_to(message, _content(client, arrays, _train_metrics()))]
        return [_reply_to(message, _content(client, None, _eval_metrics()))]

    return respond


def _server(
    tmp_path: Path, grid: ScriptedGrid, registered: dict[int, str] | None = None, **overrides: object
) -> Server:
    config = _config(tmp_path / "run", **overrides)
    server = Server(grid, config)  # type: ignore[arg-type]
    server.binding = NodeBinding(config.clients, registered)
    server.expect(_encoder())
    return server


def _finishes(call: Callable[[], object], within: float = 120.0) -> object:
    """Run ``call`` in a thread; fail if it has not returned after ``within`` seconds (a wait
    without a deadline never would)."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 (handed to the test)
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), "the server is still waiting for clients"
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome.get("value")


# ------------------------------------------------------------------------- the client's own check
def _train_result(encoder: dict[str, torch.Tensor], **metrics: float) -> TrainResult:
    values = {
        "num_examples": 10,
        "train_loss": 4.0,
        "masked_accuracy": 0.2,
        "seconds": 1.0,
        "audio_seconds": 9.0,
        "steps": 2,
    }
    return TrainResult(encoder=encoder, **(values | metrics))  # type: ignore[arg-type]


def test_the_client_sends_only_the_encoder_and_the_agreed_metrics() -> None:
    received = ArrayRecord({k: torch.from_numpy(v) for k, v in _encoder().items()})
    encoder = {k: torch.from_numpy(v.copy()) for k, v in _encoder().items()}
    content = reply("train", received, _train_result(encoder), "client_00")
    assert set(content.keys()) == {"arrays", "metrics", "client"}
    assert set(content["metrics"]) == set(TRAIN_METRICS)
    evaluation = EvalResult(
        utterances=2,
        masked_frames=50,
        heldout_masked_accuracy=0.2,
        majority_accuracy=0.05,
        heldout_loss=4.0,
        leak_free_frames=30,
        heldout_leak_free_masked_accuracy=0.15,
        leak_free_majority_accuracy=0.04,
    )
    sent = reply("evaluate", received, evaluation, "client_00")["metrics"]
    assert set(sent) == set(EVAL_METRICS) and sent["heldout-leak-free-masked-accuracy"] == 0.15
    # no leak-free frames: their accuracies are None here, 0.0 on the wire (a metric is a number)
    none_free = dataclasses.replace(
        evaluation, leak_free_frames=0, heldout_leak_free_masked_accuracy=None, leak_free_majority_accuracy=None
    )
    sent = reply("evaluate", received, none_free, "client_00")["metrics"]
    assert (
        sent["leak-free-frames"],
        sent["heldout-leak-free-masked-accuracy"],
        sent["leak-free-majority-accuracy"],
    ) == (0, 0.0, 0.0)
    with pytest.raises(OutgoingRefused, match="leak-free-frames .* exceeds num-examples"):
        reply("evaluate", received, dataclasses.replace(evaluation, leak_free_frames=51), "client_00")
    with pytest.raises(OutgoingRefused, match="heldout-leak-free-masked-accuracy is above 1"):
        reply("evaluate", received, dataclasses.replace(evaluation, heldout_leak_free_masked_accuracy=1.5), "client_00")

    head = {"heads.0.weight": torch.zeros(100, 3), "heads.0.bias": torch.zeros(100)}
    with pytest.raises(
        OutgoingRefused, match=r"client_00 refuses to send its train reply: .*unexpected: \['heads.0.bias'"
    ):
        reply("train", received, _train_result({**encoder, **head}), "client_00")
    with pytest.raises(OutgoingRefused, match="other dtype or shape"):
        reply("train", received, _train_result({k: v.double() for k, v in encoder.items()}), "client_00")
    with pytest.raises(OutgoingRefused, match="train-loss is not a finite number"):
        reply("train", received, _train_result(encoder, train_loss=float("nan")), "client_00")
    with pytest.raises(OutgoingRefused, match="masked-accuracy is above 1"):
        reply("train", received, _train_result(encoder, masked_accuracy=3.0), "client_00")


# ------------------------------------------------------------------------------ reply binding
def test_a_reply_is_bound_to_the_node_that_sent_it(tmp_path: Path) -> None:
    """Round 1 binds each node to the client it answers as. Round 2: node 2 answers as client_00
    (node 1's client), node 3 sends no client record: both are refused and logged, nothing
    raises a KeyError, client_00's own reply is accepted and node 2 stays client_01."""
    encoder = _encoder()
    honest = _honest({1: "client_00", 2: "client_01", 3: "client_02"}, encoder)
    spoofing = [False]

    def respond(message: Message) -> list[Message]:
        node = message.metadata.dst_node_id
        if spoofing[0] and node == 2:
            return [_reply_to(message, _content("client_00", {k: v * 0 for k, v in encoder.items()}, _train_metrics()))]
        if spoofing[0] and node == 3:
            return [_reply_to(message, _content(None, encoder, _train_metrics()))]
        return honest(message)

    grid = ScriptedGrid([1, 2, 3], respond)
    server = _server(tmp_path, grid, min_train_nodes=1)
    arrays = ArrayRecord({k: torch.from_numpy(v) for k, v in encoder.items()})
    strategy = make_strategy(server.config)
    good, failures = server.exchange(strategy.configure_train(1, arrays, ConfigRecord({}), grid), 1, "train")  # type: ignore[arg-type]
    assert [server.client_of(r) for r in good] == CLIENTS and failures == []
    spoofing[0] = True
    good, failures = server.exchange(strategy.configure_train(2, arrays, ConfigRecord({}), grid), 2, "train")  # type: ignore[arg-type]
    assert [server.client_of(r) for r in good] == ["client_00"]
    reasons = {f["node_id"]: f["reason"] for f in failures}
    assert reasons == {
        2: "node 2 is client client_01 but claims to be client_00",
        3: "no 'client' record with a 'client-id'",
    }
    assert server.binding.client_of(2) == "client_01" and server.binding.client_of(1) == "client_00"


def test_binding_rules() -> None:
    def reply(src: int, client: str | None) -> Message:
        sent = Message(
            metadata=Metadata(
                run_id=1,
                message_id=f"m{src}",
                src_node_id=0,
                dst_node_id=src,
                reply_to_message_id="",
                group_id="",
                created_at=0.0,
                ttl=60.0,
                message_type="train",
            ),
            content=RecordDict(),
        )
        return _reply_to(sent, _content(client, None, _train_metrics()))

    binding = NodeBinding(CLIENTS)
    accepted, failures = binding.bind(
        [(1, reply(1, "client_00")), (2, reply(2, "client_00"))], "train", connected={1, 2}
    )
    assert accepted == [] and {f["reason"] for f in failures} == {"2 replies claim to be client_00"}
    accepted, failures = binding.bind(
        [(1, reply(1, "client_00")), (2, reply(2, "client_01"))], "train", connected={1, 2}
    )
    assert len(accepted) == 2 and failures == []
    # bound now: node 2 may not become client_00 while node 1 is connected, nor change its own client
    assert (
        binding.problem(2, reply(2, "client_00"), {1, 2})[1] == "node 2 is client client_01 but claims to be client_00"
    )
    assert binding.problem(3, reply(3, "client_00"), {1, 2, 3})[1] == "claims to be client_00, which is node 1"
    assert binding.problem(3, reply(4, "client_02"), {3, 4})[1] == "reply from node 4 to a message sent to node 3"
    assert "not taking part" in str(binding.problem(3, reply(3, "client_99"), {3})[1])
    # node 1 is gone (its SuperNode restarted under a new id): client_00 may come back as node 5
    accepted, failures = binding.bind([(5, reply(5, "client_00"))], "train", connected={2, 5})
    assert len(accepted) == 1 and binding.client_of(5) == "client_00" and binding.client_of(1) is None
    # registered nodes (node authentication) are bound for good
    registered = NodeBinding(CLIENTS, {7: "client_00", 8: "client_01"})
    assert (
        registered.problem(8, reply(8, "client_00"), {7, 8})[1]
        == "node 8 is client client_01 but claims to be client_00"
    )
    assert registered.problem(9, reply(9, "client_02"), {9})[1] == "node 9 is not a registered SuperNode"
    assert registered.problem(7, reply(7, "client_00"), set())[1] is None


def test_duplicate_client_ids_do_not_count_towards_min_train_nodes(tmp_path: Path) -> None:
    """Three nodes, all claiming client_00: no reply counts, and min_train_nodes=2 stops the run
    (before, each duplicate counted and overwrote the node->client map)."""
    encoder = _encoder()

    def respond(message: Message) -> list[Message]:
        return [_reply_to(message, _content("client_00", encoder, _train_metrics()))]

    grid = ScriptedGrid([1, 2, 3], respond)
    server = _server(tmp_path, grid, min_train_nodes=2)
    with pytest.raises(FederatedRunError, match="0 of 3 clients replied"):
        server.round(make_strategy(server.config), 1, encoder)
    failure = (tmp_path / "run" / "failure.json").read_text()
    assert failure.count("3 replies claim to be client_00") == 3


# ---------------------------------------------------------------------------- update values
def test_non_finite_or_oversized_updates_are_refused(tmp_path: Path) -> None:
    encoder = _encoder()
    assert update_problem({k: v + 0.1 for k, v in encoder.items()}, encoder, bound=1.0)[1] is None
    nan = {k: v.copy() for k, v in encoder.items()}
    nan["frontend.b"][0] = np.nan
    assert "non-finite" in str(update_problem(nan, encoder, 1.0)[1])
    assert "beyond the bound" in str(update_problem({k: v * 1e6 for k, v in encoder.items()}, encoder, 1.0)[1])
    # the automatic bound: twice what AdamW's steps can move an honest client
    config = _config(tmp_path / "run", client_lr=1e-3, local_steps=50)
    assert update_norm_bound(config, 10_000) == pytest.approx(2 * 1e-3 * 50 * 100)
    assert update_norm_bound(_config(tmp_path / "run", max_update_norm=7.0), 10_000) == 7.0

    # in a round: client_01 sends NaN, client_02 a scaled encoder; client_00 alone is aggregated
    def respond(message: Message) -> list[Message]:
        node = message.metadata.dst_node_id
        if message.metadata.message_type == "evaluate":
            return [_reply_to(message, _content(CLIENTS[node - 1], None, _eval_metrics()))]
        arrays = {0: {k: v + 0.01 for k, v in encoder.items()}, 1: nan, 2: {k: v * 1e6 for k, v in encoder.items()}}[
            node - 1
        ]
        return [_reply_to(message, _content(CLIENTS[node - 1], arrays, _train_metrics()))]

    grid = ScriptedGrid([1, 2, 3], respond)
    server = _server(
        tmp_path, grid, {1: "client_00", 2: "client_01", 3: "client_02"}, min_train_nodes=1, strategy="fedavg"
    )
    new, history = server.round(make_strategy(server.config), 1, encoder)
    for name, value in encoder.items():
        np.testing.assert_allclose(new[name], value + 0.01, rtol=1e-6)
    record = history[-1]
    assert [r["client_id"] for r in record["rows"]] == ["client_00"] and record["missing"] == ["client_01", "client_02"]
    reasons = {f["client_id"]: f["reason"] for f in record["failures"]}
    assert reasons["client_01"] == "frontend.b holds non-finite values" and "beyond the bound" in reasons["client_02"]


def test_aggregation_weighs_clients_by_the_clients_table_not_by_their_own_count(tmp_path: Path) -> None:
    """client_01 claims 1e12 training utterances; the server weighs it 1:3 as its table says."""
    encoder = _encoder()
    shifts = {0: 0.03, 1: -0.01, 2: 0.0}

    def respond(message: Message) -> list[Message]:
        node = message.metadata.dst_node_id
        client = CLIENTS[node - 1]
        if message.metadata.message_type == "evaluate":
            return [_reply_to(message, _content(client, None, _eval_metrics()))]
        count = 1e12 if client == "client_01" else 10
        arrays = {k: v + shifts[node - 1] for k, v in encoder.items()}
        return [_reply_to(message, _content(client, arrays, _train_metrics(**{"num-examples": count})))]

    grid = ScriptedGrid([1, 2], respond)
    server = _server(
        tmp_path,
        grid,
        {1: "client_00", 2: "client_01"},
        clients=CLIENTS[:2],
        strategy="fedavg",
        client_weights={"client_00": 3.0, "client_01": 1.0},
    )
    new, history = server.round(make_strategy(server.config), 1, encoder)
    for name, value in encoder.items():
        np.testing.assert_allclose(new[name], value + (3 * 0.03 + 1 * -0.01) / 4, rtol=1e-5, atol=1e-6)
    assert [r["weight"] for r in history[-1]["rows"]] == [3.0, 1.0]
    # the leak-free figures reach the round's record
    assert [(e["leak_free_frames"], e["heldout_leak_free_masked_accuracy"]) for e in history[-1]["evaluation"]] == [
        (30, 0.15)
    ] * 2


# --------------------------------------------------------------------------------- deadlines
def _evaluated(server: Server, encoder: dict[str, np.ndarray], trained: list[str]) -> dict:
    """Round 1's record once ``encoder`` is evaluated after ``trained`` trained (within a deadline)."""
    record = {"round": 1, "rows": [{"client_id": c} for c in trained], "failures": []}
    history = _finishes(lambda: server.evaluate_round(make_strategy(server.config), 1, encoder, record))
    return history[-1]  # type: ignore[index]


def test_evaluation_waits_for_clients_with_a_deadline(tmp_path: Path) -> None:
    """After training, no node is connected (or none replies): evaluation gives up after its
    timeouts and the round counts those clients as missing from the evaluation. Flower's
    sampling alone would wait for ever."""
    encoder = _encoder()
    grid = ScriptedGrid([], lambda message: [])
    server = _server(tmp_path, grid, min_train_nodes=1)
    record = _evaluated(server, encoder, ["client_00"])
    assert record["evaluation"] == [] and record["aggregated_evaluation"] == {}
    assert "no client connected within 1 s" in record["failures"][0]["reason"]

    silent = ScriptedGrid([1, 2, 3], lambda message: [])
    server = _server(tmp_path, silent, {1: "client_00", 2: "client_01", 3: "client_02"}, min_train_nodes=1)
    record = _evaluated(server, encoder, CLIENTS)
    assert record["evaluation"] == [] and sorted(f["client_id"] for f in record["failures"]) == CLIENTS
    assert all(f["reason"] == "no reply within 2 s" for f in record["failures"])


def test_a_round_with_too_few_connected_clients_stops_instead_of_waiting(tmp_path: Path) -> None:
    encoder = _encoder()
    grid = ScriptedGrid([1], _honest({1: "client_00"}, encoder))
    server = _server(tmp_path, grid, {1: "client_00"}, min_train_nodes=2)
    with pytest.raises(FederatedRunError, match="only 1 of 3 clients are connected after 1 s"):
        _finishes(lambda: server.round(make_strategy(server.config), 1, encoder))


def test_evaluation_scores_the_clients_connected_when_some_left(tmp_path: Path) -> None:
    """client_02's node left after training: the two others are evaluated, client_02 is missing
    from the evaluation (before, sampling waited for it for ever: min_available_nodes = 3)."""
    encoder = _encoder()
    grid = ScriptedGrid([1, 2], _honest({1: "client_00", 2: "client_01"}, encoder))
    server = _server(tmp_path, grid, {1: "client_00", 2: "client_01", 3: "client_02"})
    record = _evaluated(server, encoder, CLIENTS)
    assert [r["client_id"] for r in record["evaluation"]] == ["client_00", "client_01"] and record["failures"] == []
    assert array_spec(ArrayRecord({k: torch.from_numpy(v) for k, v in encoder.items()})) == server.expected
