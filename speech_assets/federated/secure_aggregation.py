"""Secure aggregation of encoder updates with double masking and secret sharing (Bonawitz et al.
2017; the sparse neighbour graph of SecAgg+, Bell et al. 2020): the primitives. The messages that
carry them are :mod:`speech_assets.federated.secure_rounds`; the threat model is in docs/PRIVACY.md.

Pair masks: X25519, HKDF-SHA256 over the round context (run, round, server nonce) and a ChaCha20
keystream as the PRG: a 256-bit seed the server cannot search (Flower's ``pseudo_rand_gen`` folds
seeds to 32 bits). Arrays are flattened in sorted-name order; client ids are compared as Python strings.
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
    """Values clipped to ``±clipping_range``, mapped to integers in ``[0, target_range]``."""

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
        """Refuse ``n`` clients whose sum could reach 2^32, where it would wrap unnoticed."""
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
    """floor(2k/3) + 1: tolerates just under a third of drop-outs, and no split."""
    return max(2, 2 * num_shares // 3 + 1)


@dataclass(frozen=True)
class RoundSecrets:
    """One client's secrets of one round: X25519 ``mask_key`` (raw), P-384 ``share_key`` (PEM,
    encrypts shares) and the 32-byte ``self_seed``. Never printed."""

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
        return mask_public(self.mask_key)

    def share_public(self) -> bytes:
        return public_key_to_bytes(bytes_to_private_key(self.share_key).public_key())


def mask_public(mask_key: bytes) -> bytes:
    if len(mask_key) != KEY_BYTES:
        raise ValueError(f"an X25519 private key is {KEY_BYTES} raw bytes, got {len(mask_key)}")
    return (
        X25519PrivateKey.from_private_bytes(bytes(mask_key))
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )


def check_share_public(key: bytes) -> None:
    """Refuse what is not a PEM P-384 public key."""
    try:
        loaded = bytes_to_public_key(bytes(key))
    except (ValueError, TypeError) as error:
        raise ValueError(f"not a PEM public key: {error}") from None
    if not isinstance(loaded, ec.EllipticCurvePublicKey) or not isinstance(loaded.curve, ec.SECP384R1):
        raise ValueError("the share key is not a P-384 elliptic-curve key")


def round_context(run: str, round_number: int, nonce: bytes) -> bytes:
    """Binds masks and shares to one round; fields length-prefixed, so distinct inputs never collide."""
    if not run:
        raise ValueError("a run name is required")
    if isinstance(round_number, bool) or not isinstance(round_number, int) or round_number < 0:
        raise ValueError(f"round_number must be an int >= 0, got {round_number!r}")
    if len(nonce) < MIN_NONCE_BYTES:
        raise ValueError(f"the server nonce must be at least {MIN_NONCE_BYTES} bytes, got {len(nonce)}")
    run_bytes = run.encode("utf-8")
    head = _CONTEXT_TAG + struct.pack(">I", len(run_bytes)) + run_bytes
    return head + struct.pack(">QI", round_number, len(nonce)) + bytes(nonce)


def seed_commitment(seed: bytes, client: str, context: bytes) -> bytes:
    """The server checks a rebuilt seed against it, so bad shares are named instead of leaving masks."""
    who = client.encode("utf-8")
    return hashlib.sha256(
        b"".join([_COMMIT_TAG, struct.pack(">I", len(context)), context, struct.pack(">I", len(who)), who, bytes(seed)])
    ).digest()


def advertisement(context: bytes, client: str, mask_key: bytes, share_key: bytes, commitment: bytes) -> bytes:
    """What a client signs: round context, its id, both public keys and its commitment, length-prefixed."""
    fields = [bytes(context), client.encode("utf-8"), bytes(mask_key), bytes(share_key), bytes(commitment)]
    return _ADVERTISE_TAG + b"".join(struct.pack(">I", len(f)) + f for f in fields)


def sign_advertisement(identity: ec.EllipticCurvePrivateKey, message: bytes) -> bytes:
    return identity.sign(message, ec.ECDSA(hashes.SHA384()))


def verify_advertisement(public: ec.EllipticCurvePublicKey, signature: bytes, message: bytes) -> bool:
    try:
        public.verify(bytes(signature), message, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        return False
    return True


def neighbours(client: str, clients: Collection[str], num_shares: int) -> list[str]:
    """The clients ``client`` masks against, itself included: all (``num_shares`` 0 or enough), else
    the ``num_shares`` (odd) around it on the ring in id order. Symmetric."""
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
    """Share i (0-based) carries index i + 1 in its first 4 bytes."""
    check_threshold(threshold, num_shares)
    return create_shares(bytes(secret), threshold, num_shares)


def share_index(share: bytes) -> int:
    if len(share) < 4 + 16 or (len(share) - 4) % 16:
        raise ValueError(f"a share is 4 + 16k bytes, got {len(share)}")
    return int.from_bytes(share[:4], "little")


def combine_secret(shares: Sequence[bytes]) -> bytes:
    """Too few or corrupt shares rebuild garbage: the caller checks it against a key or commitment."""
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
    """``src``'s shares for ``dst``, Fernet under their ECDH key; the plaintext names round, sender
    and receiver, so a ciphertext replayed to another client or round is refused."""
    plain = json.dumps(
        {"context": context.hex(), "src": src, "dst": dst, "seed": seed_share.hex(), "key": key_share.hex()},
        sort_keys=True,
    ).encode()
    return encrypt(_fernet_key(secrets, peer_share_public), plain)


def open_shares(
    secrets: RoundSecrets, peer_share_public: bytes, ciphertext: bytes, context: bytes, src: str, dst: str
) -> tuple[bytes, bytes]:
    """``(seed share, key share)`` that ``src`` sealed for ``dst``."""
    try:
        fields = json.loads(decrypt(_fernet_key(secrets, peer_share_public), bytes(ciphertext)))
    except (InvalidToken, ValueError, TypeError):
        raise ValueError(f"the shares from {src} do not decrypt: not sealed for {dst} in this round") from None
    if fields.get("context") != context.hex() or fields.get("src") != src or fields.get("dst") != dst:
        raise ValueError(f"the shares from {src} name another round, sender or receiver")
    return bytes.fromhex(fields["seed"]), bytes.fromhex(fields["key"])


def mask_seed(mask_key: bytes, peer_public: bytes, context: bytes) -> bytes:
    """The pair's 32-byte seed; both ends derive the same."""
    if len(peer_public) != KEY_BYTES:
        raise ValueError(f"an X25519 public key is {KEY_BYTES} raw bytes, got {len(peer_public)}")
    private = X25519PrivateKey.from_private_bytes(bytes(mask_key))
    # exchange() raises ValueError on a low-order peer key (all-zero shared secret).
    shared = private.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=_SEED_SALT, info=bytes(context)).derive(shared)


