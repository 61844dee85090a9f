"""Secure aggregation's messages (stages in docs/ARCHITECTURE.md) on the server (:class:`SecureRounds`)
and the client (:func:`answer_secure_query`, :func:`mask_reply`).

A client trusts only the node keys of its own settings. Every stage runs under :func:`state_lock`,
and an answered unmask is on disk (owner-only) before the answer leaves: none is answered twice.
Not Flower's ``SecAggPlusWorkflow``: in Flower 1.42 it exists only on the legacy ``Strategy`` path
and owns the fit stage, around which the reply checks, seeded sampling and records would be rebuilt.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn, Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from speech_assets.federated.auth import authorised_keys, identity_key
from speech_assets.federated.config import FederatedConfig, NodeConfig
from speech_assets.federated.messages import (
    ARRAYS,
    CLIENT_RECORD,
    ArraySpec,
    NodeBinding,
    check_masked,
    content_problem,
)
from speech_assets.federated.secure_aggregation import (
    DEFAULT_TARGET_RANGE,
    KEY_BYTES,
    RoundSecrets,
    SecAggParams,
    advertisement,
    check_share_public,
    check_threshold,
    combine_secret,
    default_threshold,
    mask_public,
    mask_update,
    neighbours,
    open_shares,
    round_context,
    seal_shares,
    seed_commitment,
    share_index,
    sign_advertisement,
    split_secret,
    unmask_sum,
    verify_advertisement,
)
from speech_assets.layout import TEMP_SUFFIX, ClientRunFiles
from speech_assets.runtime.locks import LockTimeout, exclusive_lock
from speech_assets.utils import fsync_dir

ReplyProblem = Callable[[Message], str | None]  # what is wrong with a reply, or None

# keys of a secure round's ConfigRecords
SECAGG_NONCE, SECAGG_RANGE, SECAGG_TARGET = "secagg-nonce", "secagg-range", "secagg-target"
SECAGG_THRESHOLD, SECAGG_SHARES_NUM, SECAGG_KEYS = "secagg-threshold", "secagg-num-shares", "secagg-keys"
SECAGG_SURVIVORS, SECAGG_DROPPED, KIND = "secagg-survivors", "secagg-dropped", "kind"
ADVERTISE, SHARE, UNMASK = "secagg-advertise", "secagg-share", "secagg-unmask"
# records of the replies (and of the train message: SHARES, the ciphertexts routed to its client)
KEY_RECORD, MASK_KEY, SHARE_KEY, COMMITMENT, SIGNATURE = "secagg", "mask-key", "share-key", "commitment", "signature"
SHARES, SEED_SHARES, KEY_SHARES = "secagg-shares", "secagg-seed-shares", "secagg-key-shares"
ANSWERED, ABANDONED = "answered", "abandoned"


class RoundHost(Protocol):
    """What the secure rounds need from the server app (a Protocol: server_app imports this module)."""

    binding: NodeBinding
    expected: ArraySpec
    train_names: tuple[str, ...]  # the training metrics a reply must carry this round

    def exchange(
        self, messages: Iterable[Message], round_number: int, phase: str
    ) -> tuple[list[Message], list[dict[str, Any]]]: ...

    def client_of(self, reply: Message) -> str: ...

    def failure(self, reply: Message, phase: str, reason: str) -> dict[str, Any]: ...

    def screen(
        self, replies: list[Message], phase: str, failures: list[dict[str, Any]], problem_of: ReplyProblem
    ) -> list[Message]: ...

    def fail(self, round_number: int, message: str, missing: list[str], failures: list[dict[str, Any]]) -> NoReturn: ...


def _clients(value: Any) -> list[str]:
    return [c for c in str(value).split(",") if c]


class SecureRounds:
    """The server's side of one run: each round's keys, routed shares, survivors and unmasking."""

    def __init__(self, config: FederatedConfig, host: RoundHost) -> None:
        self.config, self.host = config, host
        clipping_range = config.secagg_clipping_range or 2.0 * config.client_lr * config.local_steps
        self.params = SecAggParams(clipping_range, DEFAULT_TARGET_RANGE)
        self.params.check_clients(config.sample_size)
        self.num_shares = config.secagg_shares()
        self.threshold = config.secagg_threshold or default_threshold(self.num_shares)
        check_threshold(self.threshold, self.num_shares)
        self.round_number = 0
        self.nonce = b""
        # client -> (mask key, share key, commitment, its signature of them)
        self.keys: dict[str, tuple[bytes, bytes, bytes, bytes]] = {}
        self.sealed: dict[str, dict[str, bytes]] = {}  # src -> {dst: ciphertext}
        self.survivors: list[str] = []
        self.dropped: list[str] = []

    @property
    def context(self) -> bytes:
        return round_context(self.config.run_name, self.round_number, self.nonce)

    def neighbours(self, client: str) -> list[str]:
        return neighbours(client, self.keys, self.num_shares)

    def masked_with(self, client: str) -> list[str]:
        """The clients ``client`` masked against (itself included): its neighbours that shared."""
        return [c for c in self.neighbours(client) if c in self.sealed]

    def _ask(
        self, phase: str, per_client: dict[str, dict[str, Any]], failures: list[dict[str, Any]]
    ) -> dict[str, Message]:
        """Send each client with a node its query; ``{client: reply}`` of the bound replies."""
        common = {"secure-aggregation": True, "run-name": self.config.run_name, "server-round": self.round_number}
        messages = [
            Message(
                RecordDict({"config": ConfigRecord(common | {SECAGG_NONCE: self.nonce} | fields)}),
                dst_node_id=int(node),
                message_type=MessageType.QUERY,
            )
            for client, fields in per_client.items()
            if (node := self.host.binding.node_of(client)) is not None
        ]
        good, refused = self.host.exchange(messages, self.round_number, phase)
        failures.extend(refused)
        return {self.host.client_of(reply): reply for reply in good}

    def _records(self, reply: Message, names: set[str]) -> str | None:
        if set(reply.content.keys()) != names | {CLIENT_RECORD} or reply.content.array_records:
            return f"a reply holds records {sorted(reply.content.keys())}, expected {sorted(names | {CLIENT_RECORD})}"
        return None

    def setup(self, round_number: int, clients: Collection[str], failures: list[dict[str, Any]]) -> list[str]:
        """Stages 1 and 2 for the sampled, reachable ``clients``: those that advertised and shared."""
        self.round_number, self.nonce = round_number, os.urandom(16)
        self.keys, self.sealed, self.survivors, self.dropped = {}, {}, [], []
        common = {KIND: ADVERTISE, SECAGG_THRESHOLD: self.threshold, SECAGG_SHARES_NUM: self.num_shares}
        asked = {c: common for c in clients}
        self._collect("secagg-advertise", asked, KEY_RECORD, self._read_keys, self.keys, failures)
        if len(self.keys) < self.threshold:
            self._fail_short("advertised keys", sorted(self.keys), clients, failures)
        table = json.dumps(
            {c: [m.hex(), s.decode("ascii"), h.hex(), sig.hex()] for c, (m, s, h, sig) in self.keys.items()},
            sort_keys=True,
        )
        asked = {
            c: {KIND: SHARE, SECAGG_KEYS: table, SECAGG_THRESHOLD: self.threshold, SECAGG_SHARES_NUM: self.num_shares}
            for c in self.keys
        }

        def read_shares(client: str, record: Any) -> tuple[dict[str, Any], str | None]:
            sealed = dict(record or {})
            expected = set(self.neighbours(client)) - {client}
            if set(sealed) == expected and all(isinstance(v, bytes) for v in sealed.values()):
                return sealed, None
            return sealed, f"shares for {sorted(sealed)[:10]}, expected one ciphertext for each of {sorted(expected)}"

        self._collect("secagg-share", asked, SHARES, read_shares, self.sealed, failures)
        if len(self.sealed) < self.threshold:
            self._fail_short("shared their keys", sorted(self.sealed), clients, failures)
        return sorted(self.sealed)

    def _collect(
        self,
        phase: str,
        asked: dict[str, dict[str, Any]],
        record: str,
        read: Callable[[str, Any], tuple[Any, str | None]],
        kept: dict[str, Any],
        failures: list[dict[str, Any]],
    ) -> None:
        """Keep in ``kept`` the ``record`` of each reply ``read(client, record) -> (value, problem)`` passes."""
        for client, reply in self._ask(phase, asked, failures).items():
            problem = self._records(reply, {record})
            value, found = read(client, reply.content.config_records.get(record))
            if problem or found:
                failures.append(self.host.failure(reply, phase, problem or found))  # type: ignore[arg-type]
            else:
                kept[client] = value

    def _read_keys(self, client: str, record: Any) -> tuple[tuple[Any, ...], str | None]:
        keys = tuple(record.get(k) for k in (MASK_KEY, SHARE_KEY, COMMITMENT, SIGNATURE)) if record is not None else ()
        if len(keys) != 4 or not all(isinstance(k, bytes) for k in keys):
            return keys, f"no {MASK_KEY!r}, {SHARE_KEY!r}, {COMMITMENT!r} and {SIGNATURE!r} in the advertise reply"
        mask, share, commitment, _ = keys
        if len(mask) != KEY_BYTES or len(commitment) != 32:
            return keys, f"a mask key of {len(mask)} bytes or a commitment of {len(commitment)} bytes (expected 32)"
        if any(mask == known[0] or share == known[1] for known in self.keys.values()):
            return keys, "a public key another client advertised too"
        try:
            check_share_public(share)
        except ValueError as error:
            return keys, f"share key refused: {error}"
        return keys, None

    def _fail_short(
        self, what: str, got: list[str], clients: Collection[str], failures: list[dict[str, Any]]
    ) -> NoReturn:
        missing = sorted(set(clients) - set(got))
        self.host.fail(
            self.round_number,
            f"round {self.round_number}: secure aggregation needs {self.threshold} "
            f"clients (its threshold), {len(got)} {what} (missing: {', '.join(missing) or 'none'})",
            missing,
            failures,
        )

    def configure(self, local: ConfigRecord) -> None:
        local[SECAGG_NONCE] = self.nonce
        local[SECAGG_RANGE] = self.params.clipping_range
        local[SECAGG_TARGET] = self.params.target_range

    def address(self, messages: Iterable[Message]) -> list[Message]:
        """The train messages, each with the ciphertexts sealed for its own client."""
        out = []
        for message in messages:
            meta = message.metadata
            client = str(self.host.binding.client_of(meta.dst_node_id))
            routed = ConfigRecord(
                {src: sealed[client] for src, sealed in sorted(self.sealed.items()) if client in sealed}
            )
            content = RecordDict(dict(message.content.items()) | {SHARES: routed})
            out.append(
                Message(content, dst_node_id=meta.dst_node_id, message_type=meta.message_type, group_id=meta.group_id)
            )
        return out

    def accept(self, good: list[Message], failures: list[dict[str, Any]]) -> list[Message]:
        """The masked replies that hold exactly the encoder's arrays as uint32, the metrics and the
        client id (masked values cannot be checked), from clients that shared."""
        spec = {name: ("uint32", shape) for name, (_, shape) in self.host.expected.items()}

        def problem_of(reply: Message) -> str | None:
            if problem := content_problem(reply.content, "train", spec, self.config.clients, self.host.train_names):
                return problem
            return None if self.host.client_of(reply) in self.sealed else "did not share its keys this round"

        return self.host.screen(good, "train", failures, problem_of)

    def mean_update(
        self, round_number: int, good: list[Message], failures: list[dict[str, Any]]
    ) -> dict[str, np.ndarray]:
        """The survivors' mean update; survivors (the accepted ``good``) are fixed before any share is asked."""
        masked = {self.host.client_of(r): {n: a.numpy() for n, a in r.content[ARRAYS].items()} for r in good}
        self.survivors = sorted(masked)
        self.dropped = sorted(set(self.sealed) - set(masked))
        if len(self.survivors) < self.threshold:
            self._fail_short("sent an accepted masked update", self.survivors, self.sealed, failures)
        seeds, keys = self.reveal(failures)
        public = {c: k[0] for c, k in self.keys.items()}
        masked_with = {c: self.masked_with(c) for c in self.survivors}
        try:
            total = unmask_sum(masked, seeds, keys, public, masked_with, self.params, self.context)
        except ValueError as error:
            self.host.fail(
                round_number, f"round {round_number}: the masked updates did not unmask: {error}", [], failures
            )
        return {name: (value / len(masked)).astype(np.float32) for name, value in total.items()}

    def reveal(self, failures: list[dict[str, Any]]) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """Stage 4: survivors' seeds and dropped clients' mask keys, rebuilt and checked against their adverts."""
        survivors = set(self.survivors)
        asked = {}
        for client in self.survivors:
            mine = self.masked_with(client)
            asked[client] = {
                KIND: UNMASK,
                SECAGG_SURVIVORS: ",".join(sorted(c for c in mine if c in survivors)),
                SECAGG_DROPPED: ",".join(sorted(c for c in mine if c not in survivors)),
            }
        seed_shares: dict[str, list[bytes]] = {c: [] for c in self.survivors}
        key_shares: dict[str, list[bytes]] = {c: [] for c in self.dropped}
        for client, reply in self._ask("secagg-unmask", asked, failures).items():
            problem = self._records(reply, {SEED_SHARES, KEY_SHARES})
            seeds = dict(reply.content.config_records.get(SEED_SHARES) or {})
            keys = dict(reply.content.config_records.get(KEY_SHARES) or {})
            if problem is None:
                problem = self._reveal_problem(client, asked[client], seeds, keys)
            if problem:
                failures.append(self.host.failure(reply, "secagg-unmask", problem))
                continue
            for owner, share in seeds.items():
                seed_shares[owner].append(share)
            for owner, share in keys.items():
                key_shares[owner].append(share)
        short = sorted(c for c, shares in (seed_shares | key_shares).items() if len(shares) < self.threshold)
        if short:
            self.host.fail(
                self.round_number,
                f"round {self.round_number}: fewer than {self.threshold} shares arrived to "
                f"unmask {', '.join(short)}; the sum cannot be unmasked",
                short,
                failures,
            )
        seeds = {owner: self._combine(shares) for owner, shares in seed_shares.items()}
        keys = {owner: self._combine(shares) for owner, shares in key_shares.items()}
        bad = [
            f"{c} (self-mask seed)"
            for c, seed in seeds.items()
            if seed_commitment(seed, c, self.context) != self.keys[c][2]
        ]
        bad += [
            f"{c} (mask key)" for c, key in keys.items() if len(key) != KEY_BYTES or mask_public(key) != self.keys[c][0]
        ]
        if bad:
            self.host.fail(
                self.round_number,
                f"round {self.round_number}: the revealed shares do not rebuild what "
                f"{', '.join(bad)} advertised; the sum cannot be unmasked",
                [],
                failures,
            )
        return seeds, keys

    @staticmethod
    def _combine(shares: list[bytes]) -> bytes:
        """The rebuilt secret, or nothing (which matches no commitment or key)."""
        try:
            return combine_secret(shares)
        except ValueError:
            return b""

    def _reveal_problem(
        self, client: str, asked: dict[str, Any], seeds: dict[str, Any], keys: dict[str, Any]
    ) -> str | None:
        if set(seeds) != set(_clients(asked[SECAGG_SURVIVORS])) or set(keys) != set(_clients(asked[SECAGG_DROPPED])):
            return "revealed shares for other clients than asked"
        for owner, share in seeds.items() | keys.items():
            if not isinstance(share, bytes):
                return f"a share of {owner} that is not bytes"
            try:
                index = share_index(share)
            except ValueError as error:
                return str(error)
            if index != self.neighbours(owner).index(client) + 1:
                return f"a share of {owner} with index {index}, not the one {client} was given"
        return None

    def record(self, round_number: int) -> dict[str, Any]:
        return {
            "round": round_number,
            "peers": sorted(self.keys),
            "shared": sorted(self.sealed),
            "survivors": len(self.survivors),
            "dropped": self.dropped,
            "threshold": self.threshold,
            "num_shares": self.num_shares,
            "clipping_range": self.params.clipping_range,
            "target_range": self.params.target_range,
        }


