"""Host-memory growth of one checkpoint stream, measured in a process of its own.

``RssAnon`` is process-wide: in a pytest worker that already ran other test files, threads and
heap state left behind by them add to it (the CI once measured 20 MiB past a 120 MiB bound with
the stream holding exactly its window). The memory tests run this file with ``sys.executable``
and read one JSON line: ``{"growth": bytes, "peak_buffered_bytes": bytes, "bytes": bytes}``.

Usage: ``python stream_probe.py CHECKPOINT_DIR READAHEAD``
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
    for i, (_, t) in enumerate(stream):
        float(t[::4096].sum())  # touch the data like a consumer would
        # slower than the readers, so read-ahead fills its window; a long first pause lets it fill
        # even on a loaded 2-core machine (the full suite once saw only one shard held, at 10 ms)
        time.sleep(0.5 if i == 0 else 0.01)
        del t


def main(directory: str, readahead: int) -> None:
    import torch

    from kiln.weights import CheckpointStream, discover_weights
    from kiln.weights.memory import PeakAnonMemory

    torch.set_num_threads(1)
    stream = CheckpointStream(discover_weights(Path(directory)), readahead=readahead)
    with PeakAnonMemory() as mem:
        consume(stream)
    out = {"growth": mem.growth, "peak_buffered_bytes": stream.stats.peak_buffered_bytes}
    print(json.dumps(out | {"bytes": stream.stats.bytes}))


def measure(directory: Path, readahead: int) -> dict[str, int]:
    """Run :func:`main` in a fresh interpreter and return its figures."""
    cmd = [sys.executable, __file__, str(directory), str(readahead)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
