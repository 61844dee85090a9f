"""The Flower ServerApp: rounds of local training on every client, aggregation of the encoder
with Flower's strategy (``FedAdam`` or ``FedAvg`` from ``flwr.serverapp.strategy``), held-out
evaluation of the new global encoder on every client, and a record of each completed round.

The round loop is written out (instead of ``Strategy.start``) so that a run can resume at round
``r + 1`` with the strategy's state as it was after round ``r`` (FedAdam's bias correction
depends on the round number), write each round as it completes, and name the clients that did
not reply. Sampling (``configure_train``/``configure_evaluate``) and aggregation
(``aggregate_train``/``aggregate_evaluate``) are the strategy's own; replies are aggregated in
client-id order so that a run is reproducible.

What the server accepts from a client is checked: exactly the encoder's tensors (names, shapes,
dtype float32), a MetricRecord and the client's id. A reply carrying anything else (a head, a
codebook, statistics) is refused and the client counted as failed; ``received.jsonl`` lists the
names and shapes of every record the server received.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAdam, FedAvg

from speech_assets.federated import rounds as records
from speech_assets.federated.config import FederatedConfig, FederatedPaths
from speech_assets.utils import atomic_write_text

log = logging.getLogger("speech_assets.federated.server")

POLL_SECONDS = 0.25
TRAIN_METRICS = ("num-examples", "train-loss", "masked-accuracy", "seconds", "audio-seconds", "steps")
EVAL_METRICS = ("num-examples", "utterances", "heldout-loss", "heldout-masked-accuracy", "majority-accuracy")
CLIENT_RECORD = "client"


class FederatedRunError(RuntimeError):
    """The run cannot go on (too few clients replied, or connected); completed rounds are saved."""


def make_strategy(config: FederatedConfig) -> FedAvg:
    common = {
        "fraction_train": 1.0,
        "fraction_evaluate": 1.0,
        "min_train_nodes": config.required_clients,
        "min_evaluate_nodes": 1,
        "min_available_nodes": config.required_clients,
    }
    if config.strategy == "fedadam":
        # eta_l is Flower's bookkeeping only: clients get their learning rate in the ConfigRecord.
        return FedAdam(
            **common, eta=config.eta, eta_l=config.client_lr, beta_1=config.beta_1, beta_2=config.beta_2, tau=config.tau
        )
    return FedAvg(**common)


def strategy_state(strategy: FedAvg) -> dict[str, records.NDArrays]:
    """The strategy's state worth saving: FedAdam's moments (``m_t``, ``v_t``), nothing for FedAvg."""
    if isinstance(strategy, FedAdam) and strategy.m_t is not None and strategy.v_t is not None:
        return {"m_t": dict(strategy.m_t), "v_t": dict(strategy.v_t)}
    return {}


def restore_strategy(strategy: FedAvg, state: dict[str, records.NDArrays]) -> None:
    if isinstance(strategy, FedAdam) and state:
        strategy.m_t, strategy.v_t = dict(state["m_t"]), dict(state["v_t"])


def array_bytes(record: ArrayRecord) -> int:
    """Serialized payload bytes of an ArrayRecord (what travels, before framing)."""
    return sum(len(array.data) for array in record.values())


def describe(message: Message) -> dict[str, Any]:
    """Names, kinds, keys and shapes of everything a reply carries (for ``received.jsonl``)."""
    if message.has_error():
        return {"error": message.error.reason}
    content = message.content
    described: dict[str, Any] = {}
    for name, record in content.array_records.items():
        described[name] = {"type": "ArrayRecord", "keys": {k: [a.dtype, list(a.shape)] for k, a in record.items()}}
    for name, record in content.metric_records.items():
        described[name] = {"type": "MetricRecord", "keys": sorted(record)}
    for name, record in content.config_records.items():
        described[name] = {"type": "ConfigRecord", "keys": sorted(record)}
    return {"records": described}


class Server:
    """One run of the loop described in the module docstring, on ``grid``."""

    def __init__(self, grid: Grid, config: FederatedConfig) -> None:
        self.grid, self.config = grid, config
        self.paths = FederatedPaths(config.run_dir)
        self.node_clients: dict[int, str] = {}

    # ------------------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        config, paths = self.config, self.paths
        paths.root.mkdir(parents=True, exist_ok=True)
        paths.failure.unlink(missing_ok=True)
        strategy = make_strategy(config)
        state = records.load_latest(paths, config)
        if state is None:
            from speech_assets.federated.local import initial_encoder

            encoder = records.to_numpy(initial_encoder(config.preset, config.seed))
            start, history = 0, []
            log.info("new run %s: %d rounds of %d local steps, %s, clients %s",
                     config.run_name, config.rounds, config.local_steps, config.strategy, ",".join(config.clients))  # fmt: skip
        else:
            encoder, start, history = state.encoder, state.round, state.records
            if start > config.rounds:
                self.fail(start, f"{paths.root} already holds {start} completed rounds, more than the {config.rounds} "
                          f"asked for: ask for at least {start} rounds, or use another run folder", [], [])  # fmt: skip
            restore_strategy(strategy, state.strategy)
            log.info("resuming %s after round %d (encoder %s)", config.run_name, start, history[-1]["weights_sha256"][:12])
        self.expected_keys = {name: (array.dtype, array.shape) for name, array in encoder.items()}
        for round_number in range(start + 1, config.rounds + 1):
            self.wait_for_clients(round_number)
            encoder, history = self.round(strategy, round_number, encoder)
        sha = records.save_final(paths, config, config.rounds, encoder)
        result = self.result(history, sha, resumed_from=start or None)
        atomic_write_text(paths.result, json.dumps(result, indent=2, sort_keys=True) + "\n")
        log.info("done: %d rounds, final encoder %s, written to %s", config.rounds, sha[:12], paths.final)
        return result

    def wait_for_clients(self, round_number: int) -> None:
        """Before round 1 wait for every expected client to connect (up to ``connect_timeout_s``);
        before any round, fail if fewer than ``min_train_nodes`` are connected by then (Flower's
        sampling would otherwise wait for them forever)."""
        config = self.config
        wanted = len(config.clients) if round_number == 1 or not self.node_clients else config.required_clients
        deadline = time.monotonic() + config.connect_timeout_s
        while (connected := len(list(self.grid.get_node_ids()))) < wanted:
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_SECONDS)
        if connected < config.required_clients:
            self.fail(round_number, f"only {connected} of {len(config.clients)} clients are connected after "
                      f"{config.connect_timeout_s:.0f} s; a round needs {config.required_clients}", [], [])  # fmt: skip

    def round(
        self, strategy: FedAvg, round_number: int, encoder: records.NDArrays
    ) -> tuple[records.NDArrays, list[dict[str, Any]]]:
        config = self.config
        started = time.monotonic()
        arrays = ArrayRecord({name: Array(value) for name, value in encoder.items()})
        bytes_down = array_bytes(arrays)
        messages = strategy.configure_train(round_number, arrays, ConfigRecord(config.local().to_record()), self.grid)
        good, failures = self.exchange(messages, round_number, "train")
        good = self.accept_train(good, failures)
        replied = [self.client_of(reply) for reply in good]
        missing = sorted(set(config.clients) - set(replied))
        if len(good) < config.required_clients:
            self.fail(
                round_number,
                f"round {round_number}: {len(good)} of {len(config.clients)} clients replied "
                f"(missing: {', '.join(missing) or 'none'}), fewer than min_train_nodes={config.required_clients}",
                missing,
                failures,
            )
        aggregated, train_metrics = strategy.aggregate_train(round_number, good)
        if aggregated is None:
            self.fail(round_number, f"round {round_number}: the strategy returned no aggregate", missing, failures)
        new_encoder = {name: np.asarray(aggregated[name].numpy(), dtype=np.float32) for name in encoder}
        train_seconds = time.monotonic() - started
        rows = [
            {
                "round": round_number,
                "client_id": self.client_of(reply),
                "num_examples": int(reply.content["metrics"]["num-examples"]),
                "train_loss": float(reply.content["metrics"]["train-loss"]),
                "masked_accuracy": float(reply.content["metrics"]["masked-accuracy"]),
                "bytes_up": array_bytes(reply.content["arrays"]),
                "bytes_down": bytes_down,
                "seconds": float(reply.content["metrics"]["seconds"]),
            }
            for reply in good
        ]
        evaluation, eval_metrics = self.evaluate(strategy, round_number, new_encoder, failures)
        record = {
            "rows": rows,
            "evaluation": evaluation,
            "missing": missing,
            "failures": failures,
            "round_seconds": time.monotonic() - started,
            "train_seconds": train_seconds,
            "aggregated_train": dict(train_metrics or {}),
            "aggregated_evaluation": eval_metrics,
        }
        history = records.save_round(self.paths, config, round_number, new_encoder, strategy_state(strategy), record)
        line = records.summarize_rounds(history[-1:])[0]
        log.info(
            "round %d/%d: %d clients%s, train loss %.4f, held-out masked accuracy %s (majority class %s), %.1f s",
            round_number, config.rounds, len(rows), f" (missing {', '.join(missing)})" if missing else "",
            line["train_loss"], _fmt(line["heldout_masked_accuracy"]), _fmt(line["majority_accuracy"]),
            line["round_seconds"],
        )  # fmt: skip
        return new_encoder, history

    def evaluate(
        self, strategy: FedAvg, round_number: int, encoder: records.NDArrays, failures: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """The new global encoder on every client's held-out utterances (with its own head)."""
        arrays = ArrayRecord({name: Array(value) for name, value in encoder.items()})
        messages = strategy.configure_evaluate(round_number, arrays, ConfigRecord(self.config.local().to_record()), self.grid)
        good, eval_failures = self.exchange(messages, round_number, "evaluate")
        accepted = []
        for reply in good:
            problem = self.check_reply(reply, arrays_expected=False, metrics=EVAL_METRICS)
            if problem:
                eval_failures.append(self.failure(reply, "evaluate", problem))
            else:
                accepted.append(reply)
        failures.extend(eval_failures)
        rows = [
            {
                "round": round_number,
                "client_id": self.client_of(reply),
                "utterances": int(reply.content["metrics"]["utterances"]),
                "masked_frames": int(reply.content["metrics"]["num-examples"]),
                "heldout_loss": float(reply.content["metrics"]["heldout-loss"]),
                "heldout_masked_accuracy": float(reply.content["metrics"]["heldout-masked-accuracy"]),
                "majority_accuracy": float(reply.content["metrics"]["majority-accuracy"]),
            }
            for reply in accepted
        ]
        weighted = [reply for reply in accepted if int(reply.content["metrics"]["num-examples"]) > 0]
        metrics = strategy.aggregate_evaluate(round_number, weighted) if weighted else None
        return rows, dict(metrics or {})

    # ------------------------------------------------------------------------ messaging
    def exchange(
        self, messages: Iterable[Message], round_number: int, phase: str
    ) -> tuple[list[Message], list[dict[str, Any]]]:
        """Push ``messages``, pull replies until all arrived or ``round_timeout_s`` passed.

        Returns the replies without error, sorted by client id, and a failure entry for every
        error reply (a ClientApp that raised or exited, a node that went offline) and every
        node that did not reply in time. Every reply is described in ``received.jsonl``.
        """
        messages = list(messages)
        destinations = [m.metadata.dst_node_id for m in messages]
        ids = list(self.grid.push_messages(messages))
        pending = {mid: node for mid, node in zip(ids, destinations, strict=True) if mid}
        failures = [
            {"phase": phase, "client_id": self.node_clients.get(node), "node_id": node, "reason": "could not be sent"}
            for mid, node in zip(ids, destinations, strict=True)
            if not mid
        ]
        good: list[Message] = []
        deadline = time.monotonic() + self.config.round_timeout_s
        while pending and time.monotonic() < deadline:
            for reply in self.grid.pull_messages(list(pending)):
                node = pending.pop(reply.metadata.reply_to_message_id, None)
                if node is None:
                    continue
                if not reply.has_error():
                    self.learn_client(node, reply)
                self.audit(round_number, phase, node, reply)
                if reply.has_error():
                    failures.append(
                        {"phase": phase, "client_id": self.node_clients.get(node), "node_id": node,
                         "reason": f"error {reply.error.code}: {reply.error.reason}"}
                    )  # fmt: skip
                else:
                    good.append(reply)
            if pending:
                time.sleep(POLL_SECONDS)
        for node in pending.values():
            failures.append(
                {"phase": phase, "client_id": self.node_clients.get(node), "node_id": node,
                 "reason": f"no reply within {self.config.round_timeout_s:.0f} s"}
            )  # fmt: skip
        for failure in failures:
            log.warning("round %d %s: %s (node %s) failed: %s", round_number, phase,
                        failure["client_id"] or "unknown client", failure["node_id"], failure["reason"])  # fmt: skip
        return sorted(good, key=self.client_of), failures

    def learn_client(self, node: int, reply: Message) -> None:
        record = reply.content.config_records.get(CLIENT_RECORD)
        if record is not None and isinstance(record.get("client-id"), str):
            self.node_clients[node] = str(record["client-id"])

    def client_of(self, reply: Message) -> str:
        return str(reply.content[CLIENT_RECORD]["client-id"])

    def audit(self, round_number: int, phase: str, node: int, reply: Message) -> None:
        entry = {"round": round_number, "phase": phase, "node_id": node, "client_id": self.node_clients.get(node)}
        entry.update(describe(reply))
        self.paths.received.parent.mkdir(parents=True, exist_ok=True)
        with open(self.paths.received, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry, sort_keys=True) + "\n")

    def accept_train(self, good: list[Message], failures: list[dict[str, Any]]) -> list[Message]:
        accepted = []
        for reply in good:
            problem = self.check_reply(reply, arrays_expected=True, metrics=TRAIN_METRICS)
            if problem:
                failures.append(self.failure(reply, "train", problem))
                log.warning("refusing the reply of %s: %s", self.node_clients.get(reply.metadata.src_node_id), problem)
            else:
                accepted.append(reply)
        return accepted

    def check_reply(self, reply: Message, arrays_expected: bool, metrics: Sequence[str]) -> str | None:
        """Why a reply is refused (``None`` if it is acceptable): the privacy boundary, enforced."""
        content = reply.content
        allowed = {"arrays", "metrics", CLIENT_RECORD} if arrays_expected else {"metrics", CLIENT_RECORD}
        extra = sorted(set(content.keys()) - allowed)
        if extra:
            return f"unexpected records {extra}"
        client = content.config_records.get(CLIENT_RECORD)
        if client is None or set(client) != {"client-id"} or client["client-id"] not in self.config.clients:
            return "no valid client-id"
        if set(content.metric_records.get("metrics", {})) != set(metrics):
            return f"metrics must be exactly {sorted(metrics)}"
        if arrays_expected:
            arrays = content.array_records.get("arrays")
            if arrays is None:
                return "no encoder"
            shapes = {name: (np.dtype(a.dtype), tuple(a.shape)) for name, a in arrays.items()}
            if shapes != self.expected_keys:
                unexpected = sorted(set(shapes) - set(self.expected_keys))
                return f"arrays are not exactly the encoder's (unexpected: {unexpected[:5]})"
        return None

    def failure(self, reply: Message, phase: str, reason: str) -> dict[str, Any]:
        client = reply.content.config_records.get(CLIENT_RECORD)
        return {"phase": phase, "client_id": client.get("client-id") if client else None,
                "node_id": reply.metadata.src_node_id, "reason": reason}  # fmt: skip

    # ---------------------------------------------------------------------- end of run
    def fail(self, round_number: int, message: str, missing: list[str], failures: list[dict[str, Any]]) -> None:
        """Record why the run stops (completed rounds are already saved) and raise."""
        completed = records.complete_rounds(self.paths)
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
        lines = records.summarize_rounds(history)
        last = history[-1]
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
            "heldout_masked_accuracy": lines[-1]["heldout_masked_accuracy"],
            "heldout_majority_accuracy": lines[-1]["majority_accuracy"],
            "heldout_per_client": {
                e["client_id"]: {"masked_accuracy": e["heldout_masked_accuracy"], "majority_accuracy": e["majority_accuracy"],
                                 "masked_frames": e["masked_frames"]}
                for e in last["evaluation"]
            },  # fmt: skip
            "missing_by_round": {str(line["round"]): line["missing"] for line in lines if line["missing"]},
            "mean_round_seconds": sum(line["round_seconds"] for line in lines) / len(lines),
            "bytes_up_per_round": sum(line["bytes_up"] for line in lines) / len(lines),
            "bytes_down_per_round": sum(line["bytes_down"] for line in lines) / len(lines),
            "round_summaries": lines,
            "data_versions": dict(config.data_versions),
        }


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _setup_logging(paths: FederatedPaths) -> None:
    paths.root.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter("%(asctime)s server %(levelname)s %(message)s")
    for handler in (logging.StreamHandler(sys.stdout), logging.FileHandler(paths.server_log, encoding="utf-8")):
        handler.setFormatter(formatter)
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point on the SuperLink: the run config carries :class:`FederatedConfig`."""
    config = FederatedConfig.from_run_config(context.run_config)
    _setup_logging(FederatedPaths(config.run_dir))
    Server(grid, config).run()
