"""The training loop: single process or one process per device under torchrun (DDP).

One optimizer step consumes ``grad_accum`` micro-batches per rank (each at most
``batch_seconds`` of padded audio), masks spans, predicts each sample's targets with its own
client's head, clips, steps AdamW and the warmup/linear-decay schedule. Checkpoints (every
``checkpoint_every`` steps and at the end) hold everything needed to continue bit-exactly:
weights, optimizer, scheduler, scaler, step, sampler position and every rank's RNG states. A
new attempt on the same ``run_dir`` resumes from the latest one automatically.

Rank 0 alone writes files, logs metrics to MLflow and reports to Dagster Pipes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from speech_assets.features.cmvn import Cmvn
from speech_assets.model.hubert import HubertPretrainModel, output_lengths
from speech_assets.model.loss import IGNORE_INDEX, masked_prediction_loss, summarize
from speech_assets.model.masking import span_mask
from speech_assets.model.presets import get_preset
from speech_assets.train.augment import Augmenter
from speech_assets.train.autoconfig import LaunchPlan, available_cores
from speech_assets.train.checkpoint import (
    CHECKPOINT_FORMAT,
    capture_rng_state,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    restore_rng_state,
    save_checkpoint,
    weights_sha256,
)
from speech_assets.train.config import TrainConfig
from speech_assets.train.data import (
    Batch,
    CorpusIndex,
    UtteranceRef,
    UtteranceDataset,
    build_index,
    collate,
    eval_batches,
    heldout_split,
)
from speech_assets.runtime.locks import RunFolderLock, hold_as_worker
from speech_assets.runtime.processes import LAUNCHER_ENV, die_with_parent, watch_launcher
from speech_assets.train.launch import (
    OOM_EXIT_CODE,
    RUN_LOCK_HELD_ENV,
    clear_oom,
    plan_for,
    read_oom_marker,
    write_oom_marker,
)
from speech_assets.train.sampling import BlockShuffleSampler
from speech_assets.train.tracking import MlflowTracker, PipesReporter
from speech_assets.utils import atomic_write_text

log = logging.getLogger("speech_assets.train")

# Test hook: "<rank>:<step>:<marker path>" makes that rank exit abruptly (os._exit(1)) right
# after finishing that step, once: the marker file records that the fault already happened.
# "oom:<rank>:<step>:<marker path>" raises torch's out-of-memory error there instead (on CPU too).
FAULT_ENV = "SPEECH_ASSETS_TRAIN_FAULT"
OOM_FAULT = "oom:"
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Distributed:
    """This process's place in the job (from torchrun's environment; defaults: one process)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str) -> Distributed:
    """Read ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` and join the process group (NCCL on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        target = torch.device("cuda", local_rank)
    else:
        target = torch.device("cpu")
    if (
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ
    ):
        log.warning(
            "restarted by torchrun without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: "
            "the rendezvous may fail (see speech_assets.train.launch.TORCHRUN_ENV)"
        )
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=target if use_cuda else None)
    return Distributed(rank, local_rank, world, local_world, target)


def seed_everything(seed: int) -> None:
    """Seed Python ``random``, numpy's global RNG and torch (CPU and CUDA) with one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def warmup_linear_decay(warmup_steps: int, max_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1 over ``warmup_steps``, then linear decay to 0 at ``max_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))

    return factor


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW (HuBERT betas/eps); no weight decay on biases, norms and the mask embedding."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.98), eps=1e-6)


def mask_generator(seed: int, *parts: int | str) -> torch.Generator:
    """CPU generator seeded from ``seed`` and ``parts`` (step, rank, micro-batch): masks are a
    pure function of where they are drawn, independent of the global RNG."""
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


