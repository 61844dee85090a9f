"""Secure aggregation of encoder updates with double masking and secret sharing (Bonawitz et al.
2017; the sparse neighbour graph of SecAgg+, Bell et al. 2020): the primitives. The messages that
carry them are :mod:`speech_assets.federated.secure_rounds`.

Each round, every sampled client holds an update (its encoder minus the global one), a
``dict[str, np.ndarray]`` of float arrays. The server must learn only the SUM of the updates of the
clients it counts as survivors, never one of them, even when it lies about who dropped out:

1. Each client draws fresh secrets for the round (:class:`RoundSecrets`): an X25519 key pair for
   pair masks, an ECDH key pair (Flower's, P-384) to encrypt shares, and a 32-byte self-mask seed
   ``b``. It advertises the two public keys and a commitment to ``b`` (:func:`seed_commitment`).
2. Each client splits ``b`` and its X25519 secret key into t-of-k Shamir shares (Flower's
   ``create_shares``, over GF(2^128), any secret length) for its neighbours (:func:`neighbours`:
   k clients, itself included, on a ring of the round's clients in id order; all of them by
   default) and encrypts each neighbour's pair of shares with Flower's Fernet (authenticated)
   under a key agreed with that neighbour's ECDH key (:func:`seal_shares`, :func:`open_shares`).
3. Each client quantizes its update to integers in ``[0, T]`` (Flower's ``quantize``, values
   clipped to ``±clipping_range``), adds its self-mask ``PRG(b)`` and one pair mask per neighbour
   that sent it shares, with opposite signs on the two ends of a pair, mod 2^32 (:func:`mask_update`).
4. The server fixes the survivors (the masked vectors it accepted). For each neighbour, a survivor
   reveals either its share of ``b`` (neighbour survived) or its share of the X25519 secret key
   (neighbour dropped), never both. With t shares the server rebuilds each survivor's ``b`` and
   each dropped client's secret key, removes the self-masks and the dropped clients' pair masks,
   and the other pair masks cancel (:func:`unmask_sum`).

Why a client the server counts as dropped stays hidden even when its masked vector did arrive: its
self-mask ``b`` is only rebuilt from the shares of clients that counted it as a survivor; an honest
client reveals one kind of share per neighbour and answers one unmask request per round, so with
t > k/2 the server cannot get t shares of both ``b`` and the key of one client.

Pair masks come from an X25519 exchange, HKDF-SHA256 over a context that binds run, round and the
server's nonce (:func:`round_context`), and a ChaCha20 keystream as the PRG (:func:`prg`): a
256-bit seed, so the server cannot search the seed space (Flower's ``pseudo_rand_gen`` folds seeds
to 32 bits). The self-mask is the ChaCha20 keystream of ``b``.

Who advertised a key: each client signs its advertisement (:func:`advertisement`: round context,
its client id, both public keys and its commitment) with its node identity key, the ECDSA P-384
key its SuperNode authenticates with (:func:`sign_advertisement`); before sealing a share to
anyone, every client checks each entry of the key table against the federation's authorised node
keys it was given with its own settings (:func:`verify_advertisement`). A server can then neither
invent a client nor advertise its own keys under a real client's id.

What this cannot check: the values inside a masked vector. A client may send any ``uint32``
vector; the only test is that the unmasked sum of n survivors lies in ``[0, n*T]`` per value, so
garbage that does not cancel is caught (with probability 1 - (n*T/2^32)^values), but one client
can still move the sum anywhere inside that range. Per-client norm checks are lost under masking.

Arrays are flattened into one vector in sorted-name order; ``layout`` below means that order plus
each array's shape. Client ids are compared as Python strings on both sides of a pair.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.fernet import InvalidToken
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)

MODULUS = 2**32
KEY_BYTES = 32
SEED_BYTES = 32
MIN_NONCE_BYTES = 16
DEFAULT_TARGET_RANGE = 2**22  # up to 1023 clients per sum

# Domain separation: the same secret must never yield the same bytes for two purposes.
_SEED_SALT = b"speech_assets.secagg.pair-seed.v1"
_CONTEXT_TAG = b"speech_assets.secagg.round.v1"
_COMMIT_TAG = b"speech_assets.secagg.self-seed.v1"
_ADVERTISE_TAG = b"speech_assets.secagg.advertisement.v1"


@dataclass(frozen=True)
class SecAggParams:
    """Quantization of updates: values are clipped to ``±clipping_range`` and mapped to integers in
    ``[0, target_range]`` (a step of ``2 * clipping_range / target_range``)."""

    clipping_range: float
    target_range: int = DEFAULT_TARGET_RANGE

    def __post_init__(self) -> None:
        c = self.clipping_range
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
            raise ValueError(f"clipping_range must be a finite number > 0, got {c!r}")
        t = self.target_range
        # Flower's quantize rounds into int32: target_range itself must fit.
        if isinstance(t, bool) or not isinstance(t, int) or not 2 <= t < 2**31:
            raise ValueError(f"target_range must be an int in [2, 2**31), got {t!r}")

    def check_clients(self, n: int) -> None:
        """Refuse ``n`` clients when a sum of ``n`` quantized values (each up to ``target_range``)
        could reach 2^32, where it would wrap and could not be told apart from a small sum."""
        if n * self.target_range >= MODULUS:
            raise ValueError(
                f"{n} clients x target_range {self.target_range} >= 2**32: the sum would wrap; "
                f"use target_range < {MODULUS // n} or fewer clients"
            )


def check_threshold(threshold: int, num_shares: int) -> None:
    """Refuse a t-of-k sharing that a server could split: t <= k/2 lets two disjoint halves of the
    neighbours each hand over t shares, one half those of ``b``, the other those of the key."""
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 2 * threshold > num_shares:
        raise ValueError(f"threshold {threshold!r} must be more than half of the {num_shares} shares")
    if threshold > num_shares:
        raise ValueError(f"threshold {threshold} is more than the {num_shares} shares")


def default_threshold(num_shares: int) -> int:
    """The smallest threshold above two thirds of ``num_shares`` (floor(2k/3) + 1): tolerates
    just under a third of drop-outs and refuses any split (see :func:`check_threshold`)."""
    return max(2, 2 * num_shares // 3 + 1)


@dataclass(frozen=True)
class RoundSecrets:
    """One client's secrets for one round, fresh every round: ``mask_key`` (X25519 private key,
    32 raw bytes, for pair masks), ``share_key`` (Flower's P-384 ECDH private key, PEM, to encrypt
    shares) and ``self_seed`` (32 bytes, the self-mask). Never printed."""

    mask_key: bytes = field(repr=False)
    share_key: bytes = field(repr=False)
    self_seed: bytes = field(repr=False)

    @classmethod
    def new(cls) -> RoundSecrets:
        share_key, _ = generate_key_pairs()
        mask_key = X25519PrivateKey.generate().private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return cls(mask_key, private_key_to_bytes(share_key), os.urandom(SEED_BYTES))

    def mask_public(self) -> bytes:
        """The X25519 public key of ``mask_key``, 32 raw bytes."""
        return mask_public(self.mask_key)

    def share_public(self) -> bytes:
        """The ECDH public key of ``share_key`` (PEM bytes)."""
        return public_key_to_bytes(bytes_to_private_key(self.share_key).public_key())


def mask_public(mask_key: bytes) -> bytes:
    """The X25519 public key (32 raw bytes) of a 32-byte private key."""
    if len(mask_key) != KEY_BYTES:
        raise ValueError(f"an X25519 private key is {KEY_BYTES} raw bytes, got {len(mask_key)}")
    return (
        X25519PrivateKey.from_private_bytes(bytes(mask_key))
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )


def check_share_public(key: bytes) -> None:
    """Refuse an ECDH public key that is not a PEM P-384 key (what :class:`RoundSecrets` makes)."""
    try:
        loaded = bytes_to_public_key(bytes(key))
    except (ValueError, TypeError) as error:
        raise ValueError(f"not a PEM public key: {error}") from None
    if not isinstance(loaded, ec.EllipticCurvePublicKey) or not isinstance(loaded.curve, ec.SECP384R1):
        raise ValueError("the share key is not a P-384 elliptic-curve key")


def round_context(run: str, round_number: int, nonce: bytes) -> bytes:
    """The context bytes that bind masks and shares to one round: run name, round number and the
    server's nonce (at least 16 bytes, fresh for every round). Fields are length-prefixed, so
    distinct inputs never give the same bytes."""
    if not run:
        raise ValueError("a run name is required")
    if isinstance(round_number, bool) or not isinstance(round_number, int) or round_number < 0:
        raise ValueError(f"round_number must be an int >= 0, got {round_number!r}")
    if len(nonce) < MIN_NONCE_BYTES:
        raise ValueError(f"the server nonce must be at least {MIN_NONCE_BYTES} bytes, got {len(nonce)}")
    run_bytes = run.encode("utf-8")
    return b"".join(
        [
            _CONTEXT_TAG,
            struct.pack(">I", len(run_bytes)),
            run_bytes,
            struct.pack(">Q", round_number),
            struct.pack(">I", len(nonce)),
            bytes(nonce),
        ]
    )


def seed_commitment(seed: bytes, client: str, context: bytes) -> bytes:
    """SHA-256 commitment (32 bytes) to a self-mask seed: the server checks a rebuilt seed against
    it, so bad shares are named instead of leaving masks in the sum."""
    who = client.encode("utf-8")
    return hashlib.sha256(
        b"".join([_COMMIT_TAG, struct.pack(">I", len(context)), context, struct.pack(">I", len(who)), who, bytes(seed)])
    ).digest()


def advertisement(context: bytes, client: str, mask_key: bytes, share_key: bytes, commitment: bytes) -> bytes:
    """The bytes a client signs for its advertisement: the round context (run, round, nonce), its
    client id, its two public keys and its seed commitment, each length-prefixed."""
    fields = [bytes(context), client.encode("utf-8"), bytes(mask_key), bytes(share_key), bytes(commitment)]
    return _ADVERTISE_TAG + b"".join(struct.pack(">I", len(f)) + f for f in fields)


def sign_advertisement(identity: ec.EllipticCurvePrivateKey, message: bytes) -> bytes:
    """ECDSA (SHA-384) signature of an :func:`advertisement` under a node identity key."""
    return identity.sign(message, ec.ECDSA(hashes.SHA384()))


def verify_advertisement(public: ec.EllipticCurvePublicKey, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``public``'s signature of the :func:`advertisement` ``message``."""
    try:
        public.verify(bytes(signature), message, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        return False
    return True


def neighbours(client: str, clients: Collection[str], num_shares: int) -> list[str]:
    """The clients ``client`` shares with and masks against, itself included, sorted: all of
    ``clients`` when ``num_shares`` (0 = all) is at least their number, else the ``num_shares``
    (odd) clients around it on the ring of ``clients`` in id order. Symmetric: b is a neighbour of
    a iff a is one of b."""
    order = sorted(set(clients))
    if client not in order:
        raise ValueError(f"{client} is not among the round's clients")
    if not num_shares or num_shares >= len(order):
        return order
    if num_shares < 3 or num_shares % 2 == 0:
        raise ValueError(f"num_shares must be 0 (all) or an odd number >= 3, got {num_shares}")
    i, half = order.index(client), num_shares // 2
    return sorted({order[(i + offset) % len(order)] for offset in range(-half, half + 1)})


def split_secret(secret: bytes, threshold: int, num_shares: int) -> list[bytes]:
    """``num_shares`` Shamir shares of ``secret``, any ``threshold`` of which rebuild it (Flower's
    ``create_shares``); share i (0-based) carries index i + 1 in its first 4 bytes."""
    check_threshold(threshold, num_shares)
    return create_shares(bytes(secret), threshold, num_shares)


def share_index(share: bytes) -> int:
    """The 1-based index a share carries (little-endian, its first 4 bytes)."""
    if len(share) < 4 + 16 or (len(share) - 4) % 16:
        raise ValueError(f"a share is 4 + 16k bytes, got {len(share)}")
    return int.from_bytes(share[:4], "little")


def combine_secret(shares: Sequence[bytes]) -> bytes:
    """The secret of Shamir ``shares`` (at least the threshold, distinct indices); ValueError when
    they do not combine (too few or corrupt shares rebuild garbage, which usually fails here and
    otherwise fails the caller's check against a public key or commitment)."""
    if not shares:
        raise ValueError("no shares")
    indices = [share_index(s) for s in shares]
    if len(set(indices)) != len(indices) or len({len(s) for s in shares}) != 1:
        raise ValueError("shares with repeated indices or different lengths")
    return combine_shares([bytes(s) for s in shares])


def _fernet_key(secrets: RoundSecrets, peer_share_public: bytes) -> bytes:
    check_share_public(peer_share_public)
    return generate_shared_key(bytes_to_private_key(secrets.share_key), bytes_to_public_key(bytes(peer_share_public)))


def seal_shares(
    secrets: RoundSecrets,
    peer_share_public: bytes,
    context: bytes,
    src: str,
    dst: str,
    seed_share: bytes,
    key_share: bytes,
) -> bytes:
    """``src``'s shares for ``dst`` (of its self-mask seed and its X25519 key), encrypted and
    authenticated (Fernet) under the ECDH key of ``src``'s ``share_key`` and ``dst``'s public one;
    the plaintext names the round context, sender and receiver, so a ciphertext replayed to
    another client or round is refused."""
    plain = json.dumps(
        {"context": context.hex(), "src": src, "dst": dst, "seed": seed_share.hex(), "key": key_share.hex()},
        sort_keys=True,
    ).encode()
    return encrypt(_fernet_key(secrets, peer_share_public), plain)


def open_shares(
    secrets: RoundSecrets, peer_share_public: bytes, ciphertext: bytes, context: bytes, src: str, dst: str
) -> tuple[bytes, bytes]:
    """``(seed share, key share)`` that ``src`` sealed for ``dst`` (this client) with
    :func:`seal_shares`; ValueError if the ciphertext is not authentic or names another round,
    sender or receiver."""
    try:
        fields = json.loads(decrypt(_fernet_key(secrets, peer_share_public), bytes(ciphertext)))
    except (InvalidToken, ValueError, TypeError):
        raise ValueError(f"the shares from {src} do not decrypt: not sealed for {dst} in this round") from None
    if fields.get("context") != context.hex() or fields.get("src") != src or fields.get("dst") != dst:
        raise ValueError(f"the shares from {src} name another round, sender or receiver")
    return bytes.fromhex(fields["seed"]), bytes.fromhex(fields["key"])


def mask_seed(mask_key: bytes, peer_public: bytes, context: bytes) -> bytes:
    """The 32-byte seed of the pair (the owner of ``mask_key``, the peer with ``peer_public``)
    under ``context``; both ends of the pair derive the same seed."""
    if len(peer_public) != KEY_BYTES:
        raise ValueError(f"an X25519 public key is {KEY_BYTES} raw bytes, got {len(peer_public)}")
    private = X25519PrivateKey.from_private_bytes(bytes(mask_key))
    # exchange() raises ValueError on a low-order peer key (all-zero shared secret).
    shared = private.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=_SEED_SALT, info=bytes(context)).derive(shared)


