"""The services freeze their start-up heap (qlm/heap.py)."""

from __future__ import annotations

import gc
import weakref

from qlm.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_the_start_up_heap_leaves_full_collections_and_new_garbage_is_still_collected() -> None:
    gc.unfreeze()
    try:
        freeze_startup_heap()
        # the modules and everything built so far: out of every later collection's walk
        assert gc.get_freeze_count() > 10_000
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