class BatchStream:
    """Endless stream of this rank's batches starting at ``(epoch, position)``; ``state()`` is
    the position to resume from (batches already yielded)."""

    def __init__(
        self,
        dataset: UtteranceDataset,
        sampler: BlockShuffleSampler,
        epoch: int,
        position: int,
        config: TrainConfig,
        pin_memory: bool,
    ) -> None:
        self.dataset, self.sampler, self.epoch, self.position = dataset, sampler, epoch, position
        self.num_workers, self.seed, self.pin_memory = sampler.num_workers, config.seed, pin_memory
        self._batches_in_epoch = 0
        self._iterator: Iterator[Batch] | None = None

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Batch:
        while True:
            if self._iterator is None:
                self.dataset.set_epoch(self.epoch)  # crops of long utterances move with the epoch
                batches = self.sampler.batches(self.epoch)
                self._batches_in_epoch = len(batches)
                loader = DataLoader(
                    self.dataset,
                    batch_sampler=batches[self.position :],
                    collate_fn=collate,
                    num_workers=self.num_workers,
                    pin_memory=self.pin_memory,
                    # Own generator: creating a loader must not consume the global RNG.
                    generator=torch.Generator().manual_seed(self.seed),
                )
                self._iterator = iter(loader)
            try:
                batch = next(self._iterator)
            except StopIteration:
                self.epoch, self.position, self._iterator = self.epoch + 1, 0, None
                continue
            self.position += 1
            return batch

    def state(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "batches_in_epoch": self._batches_in_epoch or len(self.sampler.batches(self.epoch)),
            "batch_seconds": self.sampler.batch_seconds,
            "world_size": self.sampler.num_replicas,
        }


