"""``frozen_heap``: the heap that exists when the block starts is out of the collector's walks
inside it, handed back after it (also on an exception), and an outer freeze is left alone.

Whether an object is frozen is read off ``gc.get_objects()``, which lists the collector's
generations and not the frozen (permanent) one; freeze counts are not compared, since any frozen
object that dies meanwhile lowers them."""

from __future__ import annotations

import gc

import pytest

from speech_assets.runtime.heap import frozen_heap


def collected(obj: object) -> bool:
    """Whether the collector walks ``obj`` (it is in a generation, not frozen)."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture(autouse=True)
def unfrozen_heap():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_heap_is_frozen_inside_and_handed_back_after() -> None:
    before = []
    with frozen_heap():
        inside = []
        assert not collected(before)
        assert collected(inside)  # what the block allocates is collected as usual
        gc.collect()  # a full collection inside does not thaw anything
        assert not collected(before)
    assert collected(before)
    assert gc.get_freeze_count() == 0


def test_an_exception_hands_the_heap_back() -> None:
    before = []
    with pytest.raises(RuntimeError), frozen_heap():
        assert not collected(before)
        raise RuntimeError("step failed")
    assert collected(before)
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_by_someone_else_stays_frozen() -> None:
    """An outer freeze (a preloading server, a long-lived process) is not undone by a block."""
    outer = []
    gc.freeze()
    between = []  # made after the outer freeze, before the block
    with frozen_heap():
        assert collected(between)  # the block freezes nothing more either
    assert not collected(outer)
    assert collected(between)
    assert gc.get_freeze_count() > 0


def test_cyclic_garbage_made_inside_is_still_collected() -> None:
    class Node:
        pass

    with frozen_heap():
        node = Node()
        node.self = node
        del node
        assert gc.collect() >= 1


def test_a_nested_block_keeps_the_heap_frozen_and_asks_the_collector_nothing(monkeypatch) -> None:
    """``gc.get_freeze_count`` walks the frozen objects: a block per shard inside a run's block would
    pay ~50 ms each in a loaded worker; only the outermost block asks, and only it thaws."""
    before = []
    with frozen_heap():
        asked = []
        monkeypatch.setattr(gc, "get_freeze_count", lambda: asked.append(1) or 1)
        with frozen_heap():
            assert not collected(before)
        monkeypatch.undo()
        assert not asked
        assert not collected(before)  # the inner block's end thaws nothing
    assert collected(before)
    assert gc.get_freeze_count() == 0
