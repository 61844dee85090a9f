"""A server that lies about the key table or the threshold, driving the real ClientApp: every
advertisement is signed by its node's identity key and checked against the federation's authorised
node keys (the node's own settings) before any share is sealed, and a client refuses a threshold
below its floor and a k below its minimum (issue 45). Also the collusion bound the defaults give,
as docs/PRIVACY.md states it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from speech_assets.federated import secure_rounds as sr
from speech_assets.federated.auth import identity_key
from speech_assets.federated.config import NodeConfig
from speech_assets.federated.secure_aggregation import (
    RoundSecrets,
    advertisement,
    check_threshold,
    default_threshold,
    round_context,
    seed_commitment,
    sign_advertisement,
)
from speech_assets_tests.support.federated_data import InProcessGrid, serverapp_identity

RUN = "run-signed"
REPO = Path(__file__).resolve().parents[2]


class LyingServer:
    """A server that drives the real ClientApp (through :class:`InProcessGrid`) one stage at a
    time and builds whatever share query it likes."""

    def __init__(self, tmp_path: Path, clients: list[str], node_config: dict | None = None) -> None:
        self.clients = clients
        self.grid = InProcessGrid(dict(enumerate(clients, start=1)), tmp_path / "data", tmp_path / "state")
        for config in self.grid.node_config.values():
            config.update(node_config or {})
        self.node = {c: n for n, c in self.grid.nodes.items()}
        self.round = 0

    def ask(self, client: str, fields: dict) -> Message:
        config = {
            "secure-aggregation": True,
            "run-name": RUN,
            "server-round": self.round,
            sr.SECAGG_NONCE: self.nonce,
        } | fields
        with serverapp_identity():
            message = Message(
                RecordDict({"config": ConfigRecord(config)}),
                dst_node_id=self.node[client],
                message_type=MessageType.QUERY,
            )
            (sent,) = self.grid.push_messages([message])
            (reply,) = self.grid.pull_messages([sent])
        return reply

    def advertise(self, clients: list[str], threshold: int, num_shares: int = 0) -> dict[str, list[str]]:
        """A new round; each of ``clients`` advertises: ``{client: table entry}`` as the honest
        server would put it in the key table."""
        self.round += 1
        self.nonce = os.urandom(16)
        self.context = round_context(RUN, self.round, self.nonce)
        entries = {}
        for client in clients:
            fields = {sr.KIND: sr.ADVERTISE, sr.SECAGG_THRESHOLD: threshold, sr.SECAGG_SHARES_NUM: num_shares}
            record = self.ask(client, fields).content[sr.KEY_RECORD]
            keys = [record[k] for k in (sr.MASK_KEY, sr.SHARE_KEY, sr.COMMITMENT, sr.SIGNATURE)]
            entries[client] = [keys[0].hex(), keys[1].decode("ascii"), keys[2].hex(), keys[3].hex()]
        return entries

    def share(self, client: str, table: str, threshold: int, num_shares: int = 0) -> Message:
        fields = {sr.KIND: sr.SHARE, sr.SECAGG_KEYS: table, sr.SECAGG_THRESHOLD: threshold}
        return self.ask(client, fields | {sr.SECAGG_SHARES_NUM: num_shares})

    def forged_entry(self, name: str, signer: ec.EllipticCurvePrivateKey | None) -> list[str]:
        """Keys the server made itself, advertised as ``name``, signed by ``signer`` (or not)."""
        secrets = RoundSecrets.new()
        mask, share = secrets.mask_public(), secrets.share_public()
        commitment = seed_commitment(secrets.self_seed, name, self.context)
        signature = (
            b""
            if signer is None
            else sign_advertisement(signer, advertisement(self.context, name, mask, share, commitment))
        )
        return [mask.hex(), share.decode("ascii"), commitment.hex(), signature.hex()]

    def state(self, client: str) -> dict:
        root = Path(self.grid.node_config[self.node[client]]["state-root"])
        return json.loads((root / RUN / "secagg" / f"round-{self.round}.json").read_text())


@pytest.fixture
def sealed(monkeypatch) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """Every (src, dst) the client code seals shares for."""
    calls: list[tuple[str, str]] = []
    real = sr.seal_shares

    def spy(secrets, public, context, src, dst, seed_share, key_share):  # type: ignore[no-untyped-def]
        calls.append((src, dst))
        return real(secrets, public, context, src, dst, seed_share, key_share)

    monkeypatch.setattr(sr, "seal_shares", spy)
    return calls


def _table(entries: dict[str, list[str]]) -> str:
    return json.dumps(entries, sort_keys=True)


def _refused(reply: Message, why: str) -> None:
    assert reply.has_error(), "the client answered a share query it should refuse"
    assert why in reply.error.reason, reply.error.reason


FORGERIES = ["server_keys", "unsigned", "unknown_node", "repeated_node", "claims_another_id"]


@pytest.mark.parametrize("forgery", FORGERIES)
def test_forged_key_table_is_refused_before_any_share_leaves(tmp_path: Path, sealed, forgery: str) -> None:  # type: ignore[no-untyped-def]
    """The issue's attack: the server sends victim c0 a table of c0 plus keys it made itself
    (threshold 3 of 3, within every floor), so that c0 would seal its shares to the server. Also
    an unsigned entry, a node the federation never authorised, a node named twice, and a real
    node (c1) signing an entry that names another (c2). c0 refuses before sealing anything, and
    the round is over for it (its secrets erased).

    Kills: checking only that the client's own keys are in the table (today's code); a verifier
    that skips entries without a signature; one that accepts any key in the authorised set (or
    the signer's claimed identity) instead of the key of the node the entry names; json.loads
    keeping the last of two entries for one node; signing that leaves out the client id."""
    clients = ["c0", "c1", "c2"]
    server = LyingServer(tmp_path, clients)
    mallory = ec.generate_private_key(ec.SECP384R1())
    c1_key = identity_key(server.grid.node_keys, "c1")
    if forgery == "repeated_node":
        entries = server.advertise(["c0", "c1", "c2"], threshold=3)
        # two entries for c1 (its own, and one with server keys): JSON keeps the last silently
        forged = server.forged_entry("c1", mallory)
        body = ", ".join(f'"{c}": {json.dumps(e)}' for c, e in [("c0", entries["c0"]), ("c1", entries["c1"])])
        table = "{" + body + f', "c1": {json.dumps(forged)}, "c2": {json.dumps(entries["c2"])}' + "}"
        why = "names a client twice"
    else:
        entries = server.advertise(["c0", "c1"] if forgery == "claims_another_id" else ["c0"], threshold=3)
        if forgery == "server_keys":
            entries |= {"c1": server.forged_entry("c1", mallory), "c2": server.forged_entry("c2", mallory)}
            why = "is not signed by c1's node key"
        elif forgery == "unsigned":
            entries |= {"c1": server.forged_entry("c1", None), "c2": server.forged_entry("c2", None)}
            why = "is not a signed advertisement"
        elif forgery == "unknown_node":
            entries |= {"m1": server.forged_entry("m1", mallory), "m2": server.forged_entry("m2", mallory)}
            why = "not a node this federation authorises"
        else:  # c1, a real node, signs keys of the server's under c2's id
            entries |= {"c2": server.forged_entry("c2", c1_key)}
            why = "is not signed by c2's node key"
        table = _table(entries)
    reply = server.share("c0", table, threshold=3)
    _refused(reply, why)
    assert sealed == []
    assert server.state("c0") == {"stage": sr.ABANDONED}
    # and nothing more for that round: the same query again is refused too
    assert server.share("c0", table, threshold=3).has_error() and sealed == []


def test_a_signed_table_of_authorised_nodes_is_answered(tmp_path: Path, sealed) -> None:  # type: ignore[no-untyped-def]
    """The control of the harness above: the honest table gets shares sealed for both peers."""
    server = LyingServer(tmp_path, ["c0", "c1", "c2"])
    entries = server.advertise(["c0", "c1", "c2"], threshold=3)
    reply = server.share("c0", _table(entries), threshold=3)
    assert not reply.has_error(), reply.error.reason
    assert sorted(reply.content[sr.SHARES].keys()) == ["c1", "c2"] and sealed == [("c0", "c1"), ("c0", "c2")]


def test_a_node_without_node_keys_takes_part_in_no_secure_round(tmp_path: Path) -> None:
    """Kills: signing being optional (a client with no identity key advertising unsigned keys)."""
    server = LyingServer(tmp_path, ["c0", "c1", "c2"])
    server.grid.node_config[1].pop("node-keys")
    server.round, server.nonce = 1, os.urandom(16)
    reply = server.ask("c0", {sr.KIND: sr.ADVERTISE, sr.SECAGG_THRESHOLD: 3, sr.SECAGG_SHARES_NUM: 0})
    assert reply.has_error() and "no node-keys" in reply.error.reason


FLOOR_CASES = {
    # clients advertised, threshold asked, node settings, refusal (None: answered)
    "k9_t5": (9, 5, {}, "below its floor 7"),  # the case: t > k/2, one colluder suffices
    "k9_t6": (9, 6, {}, "below its floor 7"),
    "k2_t2": (2, 2, {}, "fewer than its secagg-min-shares 3"),
    "k4_t3_min5": (4, 3, {"secagg-min-shares": 5}, "fewer than its secagg-min-shares 5"),
    "k4_t3_floor3of4": (4, 3, {"secagg-threshold-floor": "3/4"}, "below its floor 4"),
    "k9_t7": (9, 7, {}, None),
    "k4_t3": (4, 3, {}, None),
    "k3_t3": (3, 3, {}, None),
}


@pytest.mark.parametrize("case", sorted(FLOOR_CASES))
def test_threshold_floor_refuses_a_low_threshold(tmp_path: Path, sealed, case: str) -> None:  # type: ignore[no-untyped-def]
    """A signed, honest table, but a threshold below the client's floor (default: more than
    2k/3) or a k below its minimum (default 3): refused before any share is sealed; settings on
    the node raise either floor; t and k at the floors are answered.

    Kills: a client that accepts any t > k/2 the server sends (today's code; k = 9, t = 5 lets
    one colluder uncover a client); a k floor not checked (k = 2: the other client learns the
    victim's update from the sum); node settings that are not read."""
    n, threshold, settings, why = FLOOR_CASES[case]
    clients = [f"c{i}" for i in range(n)]
    server = LyingServer(tmp_path, clients, settings)
    entries = server.advertise(clients, threshold=threshold)
    reply = server.share("c0", _table(entries), threshold=threshold)
    if why is None:
        assert not reply.has_error(), reply.error.reason
        assert len(sealed) == n - 1
    else:
        _refused(reply, why)
        assert sealed == [] and server.state("c0") == {"stage": sr.ABANDONED}


def _colluders_needed(k: int, t: int) -> int:
    """The fewest colluding neighbours with which a lying server uncovers one victim among k
    neighbours (itself included) with threshold t, found by trying every way to deal the honest
    neighbours, each revealing one kind of share: (a) survivors H1 hand over shares of the
    victim's self-mask seed (the victim gives its own), dropped-sayers H2 shares of its mask key,
    the colluders both: both secrets need t shares; or (b) the survivors are the victim and the
    colluders only (at least t of them), and the sum less the colluders' updates is the victim's."""
    for c in range(k):
        honest = k - 1 - c
        if any(1 + h1 + c >= t and (honest - h1) + c >= t for h1 in range(honest + 1)) or 1 + c >= t:
            return c
    return k


def test_threshold_floor_collusion_bound_of_the_defaults() -> None:
    """The bound docs/PRIVACY.md states: with a client's defaults (t above 2k/3, k >= 3) a server
    that deviates needs min(2t - k, t - 1) colluding neighbours of the victim, so at least 2
    (k = 3 or 4), at least floor(k/3) + 1 for a k it picks, 5 for k = 9 and 4 for k = 10; at a
    t the floor refuses (k = 9, t = 5) one is enough.

    Kills: a default floor below 2/3 or a default minimum k below 3 (the bound drops to 1)."""
    node = NodeConfig(client_id="c0", data_dir="/nowhere")
    assert node.secagg_min_shares == 3
    needed = {}
    for k in range(2, 40):
        t = node.min_threshold(k)
        check_threshold(t, k)  # the floor is always a threshold the protocol accepts
        assert t == default_threshold(k)  # and the server's default
        needed[k] = _colluders_needed(k, t)
        assert needed[k] == min(2 * t - k, t - 1)
        assert needed[k] >= k // 3 + 1
    assert min(c for k, c in needed.items() if k >= node.secagg_min_shares) == 2
    assert (needed[9], needed[10], needed[2]) == (5, 4, 1)
    assert _colluders_needed(9, 5) == 1
    privacy = (Path(__file__).parents[2] / "docs" / "PRIVACY.md").read_text()
    assert "at least 2 colluding clients" in privacy and "⌊k/3⌋ + 1" in privacy


def _round_secrets(root: Path, clients: list[str], rounds: int = 2) -> dict[tuple[str, int], dict[str, str]]:
    """Run ``RUN`` (always the same name, threshold and neighbours) for ``rounds`` advertise stages
    against the real ClientApp under ``root``; each client's secrets of each round as its state
    file keeps them, checked against what it advertised (so they are the ones it uses)."""
    server = LyingServer(root, clients)
    found = {}
    for _ in range(rounds):
        entries = server.advertise(clients, threshold=len(clients))
        for client in clients:
            state = server.state(client)
            secrets = RoundSecrets(
                bytes.fromhex(state["mask_key"]), state["share_key"].encode("ascii"), bytes.fromhex(state["self_seed"])
            )
            mask, share, commitment, _ = entries[client]
            assert mask == secrets.mask_public().hex() and share == secrets.share_public().decode("ascii")
            assert commitment == seed_commitment(secrets.self_seed, client, server.context).hex()
            found[(client, server.round)] = {k: state[k] for k in ("self_seed", "mask_key", "share_key")}
    return found


FRESH_SCRIPT = """
import json, sys
from pathlib import Path
from speech_assets_tests.federated.test_secagg_advertisements import _round_secrets
found = _round_secrets(Path(sys.argv[1]), ["c0", "c1", "c2"], rounds=1)
print(json.dumps({f"{c}/{r}": v for (c, r), v in found.items()}))
"""


def test_fresh_self_mask_seeds_differ_between_rounds_and_runs(tmp_path: Path) -> None:
    """Kills the mutations "a constant, public self-mask seed" (all 55 secure-aggregation tests
    passed it), "secrets derived from the run's name or seed" and "secrets from a generator seeded
    per process" (e.g. ``random.Random(seed)``): two rounds of one run, two runs with the same name
    and settings in this process, and one more in a fresh process, drawn by the real client code
    (advertise stage), never repeat a self-mask seed, a mask key or a share key."""
    clients = ["c0", "c1", "c2"]
    first, second = _round_secrets(tmp_path / "a", clients), _round_secrets(tmp_path / "b", clients)
    result = subprocess.run(
        [sys.executable, "-c", FRESH_SCRIPT, str(tmp_path / "c")],
        env=os.environ | {"PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    other = json.loads(result.stdout.strip().splitlines()[-1])
    draws = [*first.values(), *second.values(), *other.values()]
    assert len(draws) == 2 * 2 * len(clients) + len(clients)
    for secret in ("self_seed", "mask_key", "share_key"):
        values = [draw[secret] for draw in draws]
        assert len(set(values)) == len(values), f"a {secret} repeats across clients, rounds, runs or processes"
    # nothing a reader of the run's params could compute: not the run's name, seed or a constant
    public = {hashlib.sha256(text.encode()).hexdigest() for text in (RUN, "0", "42", "")} | {"00" * 32}
    assert not public & {draw["self_seed"] for draw in draws}
