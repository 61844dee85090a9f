"""Secure aggregation by pairwise masking: the server recovers the sum of the survivors' updates
(dropouts included) and nothing readable from a single masked update or a partial sum; masks are
bound to their round context; keys and secrets are stable; bad parameters and layouts are refused."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from speech_assets.federated.secure_aggregation import (
    MODULUS,
    ClientKeys,
    SecAggParams,
    dropped_masks,
    load_or_create_secret,
    mask_seed,
    mask_update,
    new_secret,
    prg,
    round_context,
    unmask_sum,
)

RUN = "run-test"
PARAMS = SecAggParams(clipping_range=1.0, target_range=2**22)
SHAPES = {"layers.0.weight": (60, 100), "layers.0.bias": (100,), "proj.weight": (40, 100), "scale": ()}  # 10101 values
CONTEXT = round_context(RUN, 3, b"n" * 16)
# chi-square critical value for 63 degrees of freedom at p = 1e-4 (scipy.stats.chi2.ppf(1 - 1e-4, 63))
CHI2_63_P1E4 = 113.505


def _ids(n: int) -> list[str]:
    return [f"client_{i:02d}" for i in range(n)]


def _keys(clients: list[str]) -> dict[str, ClientKeys]:
    # fixed secrets: the statistical checks below see the same masks on every run
    return {c: ClientKeys.derive(hashlib.sha256(c.encode()).digest(), RUN) for c in clients}


def _updates(clients: list[str], scale: float = 0.3, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {c: {name: np.asarray(rng.normal(0.0, scale, shape), dtype=np.float32) for name, shape in SHAPES.items()}
            for c in clients}


def _mask_all(updates: dict[str, dict[str, np.ndarray]], keys: dict[str, ClientKeys],
              context: bytes = CONTEXT) -> dict[str, dict[str, np.ndarray]]:
    peers = {c: k.public_bytes() for c, k in keys.items()}
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
            name: (shape, np.dtype(np.uint32)) for name, shape in SHAPES.items()}
    result = unmask_sum(masked, {}, PARAMS)
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
    masked = _mask_all(updates, _keys(clients))
    subset = [c for c in clients if c != left_out]
    raw = np.zeros(10101, dtype=np.uint32)
    for c in subset:
        raw += _flat(masked[c])
    truth = _flat(_clipped_sum([updates[c] for c in subset], PARAMS.clipping_range))
    assert abs(np.corrcoef(raw.astype(np.float64), truth)[0, 1]) < 0.05
    # a true sum of 4 quantized values is <= 4T; the partial sum almost never is
    assert np.mean(raw <= len(subset) * PARAMS.target_range) < 0.05
    with pytest.raises(ValueError, match="did not cancel"):
        unmask_sum({c: masked[c] for c in subset}, {}, PARAMS)


@pytest.mark.parametrize("gone", ["client_00", "client_02", "client_03"])
def test_survivors_reveal_the_masks_of_a_dropped_client(gone: str) -> None:
    clients = _ids(4)
    keys = _keys(clients)
    peers = {c: k.public_bytes() for c, k in keys.items()}
    updates = _updates(clients)
    masked = _mask_all(updates, keys)  # all 4 mask; `gone` never sends its vector
    survivors = [c for c in clients if c != gone]
    arrived = {c: masked[c] for c in survivors}
    with pytest.raises(ValueError, match="did not cancel"):
        unmask_sum(arrived, {}, PARAMS)
    revealed = {c: dropped_masks(c, keys[c], peers, [gone], SHAPES, CONTEXT) for c in survivors}
    for c in survivors:
        assert {name: (a.shape, a.dtype) for name, a in revealed[c].items()} == {
            name: (shape, np.dtype(np.uint32)) for name, shape in SHAPES.items()}
    result = unmask_sum(arrived, revealed, PARAMS)
    _assert_close_sum(result, _clipped_sum([updates[c] for c in survivors], PARAMS.clipping_range), 3)
    # one survivor keeping its reveal back leaves masks in the sum
    with pytest.raises(ValueError, match="did not cancel"):
        unmask_sum(arrived, {c: revealed[c] for c in survivors[1:]}, PARAMS)


def test_dropped_masks_refuses_what_would_unmask_a_survivor() -> None:
    clients = _ids(3)
    keys = _keys(clients)
    peers = {c: k.public_bytes() for c, k in keys.items()}
    me = "client_00"
    with pytest.raises(ValueError, match="only survivor"):
        dropped_masks(me, keys[me], peers, ["client_01", "client_02"], SHAPES, CONTEXT)
    with pytest.raises(ValueError, match="dropped set"):
        dropped_masks(me, keys[me], peers, [me], SHAPES, CONTEXT)
    with pytest.raises(ValueError, match="not in this round"):
        dropped_masks(me, keys[me], peers, ["client_09"], SHAPES, CONTEXT)


def test_mask_update_refuses_bad_rounds() -> None:
    clients = _ids(2)
    keys = _keys(clients)
    update = _updates(clients)["client_00"]
    alone = {"client_00": keys["client_00"].public_bytes()}
    with pytest.raises(ValueError, match="at least one other client"):
        mask_update(update, "client_00", keys["client_00"], alone, PARAMS, CONTEXT)
    swapped = {"client_00": keys["client_01"].public_bytes(), "client_01": keys["client_01"].public_bytes()}
    with pytest.raises(ValueError, match="not this client's"):
        mask_update(update, "client_00", keys["client_00"], swapped, PARAMS, CONTEXT)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_mask_update_refuses_non_finite_values(bad: float) -> None:
    clients = _ids(2)
    keys = _keys(clients)
    update = _updates(clients)["client_00"]
    update["layers.0.bias"][7] = bad
    peers = {c: k.public_bytes() for c, k in keys.items()}
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
    assert mask_seed(a, b.public_bytes(), CONTEXT) == mask_seed(b, a.public_bytes(), CONTEXT)
    assert len(mask_seed(a, b.public_bytes(), CONTEXT)) == 32
    assert mask_seed(a, b.public_bytes(), CONTEXT) != mask_seed(a, b.public_bytes(), other)
    assert mask_seed(a, b.public_bytes(), CONTEXT) != mask_seed(a, c.public_bytes(), CONTEXT)


def test_round_context_is_unambiguous_and_checked() -> None:
    nonce = b"n" * 16
    contexts = {round_context(RUN, 1, nonce), round_context(RUN, 2, nonce), round_context(RUN + "x", 1, nonce),
                round_context(RUN, 1, b"m" * 16), round_context(RUN, 1, nonce + b"m")}
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


def test_keys_are_derived_from_secret_and_context() -> None:
    secret, other = new_secret(), new_secret()
    assert len(secret) == 32 and secret != other
    public = ClientKeys.derive(secret, RUN).public_bytes()
    assert len(public) == 32
    assert ClientKeys.derive(secret, RUN).public_bytes() == public
    assert ClientKeys.derive(secret, "another-run").public_bytes() != public
    assert ClientKeys.derive(other, RUN).public_bytes() != public
    with pytest.raises(ValueError, match="32 bytes"):
        ClientKeys.derive(secret[:31], RUN)
    assert repr(ClientKeys.derive(secret, RUN)) == "ClientKeys()"  # the private key stays out of logs


def test_secret_file_is_created_once_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "state" / "secagg.key"
    secret = load_or_create_secret(path)
    assert len(secret) == 32 and path.read_bytes() == secret
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_secret(path) == secret
    assert os.listdir(path.parent) == ["secagg.key"]  # no temp file left behind


def test_a_truncated_secret_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secagg.key"
    path.write_bytes(os.urandom(16))
    with pytest.raises(ValueError, match="32 bytes"):
        load_or_create_secret(path)
    assert len(path.read_bytes()) == 16  # left for the operator to look at, not replaced


def test_check_clients_refuses_a_sum_that_would_wrap() -> None:
    params = SecAggParams(clipping_range=0.5)
    assert params.target_range == 2**22
    params.check_clients(1023)
    with pytest.raises(ValueError, match="wrap"):
        params.check_clients(1024)
    SecAggParams(0.5, target_range=2**31 - 1).check_clients(2)  # 2 * (2^31 - 1) < 2^32
    with pytest.raises(ValueError, match="wrap"):
        SecAggParams(0.5, target_range=2**30).check_clients(MODULUS // 2**30)


@pytest.mark.parametrize("clipping_range, target_range", [
    (0.0, 2**22), (-1.0, 2**22), (float("nan"), 2**22), (float("inf"), 2**22), (True, 2**22),
    (1.0, 1), (1.0, 0), (1.0, -5), (1.0, 2**31), (1.0, 2.5), (1.0, True),
])
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
@pytest.mark.parametrize("where", ["masked", "revealed"])
def test_unmask_sum_refuses_mismatched_arrays(spoil, where: str) -> None:  # type: ignore[no-untyped-def]
    clients = _ids(3)
    keys = _keys(clients)
    masked = _mask_all(_updates(clients), keys)
    revealed = {"client_01": {name: np.zeros(shape, np.uint32) for name, shape in SHAPES.items()}}
    spoil(masked["client_02"] if where == "masked" else revealed["client_01"])
    with pytest.raises(ValueError, match="client_0[12]"):
        unmask_sum(masked, revealed, PARAMS)


def test_unmask_sum_refuses_too_few_survivors_and_strangers() -> None:
    clients = _ids(3)
    masked = _mask_all(_updates(clients), _keys(clients))
    with pytest.raises(ValueError, match="at least 2"):
        unmask_sum({"client_00": masked["client_00"]}, {}, PARAMS)
    stranger = {"client_09": {name: np.zeros(shape, np.uint32) for name, shape in SHAPES.items()}}
    with pytest.raises(ValueError, match="client_09"):
        unmask_sum(masked, stranger, PARAMS)
