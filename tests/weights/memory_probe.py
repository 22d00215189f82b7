"""Host-memory growth of one weight stream or one pack, measured in a process of its own.

``RssAnon`` is process-wide: in a pytest worker that already ran other test files, threads and
heap state left behind by them add to it (the CI once measured 20 MiB past a 120 MiB bound with
the stream holding exactly its window). The memory tests run this file with ``sys.executable``
and read one JSON line of figures in bytes.

Usage: ``python memory_probe.py stream CHECKPOINT_DIR READAHEAD``
       ``python memory_probe.py pack CHECKPOINT_DIR OUT_DIR TP WRITE_BUDGET_BYTES``
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def consume(stream: Iterable[tuple[str, Any]]) -> None:
    """Each tensor touched, then dropped before the next is asked for. (``for i, (_, t) in
    enumerate(stream)`` kept the last item alive through the next ``next()``: enumerate holds its
    result tuple for reuse, so a finished shard's buffer lived on while the reader filled a new one,
    up to 20 MiB past the window under load.)"""
    it = iter(stream)
    i = 0
    while (item := next(it, None)) is not None:
        t = item[1]
        float(t[::4096].sum())  # touch the data like a consumer would
        # slower than the readers, so read-ahead fills its window; a long first pause lets it fill
        # even on a loaded 2-core machine (the full suite once saw only one shard held, at 10 ms)
        time.sleep(0.5 if i == 0 else 0.01)
        del t, item
        i += 1


def stream(directory: str, readahead: str) -> dict[str, int]:
    from kiln.weights import CheckpointStream, discover_weights
    from kiln.weights.memory import PeakAnonMemory

    s = CheckpointStream(discover_weights(Path(directory)), readahead=int(readahead))
    with PeakAnonMemory() as mem:
        consume(s)
    return {"growth": mem.growth, "peak_buffered_bytes": s.stats.peak_buffered_bytes, "bytes": s.stats.bytes}


def pack(directory: str, out: str, tp: str, write_budget_bytes: str) -> dict[str, int]:
    from weights_helpers import pack as pack_weights  # this file's folder is sys.path[0]

    from kiln.weights.memory import PeakAnonMemory

    with PeakAnonMemory() as mem:
        index, _ = pack_weights(
            Path(directory), Path(out), tp=int(tp), write_budget_bytes=int(write_budget_bytes)
        )
    return {"growth": mem.growth, "peak_write_queue_bytes": index.provenance.peak_write_queue_bytes}


MODES = {"stream": stream, "pack": pack}


def measure(mode: str, *args: object) -> dict[str, int]:
    """Run ``MODES[mode](*args)`` in a fresh interpreter and return its figures."""
    cmd = [sys.executable, __file__, mode, *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    print(json.dumps(MODES[sys.argv[1]](*sys.argv[2:])))