def state_path(node: NodeConfig, run: str, round_number: int) -> Path:
    return ClientRunFiles(node.client_dir(run)).secagg_round(round_number)


# how long a stage waits for this client's secure-aggregation lock: a stage holds it for
# milliseconds, so a longer hold is a stuck or hostile process, and the stage is refused
SECAGG_LOCK_TIMEOUT_S = 30.0


@contextlib.contextmanager
def state_lock(node: NodeConfig, run: str, stage: str) -> Iterator[None]:
    """Every stage reads, checks and rewrites a round's state under this lock, so racing requests
    (threads, or the deployment engine's per-message processes) take turns: one answer per round."""
    files = ClientRunFiles(node.client_dir(run))
    files.secagg_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(exclusive_lock(files.secagg_lock, SECAGG_LOCK_TIMEOUT_S))
        except LockTimeout:
            raise ValueError(
                f"{node.client_id} refuses the {stage} stage of run {run}: its secure-aggregation state "
                f"({files.secagg_lock}) stayed locked by another request for more than {SECAGG_LOCK_TIMEOUT_S:g} s"
            ) from None
        yield


def _load(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return {}


def _save(path: Path, state: dict[str, Any]) -> None:
    """Owner-only (0600), atomic and durable, before any answer leaves."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(state, handle, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def _secrets(state: dict[str, Any]) -> RoundSecrets:
    return RoundSecrets(
        bytes.fromhex(state["mask_key"]), state["share_key"].encode("ascii"), bytes.fromhex(state["self_seed"])
    )


def _round_state(config: ConfigRecord, node: NodeConfig, stage: str) -> tuple[Path, dict[str, Any], bytes]:
    """The round's state, which must be at ``stage`` for the same nonce (to advertise: not past it)."""
    run, round_number = str(config["run-name"]), int(config["server-round"])  # type: ignore[arg-type]
    path = state_path(node, run, round_number)
    state = _load(path)
    if state.get("stage") in (ANSWERED, ABANDONED):
        raise ValueError(
            f"{node.client_id} already answered (or gave up) the unmask request of round {round_number} "
            "and answers nothing more for it"
        )
    if stage == ADVERTISE and state.get("stage") not in (None, ADVERTISE):
        # fresh keys now would let shares of two key sets leave
        raise ValueError(
            f"{node.client_id}: round {round_number} is past its advertise stage ({state['stage']}): no new keys"
        )
    if stage != ADVERTISE and state.get("stage") != stage:
        raise ValueError(f"{node.client_id}: round {round_number} is at stage {state.get('stage')!r}, not {stage!r}")
    nonce = bytes(config[SECAGG_NONCE])  # type: ignore[arg-type]
    if stage != ADVERTISE and state.get("nonce") != nonce.hex():
        raise ValueError(f"{node.client_id}: the round's nonce changed")
    return path, state, round_context(run, round_number, nonce)


def _advertise(config: ConfigRecord, node: NodeConfig, content: RecordDict) -> None:
    path, _, context = _round_state(config, node, ADVERTISE)
    run, round_number = str(config["run-name"]), int(config["server-round"])  # type: ignore[arg-type]
    files = ClientRunFiles(node.client_dir(run))
    for number in files.secagg_rounds.numbers(files.secagg_dir):
        # an older round that never reached its unmask: its secrets go, and it answers nothing more
        old = files.secagg_round(number)
        if number < round_number and _load(old).get("stage") not in (ANSWERED, ABANDONED):
            _save(old, {"stage": ABANDONED})
    identity = identity_key(_node_keys(node), node.client_id)
    secrets = RoundSecrets.new()
    _save(
        path,
        {
            "stage": ADVERTISE,
            "nonce": bytes(config[SECAGG_NONCE]).hex(),  # type: ignore[arg-type]
            "mask_key": secrets.mask_key.hex(),
            "share_key": secrets.share_key.decode("ascii"),
            "self_seed": secrets.self_seed.hex(),
        },
    )
    mask, share = secrets.mask_public(), secrets.share_public()
    commitment = seed_commitment(secrets.self_seed, node.client_id, context)
    signature = sign_advertisement(identity, advertisement(context, node.client_id, mask, share, commitment))
    content[KEY_RECORD] = ConfigRecord({MASK_KEY: mask, SHARE_KEY: share, COMMITMENT: commitment, SIGNATURE: signature})


def _node_keys(node: NodeConfig) -> str:
    if not node.node_keys:
        raise ValueError(
            f"{node.client_id} has no node-keys in its node config: it cannot sign its advertisement "
            "or check its peers', and takes part in no secure round"
        )
    return node.node_keys


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"the key map names a client twice: {sorted({n for n in names if names.count(n) > 1})[:10]}")
    return dict(pairs)