class Trainer:
    """Builds data, model and optimizer for ``config`` on this rank (as ``plan`` says) and
    resumes from the run's latest checkpoint if there is one."""

    def __init__(self, config: TrainConfig, job: Distributed, plan: LaunchPlan) -> None:
        self.config, self.job, self.plan = config, job, plan
        self.run_dir = Path(config.run_dir)
        index = build_index(config.shards, {n: c.labels for n, c in config.clients.items()}, config.max_frames)
        train_refs, heldout_refs = heldout_split(index.utterances, config.heldout_fraction)
        if not train_refs:
            raise ValueError("no labelled training utterances in the shards")
        self.heldout_speakers = sorted({u.speaker_id for u in heldout_refs})
        log.info(
            "data: %d training and %d held-out utterances (held-out speakers: %s; %.0f s / %.0f s), "
            "%d without labels skipped",
            len(train_refs),
            len(heldout_refs),
            ", ".join(self.heldout_speakers[:10]) + (" ..." if len(self.heldout_speakers) > 10 else "") or "none",
            sum(u.seconds for u in train_refs),
            sum(u.seconds for u in heldout_refs),
            index.unlabelled,
        )
        self.unlabelled = index.unlabelled
        self.majority_labels = majority_labels(index, train_refs)
        cmvn = Cmvn.load(config.cmvn)
        augment = Augmenter(config.augmentation(), seed=config.seed)
        self.train_set = UtteranceDataset(
            index, train_refs, cmvn, config.max_frames, seed=config.seed, cached_row_groups=WINDOW_BLOCKS + 1, augment=augment
        )
        if augment.options.enabled:
            log.info("augmenting training utterances: %s", augment.options.describe())
        self.heldout_set = UtteranceDataset(index, heldout_refs, cmvn, config.max_frames)
        self.num_workers = loader_workers(config, job)
        self.sampler = BlockShuffleSampler(
            [(u.shard, u.row_group) for u in train_refs],
            self.train_set.seconds,
            plan.batch_seconds,
            num_replicas=job.world_size,
            rank=job.rank,
            seed=config.seed,
            window_blocks=WINDOW_BLOCKS,
            num_workers=self.num_workers,
        )

        seed_everything(config.seed)
        self.model = HubertPretrainModel(get_preset(config.preset), {n: c.k for n, c in config.clients.items()})
        self.model.to(job.device)
        self.optimizer = build_optimizer(self.model, config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_linear_decay(config.warmup_steps, config.max_steps)
        )
        self.scaler = torch.amp.GradScaler(job.device.type, enabled=plan.precision == "fp16")
        seed_everything(config.seed + 1 + job.rank)  # distinct dropout streams per rank
        self.step = 0
        self.stream = BatchStream(self.train_set, self.sampler, 0, 0, config, pin_memory=job.device.type == "cuda")
        self.progress = {"audio_seconds": 0.0, "train_seconds": 0.0}
        self.last_metrics: dict[str, float] = {}
        self.resumed_from: int | None = None
        self._resume()
        self.ddp = (
            DistributedDataParallel(
                self.model,
                device_ids=[job.local_rank] if job.device.type == "cuda" else None,
                # every head takes part in every step (see idle_heads_term), so DDP needs no
                # search for unused parameters after each backward pass
                find_unused_parameters=False,
            )
            if job.enabled
            else None
        )

    # ----------------------------------------------------------------- resume / checkpoints
    def _resume(self) -> None:
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return
        state = load_checkpoint(path)
        saved = state["config"]
        saved_clients = {name: c["k"] for name, c in saved["clients"].items()}
        if saved["preset"] != self.config.preset or saved_clients != {n: c.k for n, c in self.config.clients.items()}:
            raise ValueError(f"{path} was trained with another model (preset or client codebooks differ)")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.progress = dict(state["progress"])
        self.last_metrics = dict(state["metrics"])
        sampler = state["sampler"]
        epoch, position = int(sampler["epoch"]), int(sampler["position"])
        same_batching = (
            sampler["batch_seconds"] == self.sampler.batch_seconds and sampler["world_size"] == self.job.world_size
        )
        if not same_batching:
            new_count = len(self.sampler.batches(epoch))
            position = round(position * new_count / max(int(sampler["batches_in_epoch"]), 1))
            log.warning("batching changed since the checkpoint; continuing epoch %d at batch %d", epoch, position)
        self.stream.epoch, self.stream.position = epoch, position
        rng = state["rng"]
        if len(rng) == self.job.world_size:
            restore_rng_state(rng[self.job.rank], self.job.device)
        else:
            log.warning("world size changed (%d -> %d): RNG streams restart", len(rng), self.job.world_size)
        self.resumed_from = self.step
        log.info("resumed from %s (step %d)", path, self.step)

    def _save_checkpoint(self, mlflow_run_id: str | None) -> None:
        """Collective: gathers every rank's RNG state; rank 0 writes and prunes."""
        rng = capture_rng_state(self.job.device)
        states: list[Any] = [None] * self.job.world_size
        if self.job.enabled:
            dist.all_gather_object(states, rng)
        else:
            states = [rng]
        if self.job.is_main:
            model_state = self.model.state_dict()
            state = {
                "format": CHECKPOINT_FORMAT,
                "step": self.step,
                "model": model_state,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "sampler": self.stream.state(),
                "rng": states,
                "config": self.config.to_dict(),
                "data_versions": dict(self.config.data_versions),
                "weights_sha256": weights_sha256(model_state),
                "progress": dict(self.progress),
                "metrics": dict(self.last_metrics),
                "mlflow_run_id": mlflow_run_id,
                "plan": self.plan.to_dict(),
            }
            path = save_checkpoint(checkpoint_path(self.run_dir, self.step), state)
            prune_checkpoints(self.run_dir, self.config.keep_checkpoints)
            log.info("checkpoint %s", path)
        self._barrier()

    def _barrier(self) -> None:
        if self.job.enabled:
            dist.barrier()

    def _all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        if self.job.enabled:
            dist.all_reduce(values)
        return values

    # ------------------------------------------------------------------------- training
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = AUTOCAST_DTYPES.get(self.plan.precision)
        return torch.autocast(self.job.device.type, dtype=dtype, enabled=dtype is not None)

    def _train_step(self) -> tuple[torch.Tensor, float, torch.Tensor]:
        """One optimizer step: returns summed loss stats ``(6,)``, local audio seconds, grad norm."""
        model = self.ddp or self.model
        accum = self.plan.grad_accum
        stats = torch.zeros(6, dtype=torch.float64, device=self.job.device)
        seconds = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for micro in range(accum):
            batch = next(self.stream)
            mask = span_mask(
                output_lengths(batch.lengths),
                self.config.mask_prob,
                self.config.mask_length,
                mask_generator(self.config.seed, self.step, self.job.rank, micro),
            )
            batch = batch.to(self.job.device)
            mask = mask.to(self.job.device)
            # DDP all-reduces gradients only on the last micro-batch of the step.
            accumulate = self.ddp.no_sync() if self.ddp is not None and micro < accum - 1 else contextlib.nullcontext()
            with accumulate, self._autocast():
                output = model(batch.feats, batch.lengths, batch.clients, mask)
                loss = masked_prediction_loss(output.logits, batch.targets, mask, self.config.unmasked_weight)
            self.scaler.scale((loss.loss + idle_heads_term(self.model, output.logits)) / accum).backward()
            stats += loss.stats
            seconds += batch.seconds
        self.scaler.unscale_(self.optimizer)
        clip = self.config.clip_norm if self.config.clip_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.step += 1
        return stats, seconds, grad_norm

    def run(self, reporter: PipesReporter | None = None, stop_after_step: int | None = None) -> dict[str, Any] | None:
        """Train to ``max_steps``, evaluate, write ``final.pt``/``result.json`` (rank 0) and return
        the result on rank 0 (``None`` elsewhere, and when stopped early by ``stop_after_step``).
        ``reporter`` (rank 0) receives the final materialization."""
        config = self.config
        tracker = self._start_mlflow() if self.job.is_main and config.mlflow_tracking_uri else None
        mlflow_run_id = tracker.run_id if tracker else None
        try:
            # summed loss stats (6), audio seconds, audio seconds of timed steps; since the last flush
            window = torch.zeros(8, dtype=torch.float64, device=self.job.device)
            window_start, timed_seconds, first_step = time.perf_counter(), 0.0, self.step + 1
            while self.step < config.max_steps:
                started = time.perf_counter()
                stats, seconds, grad_norm = self._train_step()
                timed = self.step > first_step  # the first step of an attempt pays for warm-up
                window[:6] += stats
                window[6] += seconds
                if timed:
                    window[7] += seconds
                    timed_seconds += time.perf_counter() - started
                _maybe_inject_fault(self.step, self.job.rank)
                checkpoint = (
                    self.step in (config.max_steps, stop_after_step) or self.step % config.checkpoint_every == 0
                )
                if checkpoint or self.step % config.log_every == 0:
                    totals = self._all_reduce(window.clone()).tolist()
                    self.progress["audio_seconds"] += totals[7]
                    self.progress["train_seconds"] += timed_seconds
                    self.last_metrics = self._window_metrics(totals, grad_norm, time.perf_counter() - window_start)
                    self._report_step(tracker)
                    if checkpoint:
                        self._save_checkpoint(mlflow_run_id)
                    window.zero_()
                    window_start, timed_seconds = time.perf_counter(), 0.0
                if self.step == stop_after_step:
                    return None
            return self._finish(tracker, reporter)
        except BaseException:
            if tracker is not None:
                with contextlib.suppress(Exception):
                    tracker.fail()
            raise

    def _window_metrics(self, totals: list[float], grad_norm: torch.Tensor, elapsed: float) -> dict[str, float]:
        summary = summarize(torch.tensor(totals[:6]))
        return {
            "loss": summary["masked_loss"] + self.config.unmasked_weight * summary["unmasked_loss"],
            "masked_loss": summary["masked_loss"],
            "masked_accuracy": summary["masked_accuracy"],
            "unmasked_accuracy": summary["unmasked_accuracy"],
            "lr": float(self.scheduler.get_last_lr()[0]),
            "grad_norm": float(grad_norm),
            "audio_seconds_per_second": totals[6] / max(elapsed, 1e-9),
            "epoch": float(self.stream.epoch),
        }

    def _report_step(self, tracker: MlflowTracker | None) -> None:
        if not self.job.is_main:
            return
        metrics = self.last_metrics
        log.info(
            "step %d/%d loss %.4f masked_acc %.3f lr %.2e grad_norm %.2f audio %.1f s/s",
            self.step,
            self.config.max_steps,
            metrics["loss"],
            metrics["masked_accuracy"],
            metrics["lr"],
            metrics["grad_norm"],
            metrics["audio_seconds_per_second"],
        )
        with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": self.step, **metrics}) + "\n")
        if tracker is not None:
            tracker.log_metrics(metrics, self.step)

    def _start_mlflow(self) -> MlflowTracker:
        tracker = MlflowTracker(self.config)
        id_file = self.run_dir / "mlflow_run_id"
        previous = id_file.read_text(encoding="utf-8").strip() if id_file.is_file() else None
        tracker.start(previous or None, self.plan.to_dict())
        atomic_write_text(id_file, tracker.run_id + "\n")
        return tracker

    # --------------------------------------------------------------------------- finish
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any] | None:
        """Masked prediction on the held-out utterances (fixed masks), summed over ranks.

        Besides loss and accuracy, reports what a predictor that knows only each client's label
        frequencies would score on the same masked frames (``majority_accuracy``: always
        predicting the client's most frequent training label), overall and per client, and both
        again on span-interior frames only (``interior_*``: masked frames whose two neighbours
        are masked too, the frames furthest from any visible context).
        """
        if len(self.heldout_set) == 0:
            return None
        self.model.eval()
        world, rank = self.job.world_size, self.job.rank
        batches = eval_batches(self.heldout_set.seconds, self.plan.batch_seconds, world, rank)
        loader = DataLoader(
            self.heldout_set, batch_sampler=batches, collate_fn=collate, num_workers=0
        )
        totals = torch.zeros(6, dtype=torch.float64, device=self.job.device)
        clients = len(self.model.clients)
        # per client: masked frames, correct predictions, majority-label hits; the same on interior frames
        per_client = torch.zeros(clients, 6, dtype=torch.float64, device=self.job.device)
        majority = torch.tensor(self.majority_labels, dtype=torch.long, device=self.job.device)
        for local_index, batch in enumerate(loader):
            generator = mask_generator(self.config.seed, "heldout", local_index * world + rank)
            mask = span_mask(output_lengths(batch.lengths), self.config.mask_prob, self.config.mask_length, generator)
            batch, mask = batch.to(self.job.device), mask.to(self.job.device)
            with self._autocast():
                output = self.model(batch.feats, batch.lengths, batch.clients, mask)
                totals += masked_prediction_loss(output.logits, batch.targets, mask).stats
            interior = torch.zeros_like(mask)
            interior[:, 1:-1] = mask[:, :-2] & mask[:, 1:-1] & mask[:, 2:]
            for group in output.logits:
                targets = batch.targets[group.rows]
                scored = mask[group.rows] & (targets != IGNORE_INDEX)
                correct = (group.logits.argmax(dim=-1) == targets) & scored
                hits = (targets == majority[group.client]) & scored
                inner = interior[group.rows]
                counts = [scored, correct, hits, scored & inner, correct & inner, hits & inner]
                per_client[group.client] += torch.stack([c.sum() for c in counts]).double()
        self.model.train()
        summary: dict[str, Any] = summarize(self._all_reduce(totals).cpu())
        summary["loss"] = summary["masked_loss"] + self.config.unmasked_weight * summary["unmasked_loss"]
        per_client = self._all_reduce(per_client).cpu()
        frames, inner = float(per_client[:, 0].sum()), float(per_client[:, 3].sum())
        summary["majority_accuracy"] = float(per_client[:, 2].sum()) / frames if frames else 0.0
        summary["interior_frames"] = inner
        summary["interior_masked_accuracy"] = float(per_client[:, 4].sum()) / inner if inner else None
        summary["interior_majority_accuracy"] = float(per_client[:, 5].sum()) / inner if inner else None
        summary["per_client"] = {
            name: {
                "masked_frames": int(row[0]),
                "masked_accuracy": float(row[1] / row[0]) if row[0] else None,
                "majority_accuracy": float(row[2] / row[0]) if row[0] else None,
                "interior_frames": int(row[3]),
                "interior_masked_accuracy": float(row[4] / row[3]) if row[3] else None,
                "interior_majority_accuracy": float(row[5] / row[3]) if row[3] else None,
            }
            for name, row in zip(self.model.clients, per_client.tolist(), strict=True)
        }
        return summary

    def _finish(self, tracker: MlflowTracker | None, reporter: PipesReporter | None) -> dict[str, Any] | None:
        heldout = self.evaluate()
        if not self.job.is_main:
            self._barrier()
            return None
        model_state = self.model.state_dict()
        sha = weights_sha256(model_state)
        final_path = self.run_dir / "final.pt"
        save_checkpoint(
            final_path,
            {
                "format": CHECKPOINT_FORMAT,
                "step": self.step,
                "model": model_state,
                "preset": get_preset(self.config.preset).to_dict(),
                "clients": {n: c.k for n, c in self.config.clients.items()},
                "config": self.config.to_dict(),
                "data_versions": dict(self.config.data_versions),
                "weights_sha256": sha,
                "plan": self.plan.to_dict(),
            },
        )
        progress = self.progress
        result: dict[str, Any] = {
            "step": self.step,
            "final_loss": self.last_metrics.get("loss"),
            "final_masked_accuracy": self.last_metrics.get("masked_accuracy"),
            "heldout_masked_accuracy": heldout["masked_accuracy"] if heldout else None,
            "heldout_loss": heldout["loss"] if heldout else None,
            "heldout_majority_accuracy": heldout["majority_accuracy"] if heldout else None,
            "heldout_interior_masked_accuracy": heldout["interior_masked_accuracy"] if heldout else None,
            "heldout_interior_majority_accuracy": heldout["interior_majority_accuracy"] if heldout else None,
            "heldout_per_client": heldout["per_client"] if heldout else None,
            "heldout_utterances": len(self.heldout_set),
            "heldout_speakers": self.heldout_speakers,
            "chance_accuracy": self.config.chance_accuracy,
            "audio_seconds_per_second": progress["audio_seconds"] / progress["train_seconds"]
            if progress["train_seconds"] > 0
            else None,
            "train_audio_seconds": progress["audio_seconds"],
            "checkpoint": str(final_path),
            "checkpoint_sha256": sha,
            "resumed_from_step": self.resumed_from,
            "world_size": self.job.world_size,
            "unlabelled_utterances": self.unlabelled,
            "autoconfig": self.plan.to_dict(),
            "data_versions": dict(self.config.data_versions),
            "mlflow_run_id": tracker.run_id if tracker else None,
            "mlflow_run_url": tracker.url if tracker else None,
            "mlflow_ui": tracker.ui_command if tracker and not tracker.url else None,
        }
        if tracker is not None:
            tracker.finish(result, final_path)
        atomic_write_text(self.run_dir / "result.json", json.dumps(result, indent=2, sort_keys=True) + "\n")
        clear_oom(self.run_dir)
        log.info(
            "done: step %d, final loss %s, held-out masked accuracy %s (majority class %s; span interior %s, "
            "majority %s; chance %.3f), %s s of audio per second",
            self.step,
            _fmt(result["final_loss"]),
            _fmt(result["heldout_masked_accuracy"]),
            _fmt(result["heldout_majority_accuracy"]),
            _fmt(result["heldout_interior_masked_accuracy"]),
            _fmt(result["heldout_interior_majority_accuracy"]),
            result["chance_accuracy"],
            _fmt(result["audio_seconds_per_second"]),
        )
        if reporter is not None:
            metadata_keys = (
                "step", "final_loss", "heldout_masked_accuracy", "heldout_majority_accuracy", "heldout_loss", "chance_accuracy",
                "heldout_interior_masked_accuracy", "heldout_interior_majority_accuracy",
                "audio_seconds_per_second", "checkpoint", "checkpoint_sha256", "mlflow_run_id",
                "mlflow_run_url", "mlflow_ui", "autoconfig",
            )  # fmt: skip
            metadata = {("steps" if k == "step" else k): result[k] for k in metadata_keys if result[k] is not None}
            reporter.report(metadata, data_version=sha, paths=("checkpoint",))
        self._barrier()
        return result


