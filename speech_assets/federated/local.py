"""One client's local round and held-out evaluation, with the centralised trainer's own parts.

The model is :class:`~speech_assets.model.HubertPretrainModel` with a single head (this client's
codebook of ``K`` clusters); masking (:func:`~speech_assets.model.span_mask` with the trainer's
:func:`~speech_assets.train.trainer.mask_generator`), the loss
(:func:`~speech_assets.model.masked_prediction_loss`), the optimizer
(:func:`~speech_assets.train.trainer.build_optimizer`), batching
(:class:`~speech_assets.train.data.DurationBucketSampler` through the trainer's ``BatchStream``)
and autocast precision are the centralised trainer's. Inputs are log-mel ``(B, T, 80)`` at 100 Hz
normalised with the client's own CMVN; the encoder gives ``(B, (T + 1) // 2, D)`` at 50 Hz and the
head ``(B, L, K)`` logits against the client's 50 Hz labels.

What travels: only :func:`encoder_state` (every parameter except ``heads.*``). The head stays here,
saved after every local round as ``<client dir>/heads/round_NNNNN.pt`` (FedPer-style). A round
``r`` starts from the newest head saved *before* ``r``, so a round that is re-run (after a crash
or a kill) starts from exactly the same head and data position, whatever the first attempt left.

Everything is a pure function of (seed, client id, round): batch order, masks, dropout and a new
head's initialisation, so a resumed run repeats an uninterrupted one bit for bit on the same
hardware and thread count.

Several GPUs per client: a local round is a fixed number of steps from given weights, so it can
run as a ``torchrun`` DDP job (write the global encoder and head, train, read back) exactly as
``pretrained_checkpoint`` runs; not implemented here (the development machines have no GPU): one
process per client trains on ``cuda`` or the CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from speech_assets.federated.client_data import ClientData
from speech_assets.federated.config import LocalConfig, NodeConfig
from speech_assets.model.hubert import HubertPretrainModel, output_lengths
from speech_assets.model.loss import IGNORE_INDEX, masked_prediction_loss, summarize
from speech_assets.model.masking import span_mask
from speech_assets.model.presets import get_preset
from speech_assets.train.checkpoint import load_checkpoint, save_checkpoint
from speech_assets.train.config import ClientTargets, TrainConfig
from speech_assets.train.data import UtteranceDataset, build_index, collate, eval_batches, heldout_split
from speech_assets.train.trainer import (
    AUTOCAST_DTYPES,
    BatchStream,
    build_optimizer,
    majority_labels,
    mask_generator,
    seed_everything,
)

log = logging.getLogger("speech_assets.federated")

HEAD_PREFIX = "heads."
HEAD_FORMAT = 1
KEEP_HEADS = 3
_HEAD_FILE = re.compile(r"^round_(\d{5})\.pt$")
# Test hook: "<client>:<round>:<action>[:<marker dir>]" makes that client's local round fail:
# "raise" raises, "hold" writes <marker dir>/<client>-<round>.started and waits (for a test to
# kill its SuperNode), "exit" ends the ClientApp process abruptly.
FAULT_ENV = "SPEECH_ASSETS_FEDERATED_FAULT"


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from ``seed`` and ``parts`` (sha256; independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def encoder_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The shared encoder's weights: every entry of ``model.state_dict()`` but ``heads.*``
    (conv subsampler, mask embedding ``(D,)``, positional conv, Transformer layers, final norm)."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if not k.startswith(HEAD_PREFIX)}


def initial_encoder(preset: str, seed: int) -> dict[str, torch.Tensor]:
    """The round-0 global encoder: a fresh model's encoder, seeded by ``seed`` alone."""
    seed_everything(seed)
    return encoder_state(HubertPretrainModel(get_preset(preset), {"init": 2}))


