"""Centralised HuBERT pretraining: single process or one process per device under torchrun (DDP).

Masked prediction with one head per client on the engine's :class:`Fit`; the held-out utterances
are evaluated at each checkpoint (the ``val/`` series).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speech_assets.features.cmvn import training_cmvn
from speech_assets.layout import CmvnFiles
from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.model.presets import get_preset
from speech_assets.model.speed import profile_model
from speech_assets.train.augment import Augmenter
from speech_assets.train.autoconfig import profile_durations
from speech_assets.train.config import TrainConfig
from speech_assets.train.data import UtteranceDataset, split_corpus
from speech_assets.train.engine import (
    BatchStream,
    Distributed,
    Evaluation,
    Fit,
    default_workers,
    seed_everything,
    warmup_linear_decay,
)
from speech_assets.train.launch import handed_plan, plan_for
from speech_assets.train.objectives import MaskedPrediction, majority_labels
from speech_assets.train.oom import clear_oom, refuse_known_oom
from speech_assets.train.sampling import BlockShuffleSampler
from speech_assets.train.tracking import PipesReporter
from speech_assets.train.worker import worker

log = logging.getLogger("speech_assets.train")
WINDOW_BLOCKS = 16  # blocks (shard row groups) mixed at a time; the dataset caches one window


class Trainer(Fit):
    """Data, model and engine for ``config`` on this rank, resumed from the latest checkpoint if any."""

    materialized = (
        "heldout_leak_free_masked_accuracy",
        "heldout_leak_free_majority_accuracy",
        "heldout_masked_accuracy",
        "heldout_majority_accuracy",
        "heldout_loss",
        "chance_accuracy",
        "heldout_interior_masked_accuracy",
        "heldout_interior_majority_accuracy",
        "audio_seconds_per_second",
        "mlflow_ui",
        "autoconfig",
    )

    def __init__(self, config: TrainConfig, job: Distributed) -> None:
        self.job = job
        augment = Augmenter(config.augmentation(), seed=config.seed)
        # negative: the engine's default (on CPU none: one process reads over 2,000 s of audio per second)
        workers = config.num_workers if config.num_workers >= 0 else default_workers(job)
        index, train_refs, heldout_refs, speakers = split_corpus(config, config.heldout_speakers)
        if not train_refs:
            raise ValueError("no labelled training utterances in the shards")
        self.heldout_speakers = speakers["heldout"]
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
        seed_everything(config.seed)  # the model's initial weights: nothing else draws before them
        clients = {n: c.k for n, c in config.clients.items()}
        self.model = HubertPretrainModel(get_preset(config.preset), clients).to(job.device)
        if config.compile:
            self.model.compile_encoder()
        # analytic and cheap: what this rank would plan by when the launcher handed no plan
        data = profile_durations(np.array([u.seconds for u in train_refs]))
        profile = profile_model(config.preset, len(clients), list(clients.values()), data.mean_seconds)
        cmvn = training_cmvn(config.normalisation, CmvnFiles(Path(config.cmvn).parent).speaker_sums, speakers["train"])
        plan = handed_plan(config) or plan_for(config, data, profile, nproc=job.world_size)
        # this job's world size and threads; a batch that already ran out of CUDA memory in this run is refused
        if config.threads is None and job.device.type == "cpu":
            threads = job.cores
        else:
            threads = config.threads or plan.threads_per_process
        self.launch = plan = replace(plan, nproc=job.world_size, threads_per_process=threads)
        refuse_known_oom(config.run_dir, plan.batch_seconds)
        torch.set_num_threads(plan.threads_per_process)
        log.info("autoconfig: %s", plan.reason)
        job.batch = (plan.batch_seconds, plan.grad_accum)
        self.train_set = UtteranceDataset(
            index,
            train_refs,
            cmvn,
            config.max_frames,
            seed=config.seed,
            cached_row_groups=WINDOW_BLOCKS + 1,
            augment=augment,
            crop_batches=config.crop_batches,
        )
        if augment.options.enabled:
            log.info("augmenting training utterances: %s", augment.options.describe())
        self.heldout_set = UtteranceDataset(index, heldout_refs, cmvn, config.max_frames)
        sampler = BlockShuffleSampler(
            [(u.shard, u.row_group) for u in train_refs],
            self.train_set.seconds,
            plan.batch_seconds,
            num_replicas=job.world_size,
            rank=job.rank,
            seed=config.seed,
            window_blocks=WINDOW_BLOCKS,
            num_workers=workers,
        )
        objective = MaskedPrediction(
            self.model,
            job.device,
            seed=config.seed,
            mask_prob=config.mask_prob,
            mask_length=config.mask_length,
            unmasked_weight=config.unmasked_weight,
            rank=job.rank,
        )
        seed_everything(config.seed + 1 + job.rank)  # distinct dropout streams per rank
        stream = BatchStream(self.train_set, sampler, config.seed, device=job.device)
        self.start(
            self.model,
            job,
            config,
            stream,
            objective,
            precision=plan.precision,
            schedule=warmup_linear_decay(config.warmup_steps, config.max_steps),
            speakers=speakers,
            cmvn=cmvn,
            # what a checkpoint must share with the run to continue it: the preset and the client codebooks
            identity=lambda stored: (
                stored["preset"],
                {name: client["k"] for name, client in stored["clients"].items()},
            ),
            launch=plan.to_dict(),
            # one rank: a snapshot scored beside the steps; several: the evaluation's all_reduce must
            # keep its place among DDP's collectives, so it runs between the steps (a compiled
            # encoder is not copied)
            evaluate=Evaluation(
                self.score_heldout,
                lambda step, result: result,
                background=job.world_size == 1 and not config.compile,
            )
            if len(self.heldout_set)
            else None,
            plan=plan.to_dict(),
        )

    def score_heldout(self, model: HubertPretrainModel | None = None) -> dict[str, Any] | None:
        if len(self.heldout_set) == 0:
            return None
        plan = self.launch
        return self.objective.evaluate(
            self.heldout_set, self.majority_labels, plan.batch_seconds, self.job, plan.precision, model
        )

    def conclude(self) -> None:
        last = self.engine.evaluation  # the final step's checkpoint evaluated the final weights
        self.heldout = dict((last[1] if last and last[0] == self.step else self.score_heldout()) or {})

    def final(self) -> dict[str, Any]:
        config = self.config
        return {
            "preset": get_preset(config.preset).to_dict(),
            "clients": {n: c.k for n, c in config.clients.items()},
            "plan": self.launch.to_dict(),
        }

    def result(self) -> dict[str, Any]:
        heldout, progress = self.heldout, self.engine.progress
        return {
            "final_masked_accuracy": self.engine.metrics.get("masked_accuracy"),
            **{f"heldout_{key}": heldout.get(key) for key in HELDOUT_KEYS},
            "heldout_per_client": heldout.get("per_client"),
            "heldout_utterances": len(self.heldout_set),
            "heldout_speakers": self.heldout_speakers,
            "chance_accuracy": self.config.chance_accuracy,
            "audio_seconds_per_second": progress["audio_seconds"] / progress["train_seconds"]
            if progress["train_seconds"] > 0
            else None,
            "unlabelled_utterances": self.unlabelled,
            "autoconfig": self.launch.to_dict(),
            "mlflow_ui": self.tracker.ui_command if self.tracker and not self.tracker.served else None,
        }

    def done(self, result: Mapping[str, Any]) -> None:
        clear_oom(self.config.run_dir)
        log.info(
            "done: step %d, final loss %s, held-out masked accuracy on leak-free frames %s (majority class %s; "
            "all masked frames %s, majority %s; chance %.3f), %s s of audio per second",
            self.step,
            _fmt(result["final_loss"]),
            *(_fmt(result[k]) for k in self.materialized[:4]),
            result["chance_accuracy"],
            _fmt(result["audio_seconds_per_second"]),
        )

    def materialization(self, result: Mapping[str, Any]) -> dict[str, Any]:
        shown = super().materialization(result)
        return {"steps": shown.pop("step"), **shown}


HELDOUT_KEYS = (
    "masked_accuracy",
    "loss",
    "majority_accuracy",
    "interior_masked_accuracy",
    "interior_majority_accuracy",
    "leak_free_masked_accuracy",
    "leak_free_majority_accuracy",
    "leak_free_frames",
)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def train(config: TrainConfig) -> dict[str, Any] | None:
    """Train ``config`` in this process (alone or as one torchrun rank); ``result.json``'s content on rank 0."""
    with worker(config.run_dir, config.device, command="python -m speech_assets.train") as job:
        reporter = PipesReporter(log) if job.is_main else None  # before the plan: its log line goes to Dagster too
        return Trainer(config, job).run(reporter)
