"""Secure aggregation with double masking: the server recovers the sum of the survivors' updates
(drop-outs included) and nothing readable from a single masked update or a partial sum; masks are
bound to their round context; shares rebuild a secret from t of them and are sealed for one
receiver; bad parameters, thresholds and layouts are refused. Then the whole protocol with the
real ClientApp and ServerApp in process, attacked as a lying server would."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from speech_assets.federated.secure_aggregation import (
    MODULUS,
    MasksDidNotCancel,
    RoundSecrets,
    SecAggParams,
    check_threshold,
    combine_secret,
    default_threshold,
    mask_seed,
    mask_update,
    neighbours,
    open_shares,
    prg,
    round_context,
    seal_shares,
    split_secret,
    unmask_sum,
)
from speech_assets_tests.support.federated_data import run_in_process

RUN = "run-test"
PARAMS = SecAggParams(clipping_range=1.0, target_range=2**22)
SHAPES = {"layers.0.weight": (60, 100), "layers.0.bias": (100,), "proj.weight": (40, 100), "scale": ()}  # 10101 values
CONTEXT = round_context(RUN, 3, b"n" * 16)
# chi-square critical value for 63 degrees of freedom at p = 1e-4 (scipy.stats.chi2.ppf(1 - 1e-4, 63))
CHI2_63_P1E4 = 113.505


def _ids(n: int) -> list[str]:
    return [f"client_{i:02d}" for i in range(n)]


def _keys(clients: list[str]) -> dict[str, RoundSecrets]:
    # fixed mask keys and seeds: the statistical checks below see the same masks on every run
    share_key = RoundSecrets.new().share_key
    return {
        c: RoundSecrets(hashlib.sha256(c.encode()).digest(), share_key, hashlib.sha256(c.encode() + b"b").digest())
        for c in clients
    }


def _unmask(masked: dict, keys: dict[str, RoundSecrets], dropped: list[str] = (), context: bytes = CONTEXT) -> dict:  # type: ignore[assignment]
    """unmask_sum as the server calls it, given the secrets it would rebuild from the shares."""
    everyone = sorted(set(masked) | set(dropped))
    return unmask_sum(
        masked,
        {c: keys[c].self_seed for c in masked},
        {c: keys[c].mask_key for c in dropped},
        {c: keys[c].mask_public() for c in everyone},
        {c: everyone for c in masked},
        PARAMS,
        context,
    )


def _updates(clients: list[str], scale: float = 0.3, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        c: {name: np.asarray(rng.normal(0.0, scale, shape), dtype=np.float32) for name, shape in SHAPES.items()}
        for c in clients
    }


def _mask_all(
    updates: dict[str, dict[str, np.ndarray]], keys: dict[str, RoundSecrets], context: bytes = CONTEXT
) -> dict[str, dict[str, np.ndarray]]:
    peers = {c: k.mask_public() for c, k in keys.items()}
    return {c: mask_update(u, c, keys[c], peers, PARAMS, context) for c, u in updates.items()}


def _clipped_sum(updates: list[dict[str, np.ndarray]], c: float) -> dict[str, np.ndarray]:
    return {name: np.sum([np.clip(u[name].astype(np.float64), -c, c) for u in updates], axis=0) for name in SHAPES}


def _flat(arrays: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(arrays[name]).ravel() for name in sorted(arrays)])


def _assert_close_sum(result: dict[str, np.ndarray], expected: dict[str, np.ndarray], n: int) -> None:
    # stochastic rounding moves each quantized value by less than one step 2c/T; float32 output adds ~1e-7
    step = 2 * PARAMS.clipping_range / PARAMS.target_range
    assert sorted(result) == sorted(expected)
    for name in SHAPES:
        assert result[name].dtype == np.float32 and result[name].shape == SHAPES[name]
        np.testing.assert_allclose(result[name], expected[name], rtol=0, atol=n * step + 1e-6)


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("out_of_range", [False, True])
def test_unmasked_sum_is_the_sum_of_the_updates(n: int, out_of_range: bool) -> None:
    clients = _ids(n)
    keys = _keys(clients)
    updates = _updates(clients)
    if out_of_range:
        # values beyond ±clipping_range are clipped: the server gets the sum of the clipped updates
        for i, u in enumerate(updates.values()):
            u["layers.0.weight"][0, :10] = 5.0 * (-1) ** i
            u["scale"] = np.asarray(-3.0, dtype=np.float32)
    masked = _mask_all(updates, keys)
    for c in clients:
        assert {name: (a.shape, a.dtype) for name, a in masked[c].items()} == {
            name: (shape, np.dtype(np.uint32)) for name, shape in SHAPES.items()
        }
    result = _unmask(masked, keys)
    _assert_close_sum(result, _clipped_sum(list(updates.values()), PARAMS.clipping_range), n)
    if out_of_range:
        assert result["scale"] == pytest.approx(-n * PARAMS.clipping_range, abs=1e-5)


def test_a_single_masked_update_is_unreadable() -> None:
    clients = _ids(3)
    updates = _updates(clients)
    masked = _mask_all(updates, _keys(clients))
    truth = _flat(updates["client_01"]).astype(np.float64)
    values = _flat(masked["client_01"])
    assert values.dtype == np.uint32 and values.size == truth.size == 10101

    assert abs(np.corrcoef(values.astype(np.float64), truth)[0, 1]) < 0.05
    assert abs(values.astype(np.float64).mean() / 2**31 - 1) < 0.05
    assert _chi2_top_bits(values) < CHI2_63_P1E4
    # the same check has power: the quantized update without masks sits in [0, 2^22]
    unmasked = np.round((np.clip(truth, -1, 1) + 1) * PARAMS.target_range / 2).astype(np.uint32)
    assert _chi2_top_bits(unmasked) > CHI2_63_P1E4


def _chi2_top_bits(values: np.ndarray) -> float:
    """Chi-square statistic of the values' top 6 bits against the uniform distribution (64 bins)."""
    counts = np.bincount((values >> 26).astype(np.int64), minlength=64)
    expected = values.size / 64
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("left_out", ["client_00", "client_02", "client_04"])
def test_a_partial_sum_of_masked_updates_is_unreadable(left_out: str) -> None:
    clients = _ids(5)
    updates = _updates(clients)
    keys = _keys(clients)
    masked = _mask_all(updates, keys)
    subset = [c for c in clients if c != left_out]
    raw = np.zeros(10101, dtype=np.uint32)
    for c in subset:
        raw += _flat(masked[c])
    truth = _flat(_clipped_sum([updates[c] for c in subset], PARAMS.clipping_range))
    assert abs(np.corrcoef(raw.astype(np.float64), truth)[0, 1]) < 0.05
    # a true sum of 4 quantized values is <= 4T; the partial sum almost never is
    assert np.mean(raw <= len(subset) * PARAMS.target_range) < 0.05
    with pytest.raises(MasksDidNotCancel, match="beyond n x T"):
        _unmask({c: masked[c] for c in subset}, keys)