def prg(seed: bytes, count: int) -> np.ndarray:
    """``count`` pseudo-random ``np.uint32`` values, shape ``(count,)``: the ChaCha20 keystream of
    the 32-byte ``seed`` (zero nonce and counter, safe as every seed is used for one stream), read
    as little-endian 32-bit words."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a PRG seed is {SEED_BYTES} bytes, got {len(seed)}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    encryptor = Cipher(algorithms.ChaCha20(bytes(seed), bytes(16)), mode=None).encryptor()
    keystream = encryptor.update(bytes(4 * count))
    return np.frombuffer(keystream, dtype="<u4").astype(np.uint32)


def _layout(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(np.shape(arrays[name])) for name in sorted(arrays)}


def _size(layout: Mapping[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in layout.values())


def _split(flat: np.ndarray, layout: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    start = 0
    for name in sorted(layout):
        shape = tuple(layout[name])
        stop = start + math.prod(shape)
        out[name] = flat[start:stop].reshape(shape)
        start = stop
    return out


def _flatten_uint32(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    parts = [np.asarray(arrays[name]).ravel() for name in sorted(arrays)]
    return np.concatenate(parts).astype(np.uint32, copy=False) if parts else np.zeros(0, np.uint32)


def _pair_mask(flat: np.ndarray, me: str, peer: str, seed: bytes, sign: int) -> None:
    # uint32 arithmetic wraps mod 2^32; the lower id adds the pair's mask and the higher subtracts
    # it; sign -1 removes what ``me`` added.
    mask = prg(seed, flat.size)
    if (me < peer) == (sign > 0):
        flat += mask
    else:
        flat -= mask


def mask_update(
    update: Mapping[str, np.ndarray],
    me: str,
    secrets: RoundSecrets,
    peers: Mapping[str, bytes],
    params: SecAggParams,
    context: bytes,
) -> dict[str, np.ndarray]:
    """This client's masked update: the same names and shapes as ``update`` (float arrays of any
    shape, 0-d included), each an ``np.uint32`` array.

    Each value is clipped to ``±params.clipping_range`` and stochastically rounded to an integer in
    ``[0, params.target_range]``; then the self-mask ``prg(secrets.self_seed)`` and one pair mask
    per peer in ``peers`` (``{client: X25519 public key}`` of the neighbours that sent this client
    their shares; ``me`` skipped) are added or subtracted mod 2^32. Refuses non-finite values and a
    round with no other client.
    """
    if me in peers and bytes(peers[me]) != secrets.mask_public():
        raise ValueError(f"the peer map holds a public key for {me} that is not this client's")
    others = sorted(peer for peer in peers if peer != me)
    if not others:
        raise ValueError("secure aggregation needs at least one other client in the round")
    params.check_clients(len(others) + 1)
    names = sorted(update)
    values = [np.asarray(update[name], dtype=np.float64) for name in names]  # float64: no float32 rounding at 2^22
    for name, value in zip(names, values):
        if not np.all(np.isfinite(value)):
            raise ValueError(f"update array {name!r} holds non-finite values")
    quantized = quantize(values, params.clipping_range, params.target_range)
    flat = _flatten_uint32({name: np.asarray(q) for name, q in zip(names, quantized)})
    flat += prg(secrets.self_seed, flat.size)
    for peer in others:
        _pair_mask(flat, me, peer, mask_seed(secrets.mask_key, peers[peer], context), +1)
    return _split(flat, _layout(update))


def _check_layout(who: str, arrays: Mapping[str, np.ndarray], layout: Mapping[str, tuple[int, ...]]) -> None:
    if sorted(arrays) != sorted(layout):
        raise ValueError(f"{who}: array names {sorted(arrays)} differ from {sorted(layout)}")
    for name, shape in layout.items():
        array = arrays[name]
        if not isinstance(array, np.ndarray) or array.dtype != np.uint32:
            raise ValueError(f"{who}: array {name!r} must be np.uint32, got {getattr(array, 'dtype', type(array))}")
        if array.shape != shape:
            raise ValueError(f"{who}: array {name!r} has shape {array.shape}, expected {shape}")


class MasksDidNotCancel(ValueError):
    """The unmasked sum is out of range: a client's vector or shares were wrong."""


