"""Secure aggregation of encoder updates by pairwise masking (Bonawitz et al. 2017, the
pairwise-mask part, without self-masks or secret sharing).

Each round, every sampled client holds an update (its encoder minus the global one), a
``dict[str, np.ndarray]`` of float arrays. The server must learn only the SUM of the updates that
arrive, never one of them:

1. key-up: each client sends its X25519 public key (``ClientKeys.public_bytes()``, 32 raw bytes,
   derived from its secret and the run name); the server sends every sampled client the map
   ``client id -> public key`` of all of them and a fresh nonce.
2. masking: each client quantizes its update to integers in ``[0, T]`` (Flower's ``quantize``,
   values clipped to ``±clipping_range``) and adds, mod 2^32, one pseudo-random mask per peer, with
   opposite signs on the two ends of a pair (``mask_update``); it sends the ``np.uint32`` result.
3. unmasking: clients whose masked vector did not arrive are dropped; each survivor reveals the
   net mask it shared with the dropped ones only (``dropped_masks``); the server sums the survivors'
   masked vectors, subtracts the reveals, and the pair masks cancel (``unmask_sum``).

Pair masks come from an X25519 exchange, HKDF-SHA256 over a context that binds run, round and the
server's nonce (``round_context``), and a ChaCha20 keystream as the PRG (``prg``): a 256-bit seed,
so the server cannot search the seed space (Flower's ``pseudo_rand_gen`` folds seeds to 32 bits).

Threat model: the server follows the protocol but is curious (honest-but-curious), and does not
collude with clients. Without Bonawitz's self-masks, a server that LIES about drop-outs can unmask
a client: if it holds client k's masked vector and still announces k as dropped, the survivors'
reveals remove k's masks. The server-side caller must therefore decide the dropped set before
asking for reveals and discard any masked vector that arrives after that decision. A masked vector
reused under the same context also leaks differences of updates, hence a fresh nonce for every
masking request (also when a round is retried).

Arrays are flattened into one vector in sorted-name order; ``layout`` below means that order plus
each array's shape. Client ids are compared as Python strings on both sides of a pair.
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.common.secure_aggregation.quantization import dequantize, quantize

MODULUS = 2**32
SECRET_BYTES = 32
KEY_BYTES = 32
SEED_BYTES = 32
MIN_NONCE_BYTES = 16
DEFAULT_TARGET_RANGE = 2**22  # up to 1023 clients per sum

# Domain separation: the same secret must never yield the same bytes for two purposes.
_KEY_SALT = b"speech_assets.secagg.x25519-key.v1"
_SEED_SALT = b"speech_assets.secagg.pair-seed.v1"
_CONTEXT_TAG = b"speech_assets.secagg.round.v1"


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
                f"use target_range < {MODULUS // n} or fewer clients")


@dataclass(frozen=True)
class ClientKeys:
    """A client's X25519 key pair for one run."""

    private: X25519PrivateKey = field(repr=False)

    @classmethod
    def derive(cls, secret: bytes, context: str) -> ClientKeys:
        """The key pair of ``secret`` (32 bytes) for ``context`` (e.g. the run name): the same
        inputs always give the same pair, so a restarted client keeps its public key."""
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a client secret is {SECRET_BYTES} bytes, got {len(secret)}")
        if not context:
            raise ValueError("a key context (e.g. the run name) is required")
        private = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=_KEY_SALT,
                       info=context.encode("utf-8")).derive(bytes(secret))
        return cls(X25519PrivateKey.from_private_bytes(private))

    def public_bytes(self) -> bytes:
        """The public key, 32 raw bytes."""
        return self.private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def new_secret() -> bytes:
    """A fresh 32-byte client secret."""
    return os.urandom(SECRET_BYTES)


