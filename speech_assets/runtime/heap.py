"""The garbage collector's view of a long-lived heap (``frozen_heap``), and reused buffers (``scratch``).

A process that has imported torch, pyarrow or the code location holds hundreds of thousands of
long-lived objects. CPython's full collections walk all of them whenever enough objects have
survived younger collections, which a loop that builds records keeps doing; neither the shard
builder's objects nor a run's steps are cyclic garbage worth that walk.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

import numpy as np

_SCRATCH = threading.local()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside the block, the objects that exist when it starts are left out of garbage collection
    (``gc.freeze``, O(1)): collections took 0.83 s of an 11 s absorb, 0.19 s frozen (docs/BENCHMARKS.md).

    A heap someone else froze is left as it is: unfreezing would hand back their objects too.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def scratch(name: str, dtype: type, length: int) -> np.ndarray:
    """A per-thread reusable 1-D buffer of ``length`` elements: fresh multi-MB arrays per utterance
    cost more in page faults than the arithmetic."""
    buffer = getattr(_SCRATCH, name, None)
    if buffer is None or buffer.shape[0] < length:
        buffer = np.empty(max(length, 1 << 19), dtype)
        setattr(_SCRATCH, name, buffer)
    return buffer[:length]