def _signed_table(config: ConfigRecord, node: NodeConfig, context: bytes) -> dict[str, tuple[bytes, bytes, bytes]]:
    """``{client: (mask key, share key, commitment)}``, each entry signed by the node it names; the
    authorised keys come from this node's own settings, never from the server."""
    me, authorised = node.client_id, authorised_keys(_node_keys(node))
    table = {}
    for client, entry in json.loads(str(config[SECAGG_KEYS]), object_pairs_hook=_no_repeats).items():
        if not isinstance(entry, list) or len(entry) != 4 or not all(isinstance(f, str) for f in entry) or not entry[3]:
            raise ValueError(f"{me}: the key map's entry of {client} is not a signed advertisement")
        mask, share, commitment = bytes.fromhex(entry[0]), entry[1].encode("ascii"), bytes.fromhex(entry[2])
        if client not in authorised:
            raise ValueError(f"{me}: the key map names {client}, not a node this federation authorises")
        signed = advertisement(context, client, mask, share, commitment)
        if not verify_advertisement(authorised[client], bytes.fromhex(entry[3]), signed):
            raise ValueError(f"{me}: the key map's entry of {client} is not signed by {client}'s node key")
        table[client] = (mask, share, commitment)
    return table


def _share(config: ConfigRecord, node: NodeConfig, content: RecordDict) -> None:
    path, state, context = _round_state(config, node, ADVERTISE)
    try:
        table, threshold, group = _checked_round(config, node, state, context)
    except ValueError:
        _save(path, {"stage": ABANDONED})  # a round refused once answers nothing more; its secrets go
        raise
    secrets, me = _secrets(state), node.client_id
    seed_shares = split_secret(secrets.self_seed, threshold, len(group))
    key_shares = split_secret(secrets.mask_key, threshold, len(group))
    sealed = {}
    for i, peer in enumerate(group):
        if peer != me:
            sealed[peer] = seal_shares(secrets, table[peer][1], context, me, peer, seed_shares[i], key_shares[i])
    own = group.index(me)
    state |= {
        "stage": SHARE,
        "threshold": threshold,
        "num_shares": int(config[SECAGG_SHARES_NUM]),  # type: ignore[arg-type]
        "keys": {c: k[0].hex() for c, k in table.items()},
        "share_keys": {c: k[1].decode("ascii") for c, k in table.items()},
        "neighbours": group,
        "shares": {me: [seed_shares[own].hex(), key_shares[own].hex()]},
    }
    _save(path, state)
    content[SHARES] = ConfigRecord(sealed)  # type: ignore[arg-type]