def prg(seed: bytes, count: int) -> np.ndarray:
    """``count`` uint32 of the ChaCha20 keystream of ``seed`` (zero nonce: each seed makes one stream)."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a PRG seed is {SEED_BYTES} bytes, got {len(seed)}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    encryptor = Cipher(algorithms.ChaCha20(bytes(seed), bytes(16)), mode=None).encryptor()
    keystream = encryptor.update(bytes(4 * count))
    return np.frombuffer(keystream, dtype="<u4").astype(np.uint32)


def _layout(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(np.shape(arrays[name])) for name in sorted(arrays)}


def _split(flat: np.ndarray, layout: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    names = sorted(layout)
    ends = np.cumsum([math.prod(layout[name]) for name in names], dtype=np.int64)[:-1]
    return {name: part.reshape(layout[name]) for name, part in zip(names, np.split(flat, ends), strict=False)}


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
    """``update`` quantized, plus its self-mask and one pair mask per peer of ``peers`` (``{client:
    X25519 public key}`` of the neighbours that sent shares), as uint32 arrays of the same shapes."""
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
    """The float32 sum of the survivors' (clipped) updates, from their ``masked`` vectors, rebuilt
    ``self_seeds`` and the rebuilt X25519 keys of the ``dropped``; error per value below
    ``n * 2 * clipping_range / target_range`` for n survivors (stochastic rounding)."""
    survivors = sorted(masked)
    if len(survivors) < 2:
        raise ValueError(f"secure aggregation needs at least 2 survivors, got {len(survivors)}")
    if sorted(self_seeds) != survivors:
        raise ValueError(f"self-mask seeds for {sorted(self_seeds)}, survivors are {survivors}")
    params.check_clients(len(survivors))
    layout = _layout(masked[survivors[0]])
    for client in survivors:
        who, arrays = f"masked update of {client}", masked[client]
        if sorted(arrays) != sorted(layout):
            raise ValueError(f"{who}: array names {sorted(arrays)} differ from {sorted(layout)}")
        for name, shape in layout.items():
            array = arrays[name]
            if not isinstance(array, np.ndarray) or array.dtype != np.uint32:
                raise ValueError(f"{who}: array {name!r} must be np.uint32, got {getattr(array, 'dtype', type(array))}")
            if array.shape != shape:
                raise ValueError(f"{who}: array {name!r} has shape {array.shape}, expected {shape}")

    total = np.zeros(sum(math.prod(shape) for shape in layout.values()), dtype=np.uint32)
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