def load_or_create_secret(path: Path) -> bytes:
    """The 32-byte secret in ``path``, created (owner-only, 0600) on first use.

    The file appears complete or not at all: the secret is written and fsynced in a temp file in
    the same folder, then hard-linked to ``path``. Linking (rather than ``os.replace``) never
    overwrites: when two processes create the secret at once, both return the one that won.
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mode 0600
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(new_secret())
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            else:
                _fsync_dir(path.parent)
        finally:
            os.unlink(tmp)
    secret = path.read_bytes()
    if len(secret) != SECRET_BYTES:
        raise ValueError(
            f"{path}: a secure-aggregation secret is {SECRET_BYTES} bytes, this file has {len(secret)}; "
            "it is damaged or not a secret file (removing it gives the client a new key pair)")
    return secret


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def round_context(run: str, round_number: int, nonce: bytes) -> bytes:
    """The context bytes that bind pair masks to one masking request: run name, round number and
    the server's nonce (at least 16 bytes, fresh for every request). Fields are length-prefixed,
    so distinct inputs never give the same bytes."""
    if not run:
        raise ValueError("a run name is required")
    if isinstance(round_number, bool) or not isinstance(round_number, int) or round_number < 0:
        raise ValueError(f"round_number must be an int >= 0, got {round_number!r}")
    if len(nonce) < MIN_NONCE_BYTES:
        raise ValueError(f"the server nonce must be at least {MIN_NONCE_BYTES} bytes, got {len(nonce)}")
    run_bytes = run.encode("utf-8")
    return b"".join([
        _CONTEXT_TAG, struct.pack(">I", len(run_bytes)), run_bytes,
        struct.pack(">Q", round_number), struct.pack(">I", len(nonce)), bytes(nonce),
    ])


def mask_seed(keys: ClientKeys, peer_public: bytes, context: bytes) -> bytes:
    """The 32-byte seed of the pair (this client, the peer with ``peer_public``) under
    ``context``; both ends of the pair derive the same seed."""
    if len(peer_public) != KEY_BYTES:
        raise ValueError(f"an X25519 public key is {KEY_BYTES} raw bytes, got {len(peer_public)}")
    # exchange() raises ValueError on a low-order peer key (all-zero shared secret).
    shared = keys.private.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
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


def _add_pair_masks(flat: np.ndarray, me: str, keys: ClientKeys, peers: Mapping[str, bytes],
                    others: Collection[str], context: bytes) -> None:
    # uint32 arithmetic wraps mod 2^32; the lower id adds the pair's mask and the higher subtracts it.
    for peer in sorted(others):
        mask = prg(mask_seed(keys, peers[peer], context), flat.size)
        if me < peer:
            flat += mask
        else:
            flat -= mask


def _check_me(me: str, keys: ClientKeys, peers: Mapping[str, bytes]) -> None:
    if me in peers and bytes(peers[me]) != keys.public_bytes():
        raise ValueError(f"the peer map holds a public key for {me} that is not this client's")


def mask_update(update: Mapping[str, np.ndarray], me: str, keys: ClientKeys, peers: Mapping[str, bytes],
                params: SecAggParams, context: bytes) -> dict[str, np.ndarray]:
    """This client's masked update: the same names and shapes as ``update`` (float arrays of any
    shape, 0-d included), each an ``np.uint32`` array.

    Each value is clipped to ``±params.clipping_range`` and stochastically rounded to an integer in
    ``[0, params.target_range]``; then every pair mask (one per peer in ``peers``, the map of all
    clients sampled this round to their public keys, ``me`` skipped) is added or subtracted mod
    2^32. Refuses non-finite values and a round with no other client (the masked vector would be
    the update itself).
    """
    _check_me(me, keys, peers)
    others = [peer for peer in peers if peer != me]
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
    _add_pair_masks(flat, me, keys, peers, others, context)
    return _split(flat, _layout(update))


def dropped_masks(me: str, keys: ClientKeys, peers: Mapping[str, bytes], dropped: Collection[str],
                  shapes: Mapping[str, tuple[int, ...]], context: bytes) -> dict[str, np.ndarray]:
    """The net mask (``np.uint32`` arrays with the names and ``shapes`` of the masked update) that
    this surviving client added for its pairs with the ``dropped`` clients only: what it reveals so
    that the server can remove masks that will never cancel. ``peers`` and ``context`` are those it
    masked with. Refuses when it would be the only survivor (the reveal would unmask its update)."""
    _check_me(me, keys, peers)
    dropped = set(dropped)
    if me in dropped:
        raise ValueError(f"{me} is in the dropped set: a dropped client reveals nothing")
    unknown = sorted(dropped - set(peers))
    if unknown:
        raise ValueError(f"dropped clients not in this round's peer map: {unknown}")
    if not set(peers) - dropped - {me}:
        raise ValueError(f"{me} would be the only survivor: revealing its masks would unmask its update")
    layout = {name: tuple(shapes[name]) for name in sorted(shapes)}
    net = np.zeros(_size(layout), dtype=np.uint32)
    _add_pair_masks(net, me, keys, peers, dropped, context)
    return _split(net, layout)


def _check_layout(who: str, arrays: Mapping[str, np.ndarray], layout: Mapping[str, tuple[int, ...]]) -> None:
    if sorted(arrays) != sorted(layout):
        raise ValueError(f"{who}: array names {sorted(arrays)} differ from {sorted(layout)}")
    for name, shape in layout.items():
        array = arrays[name]
        if not isinstance(array, np.ndarray) or array.dtype != np.uint32:
            raise ValueError(f"{who}: array {name!r} must be np.uint32, got {getattr(array, 'dtype', type(array))}")
        if array.shape != shape:
            raise ValueError(f"{who}: array {name!r} has shape {array.shape}, expected {shape}")


def unmask_sum(masked: Mapping[str, Mapping[str, np.ndarray]], revealed: Mapping[str, Mapping[str, np.ndarray]],
               params: SecAggParams) -> dict[str, np.ndarray]:
    """The sum of the survivors' updates (each clipped to ``±params.clipping_range``), as float32
    arrays with the masked arrays' names and shapes.

    ``masked`` maps each survivor (at least 2) to its masked update (``np.uint32`` arrays, all with
    the same names and shapes); ``revealed`` maps survivors to their ``dropped_masks`` (empty when
    nobody dropped). The error per value is below ``n * 2 * clipping_range / target_range`` for n
    survivors (stochastic rounding). Raises ValueError on mismatched arrays and when the masks did
    not cancel (a reveal missing or wrong, or clients masked with different peer maps or contexts).
    """
    survivors = sorted(masked)
    if len(survivors) < 2:
        raise ValueError(f"secure aggregation needs at least 2 survivors, got {len(survivors)}")
    params.check_clients(len(survivors))
    layout = _layout(masked[survivors[0]])
    for client in survivors:
        _check_layout(f"masked update of {client}", masked[client], layout)
    strangers = sorted(set(revealed) - set(masked))
    if strangers:
        raise ValueError(f"masks revealed by clients whose masked update is not summed: {strangers}")
    for client in sorted(revealed):
        _check_layout(f"masks revealed by {client}", revealed[client], layout)

    total = np.zeros(_size(layout), dtype=np.uint32)
    for client in survivors:
        total += _flatten_uint32(masked[client])
    for client in sorted(revealed):
        total -= _flatten_uint32(revealed[client])

    n = len(survivors)
    # Every true sum is <= n * T < 2^32; leftover masks are uniform, so over many values some
    # land above n * T (a lone value escapes this check with probability n * T / 2^32).
    if total.size and int(total.max()) > n * params.target_range:
        raise ValueError("the masks did not cancel: a survivor's reveal is missing or wrong, "
                         "or clients masked with different peer maps or contexts")
    c = params.clipping_range
    # dequantize maps q to q * 2c/T - c; a sum of n values carries n offsets of c, not one.
    (summed,) = dequantize([total], c, params.target_range)
    return _split((summed - (n - 1) * c).astype(np.float32), layout)
