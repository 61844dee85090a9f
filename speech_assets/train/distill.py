"""DistilHuBERT-style distillation: a small student encoder predicts chosen layers of a frozen teacher.

``python -m speech_assets.train.distill --config CONFIG.json``. The teacher's ``teacher_layers``
(1-based, layer-normalised) are the targets of one linear student head each; loss per head = L1 -
``cosine_weight`` * log sigmoid(cos) (Chang et al., 2022). Only training speakers' utterances are
used, so held-out speakers stay unseen for the probe. The student is a :class:`HubertPretrainModel`
whose "heads" are the layer predictors, so its ``final.pt`` loads like a pretrained checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from speech_assets.features.cmvn import Cmvn, from_record
from speech_assets.model.encoders import load_encoder
from speech_assets.model.hubert import HubertPretrainModel, count_parameters
from speech_assets.model.presets import ModelPreset
from speech_assets.model.speed import forward_speed
from speech_assets.train.config import DistillConfig
from speech_assets.train.data import Batch, DurationBucketSampler, UtteranceDataset, split_corpus
from speech_assets.train.engine import (
    BatchStream,
    Distributed,
    Fit,
    default_workers,
    fixed_batch,
    seed_everything,
    warmup_linear_decay,
)
from speech_assets.train.tracking import PipesReporter
from speech_assets.train.worker import worker

log = logging.getLogger("speech_assets.train")
CHECKPOINT_KIND = "distilled"
STUDENT_FIELDS = ("teacher", "dim", "layers", "heads", "ffn_dim", "teacher_layers")  # a checkpoint continues only these


def default_teacher_layers(depth: int, count: int = 3) -> list[int]:
    """``count`` evenly spaced 1-based layers ending at ``depth`` (12 -> 4, 8, 12; 4 -> 1, 3, 4)."""
    return sorted({max(1, round(depth * (i + 1) / count)) for i in range(count)})


def build_student(config: DistillConfig, teacher: HubertPretrainModel, layers: list[int]) -> HubertPretrainModel:
    """The config's shape with the teacher's input and positional convolution (groups dividing ``dim``)."""
    shape = ModelPreset(
        name=config.preset,
        dim=config.dim,
        layers=config.layers,
        heads=config.heads,
        ffn_dim=config.ffn_dim,
        conv_channels=config.dim,
        pos_kernel=teacher.preset.pos_kernel,
        pos_groups=math.gcd(teacher.preset.pos_groups, config.dim),
        dropout=0.0,
        input_dim=teacher.preset.input_dim,
    )
    student = HubertPretrainModel(shape, {f"layer_{layer:02d}": teacher.preset.dim for layer in layers})
    student.mask_embedding.requires_grad_(False)  # never masked: keeps DDP from waiting for its gradient
    return student


class LayerPredictor(nn.Module):
    """``feats (B, T, 80)``, ``lengths (B,)`` -> ``predictions (B, H, L, D_teacher)``, ``padding (B, L)``:
    every head on every frame (what DDP wraps). ``padded``: as :meth:`HubertPretrainModel.encode`'s."""

    def __init__(self, student: HubertPretrainModel) -> None:
        super().__init__()
        self.student = student

    def forward(
        self, feats: torch.Tensor, lengths: torch.Tensor, padded: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = self.student.encode(feats, lengths, padded=padded)
        return torch.stack([head(encoded.hidden) for head in self.student.heads], dim=1), encoded.padding


def teacher_targets(
    teacher: HubertPretrainModel, feats: torch.Tensor, lengths: torch.Tensor, layers: list[int]
) -> torch.Tensor:
    """``(B, H, L, D_teacher)``: teacher ``layers`` (1-based), each layer-normalised without affine
    parameters (the pre-LN residual stream grows with depth; normalised, every head's L1 has one scale)."""
    with torch.no_grad():
        states, _ = teacher.hidden_states(feats, lengths)
        return torch.stack([F.layer_norm(states[layer], states[layer].shape[-1:]) for layer in layers], dim=1)


def layer_prediction_loss(
    predictions: torch.Tensor, targets: torch.Tensor, padding: torch.Tensor, cosine_weight: float = 1.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DistilHuBERT's loss over ``(B, H, L, D)`` predictions and targets, ``padding (B, L)`` excluded:
    summed over heads, and the detached per-head means ``l1``/``cosine`` ``(H,)``."""
    if (
        predictions.dim() != 4
        or targets.shape != predictions.shape
        or padding.shape != (predictions.shape[0], predictions.shape[2])
    ):
        raise ValueError(
            f"shapes {tuple(predictions.shape)}, {tuple(targets.shape)}, {tuple(padding.shape)} do not match"
        )
    valid = (~padding)[:, None, :].to(predictions.dtype)  # (B, 1, L)
    frames = valid.sum().clamp(min=1)
    l1 = ((predictions - targets).abs().mean(dim=-1) * valid).sum(dim=(0, 2)) / frames
    cosine = F.cosine_similarity(predictions, targets, dim=-1)
    log_sigmoid = (F.logsigmoid(cosine) * valid).sum(dim=(0, 2)) / frames
    loss = (l1 - cosine_weight * log_sigmoid).sum()
    return loss, {"l1": l1.detach(), "cosine": ((cosine * valid).sum(dim=(0, 2)) / frames).detach()}


def encoder_parameters(model: HubertPretrainModel) -> int:
    return count_parameters(model) - count_parameters(model.heads)


@dataclass
class LayerPrediction:
    """The distillation objective; statistics ``(2 + 2H,)``: a count of 1, the loss, per-head L1 and cosine."""

    teacher: HubertPretrainModel
    layers: list[int]
    cosine_weight: float
    device: torch.device

    def __call__(self, model: nn.Module, batch: Batch, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = batch.to(self.device)
        targets = teacher_targets(self.teacher, batch.feats, batch.lengths, self.layers)
        predictions, padding = model(batch.feats, batch.lengths, batch.padded)
        loss, parts = layer_prediction_loss(predictions.float(), targets.float(), padding, self.cosine_weight)
        value = loss.detach().double()[None]
        return loss, torch.cat([torch.ones_like(value), value, parts["l1"].double(), parts["cosine"].double()])

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        means = (totals[1:] / totals[0].clamp(min=1)).tolist()
        metrics = {"loss": means[0]}
        for i, layer in enumerate(self.layers):
            metrics[f"l1_layer_{layer:02d}"] = means[1 + i]
            metrics[f"cosine_layer_{layer:02d}"] = means[1 + len(self.layers) + i]
        return metrics


class Distillation(Fit):
    """A distillation run on this rank of ``job``: the teacher, the student and their data."""

    materialized = ("student", "student_parameters", "teacher_parameters")

    def __init__(self, config: DistillConfig, job: Distributed) -> None:
        precision = fixed_batch(job, config)
        self.teacher_loaded = load_encoder(config.teacher)
        self.teacher = teacher = self.teacher_loaded.model.to(job.device).requires_grad_(False)
        self.layers = layers = config.teacher_layers or default_teacher_layers(teacher.preset.layers)
        if not all(1 <= layer <= teacher.preset.layers for layer in layers):
            raise ValueError(f"teacher_layers {layers} outside 1..{teacher.preset.layers}")
        # the student learns on the teacher's training speakers, with the teacher's input normalisation
        recorded = self.teacher_loaded.checkpoint.get("speakers") or {}
        heldout = config.heldout_speakers if config.heldout_speakers is not None else recorded.get("heldout")
        index, self.train_refs, self.heldout_refs, speakers = split_corpus(config, heldout)
        cmvn = from_record(self.teacher_loaded.checkpoint.get("normalisation")) or Cmvn.load(config.cmvn)
        self.dataset = UtteranceDataset(index, self.train_refs, cmvn, config.max_frames, seed=config.seed)
        sampler = DurationBucketSampler(
            self.dataset.seconds, config.batch_seconds, num_replicas=job.world_size, rank=job.rank, seed=config.seed
        )
        sampler.num_workers = config.num_workers or default_workers(job)  # 0: the device's default
        stream = BatchStream(self.dataset, sampler, config.seed, device=job.device)
        seed_everything(config.seed)
        self.student = build_student(config, teacher, layers).to(job.device)
        self.start(
            self.student,
            job,
            config,
            stream,
            LayerPrediction(teacher, layers, config.cosine_weight, job.device),
            precision=precision,
            schedule=warmup_linear_decay(config.warmup_steps, config.max_steps),
            forward=LayerPredictor(self.student),
            speakers=speakers,
            cmvn=cmvn,
            identity=lambda stored: {name: stored[name] for name in STUDENT_FIELDS},
            kind=CHECKPOINT_KIND,
        )

    def announce(self) -> None:
        config = self.config
        log.info(
            "distilling %s (%d encoder parameters, layers %s) into %s (%d) on %d utterances of the training "
            "speakers (%d held-out utterances left out), %s",
            config.teacher,
            encoder_parameters(self.teacher),
            self.layers,
            config.preset,
            encoder_parameters(self.student),
            len(self.dataset),
            len(self.heldout_refs),
            self.engine.precision,
        )

    def final(self) -> dict[str, Any]:
        return {
            "preset": self.student.preset.to_dict(),
            "clients": {name: self.teacher.preset.dim for name in self.student.clients},
            "teacher": self.config.teacher,
            "teacher_sha256": self.teacher_loaded.sha256,
            "teacher_layers": list(self.layers),
        }

    def result(self) -> dict[str, Any]:
        # both models are at hand here: timed now, the step that launched this loads neither
        feats = [self.dataset.logmel(ref).astype(np.float32) for ref in self.train_refs[:16]]
        models = {"teacher": self.teacher.cpu(), "student": self.student.cpu()}
        speed = forward_speed(models, feats, repeats=2, threads=1)
        return {
            "teacher": self.config.teacher,
            "teacher_sha256": self.teacher_loaded.sha256,
            "teacher_layers": list(self.layers),
            "student": self.config.preset,
            "student_parameters": encoder_parameters(self.student),
            "teacher_parameters": encoder_parameters(self.teacher),
            "train_utterances": len(self.dataset),
            "student_audio_s_per_s": round(speed["student"], 1),
            "teacher_audio_s_per_s": round(speed["teacher"], 1),
            "speedup": round(speed["student"] / speed["teacher"], 3),
            **{k: v for k, v in self.engine.metrics.items() if k.startswith(("l1_", "cosine_"))},
        }


def distill(config: DistillConfig) -> dict[str, Any] | None:
    """Distil in this process (alone or as one torchrun rank); ``result.json``'s content on rank 0."""
    with worker(config.run_dir, config.device, command="python -m speech_assets.train.distill") as job:
        return Distillation(config, job).run(PipesReporter(log) if job.is_main else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speech_assets.train.distill", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="DistillConfig JSON file")
    distill(DistillConfig.from_json(parser.parse_args(argv).config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
