"""Python's cyclic garbage collector in a long-running engine: its pauses, measured, and the
start-up heap frozen so that they stay short.

A full collection walks every tracked object alive: after an engine starts that is torch's, the
kernels', the artifact's and the tokenizer's objects (about 0.3 M on the CPU demo, where one full
collection took 50-90 ms; far more beside a GPU model). The collector runs on whichever thread
allocates, holding the GIL, so a full collection stalls the engine's step (a serving run on the
H100 saw decode step() calls of 200-300 ms against 7 ms steps, with no graph capture in the run).

* :func:`freeze_startup` (the ``gc_freeze`` setting, on by default; ``kiln serve`` calls it once
  its engine and app are up): one full collection, then every object alive goes to the
  collector's permanent generation (``gc.freeze()``), which no collection walks. Objects made
  later are collected as usual. A frozen object is never collected, even once it is garbage in a
  cycle: so only a process that keeps its engine for good freezes (the server, and tensor-parallel
  ranks 1..N-1 once set up, whose collections would stall every rank's collectives), not
  ``kiln.LLM``, whose engines come and go (the tests make hundreds).
* :func:`install` / :func:`pauses`: every collection's pause, by generation, in buckets of
  :data:`PAUSE_BUCKETS_S` (the server's ``kiln_python_gc_pause_seconds`` histogram). One
  process-wide callback, installed once; its cost is two clock reads per collection. No lock: only
  the callback writes, inside a collection, and CPython runs one collection at a time; a lock
  would deadlock, since :func:`pauses` allocates while reading and may itself start a collection
  whose callback then waits for it.
"""

from __future__ import annotations

import bisect
import gc
import time
from typing import Any

PAUSE_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)  # upper bounds; one more open

_counts = [[0] * (len(PAUSE_BUCKETS_S) + 1) for _ in range(3)]  # per generation, per bucket
_sums = [0.0, 0.0, 0.0]
_started: list[float | None] = [None]  # when the collection under way started (one at a time)


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    t0, _started[0] = _started[0], None
    if t0 is None:  # installed mid-collection
        return
    s = time.perf_counter() - t0
    g = min(int(info.get("generation", 2)), 2)
    _counts[g][bisect.bisect_left(PAUSE_BUCKETS_S, s)] += 1
    _sums[g] += s


def install() -> None:
    """Start recording collector pauses in this process (idempotent)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def pauses() -> dict[int, tuple[list[int], float]]:
    """``{generation: (collections per bucket of PAUSE_BUCKETS_S plus the open one, seconds)}``
    since :func:`install` (a copy; a collection that ends while it is taken may be half in it)."""
    return {g: (list(_counts[g]), _sums[g]) for g in range(3)}


def freeze_startup(enabled: bool) -> None:
    """When ``enabled`` (the ``gc_freeze`` setting): collect the garbage there is, then
    ``gc.freeze()``: every object alive now is never walked by a collection again (module
    docstring)."""
    if enabled:
        gc.collect()
        gc.freeze()
