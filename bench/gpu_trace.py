"""What a torch.profiler capture says about training steps: the attention kernel that ran, the
share of the wall time the GPU spends in kernels, and the host reads (device-to-host syncs).

The host-read census is the tests' (``speech_assets_tests/support/census.py``), re-exported here.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch

from speech_assets_tests.support.census import HOST_RANGE, HostReads, host_syncs, to_host

__all__ = ["HOST_RANGE", "HostReads", "host_syncs", "to_host"]

# aten ops of scaled_dot_product_attention's backends, forward and backward (CPU and CUDA traces)
SDPA_BACKENDS = (
    ("flash_cpu", "_scaled_dot_product_flash_attention_for_cpu"),
    ("flash", "_scaled_dot_product_flash_attention"),
    ("efficient", "_scaled_dot_product_efficient_attention"),
    ("cudnn", "_scaled_dot_product_cudnn_attention"),
    ("math", "_scaled_dot_product_attention_math"),
)
# CUDA kernel names by backend (first match wins): cuDNN's SDPA kernels also say "flash"; the
# efficient path runs xformers' CUTLASS kernels (fmha_cutlassF/B); flash: pytorch_flash::flash_*
ATTENTION_KERNELS = (
    ("cudnn", ("cudnn_generated_fort_native_sdpa", "_sdpa_")),
    ("flash", ("pytorch_flash::", "flash_fwd", "flash_bwd")),
    ("efficient", ("fmha_cutlass", "mem_eff", "attention_kernel_batched")),
)


def attention_backends(events: Iterable[Any]) -> list[str]:
    """The SDPA backends whose aten ops ran (``flash_cpu``, ``flash``, ``efficient``, ``cudnn``, ``math``)."""
    found: Counter[str] = Counter()
    for event in events:
        name = event.name.removeprefix("aten::")
        backend = next((b for b, op in SDPA_BACKENDS if name.startswith(op)), None)
        if backend:
            found[backend] += 1
    return [backend for backend, _ in found.most_common()]


def is_cuda_kernel(event: Any) -> bool:
    return event.device_type == torch.autograd.DeviceType.CUDA


def attention_kernels(events: Iterable[Any]) -> dict[str, list[str]]:
    """CUDA kernels of attention by backend (:data:`ATTENTION_KERNELS`), up to 3 names each, the
    backend with the most launches first."""
    found: dict[str, Counter[str]] = {}
    for event in events:
        if not is_cuda_kernel(event):
            continue
        for backend, patterns in ATTENTION_KERNELS:
            if any(pattern in event.name for pattern in patterns):
                found.setdefault(backend, Counter())[event.name[:120]] += 1
                break
    ranked = sorted(found.items(), key=lambda item: -item[1].total())  # the most launched backend first
    return {backend: [name for name, _ in names.most_common(3)] for backend, names in ranked}


def kernel_busy_us(events: Iterable[Any]) -> float:
    """Microseconds of the union of the CUDA kernels' intervals (kernels on other streams overlap);
    copies and memsets (the next batch's copy on the side stream) are not kernels."""
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if is_cuda_kernel(e) and not e.name.startswith(("Memcpy", "Memset"))
    )
    busy, end = 0.0, float("-inf")
    for start, stop in intervals:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(device: torch.device, steps: int, step: Callable[[], object]) -> tuple[float, list[Any]]:
    """Wall seconds of ``steps`` calls of ``step`` (the device synchronized before and after) and the
    warnings CUDA's sync-debug mode raised in them, one per host synchronization."""
    synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            started = time.perf_counter()
            for _ in range(steps):
                step()
            synchronize(device)
            elapsed = time.perf_counter() - started
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    return elapsed, [w for w in caught if "synchroniz" in str(w.message).lower()]


def profiled_steps(device: torch.device, steps: int, step: Callable[[], object], **options: Any) -> tuple[Any, float]:
    """A torch.profiler capture (CPU, and CUDA on a GPU; ``options`` to ``profile``) of ``steps``
    calls of ``step`` and their wall microseconds, the device synchronized before and after."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities, **options) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall_us = (time.perf_counter() - started) * 1e6
    return prof, wall_us