def unmask_sum(
    masked: Mapping[str, Mapping[str, np.ndarray]],
    self_seeds: Mapping[str, bytes],
    dropped_keys: Mapping[str, bytes],
    public_keys: Mapping[str, bytes],
    masked_with: Mapping[str, Collection[str]],
    params: SecAggParams,
    context: bytes,
) -> dict[str, np.ndarray]:
    """The sum of the survivors' updates (each clipped to ``±params.clipping_range``), as float32
    arrays with the masked arrays' names and shapes.

    ``masked`` maps each survivor (at least 2) to its masked update (``np.uint32`` arrays, all with
    the same names and shapes); ``self_seeds`` each survivor to its rebuilt self-mask seed;
    ``dropped_keys`` each dropped client to its rebuilt X25519 private key; ``public_keys`` every
    client to its X25519 public key; ``masked_with`` each survivor to the clients it masked
    against. The error per value is below ``n * 2 * clipping_range / target_range`` for n
    survivors (stochastic rounding). Raises ValueError on mismatched arrays or seeds and
    :class:`MasksDidNotCancel` when the sum leaves ``[0, n * T]``.
    """
    survivors = sorted(masked)
    if len(survivors) < 2:
        raise ValueError(f"secure aggregation needs at least 2 survivors, got {len(survivors)}")
    if sorted(self_seeds) != survivors:
        raise ValueError(f"self-mask seeds for {sorted(self_seeds)}, survivors are {survivors}")
    params.check_clients(len(survivors))
    layout = _layout(masked[survivors[0]])
    for client in survivors:
        _check_layout(f"masked update of {client}", masked[client], layout)

    total = np.zeros(_size(layout), dtype=np.uint32)
    for client in survivors:
        total += _flatten_uint32(masked[client])
        total -= prg(self_seeds[client], total.size)
    for gone in sorted(dropped_keys):
        for client in survivors:
            if gone in masked_with[client] and gone != client:
                _pair_mask(total, client, gone, mask_seed(dropped_keys[gone], public_keys[client], context), -1)

    n = len(survivors)
    # Every true sum is <= n * T < 2^32; leftover masks are uniform, so over many values some
    # land above n * T (a lone value escapes this check with probability n * T / 2^32).
    if total.size and int(total.max()) > n * params.target_range:
        raise MasksDidNotCancel(
            f"the unmasked sum of {n} survivors is beyond n x T: a survivor's masked vector "
            "or a revealed share is wrong, or clients masked with different peers"
        )
    c = params.clipping_range
    # dequantize maps q to q * 2c/T - c; a sum of n values carries n offsets of c, not one.
    (summed,) = dequantize([total], c, params.target_range)
    return _split((summed - (n - 1) * c).astype(np.float32), layout)