def test_mask_update_refuses_bad_rounds() -> None:
    clients = _ids(2)
    keys = _keys(clients)
    update = _updates(clients)["client_00"]
    alone = {"client_00": keys["client_00"].mask_public()}
    with pytest.raises(ValueError, match="at least one other client"):
        mask_update(update, "client_00", keys["client_00"], alone, PARAMS, CONTEXT)
    swapped = {"client_00": keys["client_01"].mask_public(), "client_01": keys["client_01"].mask_public()}
    with pytest.raises(ValueError, match="not this client's"):
        mask_update(update, "client_00", keys["client_00"], swapped, PARAMS, CONTEXT)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_mask_update_refuses_non_finite_values(bad: float) -> None:
    clients = _ids(2)
    keys = _keys(clients)
    update = _updates(clients)["client_00"]
    update["layers.0.bias"][7] = bad
    peers = {c: k.mask_public() for c, k in keys.items()}
    with pytest.raises(ValueError, match="layers.0.bias"):
        mask_update(update, "client_00", keys["client_00"], peers, PARAMS, CONTEXT)


def test_masks_are_bound_to_the_round_context() -> None:
    clients = _ids(3)
    keys = _keys(clients)
    updates = _updates(clients)
    other = round_context(RUN, 4, b"n" * 16)
    first = _flat(_mask_all(updates, keys, CONTEXT)["client_01"])
    second = _flat(_mask_all(updates, keys, other)["client_01"])
    assert np.mean(first == second) < 0.01

    a, b, c = (keys[x] for x in clients)
    assert mask_seed(a.mask_key, b.mask_public(), CONTEXT) == mask_seed(b.mask_key, a.mask_public(), CONTEXT)
    assert len(mask_seed(a.mask_key, b.mask_public(), CONTEXT)) == 32
    assert mask_seed(a.mask_key, b.mask_public(), CONTEXT) != mask_seed(a.mask_key, b.mask_public(), other)
    assert mask_seed(a.mask_key, b.mask_public(), CONTEXT) != mask_seed(a.mask_key, c.mask_public(), CONTEXT)


