"""The training engine: every training loop of the package takes its steps here.

An :class:`Objective` is a pure loss; the :class:`Engine` owns autocast, accumulation, clipping,
AdamW, the LR schedule, bit-exact checkpoints (written by a background thread) and the metrics
window (statistics stay on the device, read once per ``log_every`` steps). :class:`Fit` is the one
run around it (resume, MLflow, ``final.pt``, ``result.json``) of pretraining, distillation and CTC
fine-tuning. Rank 0 alone writes files, logs to MLflow and reports to Dagster Pipes.

Precision: ``auto`` is bf16 wherever the device supports it (no loss scaling). fp16 (a GPU without
bf16, or asked for) scales the loss; its GradScaler hands ``found_inf`` to the fused AdamW (every
parameter on CUDA), which skips a step on the device: no per-step host read there either.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function
from torch.utils.data import DataLoader, Dataset

from speech_assets.features.cmvn import Normaliser, describe
from speech_assets.layout import RunFiles
from speech_assets.runtime.faults import inject
from speech_assets.train.autoconfig import available_cores, resolve_precision
from speech_assets.train.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointWriter,
    capture_rng_state,
    finish_and_write,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    restore_rng_state,
)
from speech_assets.train.config import RunConfig
from speech_assets.train.data import Batch, BatchBuilder, BatchRequest, RankSampler, SpanMasking, UtteranceDataset
from speech_assets.train.tracking import MlflowTracker, PipesReporter, heldout_series, recorded_run_id
from speech_assets.utils import atomic_write_text

log = logging.getLogger("speech_assets.train")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
REPORT_RANGE = "Engine.report"  # profiler range of a step's metrics window: its reads, writes and checkpoint
LOGGED = ("loss", "masked_accuracy", "lr", "grad_norm", "audio_seconds_per_second")  # in the step's log line


class Objective(Protocol):
    """What one kind of training minimises. Pure: no optimizer, no I/O, no global RNG."""

    def __call__(self, model: nn.Module, batch: Batch, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss ``()`` and detached statistics ``(S,)`` float64 that add up over micro-batches and ranks."""
        ...

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        """The metrics of statistics ``(S,)`` summed over a window of steps and every rank."""
        ...


