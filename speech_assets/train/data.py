"""Training data: an index of (shard, row) per labelled utterance, lazy row-group reads, a
speaker-level held-out split and a distributed sampler that buckets utterances by duration.

Only scalar columns are read up front, so the index of a large corpus stays small; feature
matrices are read one row group at a time through a per-process LRU cache that holds them as
stored (float16: half the memory); each utterance becomes float32 once, at CMVN.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from speech_assets.features.cmvn import Normaliser
from speech_assets.features.shards import (
    FRAME_RATE_HZ,
    N_MELS,
    blob_matrices,
    check_blob_lengths,
    feature_dtype,
    read_shard_table,
)
from speech_assets.model.batches import cut_batches
from speech_assets.model.hubert import output_lengths
from speech_assets.model.loss import IGNORE_INDEX
from speech_assets.model.masking import span_mask
from speech_assets.targets.labels import read_labels
from speech_assets.train.augment import Augmenter
from speech_assets.train.config import RunConfig


@dataclass(frozen=True)
class UtteranceRef:
    """Where an utterance lives; ``num_frames``: the 100 Hz length the model sees (after cropping)."""

    utt_id: str
    shard: int
    row_group: int
    row: int
    num_frames: int
    client: int
    speaker_id: str

    @property
    def seconds(self) -> float:
        return self.num_frames / FRAME_RATE_HZ


@dataclass
class CorpusIndex:
    """Labelled utterances of all shards (shard/row order) and each client's labels."""

    shards: list[str]
    clients: list[str]
    utterances: list[UtteranceRef]
    labels: list[dict[str, np.ndarray]]
    unlabelled: int


def build_index(shards: Sequence[str], client_labels: Mapping[str, str], max_frames: int) -> CorpusIndex:
    """Index every utterance of ``shards`` labelled in exactly one client's labels file (client id ->
    path); unlabelled ones are counted, one labelled twice or in two shards is an error."""
    clients = sorted(client_labels)
    labels = [read_labels(client_labels[name]) for name in clients]
    owner: dict[str, int] = {}
    for client, per_utt in enumerate(labels):
        for utt_id in per_utt:
            if utt_id in owner:
                raise ValueError(f"{utt_id} has labels for clients {clients[owner[utt_id]]} and {clients[client]}")
            owner[utt_id] = client
    utterances: list[UtteranceRef] = []
    seen: set[str] = set()
    unlabelled = 0
    for shard, path in enumerate(shards):
        columns = read_shard_table(path, columns=["utt_id", "speaker_id", "num_frames"]).to_pydict()
        row_groups = row_places(path)
        rows = zip(columns["utt_id"], columns["speaker_id"], columns["num_frames"], strict=True)
        for row, (utt_id, speaker, num_frames) in enumerate(rows):
            if utt_id in seen:
                raise ValueError(f"{utt_id} appears in more than one shard (second: {path})")
            seen.add(utt_id)
            if utt_id not in owner:
                unlabelled += 1
                continue
            cropped_frames = min(int(num_frames), max_frames)
            utterances.append(UtteranceRef(utt_id, shard, *row_groups[row], cropped_frames, owner[utt_id], speaker))
    return CorpusIndex(list(shards), clients, utterances, labels, unlabelled)


def row_places(path: str) -> list[tuple[int, int]]:
    """(row group, row within it) of every row of the Parquet file ``path``, in row order."""
    metadata = pq.ParquetFile(path).metadata
    return [(g, r) for g in range(metadata.num_row_groups) for r in range(metadata.row_group(g).num_rows)]