def test_round_context_is_unambiguous_and_checked() -> None:
    nonce = b"n" * 16
    contexts = {
        round_context(RUN, 1, nonce),
        round_context(RUN, 2, nonce),
        round_context(RUN + "x", 1, nonce),
        round_context(RUN, 1, b"m" * 16),
        round_context(RUN, 1, nonce + b"m"),
    }
    assert len(contexts) == 5
    assert round_context(RUN, 1, nonce) == round_context(RUN, 1, nonce)
    with pytest.raises(ValueError, match="nonce"):
        round_context(RUN, 1, b"short")
    with pytest.raises(ValueError, match="round_number"):
        round_context(RUN, -1, nonce)
    with pytest.raises(ValueError, match="run name"):
        round_context("", 1, nonce)


def test_prg_is_the_chacha20_keystream() -> None:
    # RFC 8439 A.1 test vector #1: all-zero key, nonce and counter
    expected = np.frombuffer(bytes.fromhex("76b8e0ada0f13d90405d6ae55386bd28"), dtype="<u4")
    values = prg(bytes(32), 4)
    assert values.dtype == np.uint32 and values.shape == (4,)
    np.testing.assert_array_equal(values, expected)
    seed = hashlib.sha256(b"seed").digest()
    np.testing.assert_array_equal(prg(seed, 1000)[:10], prg(seed, 10))
    assert not np.array_equal(prg(seed, 10), prg(hashlib.sha256(b"other").digest(), 10))
    assert prg(seed, 0).shape == (0,)
    with pytest.raises(ValueError, match="32 bytes"):
        prg(b"short", 4)


