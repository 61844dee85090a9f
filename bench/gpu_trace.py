"""What a torch.profiler capture says about training steps: the attention kernel that ran, the
share of the wall time the GPU spends in kernels, and the host reads (device-to-host syncs).

The host-read census is the one of ``speech_assets_tests/train/test_sync_census.py``, copied here
so that the benchmark needs no test code: aten ops that read a value on the host (``nonzero``,
``unique``, ``item``, ``_local_scalar_dense``) and, wrapped by :class:`HostReads` in a profiler
range ``host::<method>``, the tensor methods that copy values out (``tolist``, ``numpy``, ``cpu``,
``item``, ``__array__``, ``.to`` off an accelerator), which dispatch no aten op on a CPU tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import record_function

HOST_SYNCS = {"aten::nonzero", "aten::_unique2", "aten::unique_dim", "aten::_local_scalar_dense", "aten::item"}
HOST_COPIES = ("tolist", "numpy", "cpu", "item", "__array__", "to")
HOST_RANGE = "host::"
# ranges whose host reads are not on model tensors: the trainer's metrics window (once per
# log_every steps), the loader's bookkeeping, AdamW's host step counters (not fused)
EXEMPT_RANGES = ("Engine.report", "enumerate(DataLoader)", "Optimizer.step#")

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


def to_host(tensor: object, args: tuple, kwargs: dict) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` copies an accelerator tensor to the CPU."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "cpu":
        return False
    for target in [kwargs.get("device"), *args]:
        if isinstance(target, torch.Tensor):
            target = target.device
        if isinstance(target, (str, torch.device)):
            return torch.device(target).type == "cpu"
    return False


class HostReads(TorchFunctionMode):
    """Wraps every copy of a tensor's values to the host in the profiler range ``host::<method>``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_COPIES and (name != "to" or to_host(args[0] if args else None, args[1:], kwargs)):
            with record_function(HOST_RANGE + name):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def host_syncs(events: Iterable[Any]) -> Counter[str]:
    """Host reads among profiler ``events`` outside :data:`EXEMPT_RANGES`, by op and its enclosing
    ranges; one read is counted once (``item`` calls ``_local_scalar_dense``: the outer op counts)."""
    found: Counter[str] = Counter()
    for event in events:
        if event.name not in HOST_SYNCS and not event.name.startswith(HOST_RANGE):
            continue
        parent, chain = event.cpu_parent, []
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        inner = any(name in HOST_SYNCS or name.startswith(HOST_RANGE) for name in chain)  # counted as its caller
        if not inner and not any(name.startswith(EXEMPT_RANGES) for name in chain):
            found[f"{event.name} under {' < '.join(chain[:3]) or 'the step'}"] += 1
    return found


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
