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


_FREEZE_LOCK = threading.Lock()
_frozen_depth = 0  # blocks open; the outermost one froze the heap when _we_froze
_we_froze = False


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside the block, the objects that exist when it starts are left out of garbage collection
    (``gc.freeze``, O(1)): collections took 0.83 s of an 11 s absorb, 0.19 s frozen (docs/BENCHMARKS.md).

    A heap someone else froze is left as it is: unfreezing would hand back their objects too. Only the
    outermost block asks: ``gc.get_freeze_count`` walks every frozen object (~50 ms for a loaded run
    worker's 1.3 M), and a run's in-process steps nest one block per shard inside the run's.
    """
    global _frozen_depth, _we_froze
    with _FREEZE_LOCK:
        if _frozen_depth == 0:
            _we_froze = not gc.get_freeze_count()
            if _we_froze:
                gc.freeze()
        _frozen_depth += 1
    try:
        yield
    finally:
        with _FREEZE_LOCK:
            _frozen_depth -= 1
            if _frozen_depth == 0 and _we_froze:
                gc.unfreeze()


def scratch(name: str, dtype: type, length: int) -> np.ndarray:
    """A per-thread reusable 1-D buffer of ``length`` elements: fresh multi-MB arrays per utterance
    cost more in page faults than the arithmetic."""
    buffer = getattr(_SCRATCH, name, None)
    if buffer is None or buffer.shape[0] < length:
        buffer = np.empty(max(length, 1 << 19), dtype)
        setattr(_SCRATCH, name, buffer)
    return buffer[:length]
