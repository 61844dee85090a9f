"""DistilHuBERT-style distillation: a small student encoder predicts chosen layers of a frozen teacher.

``python -m speech_assets.evaluation.distill --config CONFIG.json`` trains alone or as one rank
under torchrun (launched with :func:`speech_assets.train.launch.build_torchrun_command`, like
pretraining). Per step: the teacher encodes the batch (no masking, no gradient); its layers
``teacher_layers`` (1-based, layer-normalised) are the targets; the student's encoder plus one
linear head per target layer predicts them; loss per head = L1 - ``cosine_weight`` * log
sigmoid(cosine similarity) (Chang et al., 2022). Data: the training speakers' utterances
(:func:`speech_assets.train.data.heldout_split`), so held-out speakers stay unseen for the probe.

The student is a :class:`HubertPretrainModel` whose "heads" are the layer predictors
(``clients`` = ``{"layer_04": teacher_dim, ...}``): its ``final.pt`` has the training
checkpoint's layout, so the probe, the export and
:func:`~speech_assets.evaluation.encoders.load_encoder` read it unchanged. Rank 0 writes
``final.pt`` and ``result.json``, logs to MLflow and reports through Dagster Pipes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speech_assets.model.hubert import HubertPretrainModel, count_parameters
from speech_assets.model.presets import ModelPreset
from speech_assets.locations import redact_uri
from speech_assets.train.config import ClientTargets
from speech_assets.utils import atomic_write_text

log = logging.getLogger("speech_assets.distill")
CHECKPOINT_KIND = "distilled"


@dataclass
class DistillConfig:
    """One distillation run. ``teacher``: a training ``final.pt``; ``shards``/``cmvn``/``clients``
    as in :class:`~speech_assets.train.config.TrainConfig` (clients' labels only index the
    utterances); ``teacher_layers`` empty = three evenly spaced layers ending at the last."""

    run_dir: str
    teacher: str
    shards: list[str]
    cmvn: str
    clients: dict[str, ClientTargets]
    heldout_fraction: float = 0.05
    dim: int = 384
    layers: int = 6
    heads: int = 6
    ffn_dim: int = 1536
    teacher_layers: list[int] = field(default_factory=list)
    cosine_weight: float = 1.0
    max_steps: int = 200
    batch_seconds: float = 16.0
    lr: float = 5e-4
    warmup_steps: int = 20
    weight_decay: float = 0.01
    clip_norm: float = 10.0
    seed: int = 0
    max_frames: int = 1500
    log_every: int = 10
    num_workers: int = 0
    threads: int | None = None
    device: str = "auto"
    data_versions: dict[str, str] = field(default_factory=dict)
    git_sha: str | None = None
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "speech_assets"
    mlflow_artifact_location: str | None = None
    mlflow_run_name: str | None = None

    def __post_init__(self) -> None:
        self.shards = [str(s) for s in self.shards]
        self.clients = {
            str(n): c if isinstance(c, ClientTargets) else ClientTargets(**c) for n, c in sorted(self.clients.items())
        }
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not divisible by heads {self.heads}")
        if min(self.layers, self.max_steps, self.log_every) < 1 or self.batch_seconds <= 0:
            raise ValueError("layers, max_steps and log_every must be >= 1 and batch_seconds > 0")

    @property
    def preset(self) -> str:
        """The student's name (MLflow tags runs by it, as it does training presets)."""
        return f"student-{self.dim}x{self.layers}"

    def to_dict(self) -> dict[str, Any]:
        """The config as stored (config files, checkpoints, MLflow): the tracking URI without
        credentials, which reach the trainer through ``$MLFLOW_TRACKING_URI`` only."""
        data = asdict(self)
        if data["mlflow_tracking_uri"]:
            data["mlflow_tracking_uri"] = redact_uri(data["mlflow_tracking_uri"])
        return data

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        if path is not None:
            atomic_write_text(path, text)
        return text

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> DistillConfig:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown DistillConfig fields: {unknown}")
        return cls(**data)


