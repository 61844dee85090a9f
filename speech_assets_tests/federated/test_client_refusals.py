"""A server that deviates, tried against the real ClientApp and ServerApp (issue 45): it leaves
secure aggregation or DP's clipping out of a train message (a downgrade), it races two unmask
requests at one client, or it keeps what DP should not let it keep (each client's update norm,
loss or size) on disk. Four small clients, the real round loop on an :class:`InProcessGrid`."""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import re
import threading
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from speech_assets.federated import secure_rounds as sr
from speech_assets.federated.config import NodeConfig
from speech_assets.federated.server_app import FederatedRunError
from speech_assets.layout import FederatedPaths
from speech_assets_tests.support.federated_data import InProcessGrid, run_in_process, write_federated_corpus
from speech_assets_tests.support.locks import wait_while_held_elsewhere

FOUR = {"c0": 6, "c1": 6, "c2": 6, "c3": 6}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return write_federated_corpus(tmp_path_factory.mktemp("refusals") / "data", FOUR, speakers_per_client=2)


def _train_replies(grid: InProcessGrid) -> list:  # type: ignore[type-arg]
    return [m for m in grid.received if m.metadata.message_type == "train"]


# ------------------------------------------------------------------------------ no downgrade
class NonceStrippingGrid(InProcessGrid):
    """A server that runs the secure setup, then leaves the nonce out of the train message."""

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        messages = list(messages)
        for message in messages:
            if message.metadata.message_type == "train":
                config = message.content["config"]
                for key in (sr.SECAGG_NONCE, sr.SECAGG_RANGE, sr.SECAGG_TARGET):
                    config.pop(key, None)
        return super().push_messages(messages)


REQUIRE_SECAGG = {"require-secure-aggregation": True}
REQUIRE_DP = {"require-dp": True}


@pytest.mark.parametrize(
    "server, kind, node, why",
    [
        ({}, InProcessGrid, REQUIRE_SECAGG, "requires secure aggregation"),
        ({"secure_aggregation": True}, NonceStrippingGrid, REQUIRE_SECAGG, "requires secure aggregation"),
        ({}, InProcessGrid, REQUIRE_DP, "requires differential privacy"),
        ({"secure_aggregation": True}, InProcessGrid, REQUIRE_DP, "requires differential privacy"),
    ],
    ids=["plain-server", "nonce-stripped", "dp-without-clipping", "secagg-without-clipping"],
)
def test_downgrade_unmasked_train_request_is_refused(corpus, tmp_path: Path, server, kind, node, why) -> None:  # type: ignore[no-untyped-def]
    """test_downgrade_*: clients whose own node config requires secure aggregation (or DP) get a
    train message without the secure-aggregation nonce (or without DP's clipping norm): from a
    server that never asked for it, or one that ran the secure setup and then stripped the nonce.
    Every client refuses before training; no update leaves, masked or not. Kills the mutation
    "the client masks (clips) only when the server's message says so" (the code before issue 45
    sent its encoder in the clear), and "the requirement is read from the server's message"."""
    result, grid, _ = run_in_process(corpus, tmp_path, "downgrade", kind, node=node, **server)
    assert isinstance(result, FederatedRunError), "a round went on with every client refusing"
    replies = _train_replies(grid)
    assert len(replies) == 4
    assert not any(not r.has_error() and "arrays" in r.content for r in replies), "an update left the client"
    assert all(why in r.error.reason for r in replies), [r.error.reason for r in replies if r.has_error()]


def test_downgrade_guard_lets_a_round_with_what_the_client_requires_through(corpus, tmp_path: Path) -> None:
    """The same clients (requiring both) train, mask and clip when the server does both: kills the
    mutation "a client that requires a protection refuses every round"."""
    result, grid, _ = run_in_process(
        corpus,
        tmp_path,
        "honest",
        node=REQUIRE_SECAGG | REQUIRE_DP,
        secure_aggregation=True,
        dp_noise_multiplier=0.5,
        dp_clipping_norm=1.0,
    )
    assert isinstance(result, dict) and result["rounds"] == 1
    replies = _train_replies(grid)
    assert len(replies) == 4 and not any(r.has_error() for r in replies)
    assert all(a.dtype == "uint32" for r in replies for a in r.content["arrays"].values())


