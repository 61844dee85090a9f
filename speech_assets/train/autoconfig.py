"""Auto-configuration: processes, per-device batch (seconds of audio), accumulation and precision.

``decide`` is a pure function of the profiles, so its policy is tested with fake ones.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from speech_assets.features.shards import FRAME_RATE_HZ, read_shard_table
from speech_assets.model.speed import ModelProfile

GIB = 1 << 30
# Fraction of GPU memory the plan may use, and what CUDA context/allocator/workspaces take besides.
GPU_MEMORY_FRACTION = 0.85
GPU_RESERVED_BYTES = 2 * GIB
# Activation estimates are rough: plan for twice as much.
ACTIVATION_SAFETY = 2.0
# On CPU, larger micro-batches stop improving throughput and only make steps slower.
CPU_MAX_BATCH_SECONDS = 32.0
# One single-threaded process per core on CPU: small GEMMs scale better across processes than
# threads (bench/train.py, tiny, 2 cores: 1 process x 2 threads ~95 s of audio/s, 2 x 1 ~135).
CPU_MAX_PROCESSES = 8
# A GPU step covers at least HuBERT Base's 2,800 s (the CPU-sized 60 s would leave the device idle
# in kernel launches), but never more than a tenth of the training audio.
GPU_MIN_STEP_SECONDS = 2800.0
GPU_MIN_STEPS_PER_EPOCH = 10
# Peak dense bf16 tensor-core FLOP/s by GPU name substring (first match wins): the MFU denominator.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10", 125e12),
    ("L4", 121e12),
)


@dataclass(frozen=True)
class HardwareProfile:
    cpu_cores: int
    ram_bytes: int
    gpu_count: int = 0
    gpu_name: str | None = None
    gpu_memory_bytes: int = 0
    bf16_supported: bool = False


@dataclass(frozen=True)
class DatasetProfile:
    """Durations (seconds, from ``num_frames`` at 100 Hz) of the utterances in the shards."""

    utterances: int
    total_seconds: float
    mean_seconds: float
    max_seconds: float


@dataclass(frozen=True)
class LaunchPlan:
    nproc: int
    batch_seconds: float
    grad_accum: int
    precision: str
    device: str
    threads_per_process: int
    reason: str

    @property
    def effective_batch_seconds(self) -> float:
        return self.batch_seconds * self.nproc * self.grad_accum

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "effective_batch_seconds": self.effective_batch_seconds}


def peak_bf16_flops(gpu_name: str | None) -> float | None:
    return next((flops for key, flops in PEAK_BF16_FLOPS if gpu_name and key in gpu_name), None)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def resolve_precision(precision: str, device: str, bf16_supported: bool) -> str:
    """``auto``: fp32 on CPU, else bf16 where supported, else fp16; fp16 on a CPU (a federation's
    setting reaching a client without GPU) falls back to fp32."""
    if precision == "auto":
        return "fp32" if device == "cpu" else "bf16" if bf16_supported else "fp16"
    return "fp32" if device == "cpu" and precision == "fp16" else precision


def profile_hardware() -> HardwareProfile:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if not torch.cuda.is_available():
        return HardwareProfile(cpu_cores=available_cores(), ram_bytes=ram)
    props = torch.cuda.get_device_properties(0)
    return HardwareProfile(
        cpu_cores=available_cores(),
        ram_bytes=ram,
        gpu_count=torch.cuda.device_count(),
        gpu_name=props.name,
        gpu_memory_bytes=props.total_memory,
        bf16_supported=torch.cuda.is_bf16_supported(),
    )


def profile_dataset(shards: Sequence[str]) -> DatasetProfile:
    frames = [read_shard_table(path, columns=["num_frames"]).column("num_frames").to_numpy() for path in shards]
    return profile_durations(np.concatenate(frames).astype(np.float64) / FRAME_RATE_HZ if frames else np.zeros(0))


def profile_durations(seconds: np.ndarray) -> DatasetProfile:
    if seconds.size == 0:
        raise ValueError("the shards hold no utterances")
    return DatasetProfile(
        utterances=int(seconds.size),
        total_seconds=float(seconds.sum()),
        mean_seconds=float(seconds.mean()),
        max_seconds=float(seconds.max()),
    )


def decide(
    hw: HardwareProfile,
    data: DatasetProfile,
    model: ModelProfile,
    target_batch_seconds: float,
    *,
    nproc: int | str = "auto",
    batch_seconds: float | None = None,
    grad_accum: int | str = "auto",
    precision: str = "auto",
    device: str = "auto",
    max_utterance_seconds: float = 15.0,
) -> LaunchPlan:
    """Choose the launch: explicit arguments win, ``"auto"``/``None`` are decided here. The per-device
    batch is the largest that fits memory without exceeding the target; accumulation makes up the
    rest and the batch is evened out so ``batch * nproc * accum`` is close to the target."""
    notes: list[str] = []
    if device == "auto":
        device = "cuda" if hw.gpu_count > 0 else "cpu"
    if device == "cuda" and hw.gpu_count == 0:
        raise ValueError("device 'cuda' requested but no GPU was found")
    notes.append(
        f"hardware: {hw.cpu_cores} cores, {hw.ram_bytes / GIB:.1f} GiB RAM"
        + (f", {hw.gpu_count}x {hw.gpu_name} ({hw.gpu_memory_bytes / GIB:.1f} GiB)" if hw.gpu_count else ", no GPU")
    )

    if device == "cpu" and precision == "fp16":
        raise ValueError("fp16 training needs CUDA (use fp32 or bf16 on CPU)")
    if precision == "auto":
        precision = resolve_precision(precision, device, hw.bf16_supported)
        gpu = "GPU supports bf16" if hw.bf16_supported else "no bf16 on this GPU, fp16 + GradScaler"
        notes.append(f"precision {precision}: {'CPU' if device == 'cpu' else gpu}")

    if nproc == "auto":
        if device == "cuda":
            nproc = hw.gpu_count
            notes.append(f"nproc {nproc}: one process per GPU")
        else:
            nproc = max(1, min(hw.cpu_cores, CPU_MAX_PROCESSES))
            notes.append(
                f"nproc {nproc}: one process per core (up to {CPU_MAX_PROCESSES}); "
                "processes scale better than threads on CPU"
            )
    elif device == "cuda" and int(nproc) > hw.gpu_count:
        raise ValueError(f"nproc {nproc} exceeds the {hw.gpu_count} GPUs")
    nproc = int(nproc)
    threads = max(1, hw.cpu_cores // nproc) if device == "cpu" else max(1, min(4, hw.cpu_cores // nproc))

    longest = min(data.max_seconds, max_utterance_seconds)
    per_second = ACTIVATION_SAFETY * (
        model.activation_bytes_per_second_16bit
        if precision in ("bf16", "fp16")
        else model.activation_bytes_per_second_fp32
    )
    if device == "cuda":
        budget = GPU_MEMORY_FRACTION * hw.gpu_memory_bytes - GPU_RESERVED_BYTES - model.state_bytes
    else:
        budget = 0.5 * hw.ram_bytes / nproc - model.state_bytes
    memory_cap = budget / per_second
    notes.append(
        f"model {model.preset}: {model.parameters / 1e6:.2f}M params, weights+grads+Adam "
        f"{model.state_bytes / 2**20:.0f} MiB, ~{per_second / 2**20:.1f} MiB activations per second of audio "
        f"(x{ACTIVATION_SAFETY:g} margin) -> memory fits {memory_cap:.0f} s per device"
    )
    if memory_cap < longest:
        raise ValueError(
            f"a {longest:.1f} s utterance needs more memory than the {budget / GIB:.1f} GiB budget per device"
        )

    if device == "cuda" and batch_seconds is None:
        floor = min(GPU_MIN_STEP_SECONDS, data.total_seconds / GPU_MIN_STEPS_PER_EPOCH)
        if target_batch_seconds < floor:
            notes.append(
                f"target raised from {target_batch_seconds:g} s to {floor:g} s per step: a GPU step of "
                f"{target_batch_seconds / nproc:g} s per device would leave it mostly idle (HuBERT Base steps "
                f"{GPU_MIN_STEP_SECONDS:g} s; at most a tenth of the {data.total_seconds:.0f} s of training audio)"
            )
            target_batch_seconds = floor
    target_per_device = target_batch_seconds / nproc
    if batch_seconds is None:
        cap = memory_cap if device == "cuda" else min(memory_cap, CPU_MAX_BATCH_SECONDS)
        batch_seconds = max(min(target_per_device, cap), longest)
        accum = int(grad_accum) if grad_accum != "auto" else math.ceil(target_batch_seconds / (nproc * batch_seconds))
        if grad_accum == "auto":
            batch_seconds = max(target_batch_seconds / (nproc * accum), longest)
        batch_seconds = math.floor(batch_seconds * 10) / 10
        notes.append(f"batch {batch_seconds:g} s per device (target {target_per_device:.1f}, cap {cap:.0f})")
    else:
        accum = (
            int(grad_accum) if grad_accum != "auto" else max(1, round(target_batch_seconds / (nproc * batch_seconds)))
        )
        notes.append(f"batch {batch_seconds:g} s per device (given)")
    effective = batch_seconds * nproc * accum
    notes.append(f"grad_accum {accum}: effective {effective:.1f} s per step (target {target_batch_seconds:g} s)")
    peak = peak_bf16_flops(hw.gpu_name) if device == "cuda" else None
    if peak:
        work = batch_seconds * model.train_flops_per_second
        notes.append(
            f"a micro-batch is {work / 1e12:.1f} TFLOP, {1e3 * work / peak:.0f} ms at the "
            f"{peak / 1e12:.0f} TFLOP/s bf16 peak"
        )
    if data.total_seconds < effective:
        notes.append(f"note: one step covers more than the {data.total_seconds:.0f} s of training audio")
    return LaunchPlan(nproc, float(batch_seconds), accum, precision, device, threads, "; ".join(notes))
