"""One client's local round and held-out evaluation on the centralised trainer's engine, with one
head (its codebook) that stays here (FedPer-style); only :func:`encoder_state` travels. Round ``r``
starts from the newest head saved before ``r``; batches, masks, dropout and a new head are pure
functions of (seed, client, round), so a re-run round repeats the first bit for bit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from speech_assets.features.cmvn import UtteranceCmvn
from speech_assets.federated.client_data import ClientData
from speech_assets.federated.config import LocalConfig, NodeConfig, derive_seed
from speech_assets.layout import ClientRunFiles
from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.model.presets import get_preset
from speech_assets.runtime.faults import inject
from speech_assets.train.autoconfig import resolve_precision
from speech_assets.train.checkpoint import load_checkpoint, save_checkpoint
from speech_assets.train.data import DurationBucketSampler, UtteranceDataset, build_index, heldout_split
from speech_assets.train.engine import BatchStream, Distributed, Engine, resolve_device, seed_everything
from speech_assets.train.objectives import MaskedPrediction, Proximal, majority_labels

log = logging.getLogger("speech_assets.federated")

HEAD_PREFIX = "heads."
HEAD_FORMAT = 1
KEEP_HEADS = 3


def round_schedule(local: LocalConfig) -> Callable[[int], float]:
    """The lr multiplier at local step ``s`` (0-based): linear from 1 towards ``lr_end / lr``."""
    end = local.lr_end / local.lr if local.lr > 0 else 1.0
    return lambda step: 1.0 + (end - 1.0) * step / local.local_steps


def encoder_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The shared encoder's weights: every entry of ``model.state_dict()`` but ``heads.*``."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if not k.startswith(HEAD_PREFIX)}


def initial_encoder(preset: str, seed: int) -> dict[str, torch.Tensor]:
    """The round-0 global encoder, seeded by ``seed`` alone."""
    seed_everything(seed)
    return encoder_state(HubertPretrainModel(get_preset(preset), {"init": 2}))


class HeadStore:
    """A client's prediction head between rounds (tensors and plain values: ``weights_only``-safe)."""

    def __init__(self, client_dir: Path, client_id: str) -> None:
        self.files = ClientRunFiles(client_dir)
        self.client_id = client_id

    def rounds(self) -> list[int]:
        return self.files.heads.numbers(self.files.heads_dir)

    def load_latest(self, up_to: int, k: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """``(round, {"weight": (K, D), "bias": (K,)})`` of the newest head saved at a round ``<= up_to``."""
        found = [r for r in self.rounds() if r <= up_to]
        if not found:
            return None
        path = self.files.head(found[-1])
        state = load_checkpoint(path)
        if state["client_id"] != self.client_id or int(state["k"]) != k:
            raise ValueError(f"{path} belongs to another client or codebook (K={state['k']}, now {k})")
        return found[-1], dict(state["head"])

    def save(self, round_number: int, head: Mapping[str, torch.Tensor], k: int) -> Path:
        path = save_checkpoint(
            self.files.head(round_number),
            {
                "format": HEAD_FORMAT,
                "client_id": self.client_id,
                "round": round_number,
                "k": k,
                "head": {name: t.detach().cpu().clone() for name, t in head.items()},
            },
        )
        for old in self.rounds()[:-KEEP_HEADS]:
            self.files.head(old).unlink(missing_ok=True)
        return path


@dataclass
class TrainResult:
    encoder: dict[str, torch.Tensor]
    num_examples: int  # training utterances of this client (the FedAvg weight)
    train_loss: float  # mean masked-prediction loss over the round's masked frames
    masked_accuracy: float
    seconds: float  # wall time of the local round (data, forward, backward, steps)
    audio_seconds: float
    steps: int


@dataclass
class EvalResult:
    """The columns of ``evaluation.parquet`` (:data:`~speech_assets.federated.history.EVALUATION_METRICS`)."""

    utterances: int
    masked_frames: int
    heldout_loss: float
    heldout_masked_accuracy: float
    majority_accuracy: float  # always predicting the client's most frequent training label
    # the same on the leak-free masked frames (MaskedPrediction.evaluate); None when there are none
    leak_free_frames: int
    heldout_leak_free_masked_accuracy: float | None
    leak_free_majority_accuracy: float | None


class LocalClient:
    def __init__(self, data: ClientData, local: LocalConfig, node: NodeConfig) -> None:
        self.data, self.local, self.node = data, local, node
        # False in a DP round that withholds the metrics: the log may end up beside the server's run folder
        self.log_metrics = True
        self.client_dir = node.client_dir(local.run_name)
        self.client_dir.mkdir(parents=True, exist_ok=True)
        self.heads = HeadStore(self.client_dir, data.client_id)
        device = resolve_device(node.device)
        self.job = Distributed(rank=0, local_rank=0, world_size=1, local_world_size=1, device=device)
        self.precision = resolve_precision(
            local.precision, device.type, device.type == "cuda" and torch.cuda.is_bf16_supported()
        )
        if node.threads > 0:
            torch.set_num_threads(node.threads)
        index = build_index([str(p) for p in data.shards], {data.client_id: str(data.labels)}, local.max_frames)
        train_refs, heldout_refs = heldout_split(index.utterances, 0.0, local.heldout_speakers)
        if not train_refs:
            raise ValueError(f"client {data.client_id} has no labelled training utterances")
        self.num_examples = len(train_refs)
        self.majority_labels = majority_labels(index, train_refs)
        # a federation has no corpus statistics: every utterance is normalised on its own
        self.train_set = UtteranceDataset(index, train_refs, UtteranceCmvn(), local.max_frames)
        self.heldout_set = UtteranceDataset(index, heldout_refs, UtteranceCmvn(), local.max_frames)

    def model(self, encoder: Mapping[str, torch.Tensor], head_up_to: int) -> tuple[HubertPretrainModel, int | None]:
        """The encoder and the newest head saved at a round ``<= head_up_to`` (else a new one); the head's round."""
        seed_everything(derive_seed(self.local.seed, "head", self.data.client_id))
        model = HubertPretrainModel(get_preset(self.local.preset), {self.data.client_id: self.data.k})
        missing, unexpected = model.load_state_dict(dict(encoder), strict=False)
        if unexpected or any(not name.startswith(HEAD_PREFIX) for name in missing):
            raise ValueError(f"the global encoder does not fit preset {self.local.preset}: {missing=} {unexpected=}")
        saved = self.heads.load_latest(head_up_to, self.data.k)
        if saved is not None:
            model.heads[0].load_state_dict(saved[1])
        return model.to(self.job.device), saved[0] if saved else None

    def objective(self, model: HubertPretrainModel, round_number: int) -> MaskedPrediction:
        """Masked prediction with masks drawn from (seed, client, round, step)."""
        local = self.local
        return MaskedPrediction(
            model,
            self.job.device,
            seed=local.seed,
            mask_prob=local.mask_prob,
            mask_length=local.mask_length,
            unmasked_weight=local.unmasked_weight,
            key=("federated", self.data.client_id, round_number),
        )

    def _stream(self, round_number: int) -> BatchStream:
        """The client's endless epoch stream from batch ``(round - 1) * local_steps``."""
        sampler = DurationBucketSampler(
            self.train_set.seconds,
            self.local.batch_seconds,
            seed=derive_seed(self.local.seed, "batches", self.data.client_id),
        )
        skip, epoch = (round_number - 1) * self.local.local_steps, 0
        while skip >= (count := len(sampler.batches(epoch))):
            skip, epoch = skip - count, epoch + 1
        return BatchStream(self.train_set, sampler, self.local.seed, epoch=epoch, position=skip)

    def train_round(self, round_number: int, encoder: Mapping[str, torch.Tensor]) -> TrainResult:
        """``local_steps`` steps from the global ``encoder`` and the newest head saved before the round."""
        inject("federated.round", client=self.data.client_id, round=round_number)
        started = time.perf_counter()
        model, head_round = self.model(encoder, round_number - 1)
        model.train()
        local = self.local
        engine = Engine(
            model,
            self.job,
            precision=self.precision,
            lr=local.lr,
            weight_decay=local.weight_decay,
            clip_norm=local.clip_norm,
            schedule=round_schedule(local),
        )
        objective, stream = self.objective(model, round_number), self._stream(round_number)
        if local.proximal_mu > 0:
            reference = {name: torch.as_tensor(value) for name, value in encoder.items()}
            objective = Proximal(objective, model, reference, local.proximal_mu)  # type: ignore[assignment]
        seed_everything(derive_seed(local.seed, "dropout", self.data.client_id, round_number))
        totals, audio = torch.zeros(6, dtype=torch.float64, device=self.job.device), 0.0
        for _ in range(local.local_steps):
            stats, seconds, _ = engine.train_step(objective, stream)
            totals, audio = totals + stats, audio + seconds
        metrics = objective.metrics(totals.cpu())
        self.heads.save(round_number, model.heads[0].state_dict(), self.data.k)
        shown = (
            f", loss {metrics['masked_loss']:.4f}, masked accuracy {metrics['masked_accuracy']:.3f}"
            if self.log_metrics
            else " (metrics withheld: DP)"
        )
        log.info(
            "%s round %d: %d steps from head of round %s%s",
            self.data.client_id,
            round_number,
            local.local_steps,
            head_round,
            shown,
        )
        return TrainResult(
            encoder=encoder_state(model),
            num_examples=self.num_examples,
            train_loss=metrics["loss"],
            masked_accuracy=metrics["masked_accuracy"],
            seconds=time.perf_counter() - started,
            audio_seconds=audio,
            steps=local.local_steps,
        )

    def evaluate(self, round_number: int, encoder: Mapping[str, torch.Tensor]) -> EvalResult:
        """Masked prediction on the held-out utterances with the global ``encoder`` and this client's head."""
        model, _ = self.model(encoder, round_number)
        summary = self.objective(model, round_number).evaluate(
            self.heldout_set, self.majority_labels, self.local.batch_seconds, self.job, self.precision
        )
        return EvalResult(
            utterances=len(self.heldout_set),
            masked_frames=int(summary["masked_frames"]),
            heldout_masked_accuracy=summary["masked_accuracy"],
            majority_accuracy=summary["majority_accuracy"],
            heldout_loss=summary["loss"],
            leak_free_frames=int(summary["leak_free_frames"]),
            heldout_leak_free_masked_accuracy=summary["leak_free_masked_accuracy"],
            leak_free_majority_accuracy=summary["leak_free_majority_accuracy"],
        )
