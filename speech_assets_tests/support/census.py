"""A census of host reads (device-to-host syncs) in torch.profiler events, for the tests and the GPU
benchmark: aten ops that read a value on the host (``nonzero``, ``unique``, ``item``,
``_local_scalar_dense``) and, wrapped by :class:`HostReads` in a profiler range ``host::<method>``,
the tensor methods that copy values out (``tolist``, ``numpy``, ``cpu``, ``item``, ``__array__``,
``.to`` off an accelerator), which dispatch no aten op on a CPU tensor."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import record_function

from speech_assets.train.engine import REPORT_RANGE

HOST_SYNCS = {"aten::nonzero", "aten::_unique2", "aten::unique_dim", "aten::_local_scalar_dense", "aten::item"}
HOST_COPIES = ("tolist", "numpy", "cpu", "item", "__array__", "to")
HOST_RANGE = "host::"
# ranges whose host reads are not on model tensors: the trainer's metrics window (once per
# log_every steps), the loader's bookkeeping, AdamW's host step counters (not fused)
EXEMPT_RANGES = (REPORT_RANGE, "enumerate(DataLoader)", "Optimizer.step#")


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