def _checked_round(
    config: ConfigRecord, node: NodeConfig, state: dict[str, Any], context: bytes
) -> tuple[dict[str, tuple[bytes, bytes, bytes]], int, list[str]]:
    """``(key table, threshold, neighbours)`` of a share query this client agrees to."""
    secrets, me = _secrets(state), node.client_id
    table = _signed_table(config, node, context)
    mine = table.get(me)
    if mine is None or mine[0] != secrets.mask_public() or mine[1] != secrets.share_public():
        raise ValueError(f"{me}: the key map does not hold this client's own keys")
    if len({k[0] for k in table.values()}) != len(table) or len({k[1] for k in table.values()}) != len(table):
        raise ValueError(f"{me}: the key map repeats a public key")
    threshold, num_shares = int(config[SECAGG_THRESHOLD]), int(config[SECAGG_SHARES_NUM])  # type: ignore[arg-type]
    group = neighbours(me, table, num_shares)
    if len(group) < node.secagg_min_shares:
        raise ValueError(
            f"{me}: {len(group)} clients would share with it, fewer than its secagg-min-shares {node.secagg_min_shares}"
        )
    if threshold < node.min_threshold(len(group)):
        raise ValueError(
            f"{me}: threshold {threshold} of {len(group)} shares is below its floor {node.min_threshold(len(group))} "
            f"(secagg-threshold-floor {node.secagg_threshold_floor})"
        )
    check_threshold(threshold, len(group))
    return table, threshold, group


