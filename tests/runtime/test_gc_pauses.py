"""runtime/gc_pauses.py: the collector's pauses are recorded by generation, and freezing moves
every object alive out of the collections' reach without stopping later ones."""

from __future__ import annotations

import gc

from kiln.runtime import gc_pauses


def test_collections_are_recorded_by_generation():
    gc_pauses.install()
    gc_pauses.install()  # idempotent: one callback
    assert gc.callbacks.count(gc_pauses._on_gc) == 1
    before = gc_pauses.pauses()
    gc.collect()  # a full collection: generation 2
    gc.collect(0)
    after = gc_pauses.pauses()
    assert sum(after[2][0]) == sum(before[2][0]) + 1 and after[2][1] > before[2][1]
    assert sum(after[0][0]) >= sum(before[0][0]) + 1
    assert len(after[2][0]) == len(gc_pauses.PAUSE_BUCKETS_S) + 1


def test_freeze_startup_freezes_and_later_garbage_is_still_collected():
    gc.unfreeze()
    try:
        gc_pauses.freeze_startup(False)
        assert gc.get_freeze_count() == 0
        gc_pauses.freeze_startup(True)
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # everything alive: pytest's, torch's objects
        import weakref

        class Node:
            pass

        a = Node()
        a.self = a  # a garbage cycle made after the freeze
        gone = weakref.ref(a)
        del a
        gc.collect()
        assert gone() is None  # collected: the freeze does not stop later collections
        assert gc.get_freeze_count() > frozen // 2  # still frozen (objects that die leave the count)
    finally:
        gc.unfreeze()


def test_reading_the_pauses_while_collections_run_does_not_deadlock():
    """``pauses()`` allocates, so a collection (and its callback) may start inside it: with a lock
    shared by the two the reader waited for itself (a /metrics scrape hung the server)."""
    import threading

    gc_pauses.install()
    done = threading.Event()

    def read() -> None:
        for _ in range(2000):
            gc_pauses.pauses()
        done.set()

    old = gc.get_threshold()
    gc.set_threshold(1)  # a collection at nearly every allocation
    try:
        threading.Thread(target=read, daemon=True).start()
        assert done.wait(30), "pauses() did not return"
    finally:
        gc.set_threshold(*old)