def default_teacher_layers(depth: int, count: int = 3) -> list[int]:
    """``count`` evenly spaced 1-based layers ending at ``depth`` (12 -> 4, 8, 12; 4 -> 1, 3, 4)."""
    return sorted({max(1, round(depth * (i + 1) / count)) for i in range(count)})


def student_preset(config: DistillConfig, teacher: ModelPreset) -> ModelPreset:
    """The student's shape: ``dim``/``layers``/``heads``/``ffn_dim`` from the config, the teacher's
    input and positional convolution (groups reduced until they divide ``dim``)."""
    return ModelPreset(
        name=config.preset, dim=config.dim, layers=config.layers, heads=config.heads, ffn_dim=config.ffn_dim,
        conv_channels=config.dim, pos_kernel=teacher.pos_kernel, pos_groups=math.gcd(teacher.pos_groups, config.dim),
        dropout=0.0, input_dim=teacher.input_dim,
    )  # fmt: skip


def build_student(config: DistillConfig, teacher: HubertPretrainModel, layers: list[int]) -> HubertPretrainModel:
    """The student encoder with one ``Linear(dim, teacher_dim)`` head per teacher layer."""
    student = HubertPretrainModel(
        student_preset(config, teacher.preset), {f"layer_{layer:02d}": teacher.preset.dim for layer in layers}
    )
    student.mask_embedding.requires_grad_(False)  # never masked: keeps DDP from waiting for its gradient
    return student


class LayerPredictor(nn.Module):
    """``feats (B, T, 80)``, ``lengths (B,)`` -> ``predictions (B, H, L, D_teacher)``, ``padding (B, L)``:
    every head on every frame (what DDP wraps)."""

    def __init__(self, student: HubertPretrainModel) -> None:
        super().__init__()
        self.student = student

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = self.student.encode(feats, lengths)
        return torch.stack([head(encoded.hidden) for head in self.student.heads], dim=1), encoded.padding