def mask_reply(out: Message, message: Message, node: NodeConfig) -> Message:
    """Replace the reply's encoder by its masked update, against the neighbours whose shares arrived."""
    config = message.content["config"]
    with state_lock(node, str(config["run-name"]), "train (mask)"):
        path, state, context = _round_state(config, node, SHARE)
        secrets, me = _secrets(state), node.client_id
        routed = dict(message.content.config_records.get(SHARES) or {})
        strangers = sorted(set(routed) - set(state["neighbours"]) | ({me} & set(routed)))
        if strangers:
            raise ValueError(f"{me}: shares from clients that are not its neighbours: {strangers[:10]}")
        for src, sealed in routed.items():
            peer_key = state["share_keys"][src].encode("ascii")
            seed_share, key_share = open_shares(secrets, peer_key, bytes(sealed), context, src, me)  # type: ignore[arg-type]
            state["shares"][src] = [seed_share.hex(), key_share.hex()]
        masked_with = sorted(state["shares"])
        if len(masked_with) < int(state["threshold"]):
            raise ValueError(f"{me}: shares from {len(masked_with) - 1} neighbours, fewer than the threshold needs")
        state |= {"stage": "masked", "masked_with": masked_with}
        _save(path, state)
        received = message.content[ARRAYS]
        trained = out.content[ARRAYS]
        update = {name: trained[name].numpy().astype(np.float64) - received[name].numpy() for name in received}
        params = SecAggParams(float(config[SECAGG_RANGE]), int(config[SECAGG_TARGET]))  # type: ignore[arg-type]
        peers = {c: bytes.fromhex(state["keys"][c]) for c in masked_with}
        masked = mask_update(update, me, secrets, peers, params, context)
        out.content[ARRAYS] = ArrayRecord({name: Array(masked[name]) for name in received})
        return check_masked(out, me)