def test_node_config_reads_its_requirements() -> None:
    node = NodeConfig.from_node_config(
        {"client-id": "c", "data-dir": "/d", "require-secure-aggregation": True, "require-dp": "true"}
    )
    assert node.require_secure_aggregation and node.require_dp
    from flwr.common.config import parse_config_args

    assert NodeConfig.from_node_config(parse_config_args([node.to_node_config()])) == node
    assert not NodeConfig.from_node_config({"client-id": "c", "data-dir": "/d"}).require_dp
    with pytest.raises(ValueError, match="true or false"):
        NodeConfig.from_node_config({"client-id": "c", "data-dir": "/d", "require-dp": "yes"})


def _launcher_limits(config, root: Path, **settings) -> dict:  # type: ignore[no-untyped-def]
    """What the launcher puts in every local client's ``--node-config`` for ``config`` under the
    ``[federated]`` settings ``settings`` (its protections and limits), as the SuperNode parses it."""
    from flwr.common.config import parse_config_args

    from speech_assets.defs.resources import FederatedSettings
    from speech_assets.federated.launch import Deployment, node_configs

    deployment = Deployment.of(FederatedSettings(**settings))
    node = node_configs(config, root, {c: root / c for c in config.clients}, 1, deployment)[0]
    parsed = parse_config_args([node.to_node_config()])
    return {k: v for k, v in parsed.items() if k not in ("client-id", "data-dir", "state-root", "threads")}


class HugeClippingNormGrid(InProcessGrid):
    """A server that asks for DP but sends a clipping norm a million times the run's: in effect
    no clipping."""

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        messages = list(messages)
        for message in messages:
            if message.metadata.message_type == "train" and KEY_CLIPPING_NORM in message.content["config"]:
                message.content["config"][KEY_CLIPPING_NORM] = 1e6
        return super().push_messages(messages)


@pytest.mark.parametrize("kind", [InProcessGrid, HugeClippingNormGrid], ids=["honest", "huge-norm"])
def test_downgrade_huge_clipping_norm_is_refused(corpus, tmp_path: Path, kind: type[InProcessGrid]) -> None:
    """test_downgrade_huge_clipping_norm: the clients get what the launcher gives them under the
    ``[federated]`` settings of a DP run (dp_max_clipping_norm unset: the run's dp_clipping_norm).
    A server that sends a clipping norm of 1e6 is refused by every client before training, no
    update leaves; the honest server's round (the run's norm) goes through. Kills the mutations
    "a client that requires DP accepts any clipping norm" (the code before this change: 4 of 4
    clients trained and sent their update clipped at 1e6) and "the launcher leaves the node's
    maximum unset"."""
    dp = {"dp_noise_multiplier": 0.5, "dp_clipping_norm": 1.0}
    config = corpus.config(tmp_path, "probe-config", **dp)
    node = _launcher_limits(config, tmp_path, **dp)
    assert node["dp-max-clipping-norm"] == 1.0 and node["require-dp"] is True
    result, grid, _ = run_in_process(corpus, tmp_path, "clip", kind, node=node, **dp)
    replies = _train_replies(grid)
    assert len(replies) == 4
    if kind is InProcessGrid:
        assert isinstance(result, dict) and not any(r.has_error() for r in replies)
        return
    assert isinstance(result, FederatedRunError), "a round went on with every client refusing"
    assert not any(not r.has_error() and "arrays" in r.content for r in replies), "an update left the client"
    assert all("refuses a clipping norm of 1000000.0" in r.error.reason for r in replies), [
        r.error.reason for r in replies if r.has_error()
    ]


@pytest.mark.parametrize("floor", ["2/3", "3/4"])
def test_threshold_floor_from_settings_makes_a_real_client_refuse(corpus, tmp_path: Path, floor: str) -> None:
    """test_threshold_floor_from_settings: four clients with secure aggregation at the server's
    default threshold (t = 3 of k = 4). With the launcher's node configs under the default
    ``[federated]`` settings they accept the round; with ``secagg_threshold_floor = "3/4"`` in
    the settings (t must exceed 3) every real client refuses at its advertise stage, naming the
    floor, and the run stops. Kills the mutation "the launcher passes the node defaults whatever
    the settings say" (the code before this change: the round went on at t = 3)."""
    config = corpus.config(tmp_path, "probe-config", secure_aggregation=True)
    node = _launcher_limits(config, tmp_path, secure_aggregation=True, secagg_threshold_floor=floor)
    result, grid, _ = run_in_process(corpus, tmp_path, f"floor-{floor[0]}", node=node, secure_aggregation=True)
    if floor == "2/3":
        assert isinstance(result, dict) and result["rounds"] == 1, result
        return
    assert isinstance(result, FederatedRunError), "a round went on below the clients' floor"
    refusals = [m.error.reason for m in grid.received if m.has_error()]
    assert len(refusals) == 4 and all("is below its floor" in r for r in refusals), refusals
    assert not _train_replies(grid)