def teacher_targets(teacher: HubertPretrainModel, feats: torch.Tensor, lengths: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """``(B, H, L, D_teacher)``: teacher ``layers`` (1-based), each layer-normalised without affine
    parameters (the pre-LN residual stream grows with depth; normalised, every head's L1 has one scale)."""
    with torch.no_grad():
        states, _ = teacher.hidden_states(feats, lengths)
        return torch.stack([F.layer_norm(states[layer], states[layer].shape[-1:]) for layer in layers], dim=1)


def layer_prediction_loss(
    predictions: torch.Tensor, targets: torch.Tensor, padding: torch.Tensor, cosine_weight: float = 1.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DistilHuBERT's loss: per head, mean L1 minus ``cosine_weight`` * mean log sigmoid(cos).

    Args:
        predictions: ``(B, H, L, D)`` the student's head outputs.
        targets: ``(B, H, L, D)`` the teacher's (normalised) layers.
        padding: ``(B, L)`` bool, ``True`` on padded frames (excluded from every mean).

    Returns:
        The scalar loss summed over heads, and ``l1``/``cosine`` ``(H,)`` per-head means (detached).
    """
    if (
        predictions.shape != targets.shape
        or predictions.dim() != 4
        or padding.shape != (predictions.shape[0], predictions.shape[2])
    ):
        raise ValueError(f"shapes {tuple(predictions.shape)}, {tuple(targets.shape)}, {tuple(padding.shape)} do not match")
    valid = (~padding)[:, None, :].to(predictions.dtype)  # (B, 1, L)
    frames = valid.sum().clamp(min=1)
    l1 = ((predictions - targets).abs().mean(dim=-1) * valid).sum(dim=(0, 2)) / frames
    cosine = F.cosine_similarity(predictions, targets, dim=-1)
    log_sigmoid = (F.logsigmoid(cosine) * valid).sum(dim=(0, 2)) / frames
    loss = (l1 - cosine_weight * log_sigmoid).sum()
    return loss, {"l1": l1.detach(), "cosine": ((cosine * valid).sum(dim=(0, 2)) / frames).detach()}


def encoder_parameters(model: HubertPretrainModel) -> int:
    """Parameters of the encoder alone (no prediction heads)."""
    return count_parameters(model) - count_parameters(model.heads)


def distill(config: DistillConfig) -> dict[str, Any] | None:
    """Run the distillation in this process (alone or as one torchrun rank); ``result.json``'s
    content on rank 0, ``None`` elsewhere."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from speech_assets.evaluation.encoders import load_encoder
    from speech_assets.features.cmvn import Cmvn
    from speech_assets.train.checkpoint import CHECKPOINT_FORMAT, save_checkpoint, weights_sha256
    from speech_assets.train.data import DurationBucketSampler, UtteranceDataset, build_index, heldout_split
    from speech_assets.train.tracking import MlflowTracker, PipesReporter
    from speech_assets.train.trainer import (
        BatchStream, build_optimizer, hold_run_folder, init_distributed, seed_everything, warmup_linear_decay,
    )  # fmt: skip

    run_dir = Path(config.run_dir)
    handler = _setup_logging(run_dir, int(os.environ.get("RANK", "0")))
    folder = contextlib.ExitStack()
    tracker: MlflowTracker | None = None
    job = None
    try:
        # like a training worker: dies with its launcher, holds the run folder (no orphan after kill -9)
        folder.enter_context(hold_run_folder(config.run_dir))
        job = init_distributed(config.device)
        torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 1) // job.local_world_size))
        reporter = PipesReporter(log) if job.is_main else None
        teacher_loaded = load_encoder(config.teacher)
        teacher = teacher_loaded.model.to(job.device).requires_grad_(False)
        layers = config.teacher_layers or default_teacher_layers(teacher.preset.layers)
        if not all(1 <= layer <= teacher.preset.layers for layer in layers):
            raise ValueError(f"teacher_layers {layers} outside 1..{teacher.preset.layers}")
        index = build_index(config.shards, {n: c.labels for n, c in config.clients.items()}, config.max_frames)
        train_refs, heldout_refs = heldout_split(index.utterances, config.heldout_fraction)
        dataset = UtteranceDataset(index, train_refs, Cmvn.load(config.cmvn), config.max_frames, seed=config.seed)
        sampler = DurationBucketSampler(
            dataset.seconds, config.batch_seconds, num_replicas=job.world_size, rank=job.rank, seed=config.seed
        )
        # BatchStream, build_optimizer and MlflowTracker read only fields DistillConfig shares with TrainConfig
        stream = BatchStream(dataset, sampler, 0, 0, config, pin_memory=job.device.type == "cuda")  # type: ignore[arg-type]
        seed_everything(config.seed)
        student = build_student(config, teacher, layers).to(job.device)
        predictor: nn.Module = LayerPredictor(student)
        if job.enabled:
            predictor = DistributedDataParallel(predictor, device_ids=[job.local_rank] if job.device.type == "cuda" else None)
        optimizer = build_optimizer(student, config)  # type: ignore[arg-type]
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear_decay(config.warmup_steps, config.max_steps))
        if job.is_main and config.mlflow_tracking_uri:
            tracker = MlflowTracker(config)  # type: ignore[arg-type]
            tracker.start(None, {"nproc": job.world_size, "batch_seconds": config.batch_seconds})
        log.info(
            "distilling %s (%d encoder parameters, layers %s) into %s (%d) on %d utterances of the training "
            "speakers (%d held-out utterances left out)",
            config.teacher, encoder_parameters(teacher), layers, config.preset, encoder_parameters(student),
            len(train_refs), len(heldout_refs),
        )  # fmt: skip
        window = torch.zeros(1 + 2 * len(layers), dtype=torch.float64)  # loss, then per-head L1 and cosine sums
        started, audio_seconds, metrics = time.perf_counter(), 0.0, {}
        for step in range(1, config.max_steps + 1):
            batch = next(stream).to(job.device)
            targets = teacher_targets(teacher, batch.feats, batch.lengths, layers)
            predictions, padding = predictor(batch.feats, batch.lengths)
            loss, parts = layer_prediction_loss(predictions, targets, padding, config.cosine_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(student.parameters(), config.clip_norm)
            optimizer.step()
            scheduler.step()
            window += torch.cat([loss.detach().double().cpu()[None], parts["l1"].double().cpu(), parts["cosine"].double().cpu()])
            audio_seconds += batch.seconds
            if step % config.log_every == 0 or step == config.max_steps:
                totals = window.clone()
                if job.enabled:
                    dist.all_reduce(totals)
                totals /= (step - 1) % config.log_every + 1
                totals /= job.world_size
                metrics = {"loss": float(totals[0]), "lr": float(scheduler.get_last_lr()[0])}
                for i, layer in enumerate(layers):
                    metrics[f"l1_layer_{layer:02d}"] = float(totals[1 + i])
                    metrics[f"cosine_layer_{layer:02d}"] = float(totals[1 + len(layers) + i])
                window.zero_()
                if job.is_main:
                    log.info("step %d/%d loss %.4f", step, config.max_steps, metrics["loss"])
                    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
                        handle.write(json.dumps({"step": step, **metrics}) + "\n")
                    if tracker is not None:
                        tracker.log_metrics(metrics, step)
        if not job.is_main:
            return None
        state = student.state_dict()
        sha = weights_sha256(state)
        final = run_dir / "final.pt"
        save_checkpoint(final, {
            "format": CHECKPOINT_FORMAT, "kind": CHECKPOINT_KIND, "step": config.max_steps, "model": state,
            "preset": student.preset.to_dict(), "clients": {name: teacher.preset.dim for name in student.clients},
            "teacher": config.teacher, "teacher_sha256": teacher_loaded.sha256, "teacher_layers": list(layers),
            "config": config.to_dict(), "data_versions": dict(config.data_versions), "weights_sha256": sha,
        })  # fmt: skip
        result = {
            "step": config.max_steps, "final_loss": metrics["loss"], "checkpoint": str(final), "checkpoint_sha256": sha,
            "teacher": config.teacher, "teacher_sha256": teacher_loaded.sha256, "teacher_layers": list(layers),
            "student": config.preset, "student_parameters": encoder_parameters(student),
            "teacher_parameters": encoder_parameters(teacher), "train_utterances": len(train_refs),
            "train_audio_seconds": audio_seconds * job.world_size, "train_seconds": time.perf_counter() - started,
            "world_size": job.world_size, "data_versions": dict(config.data_versions),
            "mlflow_run_id": tracker.run_id if tracker else None, "mlflow_run_url": tracker.url if tracker else None,
            **{k: v for k, v in metrics.items() if k.startswith(("l1_", "cosine_"))},
        }  # fmt: skip
        if tracker is not None:
            tracker.finish(result, final)
        atomic_write_text(run_dir / "result.json", json.dumps(result, indent=2, sort_keys=True) + "\n")
        log.info("done: %d steps, loss %.4f, student %s", config.max_steps, metrics["loss"], final)
        if reporter is not None:
            keys = ("step", "final_loss", "checkpoint", "checkpoint_sha256", "student", "student_parameters",
                    "teacher_parameters", "mlflow_run_id", "mlflow_run_url")  # fmt: skip
            reporter.report({k: result[k] for k in keys if result[k] is not None}, data_version=sha, paths=("checkpoint",))
        return result
    except BaseException:
        if tracker is not None:
            tracker.fail()
        raise
    finally:
        log.removeHandler(handler)
        handler.close()
        if job is not None and job.enabled and dist.is_initialized():
            dist.destroy_process_group()
        folder.close()


def _setup_logging(run_dir: Path, rank: int) -> logging.Handler:
    run_dir.mkdir(parents=True, exist_ok=True)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s distill rank{rank} %(levelname)s %(message)s"))
    log.addHandler(handler)
    return handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speech_assets.evaluation.distill", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="DistillConfig JSON file")
    distill(DistillConfig.from_json(parser.parse_args(argv).config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