def resolve_device(device: str) -> torch.device:
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto``: fp32 on CPU, bf16 on GPUs that support it, else fp16 (as the trainer's autoconfig)."""
    if precision != "auto":
        return "fp32" if device.type == "cpu" and precision == "fp16" else precision
    if device.type == "cpu":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


class HeadStore:
    """A client's prediction head between rounds: ``<dir>/heads/round_NNNNN.pt``, atomic writes,
    ``torch.load(weights_only=True)``-safe (tensors and plain values only)."""

    def __init__(self, client_dir: Path, client_id: str) -> None:
        self.folder = client_dir / "heads"
        self.client_id = client_id

    def rounds(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _HEAD_FILE.match(p.name)))

    def path(self, round_number: int) -> Path:
        return self.folder / f"round_{round_number:05d}.pt"

    def load_latest(self, up_to: int, k: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest head saved at a round ``<= up_to``: ``(round, {"weight": (K, D), "bias": (K,)})``."""
        found = [r for r in self.rounds() if r <= up_to]
        if not found:
            return None
        state = load_checkpoint(self.path(found[-1]))
        if state["client_id"] != self.client_id or int(state["k"]) != k:
            raise ValueError(f"{self.path(found[-1])} belongs to another client or codebook (K={state['k']}, now {k})")
        return found[-1], dict(state["head"])

    def save(self, round_number: int, head: Mapping[str, torch.Tensor], k: int) -> Path:
        path = save_checkpoint(
            self.path(round_number),
            {"format": HEAD_FORMAT, "client_id": self.client_id, "round": round_number, "k": k,
             "head": {name: t.detach().cpu().clone() for name, t in head.items()}},
        )  # fmt: skip
        for old in self.rounds()[:-KEEP_HEADS]:
            self.path(old).unlink(missing_ok=True)
        return path


@dataclass
class TrainResult:
    """A local round: the encoder to send back, and what the server may know about the round."""

    encoder: dict[str, torch.Tensor]
    num_examples: int  # training utterances of this client (the FedAvg weight)
    train_loss: float  # mean masked-prediction loss over the round's masked frames
    masked_accuracy: float
    seconds: float  # wall time of the local round (data, forward, backward, steps)
    audio_seconds: float
    steps: int


@dataclass
class EvalResult:
    """Held-out masked prediction with the global encoder and this client's own head."""

    utterances: int
    masked_frames: int
    masked_accuracy: float
    majority_accuracy: float  # always predicting the client's most frequent training label
    loss: float


class LocalClient:
    """One client's data, model factory, local round and evaluation (see the module docstring)."""

    def __init__(self, data: ClientData, local: LocalConfig, node: NodeConfig) -> None:
        self.data, self.local, self.node = data, local, node
        self.client_dir = node.client_dir(local.run_name)
        self.client_dir.mkdir(parents=True, exist_ok=True)
        self.heads = HeadStore(self.client_dir, data.client_id)
        self.device = resolve_device(node.device)
        self.precision = resolve_precision(local.precision, self.device)
        if node.threads > 0:
            torch.set_num_threads(node.threads)
        cmvn_path = data.write_cmvn(self.client_dir / "cmvn.npz")
        self.train_config = TrainConfig(
            run_dir=str(self.client_dir),
            shards=[str(p) for p in data.shards],
            cmvn=str(cmvn_path),
            clients={data.client_id: ClientTargets(labels=str(data.labels), k=data.k)},
            preset=local.preset,
            max_steps=local.local_steps,
            batch_seconds=local.batch_seconds,
            grad_accum=1,
            lr=local.lr,
            weight_decay=local.weight_decay,
            clip_norm=local.clip_norm,
            seed=local.seed,
            heldout_fraction=local.heldout_fraction,
            precision=self.precision,
            device=self.device.type,
            unmasked_weight=local.unmasked_weight,
            mask_prob=local.mask_prob,
            mask_length=local.mask_length,
            max_frames=local.max_frames,
            num_workers=0,
        )
        index = build_index(self.train_config.shards, {data.client_id: str(data.labels)}, local.max_frames)
        train_refs, heldout_refs = heldout_split(index.utterances, local.heldout_fraction)
        if not train_refs:
            raise ValueError(f"client {data.client_id} has no labelled training utterances")
        self.num_examples = len(train_refs)
        self.majority_label = majority_labels(index, train_refs)[0]
        client_cmvn = data.cmvn()
        self.train_set = UtteranceDataset(index, train_refs, client_cmvn, local.max_frames)
        self.heldout_set = UtteranceDataset(index, heldout_refs, client_cmvn, local.max_frames)

    # ------------------------------------------------------------------------------ model
    def model(self, encoder: Mapping[str, torch.Tensor], head_up_to: int) -> tuple[HubertPretrainModel, int | None]:
        """This client's model: the given encoder and its newest head saved at a round
        ``<= head_up_to`` (or a new head seeded by the client id). Returns the head's round."""
        seed_everything(derive_seed(self.local.seed, "head", self.data.client_id))
        model = HubertPretrainModel(get_preset(self.local.preset), {self.data.client_id: self.data.k})
        missing, unexpected = model.load_state_dict(dict(encoder), strict=False)
        if unexpected or any(not name.startswith(HEAD_PREFIX) for name in missing):
            raise ValueError(f"the global encoder does not fit preset {self.local.preset}: {missing=} {unexpected=}")
        saved = self.heads.load_latest(head_up_to, self.data.k)
        if saved is not None:
            model.heads[0].load_state_dict(saved[1])
        return model.to(self.device), saved[0] if saved else None

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = AUTOCAST_DTYPES.get(self.precision)
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def _stream(self, round_number: int) -> BatchStream:
        """The batches of round ``round_number``: the client's endless epoch stream from batch
        ``(round - 1) * local_steps`` (a pure function of seed, client and round)."""
        from speech_assets.train.data import DurationBucketSampler

        sampler = DurationBucketSampler(
            self.train_set.seconds,
            self.local.batch_seconds,
            seed=derive_seed(self.local.seed, "batches", self.data.client_id),
        )
        skip, epoch = (round_number - 1) * self.local.local_steps, 0
        while skip >= (count := len(sampler.batches(epoch))):
            skip, epoch = skip - count, epoch + 1
        return BatchStream(self.train_set, sampler, epoch, skip, self.train_config, pin_memory=False)

    # ------------------------------------------------------------------------ local round
    def train_round(self, round_number: int, encoder: Mapping[str, torch.Tensor]) -> TrainResult:
        """``local_steps`` steps from the global ``encoder`` and the newest head saved before
        ``round_number``; saves the new head and returns the new encoder."""
        _maybe_fault(self.data.client_id, round_number)
        started = time.perf_counter()
        model, head_round = self.model(encoder, round_number - 1)
        model.train()
        optimizer = build_optimizer(model, self.train_config)
        scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        stream = self._stream(round_number)
        seed_everything(derive_seed(self.local.seed, "dropout", self.data.client_id, round_number))
        stats = torch.zeros(6, dtype=torch.float64, device=self.device)
        audio = 0.0
        clip = self.local.clip_norm if self.local.clip_norm > 0 else float("inf")
        for step in range(self.local.local_steps):
            batch = next(stream)
            generator = mask_generator(self.local.seed, "federated", self.data.client_id, round_number, step)
            mask = span_mask(output_lengths(batch.lengths), self.local.mask_prob, self.local.mask_length, generator)
            batch, mask = batch.to(self.device), mask.to(self.device)
            optimizer.zero_grad(set_to_none=True)
            with self._autocast():
                output = model(batch.feats, batch.lengths, batch.clients, mask)
                loss = masked_prediction_loss(output.logits, batch.targets, mask, self.local.unmasked_weight)
            scaler.scale(loss.loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
            stats += loss.stats
            audio += batch.seconds
        summary = summarize(stats.cpu())
        self.heads.save(round_number, model.heads[0].state_dict(), self.data.k)
        log.info(
            "%s round %d: %d steps from head of round %s, loss %.4f, masked accuracy %.3f",
            self.data.client_id, round_number, self.local.local_steps, head_round,
            summary["masked_loss"], summary["masked_accuracy"],
        )  # fmt: skip
        return TrainResult(
            encoder=encoder_state(model),
            num_examples=self.num_examples,
            train_loss=summary["masked_loss"] + self.local.unmasked_weight * summary["unmasked_loss"],
            masked_accuracy=summary["masked_accuracy"],
            seconds=time.perf_counter() - started,
            audio_seconds=audio,
            steps=self.local.local_steps,
        )

    # ------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, round_number: int, encoder: Mapping[str, torch.Tensor]) -> EvalResult:
        """Masked prediction on this client's held-out utterances (fixed masks) with the global
        ``encoder`` and this client's newest head saved at a round ``<= round_number``."""
        model, _ = self.model(encoder, round_number)
        model.eval()
        batches = eval_batches(self.heldout_set.seconds, self.local.batch_seconds, 1, 0)
        loader = DataLoader(self.heldout_set, batch_sampler=batches, collate_fn=collate, num_workers=0)
        totals = torch.zeros(6, dtype=torch.float64)
        majority_hits = 0
        for index, batch in enumerate(loader):
            generator = mask_generator(self.local.seed, "heldout", index)
            mask = span_mask(output_lengths(batch.lengths), self.local.mask_prob, self.local.mask_length, generator)
            targets = batch.targets
            batch, device_mask = batch.to(self.device), mask.to(self.device)
            with self._autocast():
                output = model(batch.feats, batch.lengths, batch.clients, device_mask)
                totals += masked_prediction_loss(output.logits, batch.targets, device_mask).stats.cpu()
            majority_hits += int(((targets == self.majority_label) & mask & (targets != IGNORE_INDEX)).sum())
        summary = summarize(totals)
        frames = int(summary["masked_frames"])
        return EvalResult(
            utterances=len(self.heldout_set),
            masked_frames=frames,
            masked_accuracy=summary["masked_accuracy"] if frames else 0.0,
            majority_accuracy=majority_hits / frames if frames else 0.0,
            loss=summary["masked_loss"] + self.local.unmasked_weight * summary["unmasked_loss"],
        )


def _maybe_fault(client_id: str, round_number: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    for item in filter(None, spec.split(",")):
        client, fault_round, action, *rest = item.split(":", 3)
        if client != client_id or int(fault_round) != round_number:
            continue
        log.error("fault injection: %s %s in round %d", client_id, action, round_number)
        if action == "raise":
            raise RuntimeError(f"injected fault: {client_id} fails in round {round_number}")
        if action == "exit":
            os._exit(3)
        if action == "hold":
            marker = Path(rest[0]) / f"{client_id}-{round_number}.started"
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(str(os.getpid()))
            time.sleep(3600)