@dataclass
class Distributed:
    """This process's place in the job; ``batch``: ``(batch_seconds, grad_accum)``, for the out-of-memory marker."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    batch: tuple[float, int] | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def cores(self) -> int:
        """This process's share of the host's cores (at least one)."""
        return max(1, available_cores() // max(1, self.local_world_size))


def resolve_device(device: str) -> torch.device:
    """``auto``: CUDA when there is a GPU, else the CPU."""
    return torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")


def init_distributed(device: str) -> Distributed:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    target = resolve_device(device)
    if target.type == "cuda":
        torch.cuda.set_device(local_rank)
        target = torch.device("cuda", local_rank)
    if (
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ
    ):
        log.warning(
            "restarted by torchrun without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: "
            "the rendezvous may fail (see speech_assets.train.launch.TORCHRUN_ENV)"
        )
    if world > 1 and not dist.is_initialized():
        cuda = target.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", device_id=target if cuda else None)
        if not cuda:
            # gloo's init can return on one rank while another still connects to it: a rank with
            # nothing to do (a batch whose runs all finished) would exit and break the other's init
            dist.barrier()
    return Distributed(rank, local_rank, world, local_world, target)


def all_reduce(values: torch.Tensor, job: Distributed) -> torch.Tensor:
    if job.enabled:
        dist.all_reduce(values)
    return values


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    dtype = AUTOCAST_DTYPES.get(precision)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def warmup_linear_decay(warmup_steps: int, max_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1 over ``warmup_steps``, then linear decay to 0 at ``max_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))

    return factor


def build_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (HuBERT betas/eps); no weight decay on biases, norms and the mask embedding."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = bool(trainable) and all(p.device.type == "cuda" for p in trainable)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-6, fused=fused or None)


def default_workers(job: Distributed) -> int:
    """Loader workers when a run sets none: 0 on a CPU (its cores train), else up to 4 per GPU process of the rest."""
    if job.device.type != "cuda":
        return 0
    return min(4, job.cores - 1)


class BatchStream:
    """Endless stream of this rank's batches from ``(epoch, position)``; :meth:`state` is where to resume.

    One DataLoader with persistent workers serves every epoch (each request carries its epoch); once
    :meth:`schedule` is known the workers draw the span masks too (``builder``: what builds a batch
    there). On CUDA batches are pinned and the next one is copied on a side stream while the current one trains.
    """

    def __init__(
        self,
        dataset: UtteranceDataset,
        sampler: RankSampler,
        seed: int,
        epoch: int = 0,
        position: int = 0,
        device: torch.device | None = None,
        builder: Callable[[UtteranceDataset], Dataset[Batch]] = BatchBuilder,
    ) -> None:
        self.dataset, self.sampler, self.seed, self.builder = dataset, sampler, seed, builder
        self.epoch, self.position = epoch, position
        self.device = device if device is not None and device.type == "cuda" else None
        self._sizes: dict[int, int] = {}
        self._loader: DataLoader[Batch] | None = None
        self._slots: tuple[int, int, SpanMasking | None] | None = None  # first step, grad_accum, masking
        self._copies: torch.cuda.Stream | None = None
        self._restart()

    def __iter__(self) -> BatchStream:
        return self

    def schedule(self, first_step: int, grad_accum: int, masking: SpanMasking | None) -> None:
        """The next batch trains at ``first_step``, micro-batch 0; the loader draws masks with ``masking``."""
        self._slots = (first_step, grad_accum, masking)
        self._restart()

    def _restart(self) -> None:
        self._iterator: Iterator[Batch] | None = None
        self._ahead: tuple[Batch, int, int] | None = None  # copied to the device, not yet handed out
        self._issued = 0  # requests made since the last schedule or restart
        self._next_request = (self.epoch, self.position)  # where the loader's next iteration starts
        self._pending: deque[tuple[int, int]] = deque()  # (epoch, position) of requests not yet received

    def _requests(self) -> Iterator[BatchRequest]:
        epoch, start = self._next_request
        batches = self.sampler.batches(epoch)
        self._sizes[epoch] = len(batches)
        self._next_request = (epoch + 1, 0)
        for position in range(start, len(batches)):
            slot, masking = None, None
            if self._slots is not None:
                first, accum, masking = self._slots
                slot = (first + self._issued // accum, self._issued % accum)
            self._issued += 1
            self._pending.append((epoch, position))
            yield BatchRequest(tuple(batches[position]), epoch, position, slot, masking)

    def _from_loader(self) -> tuple[Batch, int, int]:
        while True:
            if self._iterator is None:
                if self._loader is None:
                    workers = self.sampler.num_workers
                    self._loader = DataLoader(
                        self.builder(self.dataset),
                        batch_size=None,
                        sampler=_Requests(self),
                        num_workers=workers,
                        pin_memory=self.device is not None,
                        persistent_workers=workers > 0,
                        # Own generator: creating a loader must not consume the global RNG.
                        generator=torch.Generator().manual_seed(self.seed),
                    )
                self._iterator = iter(self._loader)
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._iterator = None  # the next iteration (same workers) reads the next epoch
                continue
            epoch, position = self._pending.popleft()  # the loader yields in request order
            return batch, epoch, position + 1

    def __next__(self) -> Batch:
        if self.device is None:
            batch, self.epoch, self.position = self._from_loader()
            return batch
        if self._copies is None:
            self._copies = torch.cuda.Stream(self.device)
        if self._ahead is None:
            self._ahead = self._copy_ahead()
        batch, epoch, position = self._ahead
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._copies)
        for tensor in batch.tensors().values():
            tensor.record_stream(current)  # allocated on the copy stream, used on this one
        self._ahead = self._copy_ahead()
        self.epoch, self.position = epoch, position
        return batch

    def close(self) -> None:
        """Stop the loader's workers now. The loader and this stream hold each other, so only the
        garbage collector would free them, and a collection waits out torch's 5 s join per worker."""
        iterator, self._iterator, self._loader, self._ahead = self._iterator, None, None, None
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()  # what the iterator's __del__ calls; torch has no public name for it

    def _copy_ahead(self) -> tuple[Batch, int, int]:
        batch, epoch, position = self._from_loader()
        assert self._copies is not None and self.device is not None
        with torch.cuda.stream(self._copies):
            return batch.to(self.device), epoch, position

    def _size(self, epoch: int) -> int:
        if epoch not in self._sizes:
            self._sizes[epoch] = len(self.sampler.batches(epoch))
        return self._sizes[epoch]

    def state(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "batches_in_epoch": self._size(self.epoch),
            "batch_seconds": self.sampler.batch_seconds,
            "world_size": self.sampler.num_replicas,
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` was taken; with other batching, at the same fraction of the epoch."""
        epoch, position = int(state["epoch"]), int(state["position"])
        if (state["batch_seconds"], state["world_size"]) != (self.sampler.batch_seconds, self.sampler.num_replicas):
            position = round(position * self._size(epoch) / max(int(state["batches_in_epoch"]), 1))
            log.warning("batching changed since the checkpoint; continuing epoch %d at batch %d", epoch, position)
        self.epoch, self.position = epoch, position
        self._restart()


class _Requests:
    """The loader's sampler: each iteration is the stream's next epoch, so a persistent loader walks them all."""

    def __init__(self, stream: BatchStream) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[BatchRequest]:
        return self.stream._requests()


def append_line(path: Path, line: str) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")


class BackgroundWriter:
    """Rank 0's metrics writes, in submission order on one thread so that training never waits on
    a disk or a server. A call that raised is reported by the next call (the later ones still run).
    :meth:`log` appends to ``metrics`` (the run's metrics.jsonl) and logs to ``tracker``."""

    def __init__(self, metrics: Path | None = None, tracker: MlflowTracker | None = None) -> None:
        # its thread starts at the first submit: after the loader has forked its workers, which must
        # not inherit a lock this thread might hold
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics-writer")
        self._pending: list[Future[object]] = []
        self.metrics, self.tracker = metrics, tracker

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.submit(append_line, self.metrics, json.dumps({"step": step, **values}))
        if self.tracker is not None:
            self.submit(self.tracker.log_metrics, dict(values), step)

    def submit(self, call: Callable[..., object], *args: Any) -> None:
        self._raise()
        self._pending.append(self._executor.submit(call, *args))

    def flush(self) -> None:
        for future in self._pending:
            future.exception()  # waits
        self._raise()

    def close(self, quiet: bool = False) -> None:
        """``quiet``: log a failed write instead of raising."""
        self._executor.shutdown()
        try:
            self._raise()
        except RuntimeError as error:
            if not quiet:
                raise
            log.error("%s", error)

    def _raise(self) -> None:
        done = list(takewhile(Future.done, self._pending))  # one thread: they finish in order
        del self._pending[: len(done)]
        error = next((error for error in map(Future.exception, done) if error is not None), None)
        if error is not None:
            raise RuntimeError(f"writing metrics failed: {error!r}") from error


@dataclass
class Evaluation:
    """A stage's evaluation at each checkpoint, off the step's critical path: ``score(model)`` reads
    nothing but ``model``, a snapshot of the weights at the checkpoint's step, on a side thread (and
    a side CUDA stream) while the steps go on, at most one in flight; ``record(step, result)`` takes
    its result on the training thread at the next checkpoint or the run's end, so that an early stop
    acts one evaluation late. A checkpoint whose evaluation is still owed is evaluated on resume.
    ``background=False``: scored on the live weights between the steps and recorded at once."""

    score: Callable[[nn.Module], Mapping[str, Any] | None]
    record: Callable[[int, Mapping[str, Any] | None], Mapping[str, Any] | None]
    background: bool = True
    pending: tuple[int, Future[Mapping[str, Any] | None]] | None = field(default=None, init=False)
    _executor: ThreadPoolExecutor | None = field(default=None, init=False)

    def submit(self, step: int, model: nn.Module) -> None:
        if not self.background:
            self.pending = (step, Future())
            self.pending[1].set_result(self.score(model))
            return
        snapshot = copy.deepcopy(model)  # on a GPU, copies queued on the training stream
        device = next(model.parameters()).device
        ready = torch.cuda.current_stream(device).record_event() if device.type == "cuda" else None
        if self._executor is None:  # started after the loader forked its workers (see BackgroundWriter)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="evaluation")
        self.pending = (step, self._executor.submit(self._score, snapshot, ready))

    def _score(self, snapshot: nn.Module, ready: torch.cuda.Event | None) -> Mapping[str, Any] | None:
        if ready is None:
            return self.score(snapshot)
        side = torch.cuda.Stream(ready.device)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            return self.score(snapshot)

    def collect(self) -> tuple[int, Mapping[str, Any] | None] | None:
        """The evaluation in flight, waited for and recorded: ``(step, record's result)``."""
        if self.pending is None:
            return None
        step, future = self.pending
        self.pending = None
        return step, self.record(step, future.result())

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(cancel_futures=True)
            self._executor = None


class Engine:
    """Optimizer steps of ``model`` on this rank. ``forward`` (default: ``model``) is what an objective
    calls, in DDP when there are several ranks; ``extra`` goes into every checkpoint."""

    def __init__(
        self,
        model: nn.Module,
        job: Distributed,
        *,
        precision: str,
        lr: float,
        weight_decay: float,
        clip_norm: float,
        grad_accum: int = 1,
        schedule: Callable[[int], float] | None = None,
        forward: nn.Module | None = None,
        background_checkpoints: bool = True,
    ) -> None:
        self.model, self.job, self.precision = model, job, precision
        self.grad_accum, self.clip_norm = grad_accum, clip_norm if clip_norm > 0 else math.inf
        self.optimizer = build_optimizer(model, lr, weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule or (lambda step: 1.0))
        self.scaler = torch.amp.GradScaler(job.device.type, enabled=precision == "fp16")
        self._forward, self._wrapped = forward or model, None
        self.step = 0
        self.progress = {"audio_seconds": 0.0, "train_seconds": 0.0}
        self.metrics: dict[str, float] = {}
        self.resumed_from: int | None = None
        self.extra: dict[str, Any] = {}
        # (step, result) of the latest held-out evaluation in this attempt
        self.evaluation: tuple[int, Mapping[str, Any] | None] | None = None
        self.evaluation_owed = False  # the resumed checkpoint's Evaluation was not recorded
        self.stopped = False  # an evaluation said ``stop`` (early stopping): the run ends after that checkpoint
        self.keep_steps: frozenset[int] = frozenset()  # kept by pruning besides the newest (a dev-selected step)
        self.checkpoints = CheckpointWriter(background=background_checkpoints)

    @property
    def forward(self) -> nn.Module:
        if self._wrapped is None and self.job.enabled:
            cuda = self.job.device.type == "cuda"
            self._wrapped = DistributedDataParallel(self._forward, device_ids=[self.job.local_rank] if cuda else None)
        return self._wrapped or self._forward

    def train_step(self, objective: Objective, batches: Iterator[Batch]) -> tuple[torch.Tensor, float, torch.Tensor]:
        """Statistics ``(S,)`` summed over the micro-batches, seconds of audio, gradient norm before clipping."""
        forward, accum = self.forward, self.grad_accum
        stats: torch.Tensor | None = None
        seconds = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for micro in range(accum):
            batch = next(batches)
            no_sync = isinstance(forward, DistributedDataParallel) and micro < accum - 1  # reduce at the last only
            with forward.no_sync() if no_sync else contextlib.nullcontext(), autocast(self.precision, self.job.device):
                loss, micro_stats = objective(forward, batch, self.step, micro)
            self.scaler.scale(loss / accum).backward()
            stats = micro_stats if stats is None else stats + micro_stats
            seconds += batch.seconds
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.step += 1
        assert stats is not None
        return stats, seconds, grad_norm

    def run(
        self,
        objective: Objective,
        stream: BatchStream,
        config: RunConfig,
        *,
        tracker: MlflowTracker | None = None,
        evaluate: Evaluation | None = None,
    ) -> bool:
        """Steps up to ``config.max_steps``; ``False`` after a ``preempt`` fault (that step is checkpointed).
        ``evaluate``'s numbers are logged as ``val/<name>`` at the step it evaluated; a true ``stop`` in its
        result ends the run after the checkpoint that records it."""
        stream.schedule(self.step, self.grad_accum, getattr(objective, "masking", None))
        writer = BackgroundWriter(RunFiles(Path(config.run_dir)).metrics, tracker) if self.job.is_main else None
        try:
            if evaluate is not None and self.evaluation_owed:  # the live weights are its snapshot's
                owed = (self.step, evaluate.record(self.step, evaluate.score(self.model)))
                self._recorded(owed, writer, alone=True)
            finished = self._steps(objective, stream, config, evaluate, writer)
            if finished and evaluate is not None:
                started = time.perf_counter()  # the run's wall time includes its last evaluation
                self._recorded(evaluate.collect(), writer, alone=True)
                self.progress["train_seconds"] += time.perf_counter() - started
        except BaseException:
            with contextlib.suppress(Exception):  # the step's own error is the one to report
                self.checkpoints.wait()
            if writer is not None:
                writer.close(quiet=True)  # what was submitted is written; the training error wins
            raise
        finally:
            if evaluate is not None:
                evaluate.close()
        self.checkpoints.wait()  # a checkpoint the run returns after is on disk
        if writer is not None:
            writer.close()
        return finished

    def _recorded(
        self,
        evaluated: tuple[int, Mapping[str, Any] | None] | None,
        writer: BackgroundWriter | None,
        alone: bool = False,
    ) -> dict[str, float]:
        """An evaluation's ``val/`` series for the step's own line; of another step (or ``alone``),
        logged on a line of its own."""
        if evaluated is None:
            return {}
        self.evaluation = evaluated
        self.stopped = self.stopped or bool((evaluated[1] or {}).get("stop"))
        held_out = heldout_series(evaluated[1] or {})
        if writer is not None and held_out and (alone or evaluated[0] != self.step):
            writer.log(evaluated[0], held_out)
            return {}
        return held_out

    def _steps(
        self,
        objective: Objective,
        stream: BatchStream,
        config: RunConfig,
        evaluate: Evaluation | None,
        writer: BackgroundWriter | None,
    ) -> bool:
        # The window's statistics stay on the device; they, the gradient norm and the audio
        # seconds are read once per log_every steps, in one transfer. Throughput is wall time from
        # the end of the attempt's first step (its warm-up): evaluations and checkpoints included.
        window: torch.Tensor | None = None
        audio, timed_audio = 0.0, 0.0  # seconds of audio in the window, and in its timed steps
        window_start, timed_start, first_step = time.perf_counter(), None, self.step + 1
        minutes = float(getattr(config, "checkpoint_minutes", 0.0) or 0.0)
        eval_every = int(getattr(config, "eval_every", 0) or 0)
        last_checkpoint = time.monotonic()
        while self.step < config.max_steps and not self.stopped:
            stats, seconds, grad_norm = self.train_step(objective, stream)
            window = stats.detach().clone() if window is None else window.add_(stats)
            if self.step == first_step:  # the first step of an attempt pays for warm-up: untimed
                timed_start = time.perf_counter()
            audio += seconds
            timed_audio += seconds if self.step > first_step else 0.0
            preempted = inject("train.step", error=torch.OutOfMemoryError, rank=self.job.rank, step=self.step)
            checkpoint = (
                preempted
                or self.step == config.max_steps
                or self.step % config.checkpoint_every == 0
                or (eval_every > 0 and self.step % eval_every == 0)
            )
            if minutes and not checkpoint and self.step % config.log_every == 0:
                # collective: any rank's clock makes every rank take it
                due = time.monotonic() - last_checkpoint >= 60.0 * minutes
                flag = torch.tensor([1.0 if due else 0.0], device=self.job.device)
                checkpoint = bool(all_reduce(flag, self.job).item() > 0)
            if checkpoint or self.step % config.log_every == 0:
                with record_function(REPORT_RANGE):  # the window's one device read, its writes, the checkpoint
                    host = torch.tensor([audio, timed_audio], dtype=torch.float64).to(window.device)
                    reduced = all_reduce(torch.cat([window, host]), self.job)
                    totals = torch.cat([reduced, grad_norm.detach().double().reshape(1).to(reduced.device)]).tolist()
                    now = time.perf_counter()
                    if timed_start is not None:
                        self.progress["train_seconds"] += now - timed_start
                        timed_start = now
                    self.progress["audio_seconds"] += totals[-2]
                    self.metrics = objective.metrics(torch.tensor(totals[:-3], dtype=torch.float64)) | {
                        "lr": float(self.scheduler.get_last_lr()[0]),
                        "grad_norm": totals[-1],
                        "audio_seconds_per_second": totals[-3] / max(now - window_start, 1e-9),
                        "epoch": float(stream.epoch),
                    }
                    window_start = now
                    held_out: dict[str, float] = {}
                    if checkpoint and evaluate is not None:
                        # the evaluation in flight first: its record decides what pruning keeps
                        self._recorded(evaluate.collect(), writer)
                        if not (self.stopped or preempted):  # a preempted step's is owed (resume)
                            evaluate.submit(self.step, self.model)
                            if not evaluate.background:
                                held_out = self._recorded(evaluate.collect(), writer)
                    if writer is not None:
                        self._report(config.max_steps, held_out, writer)
                    if checkpoint:
                        if writer is not None:
                            writer.flush()  # metrics lines up to a checkpoint are on disk before it is
                        owed = evaluate is not None and (preempted or evaluate.pending is not None)
                        self.save_checkpoint(Path(config.run_dir), stream, config.keep_checkpoints, owed)
                        last_checkpoint = time.monotonic()
                    window, audio, timed_audio = None, 0.0, 0.0
            if preempted:
                return False
        if timed_start is not None:  # the last report's evaluation and checkpoint
            self.progress["train_seconds"] += time.perf_counter() - timed_start
        return True

    def _report(self, max_steps: int, held_out: Mapping[str, float], writer: BackgroundWriter) -> None:
        shown = " ".join(f"{key} {self.metrics[key]:.4g}" for key in LOGGED if key in self.metrics)
        if "val/leak_free_masked_accuracy" in held_out:
            shown += f" held-out leak-free masked accuracy {held_out['val/leak_free_masked_accuracy']:.4g}"
        log.info("step %d/%d %s", self.step, max_steps, shown)
        writer.log(self.step, {**self.metrics, **held_out})

    def save_checkpoint(self, run_dir: Path, stream: BatchStream, keep: int, owed: bool = False) -> None:
        """Collective: every rank's RNG state is gathered; rank 0 hands the state to the background writer.
        ``owed``: this step's :class:`Evaluation` is not recorded in it."""
        rng = capture_rng_state(self.job.device)
        states: list[Any] = [rng] * self.job.world_size
        if self.job.enabled:
            dist.all_gather_object(states, rng)
        if self.job.is_main:
            state = {
                "format": CHECKPOINT_FORMAT,
                "step": self.step,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "sampler": stream.state(),
                "rng": states,
                "weights_sha256": None,  # filled by the writer, from the copy it writes
                "progress": dict(self.progress),
                "metrics": dict(self.metrics),
                "evaluation_owed": owed,
                **self.extra,
            }
            kept = self.keep_steps
            self.checkpoints.submit(
                RunFiles(run_dir).checkpoint(self.step), state, after=lambda: prune_checkpoints(run_dir, keep, kept)
            )
        self.barrier()

    def resume(
        self, run_dir: str, stream: BatchStream, identity: Callable[[Mapping[str, Any]], object]
    ) -> dict[str, Any] | None:
        """Continue from the run's latest checkpoint, if any, and return it; ``identity`` of a config
        says which model it trains: a checkpoint of another model is refused."""
        path = latest_checkpoint(run_dir)
        if path is None:
            return None
        state = load_checkpoint(path)
        if identity(state["config"]) != identity(self.extra["config"]):
            raise ValueError(f"{path} was trained with another model: {identity(state['config'])}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = self.resumed_from = int(state["step"])
        self.progress, self.metrics = dict(state["progress"]), dict(state["metrics"])
        self.evaluation_owed = bool(state.get("evaluation_owed"))
        stream.load_state(state["sampler"])
        rng = state["rng"]
        if len(rng) == self.job.world_size:
            restore_rng_state(rng[self.job.rank], self.job.device)
        else:
            log.warning("world size changed (%d -> %d): RNG streams restart", len(rng), self.job.world_size)
        log.info("resumed from %s (step %d)", path, self.step)
        return state

    def save_final(self, run_dir: Path, **contents: Any) -> tuple[Path, str]:
        self.checkpoints.wait()
        state = {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "model": self.model.state_dict(),
            "weights_sha256": None,  # filled from the weights, as a step checkpoint's
            **contents,
        }
        return finish_and_write(RunFiles(run_dir).final, state), state["weights_sha256"]

    def barrier(self) -> None:
        if self.job.enabled:
            dist.barrier()


@contextlib.contextmanager
def tracking(config: RunConfig, job: Distributed, plan: Mapping[str, Any]) -> Iterator[MlflowTracker | None]:
    """Rank 0's MLflow run (a resumed attempt continues the one in ``mlflow_run_id``); failed if the body raises."""
    if not (job.is_main and config.mlflow_tracking_uri):
        yield None
        return
    tracker = MlflowTracker(config)
    tracker.start(recorded_run_id(Path(config.run_dir)), plan)
    atomic_write_text(RunFiles(Path(config.run_dir)).mlflow_run_id, tracker.run_id + "\n")
    try:
        yield tracker
    except BaseException:
        with contextlib.suppress(Exception):
            tracker.fail()
        raise


def fixed_batch(job: Distributed, config: Any) -> str:
    """Threads and the out-of-memory marker's batch of a run without a launch plan; its precision."""
    torch.set_num_threads(config.threads or job.cores)
    job.batch = (config.batch_seconds, config.grad_accum)
    cuda = job.device.type == "cuda"
    return resolve_precision(config.precision, job.device.type, cuda and torch.cuda.is_bf16_supported())


# the result keys every run ends with, which its Dagster materialization reports too
MATERIALIZED = ("step", "final_loss", "checkpoint", "checkpoint_sha256", "mlflow_run_id", "mlflow_run_url")


class Fit:
    """The one training run of every stage. A stage builds its data, model, stream and objective,
    hands them to :meth:`start` and overrides the hooks below; :attr:`materialized`: its result keys
    the Dagster materialization reports."""

    materialized: tuple[str, ...] = ()
    tracker: MlflowTracker | None = None
    engine: Engine
    config: Any
    stream: BatchStream
    objective: Objective

    def start(
        self,
        model: nn.Module,
        job: Distributed,
        config: Any,
        stream: BatchStream,
        objective: Objective,
        *,
        precision: str,
        schedule: Callable[[int], float],
        speakers: Mapping[str, Any],
        cmvn: Normaliser,
        identity: Callable[[Mapping[str, Any]], object],
        forward: nn.Module | None = None,
        launch: Mapping[str, Any] | None = None,
        evaluate: Evaluation | None = None,
        **record: Any,
    ) -> dict[str, Any] | None:
        """Build the :class:`Engine` and resume; the checkpoint continued, or ``None``. ``record`` goes
        into every checkpoint; ``launch``: the plan MLflow records (default: the config's fixed batch)."""
        grad_accum = config.grad_accum if launch is None else launch["grad_accum"]
        self.engine = engine = Engine(
            model,
            job,
            precision=precision,
            lr=config.lr,
            weight_decay=config.weight_decay,
            clip_norm=config.clip_norm,
            grad_accum=grad_accum,
            schedule=schedule,
            forward=forward,
            background_checkpoints=getattr(config, "background_checkpoints", True),
        )
        self.config, self.stream, self.objective, self.evaluate = config, stream, objective, evaluate
        fixed = {"nproc": job.world_size, "batch_seconds": config.batch_seconds, "grad_accum": grad_accum}
        self.launch_plan = dict(launch or {**fixed, "precision": precision})
        engine.extra = {
            **record,
            "config": config.to_dict(),
            "data_versions": dict(config.data_versions),
            "speakers": speakers,
            "normalisation": describe(cmvn),
        }
        return engine.resume(config.run_dir, stream, identity)

    @property
    def step(self) -> int:
        return self.engine.step

    def announce(self) -> None:
        """Every rank, before the first step: log what the run trains."""

    def conclude(self) -> None:
        """Collective, after the last step: what every rank computes for the result."""

    def final(self) -> dict[str, Any]:
        """Rank 0: the stage's contents of ``final.pt`` (``step``: the step of its weights)."""
        return {}

    def result(self) -> dict[str, Any]:
        """Rank 0, after ``final.pt``: the stage's keys of the result."""
        return {}

    def done(self, result: Mapping[str, Any]) -> None:
        log.info("done: step %d, final loss %s, %s", result["step"], result["final_loss"], result["checkpoint"])

    def materialization(self, result: Mapping[str, Any]) -> dict[str, Any]:
        return {key: result[key] for key in (*MATERIALIZED, *self.materialized)}

    def run(self, reporter: PipesReporter | None = None) -> dict[str, Any] | None:
        """Train, then rank 0 writes ``final.pt`` and ``result.json``; the result on rank 0, ``None``
        elsewhere and after a preemption."""
        engine, config, job = self.engine, self.config, self.engine.job
        run_dir = Path(config.run_dir)
        with tracking(config, job, self.launch_plan) as tracker:
            self.tracker = tracker
            engine.extra["mlflow_run_id"] = tracker.run_id if tracker else None
            self.announce()
            try:
                trained = engine.run(self.objective, self.stream, config, tracker=tracker, evaluate=self.evaluate)
            finally:
                self.stream.close()
            if not trained:
                return None
            self.conclude()
            if not job.is_main:
                engine.barrier()
                return None
            contents, extra = self.final(), engine.extra
            final, sha = engine.save_final(
                run_dir,
                **{key: extra[key] for key in ("kind",) if key in extra},
                **contents,
                **{key: extra[key] for key in ("config", "data_versions", "speakers", "normalisation")},
            )
            result = {
                "step": contents.get("step", engine.step),
                "final_loss": engine.metrics.get("loss"),
                "checkpoint": str(final),
                "checkpoint_sha256": sha,
                "train_audio_seconds": engine.progress["audio_seconds"],
                "train_seconds": engine.progress["train_seconds"],
                "resumed_from_step": engine.resumed_from,
                "world_size": job.world_size,
                "precision": engine.precision,
                "data_versions": dict(config.data_versions),
                "mlflow_run_id": tracker.run_id if tracker else None,
                "mlflow_run_url": tracker.url if tracker else None,
                **self.result(),
            }
            self.done(result)
            if tracker is not None:
                tracker.finish(result, final)
            atomic_write_text(RunFiles(run_dir).result, json.dumps(result, indent=2, sort_keys=True) + "\n")
            if reporter is not None:
                present = {key: value for key, value in self.materialization(result).items() if value is not None}
                reporter.report(present, data_version=sha, paths=("checkpoint",))
        engine.barrier()
        return result