def test_client_limits_are_checked_in_the_settings_and_the_node_config() -> None:
    """Out-of-bounds limits are refused where they are set: kills the mutation "the settings take
    any floor" (a floor of 1/3 would let a server split the shares)."""
    from speech_assets.defs.resources import FederatedSettings

    for bad, why in [
        ({"secagg_min_shares": 1}, "secagg_min_shares must be an int of at least 2"),
        ({"secagg_threshold_floor": "1/3"}, "secagg_threshold_floor must be a fraction in"),
        ({"secagg_threshold_floor": "1"}, "secagg_threshold_floor must be a fraction in"),
        ({"dp_max_clipping_norm": -1.0}, "dp_max_clipping_norm must be a number >= 0"),
        ({"dp_max_clipping_norm": 0.5, "dp_clipping_norm": 1.0}, "at least dp_clipping_norm"),
    ]:
        with pytest.raises(ValueError, match=why):
            FederatedSettings(**bad)
    with pytest.raises(ValueError, match="dp-max-clipping-norm must be a number >= 0"):
        NodeConfig.from_node_config({"client-id": "c", "data-dir": "/d", "dp-max-clipping-norm": float("nan")})


# --------------------------------------------------------------------- one answer, concurrently
TRIALS = 20


def _race(kind: str, answer, count: int = 2) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """Run ``answer(i) -> (outcome, detail)`` ``count`` times at once, released together (threads
    of this process, or processes forked from it: the deployment engine's process per message)."""
    if kind == "threads":
        barrier, out = threading.Barrier(count), [("", "")] * count

        def go(i: int) -> None:
            barrier.wait()
            out[i] = answer(i)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out
    ctx = multiprocessing.get_context("fork")
    pbarrier, queue = ctx.Barrier(count), ctx.Queue()

    def child(i: int) -> None:
        pbarrier.wait()
        queue.put((i, answer(i)))

    procs = [ctx.Process(target=child, args=(i,)) for i in range(count)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return [results[i] for i in range(count)]


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_concurrent_unmask_requests_get_one_answer(corpus, tmp_path: Path, monkeypatch, kind: str) -> None:
    """test_concurrent_unmask: c0's real state of a masked round (from a real secure run) is put
    back on its disk, then two unmask requests race at it: one naming every peer a survivor (for
    their self-mask seed shares), one naming c1 dropped (for c1's key share). Both answered would
    hand the server the seed share and the key share of c1 from one client. In every one of
    :data:`TRIALS` trials exactly one is answered and the other refused. Kills the mutation
    "the one-answer record is read, then written, with no lock" (the code before issue 45
    answered both in 20 of 20 trials)."""
    seen: dict[str, object] = {}
    reveal = sr.SecureRounds.reveal

    def capturing_reveal(self, failures):  # type: ignore[no-untyped-def]
        node = NodeConfig.from_node_config(grid_of["grid"].node_config[self.host.binding.node_of("c0")])
        path = sr.state_path(node, self.config.run_name, self.round_number)
        mine = self.masked_with("c0")
        common = {
            sr.KIND: sr.UNMASK,
            "secure-aggregation": True,
            "run-name": self.config.run_name,
            "server-round": self.round_number,
            sr.SECAGG_NONCE: self.nonce,
        }
        seen.update(
            node=node,
            path=path,
            state=path.read_text(),
            requests=[
                common | {sr.SECAGG_SURVIVORS: ",".join(mine), sr.SECAGG_DROPPED: ""},
                common | {sr.SECAGG_SURVIVORS: ",".join(c for c in mine if c != "c1"), sr.SECAGG_DROPPED: "c1"},
            ],
        )
        return reveal(self, failures)

    grid_of: dict[str, InProcessGrid] = {}

    class Grid(InProcessGrid):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            grid_of["grid"] = self

    monkeypatch.setattr(sr.SecureRounds, "reveal", capturing_reveal)
    result, _, _ = run_in_process(corpus, tmp_path, "race", Grid, secure_aggregation=True)
    assert isinstance(result, dict), result
    from flwr.app import ConfigRecord, RecordDict

    node, path = seen["node"], seen["path"]
    assert json.loads(seen["state"])["stage"] == "masked"  # type: ignore[arg-type]

    def answer(i: int) -> tuple[str, str]:
        content = RecordDict()
        try:
            sr.answer_secure_query(ConfigRecord(dict(seen["requests"][i])), node, content)  # type: ignore[index]
        except ValueError as error:
            return "refused", str(error)
        return "answered", ",".join(sorted(content[sr.KEY_SHARES]))

    outcomes = []
    for _ in range(TRIALS):
        path.write_text(seen["state"])  # type: ignore[union-attr,arg-type]
        outcomes.append(_race(kind, answer))
    answered = [sum(o == "answered" for o, _ in trial) for trial in outcomes]
    assert answered == [1] * TRIALS, f"trials with both answered: {answered.count(2)} of {TRIALS}"
    for trial in outcomes:
        assert any("already answered" in detail for o, detail in trial if o == "refused"), trial
    assert json.loads(path.read_text()) == {"stage": "answered"}  # type: ignore[union-attr]


def test_concurrent_unmask_refused_while_another_process_holds_the_state_lock(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """test_concurrent_unmask, bounded: a second, real process holds c0's secure-aggregation
    lock (``secagg/.lock``) and never lets go. An unmask request at c0 is refused after the
    bounded wait, naming the stage and the lock, instead of waiting for ever; once the holder is
    gone the same request gets past the lock (and is refused for what it asks: c0 has no state of
    that round). Kills the mutation "state_lock waits on the lock without a limit" (the code
    before: the request was still blocked when the test gave up on it, 20 s later)."""

    from flwr.app import ConfigRecord, RecordDict

    from speech_assets.layout import ClientRunFiles

    monkeypatch.setattr(sr, "SECAGG_LOCK_TIMEOUT_S", 0.5)
    node = NodeConfig(client_id="c0", data_dir=str(tmp_path / "data"), state_root=str(tmp_path / "state"))
    lock = ClientRunFiles(node.client_dir("race")).secagg_lock
    lock.parent.mkdir(parents=True)
    request = ConfigRecord(
        {sr.KIND: sr.UNMASK, "secure-aggregation": True, "run-name": "race", "server-round": 1, sr.SECAGG_NONCE: "n"}
    )
    outcome: list[str] = []

    def ask() -> None:
        try:
            sr.answer_secure_query(request, node, RecordDict())
            outcome.append("answered")
        except ValueError as error:
            outcome.append(str(error))

    wait_while_held_elsewhere(lock, ask)
    (refusal,) = outcome
    assert "c0 refuses the secagg-unmask stage of run race" in refusal and "stayed locked" in refusal, refusal
    ask()
    assert "stayed locked" not in outcome[-1] and outcome[-1] != "answered", outcome[-1]


def test_concurrent_unmask_readvertise_of_a_round_past_advertise_is_refused(
    corpus, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A server that asks a client to advertise again for a round it already shared (or masked)
    in would get shares of two key sets for one round: refused, and the round's state is left
    as it was. Kills the mutation "advertise overwrites any unanswered round's secrets"."""
    seen: dict[str, object] = {}
    mean_update = sr.SecureRounds.mean_update

    def readvertising(self, round_number, good, failures):  # type: ignore[no-untyped-def]
        fields = {sr.KIND: sr.ADVERTISE, sr.SECAGG_THRESHOLD: self.threshold, sr.SECAGG_SHARES_NUM: self.num_shares}
        refused: list[dict[str, object]] = []
        seen["answer"] = self._ask("attack", {"c0": fields}, refused), refused
        return mean_update(self, round_number, good, failures)

    monkeypatch.setattr(sr.SecureRounds, "mean_update", readvertising)
    result, _, _ = run_in_process(corpus, tmp_path, "readvertise", secure_aggregation=True)
    good, refused = seen["answer"]  # type: ignore[misc]
    assert not good and "past its advertise stage" in refused[0]["reason"], refused
    assert isinstance(result, dict)  # c0's masked update still unmasks with the round's own keys


# ------------------------------------------------------------------ nothing per client under DP
UNCLIPPED = 2.7183  # c1's update norm, in clipping norms (no round number: it is searched for)


class OneUnclippedGrid(InProcessGrid):
    """c1 does not clip: its update reaches the server at :data:`UNCLIPPED` clipping norms."""

    def __init__(self, *args, clip: float = 1.0, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.clip = clip

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        messages = list(messages)
        ids = super().push_messages(messages)
        for message, answer in zip(messages, self.outbox[-len(messages) :], strict=True):
            if message.metadata.message_type == "train" and self.nodes[message.metadata.dst_node_id] == "c1":
                sent, trained = message.content["arrays"], answer.content["arrays"]
                diff = {n: trained[n].numpy().astype(np.float64) - sent[n].numpy() for n in sent}
                norm = np.sqrt(sum(float(np.sum(d * d)) for d in diff.values()))
                for name in sent:
                    value = sent[name].numpy() + diff[name] * (UNCLIPPED * self.clip / norm)
                    trained[name] = type(trained[name])(value.astype(np.float32))
        return ids


NUMBER = re.compile(r"-?\d+\.\d+(?:[eE][-+]?\d+)?")


def _numbers(text: str) -> list[float]:
    """The numbers in ``text`` given to 4 significant digits or more (``%.4g`` names a norm;
    a shorter one, such as a duration, names none)."""
    return [
        float(x) for x in NUMBER.findall(text) if len(x.split("e")[0].split("E")[0].strip("-.0").replace(".", "")) >= 4
    ]


def _disk_text(run_dir: Path) -> str:
    """Everything readable the server wrote under its run folder: text files, and the parquet
    tables' values."""
    parts = []
    for path in sorted(run_dir.rglob("*")):
        if not path.is_file():
            continue
        if path.suffix == ".parquet":
            parts.append(json.dumps(pq.read_table(path).to_pylist(), default=str))
        elif path.suffix in (".json", ".jsonl", ".log", ".txt", ".toml"):
            parts.append(path.read_text(errors="replace"))
    return "\n".join(parts)


def _evaluations(grid: InProcessGrid) -> dict[str, dict[str, float]]:
    """Each client's held-out evaluation, as its evaluate reply carried it to the server."""
    return {
        m.content["client"]["client-id"]: dict(m.content["metrics"])
        for m in grid.received
        if m.metadata.message_type == "evaluate" and not m.has_error()
    }


def _mlflow_metrics(config, records: list, result: dict, store: str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """What a real MLflow run holds once the run's tracker logged ``records`` and ``result``."""
    from mlflow.tracking import MlflowClient

    from speech_assets.federated.tracking import FederatedTracker

    tracker = FederatedTracker(config, store)
    tracker.start()
    for record in records:
        tracker.log_round(record)
    tracker.finish(result)
    return dict(MlflowClient(store).get_run(tracker.run_id).data.metrics)


EVALUATION_VALUES = (
    "utterances",
    "masked_frames",
    "heldout_loss",
    "heldout_masked_accuracy",
    "majority_accuracy",
    "leak_free_frames",
    "heldout_leak_free_masked_accuracy",
    "leak_free_majority_accuracy",
)


@pytest.mark.parametrize("share", [False, True])
def test_norm_withheld_under_dp_no_per_client_value_on_disk(corpus, tmp_path: Path, caplog, share: bool) -> None:  # type: ignore[no-untyped-def]
    """test_norm_withheld: a DP run without secure aggregation, with a clipping norm the honest
    clients stay below (so each accepted norm is that client's raw value) and c1 sending three
    the clipping norm (refused). No client's exact update norm is in any file of the run
    folder (round records, tables, result, failures) or in the server's log, not even in c1's
    refusal reason; no client's loss is in the logs either. The held-out evaluation (every
    client scores the round's encoder) leaves no client's loss, accuracy or count in the round
    record, ``evaluation.parquet`` (its columns stay, null), ``result.json`` or MLflow (no
    ``val/<client>/...``), while the federation's aggregates are there. With
    ``dp_share_client_metrics`` (the opt-in) all of it is recorded. Kills the mutations "round
    records keep every client's update_norm and a refusal names its norm under DP" (the code
    before issue 45) and "under DP the evaluation rows keep each client's values" (seen failing:
    evaluation.parquet held every client's heldout_loss)."""
    clip = 100.0
    caplog.set_level(logging.INFO, logger="speech_assets.federated.server")
    client_log_stream = io.StringIO()
    handler = logging.StreamHandler(client_log_stream)
    client_logger = logging.getLogger("speech_assets.federated")
    client_logger.addHandler(handler)
    client_level = client_logger.level
    client_logger.setLevel(logging.INFO)

    class Grid(OneUnclippedGrid):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, clip=clip, **kwargs)

    try:
        result, grid, config = run_in_process(
            corpus,
            tmp_path,
            f"dp-{share}",
            Grid,
            dp_noise_multiplier=0.5,
            dp_clipping_norm=clip,
            min_train_nodes=3,
            dp_share_client_metrics=share,
        )
    finally:
        client_logger.removeHandler(handler)
        client_logger.setLevel(client_level)
    assert isinstance(result, dict), result
    # every client's exact norm, as the server measured it against the encoder it sent
    from speech_assets.federated.local import initial_encoder
    from speech_assets.federated.rounds import to_numpy

    start = to_numpy(initial_encoder(config.preset, config.seed))
    norms = {}
    for reply in _train_replies(grid):
        arrays = reply.content["arrays"]
        diff = [arrays[n].numpy().astype(np.float64) - start[n].astype(np.float64) for n in start]
        norms[reply.content["client"]["client-id"]] = float(np.sqrt(sum(float(np.sum(d * d)) for d in diff)))
    assert len(norms) == 4 and norms["c1"] > clip and all(norms[c] < clip for c in ("c0", "c2", "c3")), norms
    paths = FederatedPaths(config.run_dir)
    record = json.loads(paths.round_record(1).read_text())
    assert record["missing"] == ["c1"]
    evaluations = _evaluations(grid)
    assert sorted(evaluations) == ["c0", "c1", "c2", "c3"]
    losses = [e["heldout-loss"] for e in evaluations.values()]
    assert all(loss > 0 for loss in losses)
    metrics = _mlflow_metrics(config, [record], result, f"sqlite:///{tmp_path / 'mlflow.db'}")
    # the federation's aggregates are released either way
    assert result["heldout_masked_accuracy"] is not None and result["heldout_loss"] is not None
    assert {"val/loss", "val/all_frames_masked_accuracy", "val/all_frames_majority_accuracy", "epsilon"} <= set(metrics)
    written = _disk_text(Path(config.run_dir)) + "\n" + caplog.text
    found = [x for x in _numbers(written) for n in norms.values() if abs(x - n) <= 1e-3 * n]
    found_losses = [x for x in _numbers(written) for loss in losses if abs(x - loss) <= 1e-9 * loss]
    client_log = client_log_stream.getvalue()
    table = pq.read_table(paths.evaluation_table).to_pylist()
    assert sorted(row["client_id"] for row in table) == ["c0", "c1", "c2", "c3"]
    if share:  # opted in: recorded (PRIVACY.md lists what that releases)
        assert all(row["update_norm"] is not None for row in record["rows"])
        assert found and "loss " in client_log
        assert found_losses and all(row["heldout_loss"] is not None for row in table)
        assert "val/c0/all_frames_masked_accuracy" in metrics
        return
    assert [row["update_norm"] for row in record["rows"]] == [None] * 3
    assert not found, f"a client's exact update norm is on disk or in the log: {found[:5]} (norms {norms})"
    refusal = next(f for f in record["failures"] if f["client_id"] == "c1")
    assert "dp_clipping_norm" in refusal["reason"]
    # sizes and losses: none per client (the training metrics are withheld, the weights uniform)
    for row in record["rows"]:
        assert all(
            row[k] is None for k in ("num_examples", "train_loss", "masked_accuracy", "seconds", "audio_seconds")
        )
        assert row["weight"] == 1.0
    assert not re.search(r"loss \d", client_log), "a client logged its training loss in a DP round"
    # the held-out evaluation: who was scored, never what each scored
    assert not found_losses, f"a client's held-out loss is on disk or in the log: {found_losses[:5]}"
    for row in [*table, *record["evaluation"]]:
        assert all(row[k] is None for k in EVALUATION_VALUES), row
    assert all(set(scores.values()) == {None} for scores in result["heldout_per_client"].values()), result
    per_client = sorted(name for name in metrics if re.match(r"(val/)?c\d", name))
    assert per_client == [], f"MLflow holds per-client values under DP: {per_client}"
