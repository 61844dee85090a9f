"""The Flower ServerApp (simulation and deployment engine alike): seeded client sampling, Flower's
strategy, held-out evaluation every ``evaluate_every`` rounds and a record per completed round.

The round loop is written out (not ``Strategy.start``) so that a run resumes at round r + 1 with
the strategy's state, saves each round as it completes, and names the clients that did not reply.
Every reply is checked (:mod:`messages`); every wait has a deadline. Aggregation weighs each client
by the server's own weight (the clients table), never by the count the client reports.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM  # the key fixedclipping_mod reads

from speech_assets.federated import rounds as records
from speech_assets.federated.config import FederatedConfig, derive_seed, update_norm_bound
from speech_assets.federated.history import (
    EVALUATION_METRICS,
    check_settings,
    complete_rounds,
    evaluation_summary,
    round_log_line,
    summarize_rounds,
)
from speech_assets.federated.messages import (
    ARRAYS,
    COUNTS,
    METRICS,
    SERVER_WEIGHT,
    SHARE_CLIENT_METRICS,
    TRAIN_METRICS,
    ArraySpec,
    NodeBinding,
    claimed_client,
    content_problem,
    train_metrics,
    update_problem,
)
from speech_assets.layout import FederatedPaths
from speech_assets.runtime.waiting import WaitTimeout, wait_until
from speech_assets.utils import atomic_write_text

if TYPE_CHECKING:
    from speech_assets.federated.privacy import Privacy
    from speech_assets.federated.secure_rounds import SecureRounds

log = logging.getLogger("speech_assets.federated.server")

POLL_SECONDS = 0.25
# the columns of a round's table rows read from each reply's metrics: {column: (metric, type)}
TRAIN_COLUMNS = {name.replace("-", "_"): (name, int if name in COUNTS else float) for name in TRAIN_METRICS}
# accuracies over the leak-free frames: 0.0 on the wire when there are none, None in the records
LEAK_FREE_COLUMNS = ("heldout_leak_free_masked_accuracy", "leak_free_majority_accuracy")
# the same for a client with no held-out frame at all (no held-out speaker): None, never 0.0
HELDOUT_COLUMNS = ("heldout_loss", "heldout_masked_accuracy", "majority_accuracy", *LEAK_FREE_COLUMNS)


class FederatedRunError(RuntimeError):
    """The run cannot go on (too few clients replied, or connected); completed rounds are saved."""


def make_strategy(config: FederatedConfig) -> FedAvg:
    """Flower's aggregation and server step; the clients are chosen by :func:`sample_clients`."""
    common = {"min_train_nodes": 1, "min_evaluate_nodes": 1, "min_available_nodes": 1, "weighted_by_key": SERVER_WEIGHT}
    if config.strategy == "fedadam":
        # eta_l is Flower's bookkeeping only: clients get their learning rate in the ConfigRecord.
        return FedAdam(
            **common, eta=config.eta, eta_l=config.client_lr, beta_1=config.beta_1, beta_2=config.beta_2, tau=config.tau
        )
    if config.strategy == "fedprox":
        return FedProx(**common, proximal_mu=config.proximal_mu)
    return FedAvg(**common)


def sample_clients(config: FederatedConfig, round_number: int) -> list[str]:
    """Seeded by (seed, round) so a resumed run draws the same clients (Flower's sampling is unseeded)."""
    if config.sample_size >= len(config.clients):
        return list(config.clients)
    seed = derive_seed(config.seed, "sample", round_number)
    chosen = np.random.default_rng(seed).choice(len(config.clients), size=config.sample_size, replace=False)
    return sorted(config.clients[int(i)] for i in chosen)


def synthetic_reply(model: ArrayRecord | records.NDArrays) -> Message:
    """A train reply of weight 1: an aggregate made outside the strategy, for its server step."""
    arrays = model if isinstance(model, ArrayRecord) else ArrayRecord({k: Array(v) for k, v in model.items()})
    content = RecordDict({ARRAYS: arrays, METRICS: MetricRecord({SERVER_WEIGHT: 1.0})})
    return Message(content, dst_node_id=0, message_type=MessageType.TRAIN)