def _unit_hash(text: str) -> float:
    """sha256 of ``text`` in ``[0, 1)`` (independent of PYTHONHASHSEED)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0**64


def heldout_speakers(speaker_clients: Mapping[str, Hashable], fraction: float) -> set[str]:
    """Speakers held out of training: those whose id hashes below ``fraction`` (stable across runs,
    machines and corpus growth), except that a client never loses all its speakers and, with
    ``fraction > 0``, at least one speaker is held out where possible.

    ``speech_assets/stats/database.py`` computes the same split in SQL (``hours_per_split``).
    """
    if fraction <= 0:
        return set()
    by_client: dict[Hashable, list[str]] = {}
    for speaker, client in speaker_clients.items():
        by_client.setdefault(client, []).append(speaker)
    held = {s for s in speaker_clients if _unit_hash(s) < fraction}
    for members in by_client.values():
        if all(s in held for s in members):
            held.discard(max(members, key=lambda s: (_unit_hash(s), s)))
    if not held:
        candidates = [s for members in by_client.values() if len(members) >= 2 for s in members]
        if candidates:
            held.add(min(candidates, key=lambda s: (_unit_hash(s), s)))
    return held


def heldout_split(
    utterances: Sequence[UtteranceRef], fraction: float, heldout: Collection[str] | None = None
) -> tuple[list[UtteranceRef], list[UtteranceRef]]:
    """Split by speaker (held-out figures measure unseen speakers): ``heldout`` when given (the
    pipeline's one split), else :func:`heldout_speakers` at ``fraction``."""
    if heldout is None:
        heldout = heldout_speakers({u.speaker_id: u.client for u in utterances}, fraction)
    held = set(heldout)
    return [u for u in utterances if u.speaker_id not in held], [u for u in utterances if u.speaker_id in held]


def split_corpus(
    config: RunConfig, heldout: Collection[str] | None
) -> tuple[CorpusIndex, list[UtteranceRef], list[UtteranceRef], dict[str, list[str]]]:
    """The index of ``config``'s shards, its training and held-out utterances (:func:`heldout_split`),
    and the speakers a checkpoint records: trained on and held out (the probe checks no encoder trained on them)."""
    index = build_index(config.shards, {n: c.labels for n, c in config.clients.items()}, config.max_frames)
    train, held = heldout_split(index.utterances, config.heldout_fraction, heldout)
    chosen = heldout if heldout is not None else {u.speaker_id for u in held}
    return index, train, held, {"train": sorted({u.speaker_id for u in train}), "heldout": sorted(chosen)}


@dataclass
class Example:
    """One utterance: ``feats (T, 80)`` float32 (CMVN applied), ``labels (L,)`` long, ``L = (T+1)//2``."""

    utt_id: str
    client: int
    feats: torch.Tensor
    labels: torch.Tensor


@dataclass(frozen=True)
class SpanMasking:
    """``(B, L)`` bool span masks for 100 Hz ``lengths (B,)``, seeded by ``(seed, *key, step, rank, micro)``:
    a pure function of where the batch trains, so workers can draw it ahead and a resumed run draws the same."""

    seed: int
    mask_prob: float
    mask_length: int
    rank: int = 0
    key: tuple[int | str, ...] = ()

    def __call__(self, lengths: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        return self.draw(lengths, *self.key, step, self.rank, micro)

    def draw(self, lengths: torch.Tensor, *parts: int | str) -> torch.Tensor:
        return span_mask(output_lengths(lengths), self.mask_prob, self.mask_length, mask_generator(self.seed, *parts))


def mask_generator(seed: int, *parts: int | str) -> torch.Generator:
    """CPU generator seeded from ``seed`` and ``parts``, independent of the global RNG."""
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


@dataclass
class Batch:
    """Padded batch: ``feats (B, T, 80)``, ``lengths (B,)``, ``targets (B, L)`` (``IGNORE_INDEX``
    on padding), ``clients (B,)``; ``seconds``: the unpadded audio duration.

    ``mask``: the span mask drawn for ``masked_for`` = ``(masking, step, micro)``. ``padded``: a
    host bool, so the model knows without a device read whether its attention needs a mask.
    """

    feats: torch.Tensor
    lengths: torch.Tensor
    targets: torch.Tensor
    clients: torch.Tensor
    seconds: float
    mask: torch.Tensor | None = None
    masked_for: tuple[SpanMasking, int, int] | None = None
    padded: bool | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        fields = {"feats": self.feats, "lengths": self.lengths, "targets": self.targets, "clients": self.clients}
        return fields if self.mask is None else fields | {"mask": self.mask}

    def replace_tensors(self, apply: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        return replace(self, **{name: apply(tensor) for name, tensor in self.tensors().items()})

    def pin_memory(self) -> Batch:
        """What ``DataLoader(pin_memory=True)`` calls."""
        return self.replace_tensors(torch.Tensor.pin_memory)

    def to(self, device: torch.device) -> Batch:
        return self.replace_tensors(lambda tensor: tensor.to(device, non_blocking=device.type == "cuda"))


def collate(
    examples: Sequence[Example], masking: SpanMasking | None = None, slot: tuple[int, int] | None = None
) -> Batch:
    """Pad ``examples`` into a :class:`Batch`, rows grouped by client (stable), with its span mask
    when ``masking`` and ``slot = (step, micro)`` are given."""
    examples = sorted(examples, key=lambda example: example.client)  # stable
    frames = [e.feats.shape[0] for e in examples]
    lengths = torch.tensor(frames, dtype=torch.long)
    max_frames = max(frames)
    feats = torch.nn.utils.rnn.pad_sequence([e.feats for e in examples], batch_first=True)
    targets = torch.full((len(examples), (max_frames + 1) // 2), IGNORE_INDEX, dtype=torch.long)
    for row, example in enumerate(examples):
        targets[row, : example.labels.shape[0]] = example.labels
    batch = Batch(
        feats,
        lengths,
        targets,
        torch.tensor([e.client for e in examples], dtype=torch.long),
        sum(frames) / FRAME_RATE_HZ,
        # padding at 50 Hz, known here on the host: without it the model's attention takes no mask
        padded=any((n + 1) // 2 < (max_frames + 1) // 2 for n in frames),
    )
    if masking is not None and slot is not None:
        batch.mask, batch.masked_for = masking(lengths, *slot), (masking, *slot)
    return batch


@dataclass(frozen=True)
class BatchRequest:
    """One batch for the loader to build; ``slot``: the (step, micro) it trains at, when known."""

    indices: tuple[int, ...]
    epoch: int
    position: int
    slot: tuple[int, int] | None = None
    masking: SpanMasking | None = None


class BatchBuilder(Dataset[Batch]):
    """Whole batches of ``dataset`` by :class:`BatchRequest`: what the loader's workers run."""

    def __init__(self, dataset: UtteranceDataset) -> None:
        self.dataset = dataset

    def __getitem__(self, request: BatchRequest) -> Batch:  # type: ignore[override]
        self.dataset.set_epoch(request.epoch)  # a worker's own copy: the epoch travels with the request
        examples = [self.dataset[i] for i in request.indices]
        if self.dataset.crop_batches:
            examples = crop_to_shortest(examples, self.dataset.seed, request.epoch)
        return collate(examples, request.masking, request.slot)


def crop_to_shortest(examples: Sequence[Example], seed: int, epoch: int) -> list[Example]:
    """Every example cut to the shortest one's length at its own :func:`crop_start` (fairseq's
    pretraining crop): the batch has no padding, so attention runs without a key mask."""
    frames = min(e.feats.shape[0] for e in examples)
    cropped = []
    for e in examples:
        start = crop_start(f"batch:{e.utt_id}", e.feats.shape[0], frames, seed, epoch)
        labels = e.labels[start // 2 : start // 2 + (frames + 1) // 2]
        cropped.append(replace(e, feats=e.feats[start : start + frames], labels=labels))
    return cropped


def align_labels(labels: np.ndarray, num_frames: int, utt_id: str) -> np.ndarray:
    """Fit 50 Hz ``labels`` to ``(num_frames + 1) // 2``: a 1-frame difference is cropped or
    padded with :data:`IGNORE_INDEX`; a larger one means features and targets disagree."""
    expected = (num_frames + 1) // 2
    if abs(labels.shape[0] - expected) > 1:
        raise ValueError(f"{utt_id}: {labels.shape[0]} labels for {num_frames} frames (expected {expected})")
    aligned = np.full(expected, IGNORE_INDEX, dtype=np.int64)
    keep = min(expected, labels.shape[0])
    aligned[:keep] = labels[:keep]
    return aligned


def crop_start(utt_id: str, num_frames: int, max_frames: int, seed: int = 0, epoch: int = 0) -> int:
    """Start frame of the ``max_frames`` window kept from a long utterance in ``epoch``: a pure
    function of ``(seed, epoch, utt_id)``, even so that 50 Hz labels stay aligned."""
    if num_frames <= max_frames:
        return 0
    return 2 * int(_unit_hash(f"crop:{seed}:{epoch}:{utt_id}") * ((num_frames - max_frames) // 2 + 1))


class UtteranceDataset(Dataset[Example]):
    """Map-style dataset over ``utterances`` of ``index``, read lazily by row group; long utterances
    are cropped at :func:`crop_start` of the epoch set by :meth:`set_epoch`. ``crop_batches``: the
    loader's batches are cut to their shortest utterance (:func:`crop_to_shortest`)."""

    def __init__(
        self,
        index: CorpusIndex,
        utterances: Sequence[UtteranceRef],
        cmvn: Normaliser,
        max_frames: int,
        cached_row_groups: int = 8,
        seed: int = 0,
        augment: Augmenter | None = None,
        crop_batches: bool = False,
    ) -> None:
        self.index, self.utterances, self.cmvn, self.max_frames = index, list(utterances), cmvn, max_frames
        self.cached_row_groups, self.seed, self.crop_batches = cached_row_groups, seed, crop_batches
        self.epoch = 0
        self.augment = augment if augment is not None and augment.options.enabled else None
        self._by_client: dict[int, list[int]] | None = None
        self._cache: OrderedDict[tuple[int, int], list[np.ndarray]] = OrderedDict()
        # read amplification = bytes_decompressed / bytes_delivered (stored log-mel bytes, per process)
        self.bytes_decompressed = 0
        self.bytes_delivered = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.utterances)

    @property
    def seconds(self) -> list[float]:
        return [u.seconds for u in self.utterances]

    def __getitem__(self, item: int) -> Example:
        ref = self.utterances[item]
        logmel = self.logmel(ref)  # as stored: a float16 view of the cached block for format-2 shards
        labels = align_labels(self.index.labels[ref.client][ref.utt_id], logmel.shape[0], ref.utt_id)
        start = crop_start(ref.utt_id, logmel.shape[0], self.max_frames, self.seed, self.epoch)
        logmel = logmel[start : start + self.max_frames]
        self.bytes_delivered += logmel.nbytes
        if self.augment is not None:  # noise on the raw log-mel, SpecAugment after CMVN: same frames
            logmel = self.augment.noise(
                logmel.astype(np.float32), ref.utt_id, self.epoch, lambda _, rng, count: self._babble(item, rng, count)
            )
        feats = self.cmvn.apply(logmel, "logmel")  # float32 (the one conversion)
        labels = labels[start // 2 : start // 2 + (feats.shape[0] + 1) // 2]
        tensor = torch.from_numpy(feats)
        if self.augment is not None:
            tensor = self.augment.specaugment(tensor, ref.utt_id, self.epoch)
        return Example(ref.utt_id, ref.client, tensor, torch.from_numpy(labels))

    def _babble(self, item: int, rng: np.random.Generator, count: int) -> list[np.ndarray]:
        """Raw log-mel of up to ``count`` other utterances of item's client in this dataset."""
        if self._by_client is None:
            self._by_client = {}
            for i, ref in enumerate(self.utterances):
                self._by_client.setdefault(ref.client, []).append(i)
        others = [i for i in self._by_client[self.utterances[item].client] if i != item]
        chosen = rng.choice(len(others), size=min(count, len(others)), replace=False) if others else []
        return [self.logmel(self.utterances[others[int(i)]]) for i in chosen]

    def logmel(self, ref: UtteranceRef) -> np.ndarray:
        """``ref``'s raw log-mel ``(T, 80)`` as stored: a read-only view into the cached row group."""
        return self._row_group(ref.shard, ref.row_group)[ref.row]

    def _row_group(self, shard: int, group: int) -> list[np.ndarray]:
        key = (shard, group)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        path = self.index.shards[shard]
        parquet = pq.ParquetFile(path)
        dtype = feature_dtype(parquet)
        table = parquet.read_row_group(group, columns=["num_frames", "logmel"])
        column = table.column("logmel").combine_chunks()
        check_blob_lengths(column, table.column("num_frames").to_numpy(), N_MELS, dtype, f"{path} row group {group}")
        self.bytes_decompressed += column.nbytes
        matrices = blob_matrices(column, N_MELS, dtype)
        self._cache[key] = matrices
        while len(self._cache) > self.cached_row_groups:
            self._cache.popitem(last=False)
        return matrices

    def __getstate__(self) -> dict[str, object]:
        # DataLoader workers start with an empty cache instead of pickling Arrow buffers.
        return {**self.__dict__, "_cache": OrderedDict(), "bytes_decompressed": 0, "bytes_delivered": 0}


class RankSampler:
    """One rank's batches (dataset indices) of each epoch, a pure function of (seed, epoch, rank)."""

    num_workers = 0  # DataLoader workers the batch order is laid out for

    def __init__(
        self, seconds: Sequence[float], batch_seconds: float, *, num_replicas: int = 1, rank: int = 0, seed: int = 0
    ) -> None:
        if not len(seconds):
            raise ValueError("no utterances to sample from")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.seconds = np.asarray(seconds, dtype=np.float64)
        self.batch_seconds = float(batch_seconds)
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed

    def batches(self, epoch: int) -> list[list[int]]:
        raise NotImplementedError


class DurationBucketSampler(RankSampler):
    """Per epoch: shuffle, cut pools of about ``pool_batches`` batches by duration, shuffle the batches and
    deal them round-robin, the same number to every rank (lock-step). No per-worker lanes: its users
    read small per-client data in the main process."""

    def __init__(
        self, seconds: Sequence[float], batch_seconds: float, *, pool_batches: int = 100, **ranks: int
    ) -> None:
        super().__init__(seconds, batch_seconds, **ranks)
        per_batch = max(1, int(self.batch_seconds / max(float(self.seconds.mean()), 1e-6)))
        self.pool_size = pool_batches * per_batch

    def batches(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.seconds))
        pooled: list[list[int]] = []
        for start in range(0, len(order), self.pool_size):
            pooled += cut_batches(order[start : start + self.pool_size], self.seconds, self.batch_seconds)
        batches = [pooled[i] for i in rng.permutation(len(pooled))]
        if len(batches) < self.num_replicas:
            batches = [batches[i % len(batches)] for i in range(self.num_replicas)]
        usable = len(batches) - len(batches) % self.num_replicas
        return batches[self.rank : usable : self.num_replicas]


def eval_batches(seconds: Sequence[float], batch_seconds: float, num_replicas: int, rank: int) -> list[list[int]]:
    """Every utterance exactly once, duration-sorted batches dealt round-robin (counts may differ by one)."""
    durations = np.asarray(seconds, dtype=np.float64)
    return cut_batches(np.arange(len(durations)), durations, batch_seconds)[rank::num_replicas]