WINDOW_BLOCKS = 16  # blocks (shard row groups) mixed at a time; the dataset caches one window


def loader_workers(config: TrainConfig, job: Distributed) -> int:
    """DataLoader worker processes: ``config.num_workers``, or, when it is negative (auto), none
    on CPU (the cores train; one process reads well over 2,000 s of audio per second) and up to 4
    per GPU process from the cores this node leaves it."""
    if config.num_workers >= 0:
        return config.num_workers
    if job.device.type != "cuda":
        return 0
    return max(0, min(4, available_cores() // max(1, job.local_world_size) - 1))


def idle_heads_term(model: HubertPretrainModel, logits: list) -> torch.Tensor:
    """Zero, but connected to the heads of clients absent from this micro-batch.

    A head whose client has no sample in a batch would get no gradient on that rank, and DDP would
    then have to search the graph for unused parameters after every backward pass (and warn on
    every rank when there are none). With this term every head gets a gradient, exactly zero.
    """
    present = {group.client for group in logits}
    idle = [head for index, head in enumerate(model.heads) if index not in present]
    if not idle:
        return torch.zeros((), device=next(model.parameters()).device)
    return sum(param.sum() for head in idle for param in head.parameters()) * 0.0


def majority_labels(index: CorpusIndex, train_refs: list[UtteranceRef]) -> list[int]:
    """Each client's most frequent label over its training utterances (index order of clients)."""
    counts: list[np.ndarray] = [np.zeros(1, np.int64) for _ in index.clients]
    for ref in train_refs:
        labels = index.labels[ref.client][ref.utt_id]
        found = np.bincount(labels[labels >= 0].astype(np.int64))
        if found.shape[0] > counts[ref.client].shape[0]:
            found, counts[ref.client] = counts[ref.client], found
        counts[ref.client][: found.shape[0]] += found
    return [int(c.argmax()) for c in counts]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _maybe_inject_fault(step: int, rank: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    out_of_memory = spec.startswith(OOM_FAULT)
    fault_rank, fault_step, marker = spec.removeprefix(OOM_FAULT).split(":", 2)
    if int(fault_rank) == rank and int(fault_step) == step and not os.path.exists(marker):
        if out_of_memory:
            Path(marker).write_text(f"rank {rank} ran out of memory at step {step}\n", encoding="utf-8")
            raise torch.OutOfMemoryError(f"fault injection: rank {rank} out of memory at step {step}")
        Path(marker).write_text(f"rank {rank} exited at step {step}\n", encoding="utf-8")
        log.error("fault injection: rank %d exits at step %d", rank, step)
        os._exit(1)


def plan_for_job(config: TrainConfig, job: Distributed) -> LaunchPlan:
    """The launch plan for this job's world size (explicit config values win); refuses to
    repeat a batch size that already ran out of CUDA memory in this run."""
    plan = plan_for(config, nproc=job.world_size)
    if config.threads is not None:
        plan = replace(plan, threads_per_process=config.threads)
    elif job.device.type == "cpu":
        plan = replace(plan, threads_per_process=max(1, available_cores() // job.local_world_size))
    marker = read_oom_marker(config.run_dir)
    if marker is not None and marker.get("batch_seconds") == plan.batch_seconds:
        log.error("a previous attempt ran out of memory with batch %.1f s; not retrying it", plan.batch_seconds)
        raise SystemExit(OOM_EXIT_CODE)
    torch.set_num_threads(plan.threads_per_process)
    log.info("autoconfig: %s", plan.reason)
    return plan


def _setup_logging(run_dir: Path, rank: int) -> list[logging.Handler]:
    """Rank 0 logs INFO to ``run_dir/train.log`` and to stderr, other ranks only warnings.

    Under Dagster Pipes rank 0's records reach the run through the Pipes session already, so
    stderr gets only warnings there: each line appears once in the run's log.
    """
    from dagster_pipes import PipesEnvVarParamsLoader

    handlers: list[logging.Handler] = []
    formatter = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    stream = logging.StreamHandler(sys.stderr)
    if PipesEnvVarParamsLoader().is_dagster_pipes_process():
        stream.setLevel(logging.WARNING)
    handlers.append(stream)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(run_dir / "train.log", encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(formatter)
        log.addHandler(handler)
    return handlers


def train(config: TrainConfig, *, stop_after_step: int | None = None) -> dict[str, Any] | None:
    """Train ``config`` in this process: alone, or as one rank of a torchrun job.

    Returns ``result.json``'s content on rank 0 (``None`` on other ranks). ``stop_after_step``
    simulates a preemption: checkpoint at that step and return ``None``. A CUDA out-of-memory
    error writes ``run_dir/oom.json`` and exits with :data:`OOM_EXIT_CODE`.
    """
    handlers = _setup_logging(Path(config.run_dir), int(os.environ.get("RANK", "0")))
    job: Distributed | None = None
    plan: LaunchPlan | None = None
    folder = contextlib.ExitStack()
    try:
        folder.enter_context(hold_run_folder(config.run_dir))
        job = init_distributed(config.device)
        reporter = PipesReporter(log) if job.is_main else None
        plan = plan_for_job(config, job)
        return Trainer(config, job, plan).run(reporter, stop_after_step)
    except torch.cuda.OutOfMemoryError as error:
        if job is None or plan is None:
            raise
        write_oom_marker(config.run_dir, job.rank, plan.batch_seconds, plan.grad_accum, str(error))
        log.error("CUDA out of memory (batch %.1f s, grad_accum %d): %s", plan.batch_seconds, plan.grad_accum, error)
        raise SystemExit(OOM_EXIT_CODE) from error
    finally:
        for handler in handlers:
            log.removeHandler(handler)
            handler.close()
        if job is not None and job.enabled and dist.is_initialized():
            dist.destroy_process_group()
        folder.close()


@contextlib.contextmanager
def hold_run_folder(run_dir: str) -> Iterator[None]:
    """This worker's claim on the run folder, and its tie to the launcher's life.

    Launched (by the asset, ``--launch`` or torchrun): die with the parent, and with the launcher
    named in the environment. Every worker holds the workers' lock shared; the run lock is the
    launcher's, or, when nobody launched this process, rank 0's own.
    """
    launched = LAUNCHER_ENV in os.environ or "TORCHELASTIC_RUN_ID" in os.environ
    if launched:
        die_with_parent()
        watch_launcher()
    with contextlib.ExitStack() as stack:
        stack.callback(hold_as_worker(run_dir).close)
        if not os.environ.get(RUN_LOCK_HELD_ENV) and int(os.environ.get("RANK", "0")) == 0:
            stack.enter_context(RunFolderLock(run_dir).acquire(command="python -m speech_assets.train"))
        yield