def clipped_sum(replies: Iterable[Message], encoder: records.NDArrays, clipping_norm: float) -> records.NDArrays:
    """The float64 sum of the replies' updates, each scaled to at most ``clipping_norm``: an update
    accepted within the DP tolerance counts exactly at the clipping norm, as the accountant assumes."""
    total = {name: np.zeros(value.shape, dtype=np.float64) for name, value in encoder.items()}
    for reply in replies:
        arrays = reply.content[ARRAYS]
        update = {name: arrays[name].numpy().astype(np.float64) - encoder[name] for name in encoder}
        norm = float(np.sqrt(sum(float(np.dot(u.ravel(), u.ravel())) for u in update.values())))
        scale = min(1.0, clipping_norm / norm) if norm > 0 else 1.0
        for name, value in update.items():
            total[name] += scale * value
    return total


class NodeSnapshot:
    """The nodes chosen here, as the ``Grid`` a strategy samples from: with every minimum at 1 it
    takes them all at once (it would wait for ever for more, and its own sampling is unseeded)."""

    def __init__(self, node_ids: Iterable[int]) -> None:
        self.node_ids = sorted(node_ids)

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


def array_bytes(record: ArrayRecord) -> int:
    return sum(len(array.data) for array in record.values())


class Server:
    def __init__(self, grid: Grid, config: FederatedConfig) -> None:
        self.grid, self.config = grid, config
        self.paths = FederatedPaths(config.run_dir)
        # the local federation's registered SuperNodes, {node id: client id}; none with a remote SuperLink
        registered = json.loads(self.paths.nodes.read_text()) if self.paths.nodes.is_file() else {}
        self.binding = NodeBinding(config.clients, {int(node): str(client) for node, client in registered.items()})
        self.expected: ArraySpec = {}  # what every train reply's arrays must match: the global encoder's
        self.encoder_values = 0
        self.rounds_run = 0
        self.privacy: Privacy | None = None
        self.secure: SecureRounds | None = None
        # the metrics a train reply carries this round (none under DP unless the run shares them)
        self.train_names: tuple[str, ...] = TRAIN_METRICS

    def expect(self, encoder: records.NDArrays) -> None:
        self.expected = {name: (str(np.dtype(a.dtype)), tuple(int(d) for d in a.shape)) for name, a in encoder.items()}
        self.encoder_values = sum(int(a.size) for a in encoder.values())

    def run(self) -> dict[str, Any]:
        config, paths = self.config, self.paths
        paths.root.mkdir(parents=True, exist_ok=True)
        paths.failure.unlink(missing_ok=True)
        check_settings(paths, config)  # the launcher checked already; a hand-made `flwr run` did not
        strategy = make_strategy(config)
        state = records.load_latest(paths, config)
        accountant = None
        if state is None:
            from speech_assets.federated.local import initial_encoder

            encoder = records.to_numpy(initial_encoder(config.preset, config.seed))
            start, history = 0, []
            log.info(
                "new run %s: %d rounds of %d local steps, %s, %d of %d clients a round",
                config.run_name,
                config.rounds,
                config.local_steps,
                config.strategy,
                config.sample_size,
                len(config.clients),
            )
        else:
            encoder, start, history = state.encoder, state.round, state.records
            if start > config.rounds:
                self.fail(
                    start,
                    f"{paths.root} already holds {start} completed rounds, more than the {config.rounds} "
                    f"asked for: ask for at least {start} rounds, or use another run folder",
                    [],
                    [],
                )
            if isinstance(strategy, FedAdam) and state.strategy:
                strategy.m_t, strategy.v_t = dict(state.strategy["m_t"]), dict(state.strategy["v_t"])
            accountant = (history[-1].get("privacy") or {}).get("accountant")
            log.info(
                "resuming %s after round %d (encoder %s)", config.run_name, start, history[-1]["weights_sha256"][:12]
            )
        if config.differential_privacy:
            from speech_assets.federated.privacy import Privacy

            self.privacy = Privacy(config, accountant)
        if config.secure_aggregation:
            from speech_assets.federated.secure_rounds import SecureRounds

            self.secure = SecureRounds(config, self)
        self.expect(encoder)
        if history and history[-1].get("evaluation_pending"):
            # killed after the round was saved (and its encoder released) but before its evaluation
            history = self.evaluate_round(strategy, start, encoder, history[-1])
        for round_number in range(start + 1, config.rounds + 1):
            encoder, history = self.round(strategy, round_number, encoder)
        sha = records.save_final(paths, config, config.rounds, encoder)
        result = self.result(history, sha, resumed_from=start or None)
        atomic_write_text(paths.result, json.dumps(result, indent=2, sort_keys=True) + "\n")
        log.info("done: %d rounds, final encoder %s, written to %s", config.rounds, sha[:12], paths.final)
        return result

    def connected(self, wanted: int, timeout: float) -> list[int]:
        """The connected nodes once at least ``wanted`` are, or after ``timeout`` seconds."""
        nodes: list[int] = []

        def enough() -> bool:
            nodes[:] = self.grid.get_node_ids()
            return len(nodes) >= wanted

        with contextlib.suppress(WaitTimeout):
            wait_until(enough, timeout, f"{wanted} connected clients", interval=POLL_SECONDS)
        return nodes

    def wait_for_clients(self, round_number: int) -> list[int]:
        """Before this server's first round wait for every client, later for ``required_clients``."""
        config = self.config
        wanted = len(config.clients) if not self.rounds_run else config.required_clients
        nodes = self.connected(wanted, config.connect_timeout_s)
        if len(nodes) < config.required_clients:
            missing = sorted(set(config.clients) - {c for n in nodes if (c := self.binding.client_of(n))})
            self.fail(
                round_number,
                f"only {len(nodes)} of {len(config.clients)} clients are connected after "
                f"{config.connect_timeout_s:.0f} s; a round needs {config.required_clients}",
                missing,
                [],
            )
        return nodes

    def identify(self, nodes: list[int], round_number: int) -> list[dict[str, Any]]:
        """Ask the nodes not yet bound (simulation, remote SuperLink) which client they are; the failures."""
        wanted = [n for n in nodes if self.binding.client_of(n) is None]
        if not wanted:
            return []
        content = {"config": ConfigRecord({"run-name": self.config.run_name})}
        messages = [Message(RecordDict(dict(content)), dst_node_id=n, message_type=MessageType.QUERY) for n in wanted]
        _, failures = self.exchange(messages, round_number, "identify")
        return failures

    def weight(self, client: str) -> float:
        """The server's weight (clients table), or 1: DP's guarantee needs a uniformly weighted mean, and
        secure aggregation sums what it gets."""
        uniform = self.config.differential_privacy or self.config.secure_aggregation
        return 1.0 if uniform else float(self.config.client_weights.get(client, 1.0))

    def round(
        self, strategy: FedAvg, round_number: int, encoder: records.NDArrays
    ) -> tuple[records.NDArrays, list[dict[str, Any]]]:
        config = self.config
        nodes = self.wait_for_clients(round_number)
        failures = self.identify(nodes, round_number)  # nodes seen for the first time only
        started = time.monotonic()
        sampled = sample_clients(config, round_number)
        chosen = sorted(n for c in sampled if (n := self.binding.node_of(c)) is not None and n in nodes)
        if self.secure is not None:  # only clients that advertised keys and shared them can be masked against
            ready = set(self.secure.setup(round_number, [str(self.binding.client_of(n)) for n in chosen], failures))
            chosen = [n for n in chosen if self.binding.client_of(n) in ready]
        if len(chosen) < config.required_clients:
            unreachable = sorted(set(sampled) - {str(self.binding.client_of(n)) for n in chosen})
            self.fail(
                round_number,
                f"round {round_number}: {len(chosen)} of {len(sampled)} clients replied when asked "
                f"who they are or are connected (missing: {', '.join(unreachable)}), fewer than the "
                f"{config.required_clients} a round needs",
                unreachable,
                failures,
            )
        arrays = ArrayRecord({name: Array(value) for name, value in encoder.items()})
        bytes_down = array_bytes(arrays)
        local = ConfigRecord(config.local(round_number).to_record())
        if self.privacy is not None:
            local[KEY_CLIPPING_NORM] = config.dp_clipping_norm
            local[SHARE_CLIENT_METRICS] = config.dp_share_client_metrics
        self.train_names = train_metrics(local)
        if self.secure is not None:
            self.secure.configure(local)
        messages = strategy.configure_train(round_number, arrays, local, NodeSnapshot(chosen))  # type: ignore[arg-type]
        if self.secure is not None:
            messages = self.secure.address(messages)
        good, train_failures = self.exchange(messages, round_number, "train")
        failures += train_failures
        if self.secure is not None:
            good, norms = self.secure.accept(good, failures), {}
        else:
            good, norms = self.accept_train(good, encoder, failures)
        replied = [self.client_of(reply) for reply in good]
        missing = sorted(set(sampled) - set(replied))
        if len(good) < config.required_clients:
            self.fail(
                round_number,
                f"round {round_number}: {len(good)} of {len(sampled)} clients replied "
                f"(missing: {', '.join(missing) or 'none'}), fewer than the {config.required_clients} a round needs",
                missing,
                failures,
            )
        rows = [
            self.row(round_number, reply, TRAIN_COLUMNS)
            | {
                "bytes_up": array_bytes(reply.content[ARRAYS]),
                "bytes_down": bytes_down,
                "weight": self.weight(self.client_of(reply)),
                "update_norm": norms.get(self.client_of(reply)),
            }
            for reply in good
        ]
        self.weigh(good)
        aggregated_train = None
        if self.train_names:  # none when the clients withheld their metrics (DP)
            aggregated_train = aggregate_metricrecords([reply.content for reply in good], SERVER_WEIGHT)
        new_encoder = self.aggregate(strategy, round_number, len(sampled), encoder, good, failures)
        train_seconds = time.monotonic() - started
        evaluated = config.evaluates(round_number)
        record = {
            "rows": rows,
            "sampled": sampled,
            "evaluation": [],
            "evaluated": evaluated,
            # the round is saved before its encoder goes anywhere (evaluation included): a DP
            # release is durable, with the accountant's state, before it is released
            "evaluation_pending": evaluated,
            "missing": missing,
            "evaluation_missing": [],
            "failures": failures,
            "round_seconds": train_seconds,
            "train_seconds": train_seconds,
            # None when the clients withheld their seconds (DP)
            "slowest_client_seconds": max((row["seconds"] for row in rows), default=0.0) if self.train_names else None,
            "aggregated_train": dict(aggregated_train or {}),
            "aggregated_evaluation": {},
            "update_norm_bound": update_norm_bound(config, self.encoder_values),
            "privacy": None
            if self.privacy is None
            else self.privacy.spent() | {"delta_target": config.dp_delta, "accountant": self.privacy.state()},
            "secure_aggregation": self.secure.record(round_number) if self.secure is not None else None,
        }
        moments = isinstance(strategy, FedAdam) and strategy.m_t is not None and strategy.v_t is not None
        state = {"m_t": dict(strategy.m_t), "v_t": dict(strategy.v_t)} if moments else {}  # type: ignore[attr-defined]
        history = records.save_round(self.paths, config, round_number, new_encoder, state, record)
        self.rounds_run += 1
        if evaluated:
            history = self.evaluate_round(strategy, round_number, new_encoder, history[-1], started)
        epsilon = f", epsilon {history[-1]['privacy']['epsilon']:.3g}" if history[-1]["privacy"] else ""
        log.info("%s%s", round_log_line(history[-1], config.rounds), epsilon)
        return new_encoder, history

    def aggregate(
        self,
        strategy: FedAvg,
        round_number: int,
        sampled: int,
        encoder: records.NDArrays,
        good: list[Message],
        failures: list[dict[str, Any]],
    ) -> records.NDArrays:
        """The strategy's step from the weighted, unmasked (secure aggregation) or noisy (DP: the step
        is post-processing) mean over the ``sampled`` clients."""
        replies = good
        total: records.NDArrays = {}
        if self.secure is not None:
            mean = self.secure.mean_update(round_number, good, failures)
            model = {name: np.asarray(encoder[name] + mean[name], dtype=np.float32) for name in encoder}
            replies = [synthetic_reply(model)]
            # back to the survivors' sum: under DP the mean is over the clients sampled
            total = {name: mean[name].astype(np.float64) * len(self.secure.survivors) for name in encoder}
        elif self.privacy is not None:
            total = clipped_sum(good, encoder, self.config.dp_clipping_norm)
        if self.privacy is not None:
            noisy = self.privacy.noisy_mean(total, sampled)
            replies = [synthetic_reply({name: encoder[name] + noisy[name] for name in encoder})]
        aggregated, _ = strategy.aggregate_train(round_number, replies)
        if aggregated is None:
            self.fail(round_number, f"round {round_number}: the strategy returned no aggregate", [], failures)
        return {name: np.asarray(aggregated[name].numpy(), dtype=np.float32) for name in encoder}

    def evaluate_round(
        self,
        strategy: FedAvg,
        round_number: int,
        encoder: records.NDArrays,
        record: dict[str, Any],
        started: float | None = None,
    ) -> list[dict[str, Any]]:
        """The saved ``encoder`` on every connected client's held-out utterances, written into its
        ``record``; returns every record. ``started`` (monotonic) times the round; ``None`` when a
        resumed run finishes an earlier attempt's."""
        config = self.config
        failures: list[dict[str, Any]] = []
        rows: list[dict[str, Any]] = []
        metrics = None
        nodes = self.connected(len(record["rows"]), config.connect_timeout_s)
        if not nodes:
            log.warning(
                "round %d evaluate: no client is connected after %.0f s", round_number, config.connect_timeout_s
            )
            reason = f"no client connected within {config.connect_timeout_s:.0f} s"
            failures.append({"phase": "evaluate", "client_id": None, "node_id": None, "reason": reason})
        else:
            arrays = ArrayRecord({name: Array(value) for name, value in encoder.items()})
            local = ConfigRecord(config.local(round_number).to_record())
            messages = strategy.configure_evaluate(round_number, arrays, local, NodeSnapshot(nodes))  # type: ignore[arg-type]
            good, failures = self.exchange(messages, round_number, "evaluate")
            accepted = self.screen(good, "evaluate", failures, lambda reply: self.check_reply(reply, "evaluate"))
            rows = [self.row(round_number, reply, EVALUATION_METRICS) for reply in accepted]
            for row in rows:
                if not row["leak_free_frames"]:
                    row.update(dict.fromkeys(LEAK_FREE_COLUMNS))
                if not row["masked_frames"]:
                    row.update(dict.fromkeys(HELDOUT_COLUMNS))
            unscored = [row["client_id"] for row in rows if not row["masked_frames"]]
            if unscored:
                log.warning(
                    "round %d evaluate: %s hold no held-out frames: their held-out results are null",
                    round_number,
                    ", ".join(unscored) if self.per_client_released else f"{len(unscored)} clients",
                )
            weighted = [reply for reply in accepted if int(reply.content[METRICS]["num-examples"]) > 0]
            self.weigh(weighted)
            metrics = strategy.aggregate_evaluate(round_number, weighted) if weighted else None
        summary = evaluation_summary(rows)
        if not self.per_client_released:
            # what each client scored stays out of every record: only the summary is kept
            for row in rows:
                row.update(dict.fromkeys(EVALUATION_METRICS))
        record = record | {
            "evaluation": rows,
            "evaluation_summary": summary,
            "evaluation_pending": False,
            "evaluation_missing": sorted(set(config.clients) - {e["client_id"] for e in rows}),
            "failures": record["failures"] + failures,
            "aggregated_evaluation": dict(metrics or {}),
        }
        if started is not None:
            record["round_seconds"] = time.monotonic() - started
        return records.rewrite_record(self.paths, round_number, record)

    def weigh(self, replies: Iterable[Message]) -> None:
        """The server's weight for Flower's ``weighted_by_key``; the client's ``num-examples`` plays no part."""
        for reply in replies:
            reply.content[METRICS][SERVER_WEIGHT] = self.weight(self.client_of(reply))

    def exchange(
        self, messages: Iterable[Message], round_number: int, phase: str
    ) -> tuple[list[Message], list[dict[str, Any]]]:
        """Push ``messages``, pull replies (each to ``received.jsonl``) until all arrived or ``round_timeout_s``
        passed: the replies bound to their node, and a failure for every error, refused binding and missing reply."""
        messages = list(messages)
        destinations = [m.metadata.dst_node_id for m in messages]
        ids = list(self.grid.push_messages(messages))
        pending = {mid: node for mid, node in zip(ids, destinations, strict=True) if mid}
        failures: list[dict[str, Any]] = []
        replies: list[tuple[int, Message]] = []

        def failed(node: int, reason: str) -> None:
            failures.append(
                {"phase": phase, "client_id": self.binding.client_of(node), "node_id": node, "reason": reason}
            )

        for mid, node in zip(ids, destinations, strict=True):
            if not mid:
                failed(node, "could not be sent")

        def all_replied() -> bool:
            for reply in self.grid.pull_messages(list(pending)) if pending else ():
                node = pending.pop(reply.metadata.reply_to_message_id, None)
                if node is None:
                    continue
                self.audit(round_number, phase, node, reply)
                if reply.has_error():
                    failed(node, f"error {reply.error.code}: {reply.error.reason}")
                else:
                    replies.append((node, reply))
            return not pending

        with contextlib.suppress(WaitTimeout):
            wait_until(all_replied, self.config.round_timeout_s, f"{phase} replies", interval=POLL_SECONDS)
        for node in pending.values():
            failed(node, f"no reply within {self.config.round_timeout_s:.0f} s")
        good, refused = self.binding.bind(replies, phase, connected=set(self.grid.get_node_ids()))
        failures.extend(refused)
        for failure in failures:
            log.warning(
                "round %d %s: %s (node %s) failed: %s",
                round_number,
                phase,
                failure["client_id"] or "unknown client",
                failure["node_id"],
                failure["reason"],
            )
        return sorted(good, key=self.client_of), failures

    def row(self, round_number: int, reply: Message, columns: dict[str, tuple[str, type]]) -> dict[str, Any]:
        """Its round, client and ``{column: (metric, type)}`` read from its metrics (None if withheld)."""
        metrics = reply.content[METRICS]
        return {"round": round_number, "client_id": self.client_of(reply)} | {
            column: kind(metrics[metric]) if metric in metrics else None for column, (metric, kind) in columns.items()
        }

    def client_of(self, reply: Message) -> str:
        return str(self.binding.client_of(reply.metadata.src_node_id))

    def audit(self, round_number: int, phase: str, node: int, reply: Message) -> None:
        """What a reply carries, to ``received.jsonl``: record names, kinds, keys and shapes."""
        entry: dict[str, Any] = {"round": round_number, "phase": phase, "node_id": node}
        entry["client_id"] = self.binding.client_of(node)
        if reply.has_error():
            entry["error"] = reply.error.reason
        else:
            content = reply.content
            described: dict[str, Any] = {
                name: {"type": "ArrayRecord", "keys": {k: [a.dtype, list(a.shape)] for k, a in record.items()}}
                for name, record in content.array_records.items()
            }
            for kind, group in (("MetricRecord", content.metric_records), ("ConfigRecord", content.config_records)):
                described |= {name: {"type": kind, "keys": sorted(record)} for name, record in group.items()}
            entry["records"] = described
        self.paths.received.parent.mkdir(parents=True, exist_ok=True)
        with open(self.paths.received, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry, sort_keys=True) + "\n")

    def screen(
        self,
        replies: list[Message],
        phase: str,
        failures: list[dict[str, Any]],
        problem_of: Callable[[Message], str | None],
    ) -> list[Message]:
        """The replies ``problem_of`` finds nothing wrong with; the others are refused, logged and failed."""
        accepted = []
        for reply in replies:
            if problem := problem_of(reply):
                failures.append(self.failure(reply, phase, problem))
                log.warning("refusing the %s reply of %s: %s", phase, self.client_of(reply), problem)
            else:
                accepted.append(reply)
        return accepted

    def accept_train(
        self, good: list[Message], encoder: records.NDArrays, failures: list[dict[str, Any]]
    ) -> tuple[list[Message], dict[str, float]]:
        """The replies that pass :meth:`check_reply` and :func:`update_problem`, and their norms. Under
        DP an exact norm is outside epsilon: written nowhere (refusals included) unless released."""
        bound = update_norm_bound(self.config, self.encoder_values)
        bound_name = "dp_clipping_norm" if self.config.differential_privacy else "max_update_norm"
        withhold = not self.per_client_released
        norms: dict[str, float] = {}

        def problem_of(reply: Message) -> str | None:
            if problem := self.check_reply(reply, "train"):
                return problem
            update = {name: array.numpy() for name, array in reply.content[ARRAYS].items()}
            norm, problem = update_problem(update, encoder, bound, bound_name, withhold_norm=withhold)
            if problem is None and not withhold:
                norms[self.client_of(reply)] = float(norm)  # type: ignore[arg-type]
            return problem

        return self.screen(good, "train", failures, problem_of), norms

    @property
    def per_client_released(self) -> bool:
        """Whether per-client values (metrics, norms, held-out results, refusal values) may be recorded:
        under DP only when the run opts in (``dp_share_client_metrics``)."""
        return not self.config.differential_privacy or self.config.dp_share_client_metrics

    def check_reply(self, reply: Message, phase: str) -> str | None:
        """Why a reply is refused (``None`` if it is acceptable): the privacy boundary, enforced."""
        names = self.train_names if phase == "train" else None
        withhold = not self.per_client_released
        return content_problem(reply.content, phase, self.expected, self.config.clients, names, withhold=withhold)

    def failure(self, reply: Message, phase: str, reason: str) -> dict[str, Any]:
        return self.binding.failure(phase, reply.metadata.src_node_id, claimed_client(reply.content), reason)

    def fail(self, round_number: int, message: str, missing: list[str], failures: list[dict[str, Any]]) -> NoReturn:
        """Record why the run stops (completed rounds are already saved) and raise."""
        completed = complete_rounds(self.paths)
        payload = {
            "round": round_number,
            "message": message,
            "missing": missing,
            "failures": failures,
            "completed_rounds": completed[-1] if completed else 0,
        }
        atomic_write_text(self.paths.failure, json.dumps(payload, indent=2, sort_keys=True) + "\n")
        log.error("%s; rounds completed and saved: %d", message, payload["completed_rounds"])
        raise FederatedRunError(message)

    def result(self, history: list[dict[str, Any]], sha: str, resumed_from: int | None) -> dict[str, Any]:
        config = self.config
        lines = summarize_rounds(history)
        last = history[-1]
        overheads = [line["overhead"] for line in lines if line["overhead"] is not None]  # None: seconds withheld
        return {
            "run_name": config.run_name,
            "rounds": config.rounds,
            "strategy": config.strategy,
            "local_steps": config.local_steps,
            "clients": config.clients,
            "checkpoint": str(self.paths.final),
            "checkpoint_sha256": sha,
            "resumed_from_round": resumed_from,
            "final_train_loss": lines[-1]["train_loss"],
            "heldout_loss": lines[-1]["heldout_loss"],
            "heldout_masked_accuracy": lines[-1]["heldout_masked_accuracy"],
            "heldout_majority_accuracy": lines[-1]["majority_accuracy"],
            "heldout_leak_free_masked_accuracy": lines[-1]["heldout_leak_free_masked_accuracy"],
            "heldout_leak_free_majority_accuracy": lines[-1]["heldout_leak_free_majority_accuracy"],
            "heldout_leak_free_frames": lines[-1]["leak_free_frames"],
            "heldout_per_client": {
                e["client_id"]: {
                    "masked_accuracy": e["heldout_masked_accuracy"],
                    "majority_accuracy": e["majority_accuracy"],
                    "masked_frames": e["masked_frames"],
                    "leak_free_frames": e.get("leak_free_frames", 0),
                    "leak_free_masked_accuracy": e.get("heldout_leak_free_masked_accuracy"),
                    "leak_free_majority_accuracy": e.get("leak_free_majority_accuracy"),
                }
                for e in last["evaluation"]
            },
            "missing_by_round": {str(line["round"]): line["missing"] for line in lines if line["missing"]},
            "sampled_by_round": {str(record["round"]): record.get("sampled", []) for record in history},
            "fraction_train": config.fraction_train,
            "evaluate_every": config.evaluate_every,
            "privacy": {k: v for k, v in (last.get("privacy") or {}).items() if k != "accountant"} or None,
            "secure_aggregation": config.secure_aggregation,
            "mean_overhead": sum(overheads) / len(overheads) if overheads else None,
            "mean_round_seconds": sum(line["round_seconds"] for line in lines) / len(lines),
            "bytes_up_per_round": sum(line["bytes_up"] for line in lines) / len(lines),
            "bytes_down_per_round": sum(line["bytes_down"] for line in lines) / len(lines),
            "round_summaries": lines,
            "data_versions": dict(config.data_versions),
        }


@contextlib.contextmanager
def run_logging(paths: FederatedPaths) -> Iterator[None]:
    """The server's lines to stdout and the run's server.log for this run only: a process that serves
    several runs (the simulation in process, a long-lived ServerApp) must not write a run's lines
    into an earlier run's log."""
    paths.root.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter("%(asctime)s server %(levelname)s %(message)s")
    handlers = (logging.StreamHandler(sys.stdout), logging.FileHandler(paths.server_log, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(formatter)
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        for handler in handlers:
            log.removeHandler(handler)
            handler.close()


def build_server_app(config: FederatedConfig | None = None) -> ServerApp:
    """``config`` given in process (simulation), else read from Flower's run config (``flwr run``)."""

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run = config or FederatedConfig.from_run_config(context.run_config)
        with run_logging(FederatedPaths(run.run_dir)):
            Server(grid, run).run()

    return server_app


app = build_server_app()