def test_check_clients_refuses_a_sum_that_would_wrap() -> None:
    params = SecAggParams(clipping_range=0.5)
    assert params.target_range == 2**22
    params.check_clients(1023)
    with pytest.raises(ValueError, match="wrap"):
        params.check_clients(1024)
    SecAggParams(0.5, target_range=2**31 - 1).check_clients(2)  # 2 * (2^31 - 1) < 2^32
    with pytest.raises(ValueError, match="wrap"):
        SecAggParams(0.5, target_range=2**30).check_clients(MODULUS // 2**30)


@pytest.mark.parametrize(
    "clipping_range, target_range",
    [
        (0.0, 2**22),
        (-1.0, 2**22),
        (float("nan"), 2**22),
        (float("inf"), 2**22),
        (True, 2**22),
        (1.0, 1),
        (1.0, 0),
        (1.0, -5),
        (1.0, 2**31),
        (1.0, 2.5),
        (1.0, True),
    ],
)
def test_bad_params_are_refused(clipping_range: float, target_range: int) -> None:
    with pytest.raises(ValueError):
        SecAggParams(clipping_range=clipping_range, target_range=target_range)


def _rename(arrays: dict[str, np.ndarray]) -> None:
    arrays["renamed"] = arrays.pop("scale")


def _reshape(arrays: dict[str, np.ndarray]) -> None:
    arrays["layers.0.bias"] = arrays["layers.0.bias"].reshape(10, 10)


def _retype(arrays: dict[str, np.ndarray]) -> None:
    arrays["proj.weight"] = arrays["proj.weight"].astype(np.int64)


def _drop(arrays: dict[str, np.ndarray]) -> None:
    del arrays["layers.0.weight"]


@pytest.mark.parametrize("spoil", [_rename, _reshape, _retype, _drop])
def test_unmask_sum_refuses_mismatched_arrays(spoil) -> None:  # type: ignore[no-untyped-def]
    clients = _ids(3)
    keys = _keys(clients)
    masked = _mask_all(_updates(clients), keys)
    spoil(masked["client_02"])
    with pytest.raises(ValueError, match="client_02"):
        _unmask(masked, keys)


@pytest.mark.parametrize("gone", ["client_00", "client_02", "client_03"])
def test_the_dropped_clients_keys_remove_their_pair_masks(gone: str) -> None:
    clients = _ids(4)
    keys = _keys(clients)
    updates = _updates(clients)
    masked = _mask_all(updates, keys)  # all 4 mask; `gone` never sends its vector
    survivors = [c for c in clients if c != gone]
    arrived = {c: masked[c] for c in survivors}
    everyone = {c: keys[c].mask_public() for c in clients}
    result = unmask_sum(
        arrived,
        {c: keys[c].self_seed for c in survivors},
        {gone: keys[gone].mask_key},
        everyone,
        {c: clients for c in survivors},
        PARAMS,
        CONTEXT,
    )
    _assert_close_sum(result, _clipped_sum([updates[c] for c in survivors], PARAMS.clipping_range), 3)
    with pytest.raises(MasksDidNotCancel):  # without the dropped client's key its masks stay
        unmask_sum(
            arrived,
            {c: keys[c].self_seed for c in survivors},
            {},
            everyone,
            {c: clients for c in survivors},
            PARAMS,
            CONTEXT,
        )


def test_a_masked_vector_without_its_self_mask_removed_is_unreadable() -> None:
    """What a server that counts a received client as dropped holds: its masked vector with every
    pair mask removed (from the revealed key), the self-mask still on."""
    clients = _ids(4)
    keys = _keys(clients)
    updates = _updates(clients)
    masked = _mask_all(updates, keys)
    target = "client_01"
    flat = _flat(masked[target]).copy()
    for peer in clients:
        if peer != target:  # remove every pair mask the target added
            mask = prg(mask_seed(keys[target].mask_key, keys[peer].mask_public(), CONTEXT), flat.size)
            flat = flat - mask if target < peer else flat + mask
    truth = _flat(updates[target]).astype(np.float64)
    assert abs(np.corrcoef(flat.astype(np.float64), truth)[0, 1]) < 0.05
    assert _chi2_top_bits(flat) < CHI2_63_P1E4
    # the power of the check: the self-mask removed too, the update is there to one step
    bare = (flat - prg(keys[target].self_seed, flat.size)).astype(np.float64) * 2 / PARAMS.target_range - 1
    np.testing.assert_allclose(bare, np.clip(truth, -1, 1), atol=2 / PARAMS.target_range + 1e-6)


@pytest.mark.parametrize("k, t", [(3, 2), (5, 4), (7, 5)])
def test_t_shares_rebuild_a_secret_and_fewer_do_not(k: int, t: int) -> None:
    secret = bytes(range(32))
    shares = split_secret(secret, t, k)
    assert len(shares) == k and [int.from_bytes(s[:4], "little") for s in shares] == list(range(1, k + 1))
    assert combine_secret(shares[:t]) == secret and combine_secret(shares[-t:]) == secret
    assert combine_secret(shares) == secret
    try:
        assert combine_secret(shares[: t - 1]) != secret
    except ValueError:
        pass  # the padding check refused the garbage
    with pytest.raises(ValueError, match="repeated"):
        combine_secret([shares[0]] * t)


@pytest.mark.parametrize("t, k", [(1, 2), (2, 4), (3, 6), (4, 3), (True, 1)])
def test_a_threshold_a_server_could_split_is_refused(t: int, k: int) -> None:
    with pytest.raises(ValueError, match="threshold"):
        check_threshold(t, k)
    with pytest.raises(ValueError, match="threshold"):
        split_secret(b"x" * 32, t, k)


def test_default_threshold_is_above_two_thirds() -> None:
    assert [default_threshold(k) for k in (2, 3, 4, 5, 6, 10)] == [2, 3, 3, 4, 5, 7]
    for k in range(2, 40):
        check_threshold(default_threshold(k), k)


def test_sealed_shares_open_only_for_their_receiver_and_round() -> None:
    a, b, c = RoundSecrets.new(), RoundSecrets.new(), RoundSecrets.new()
    sealed = seal_shares(a, b.share_public(), CONTEXT, "client_00", "client_01", b"seed-share", b"key-share")
    assert b"seed-share" not in sealed and b"key-share" not in sealed
    assert open_shares(b, a.share_public(), sealed, CONTEXT, "client_00", "client_01") == (b"seed-share", b"key-share")
    with pytest.raises(ValueError, match="do not decrypt"):  # another receiver
        open_shares(c, a.share_public(), sealed, CONTEXT, "client_00", "client_02")
    with pytest.raises(ValueError, match="another round"):
        open_shares(b, a.share_public(), sealed, round_context(RUN, 4, b"n" * 16), "client_00", "client_01")
    with pytest.raises(ValueError, match="another round, sender"):  # relabelled as from another sender
        open_shares(b, a.share_public(), sealed, CONTEXT, "client_02", "client_01")
    tampered = sealed[:-5] + bytes(5)
    with pytest.raises(ValueError, match="do not decrypt"):
        open_shares(b, a.share_public(), tampered, CONTEXT, "client_00", "client_01")
    assert repr(a) == "RoundSecrets()"  # no secret in logs


def test_neighbours_are_a_symmetric_ring_or_everyone() -> None:
    clients = _ids(7)
    assert neighbours("client_03", clients, 0) == clients
    assert neighbours("client_03", clients, 7) == clients
    assert neighbours("client_00", clients, 3) == ["client_00", "client_01", "client_06"]
    for k in (3, 5):
        for a in clients:
            mine = neighbours(a, clients, k)
            assert len(mine) == k and a in mine
            assert all(a in neighbours(b, clients, k) for b in mine)
    with pytest.raises(ValueError, match="odd"):
        neighbours("client_00", clients, 4)


# ---------------------------------------------------------------------------------------------
# the whole protocol: the real ServerApp round loop and the real ClientApp in process, four clients
FOUR = {"c0": 6, "c1": 6, "c2": 6, "c3": 6}


@pytest.fixture(scope="module")
def four_clients(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from speech_assets_tests.support.federated_data import write_federated_corpus

    return write_federated_corpus(tmp_path_factory.mktemp("four") / "data", FOUR, speakers_per_client=2)


def _replies(grid, kind: str) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The last good reply of each client to messages of ``kind`` (a stage or "train")."""
    from speech_assets.federated import secure_rounds as sr

    records = {sr.ADVERTISE: sr.KEY_RECORD, sr.UNMASK: sr.SEED_SHARES, "train": "arrays"}
    found = {}
    for reply in grid.received:
        if not reply.has_error() and records[kind] in reply.content:
            found[reply.content["client"]["client-id"]] = reply
    return found


def _without_pair_masks(secure, target: str, masked: np.ndarray, target_key: bytes) -> np.ndarray:  # type: ignore[no-untyped-def]
    """``target``'s masked vector less every pair mask it added, given its mask key: what a server
    holds once the survivors revealed the key of a client counted as dropped."""
    flat = masked.copy()
    for peer in secure.masked_with(target):
        if peer != target:
            mask = prg(mask_seed(target_key, secure.keys[peer][0], secure.context), flat.size)
            flat = flat - mask if target < peer else flat + mask
    return flat


def _as_update(flat: np.ndarray, params: SecAggParams) -> np.ndarray:
    return flat.astype(np.float64) * 2 * params.clipping_range / params.target_range - params.clipping_range


def test_a_client_counted_as_dropped_after_masking_stays_hidden(four_clients, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """test_..._dropped_after_masking: the server receives c1's masked vector, counts c1 as dropped
    anyway, and takes the survivors' reveals (the key shares of c1) plus a second unmask request
    naming c1 as a survivor (for its self-mask shares). The second is refused; the key rebuilt
    from the first removes c1's pair masks, and what is left is uniform noise, uncorrelated with
    c1's update. (On the pairwise-only code this recovered c1's update to 9.3e-08.)"""
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict

    from speech_assets.federated import secure_rounds as sr

    seen: dict[str, object] = {}
    accept = sr.SecureRounds.accept

    def lying_accept(self, good, failures):  # type: ignore[no-untyped-def]
        accepted = accept(self, good, failures)
        seen["secure"], seen["c1"] = self, next(r for r in accepted if self.host.client_of(r) == "c1")
        return [r for r in accepted if self.host.client_of(r) != "c1"]

    reveal = sr.SecureRounds.reveal

    def greedy_reveal(self, failures):  # type: ignore[no-untyped-def]
        rebuilt = reveal(self, failures)
        mine = self.masked_with("c0")
        config = ConfigRecord(
            {
                sr.KIND: sr.UNMASK,
                "secure-aggregation": True,
                "run-name": self.config.run_name,
                "server-round": self.round_number,
                sr.SECAGG_NONCE: self.nonce,
                sr.SECAGG_SURVIVORS: ",".join(mine),
                sr.SECAGG_DROPPED: "",
            }
        )
        again = Message(
            RecordDict({"config": config}), dst_node_id=self.host.binding.node_of("c0"), message_type=MessageType.QUERY
        )
        seen["again"] = self.host.exchange([again], self.round_number, "attack")
        return rebuilt

    monkeypatch.setattr(sr.SecureRounds, "accept", lying_accept)
    monkeypatch.setattr(sr.SecureRounds, "reveal", greedy_reveal)
    result, grid, config = run_in_process(
        four_clients, tmp_path, "liar", local_steps=3, secure_aggregation=True, min_train_nodes=3
    )
    assert isinstance(result, dict) and result["rounds"] == 1  # the round goes on with the 3 others

    secure = seen["secure"]
    good, refused = seen["again"]  # type: ignore[misc]
    assert not good and "already answered" in refused[0]["reason"]
    # the attacker's best: rebuild c1's mask key from the survivors' key shares, strip the pair masks
    reveals = _replies(grid, sr.UNMASK)
    assert sorted(reveals) == ["c0", "c2", "c3"]
    key_shares = [bytes(r.content[sr.KEY_SHARES]["c1"]) for r in reveals.values()]
    c1_key = combine_secret(key_shares)
    assert sr.mask_public(c1_key) == secure.keys["c1"][0]
    assert all("c1" not in r.content[sr.SEED_SHARES] for r in reveals.values())  # never both shares of c1
    masked = np.concatenate(
        [seen["c1"].content["arrays"][k].numpy().ravel() for k in sorted(seen["c1"].content["arrays"])]
    )
    attack = _without_pair_masks(secure, "c1", masked, c1_key)
    # the truth, from c1's own self-mask seed (its state file: the server never sees it)
    state = json.loads(sr.state_path(_node(grid, "c1"), config.run_name, 1).read_text())
    truth = attack - prg(bytes.fromhex(state["self_seed"]), attack.size)
    assert int(truth.max()) <= secure.params.target_range  # a real quantized update, in [0, T]
    assert abs(np.corrcoef(attack.astype(np.float64), truth.astype(np.float64))[0, 1]) < 0.05
    assert np.mean(attack <= secure.params.target_range) < 0.01  # almost no value even in range
    error = np.abs(_as_update(attack, secure.params) - _as_update(truth, secure.params))
    assert np.median(error) > 100 * secure.params.clipping_range


def _node(grid, client: str):  # type: ignore[no-untyped-def]
    from speech_assets.federated.config import NodeConfig

    node = next(n for n, c in grid.nodes.items() if c == client)
    return NodeConfig.from_node_config(grid.node_config[node])


def test_a_client_answers_one_unmask_request_per_round_repeated_unmask(
    four_clients, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """test_..._repeated_unmask: before the honest unmask, the server asks c0 three times, each
    time naming another peer as dropped (on the pairwise-only code, the three answers unmasked
    c0's update to 9.4e-08). c0 answers the first only; every later request, the server's honest
    one included, is refused, from the state on c0's disk (each in-process message is a fresh
    ClientApp call, as after a restart). What the server can rebuild does not uncover c0."""
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict

    from speech_assets.federated import secure_rounds as sr

    seen: dict[str, object] = {}
    reveal = sr.SecureRounds.reveal

    def probing_reveal(self, failures):  # type: ignore[no-untyped-def]
        seen["secure"], answers = self, []
        mine = self.masked_with("c0")
        for gone in ("c1", "c2", "c3"):
            config = ConfigRecord(
                {
                    sr.KIND: sr.UNMASK,
                    "secure-aggregation": True,
                    "run-name": self.config.run_name,
                    "server-round": self.round_number,
                    sr.SECAGG_NONCE: self.nonce,
                    sr.SECAGG_SURVIVORS: ",".join(c for c in mine if c != gone),
                    sr.SECAGG_DROPPED: gone,
                }
            )
            query = Message(
                RecordDict({"config": config}),
                dst_node_id=self.host.binding.node_of("c0"),
                message_type=MessageType.QUERY,
            )
            answers.append(self.host.exchange([query], self.round_number, "attack"))
        seen["answers"] = answers
        return reveal(self, failures)

    monkeypatch.setattr(sr.SecureRounds, "reveal", probing_reveal)
    result, grid, config = run_in_process(
        four_clients, tmp_path, "probe", local_steps=3, secure_aggregation=True, min_train_nodes=3
    )
    answers = seen["answers"]
    assert len(answers[0][0]) == 1 and not answers[0][1]  # the first is answered
    for good, refused in answers[1:]:
        assert not good and "already answered" in refused[0]["reason"]
    # the honest unmask is refused by c0 too; the three others' shares still unmask the round
    assert isinstance(result, dict) and result["rounds"] == 1
    secure = seen["secure"]
    first = answers[0][0][0]
    key_shares_of = {owner: [bytes(first.content[sr.KEY_SHARES][owner])] for owner in first.content[sr.KEY_SHARES]}
    assert sorted(key_shares_of) == ["c1"]  # one share of one peer's key: below any threshold
    # the server's best: c0's self-mask (every survivor's seed is rebuilt), no pair mask of c0 removable
    seed_shares = [
        bytes(r.content[sr.SEED_SHARES]["c0"]) for r in _replies(grid, sr.UNMASK).values()
    ]  # c0's first answer too
    c0_seed = combine_secret(seed_shares)
    train = _replies(grid, "train")["c0"]
    masked = np.concatenate([train.content["arrays"][k].numpy().ravel() for k in sorted(train.content["arrays"])])
    attack = masked - prg(c0_seed, masked.size)
    state = json.loads(sr.state_path(_node(grid, "c0"), config.run_name, 1).read_text())
    assert state == {"stage": "answered"}  # the round's secrets are gone from c0's disk
    assert np.mean(attack <= secure.params.target_range) < 0.01
    assert _chi2_top_bits(attack) < CHI2_63_P1E4


@pytest.mark.parametrize("dropped", [["c2"], ["c1", "c2"]])
def test_up_to_n_minus_t_drop_outs_after_sharing_keys_unmask_the_exact_sum(
    four_clients,
    tmp_path: Path,
    monkeypatch,  # type: ignore[no-untyped-def]
    dropped: list[str],
) -> None:
    """Four clients, threshold 3: one client failing after it shared its keys (before masking)
    leaves the survivors' exact mean (the plain run's with the same failure, to quantization);
    two fail the round cleanly, failure.json naming the round and the threshold."""
    from speech_assets.federated.server_app import FederatedRunError
    from speech_assets.layout import FederatedPaths
    from speech_assets.runtime.faults import FAULTS_ENV
    from speech_assets.train.checkpoint import load_checkpoint

    monkeypatch.setenv(FAULTS_ENV, ";".join(f"federated.round client={c} round=1 raise" for c in dropped))
    result, _, config = run_in_process(
        four_clients, tmp_path, "drop", local_steps=3, secure_aggregation=True, min_train_nodes=2
    )
    paths = FederatedPaths(config.run_dir)
    if len(dropped) <= 4 - 3:
        record = json.loads(paths.round_record(1).read_text())
        assert record["secure_aggregation"]["dropped"] == dropped and record["secure_aggregation"]["threshold"] == 3
        plain, _, plain_config = run_in_process(four_clients, tmp_path, "plain", local_steps=3, min_train_nodes=2)
        a = load_checkpoint(paths.final)["encoder"]
        b = load_checkpoint(FederatedPaths(plain_config.run_dir).final)["encoder"]
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    else:
        assert isinstance(result, FederatedRunError)
        failure = json.loads(paths.failure.read_text())
        assert failure["round"] == 1 and "needs 3 clients (its threshold)" in failure["message"]
        assert failure["missing"] == dropped


def _garbage_vector(mask_update):  # type: ignore[no-untyped-def]
    def bad(update, me, *args):  # type: ignore[no-untyped-def]
        masked = mask_update(update, me, *args)
        if me == "c2":  # any uint32 values: nothing a server could check before unmasking
            rng = np.random.default_rng(0)
            masked = {k: rng.integers(0, 2**32, v.shape, dtype=np.uint64).astype(np.uint32) for k, v in masked.items()}
        return masked

    return bad


def _garbage_shares(seal_shares):  # type: ignore[no-untyped-def]
    def bad(secrets, public, context, src, dst, seed_share, key_share):  # type: ignore[no-untyped-def]
        if src == "c2":  # shares of another secret, with the right indices
            seed_share = seed_share[:4] + bytes(len(seed_share) - 4)
        return seal_shares(secrets, public, context, src, dst, seed_share, key_share)

    return bad


@pytest.mark.parametrize(
    "spoil, target, problem",
    [
        (_garbage_vector, "mask_update", "did not unmask: the unmasked sum of 4 survivors is beyond n x T"),
        (_garbage_shares, "seal_shares", "do not rebuild what c2 (self-mask seed) advertised"),
    ],
)
def test_a_bad_clients_garbage_fails_the_round_cleanly(
    four_clients,
    tmp_path: Path,
    monkeypatch,  # type: ignore[no-untyped-def]
    spoil,
    target: str,
    problem: str,
) -> None:
    from speech_assets.federated import secure_rounds as sr
    from speech_assets.federated.server_app import FederatedRunError
    from speech_assets.layout import FederatedPaths

    monkeypatch.setattr(sr, target, spoil(getattr(sr, target)))
    result, _, config = run_in_process(four_clients, tmp_path, "bad", local_steps=3, secure_aggregation=True)
    assert isinstance(result, FederatedRunError)
    failure = json.loads(FederatedPaths(config.run_dir).failure.read_text())
    assert failure["round"] == 1 and failure["message"].startswith("round 1: ") and problem in failure["message"]
    assert not FederatedPaths(config.run_dir).round_record(1).exists()


BAD_UNMASKS = {  # (survivors, dropped) asked of c0 in a round where all four masked; threshold 3
    "overlap": ("c0,c1,c2,c3", "c1"),
    "not every peer": ("c0,c1,c2", ""),
    "a stranger": ("c0,c1,c2", "c3,c9"),
    "itself dropped": ("c1,c2,c3", "c0"),
    "fewer than t survivors": ("c0,c1", "c2,c3"),
    "named twice": ("c0,c1,c1,c2", "c3"),
}


def test_an_inconsistent_unmask_request_is_refused_and_costs_nothing(four_clients, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict

    from speech_assets.federated import secure_rounds as sr

    refusals: dict[str, list] = {}
    reveal = sr.SecureRounds.reveal

    def probing_reveal(self, failures):  # type: ignore[no-untyped-def]
        for case, (survivors, dropped) in BAD_UNMASKS.items():
            config = ConfigRecord(
                {
                    sr.KIND: sr.UNMASK,
                    "secure-aggregation": True,
                    "run-name": self.config.run_name,
                    "server-round": self.round_number,
                    sr.SECAGG_NONCE: self.nonce,
                    sr.SECAGG_SURVIVORS: survivors,
                    sr.SECAGG_DROPPED: dropped,
                }
            )
            query = Message(
                RecordDict({"config": config}),
                dst_node_id=self.host.binding.node_of("c0"),
                message_type=MessageType.QUERY,
            )
            good, refused = self.host.exchange([query], self.round_number, "attack")
            refusals[case] = [r["reason"] for r in refused] if not good else []
        return reveal(self, failures)

    monkeypatch.setattr(sr.SecureRounds, "reveal", probing_reveal)
    result, _, _ = run_in_process(four_clients, tmp_path, "inconsistent", local_steps=3, secure_aggregation=True)
    assert all(len(reasons) == 1 and "ValueError" in reasons[0] for reasons in refusals.values()), refusals
    # a refused request is not an answer: c0 still answers the server's consistent one
    assert isinstance(result, dict) and result["rounds"] == 1