def _unmask(config: ConfigRecord, node: NodeConfig, content: RecordDict) -> None:
    path, state, _ = _round_state(config, node, "masked")
    me = node.client_id
    survivors, dropped = _clients(config[SECAGG_SURVIVORS]), _clients(config[SECAGG_DROPPED])
    masked_with = set(state["masked_with"])
    if set(survivors) & set(dropped):
        raise ValueError(f"{me}: clients both survived and dropped: {sorted(set(survivors) & set(dropped))}")
    if len(set(survivors)) != len(survivors) or len(set(dropped)) != len(dropped):
        raise ValueError(f"{me}: a client named twice")
    if set(survivors) | set(dropped) != masked_with:
        raise ValueError(f"{me}: survivors and dropped clients are not the {len(masked_with)} clients it masked with")
    if me not in survivors:
        raise ValueError(f"{me} is named as dropped; a dropped client reveals nothing")
    if len(survivors) < int(state["threshold"]):
        raise ValueError(f"{me}: {len(survivors)} survivors, fewer than the threshold {state['threshold']}")
    shares = state["shares"]
    _save(path, {"stage": ANSWERED})  # before anything leaves: one answer per round, ever
    content[SEED_SHARES] = ConfigRecord({c: bytes.fromhex(shares[c][0]) for c in survivors})
    content[KEY_SHARES] = ConfigRecord({c: bytes.fromhex(shares[c][1]) for c in dropped})


def answer_secure_query(config: ConfigRecord, node: NodeConfig, content: RecordDict) -> None:
    stages = {ADVERTISE: _advertise, SHARE: _share, UNMASK: _unmask}
    stage = stages.get(str(config.get(KIND)))
    if stage is None:
        raise ValueError(f"unknown secure-aggregation query {config.get(KIND)!r:.40}")
    with state_lock(node, str(config["run-name"]), str(config[KIND])):
        stage(config, node, content)
