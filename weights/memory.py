"""Host memory of this process beyond the page cache, sampled (Linux ``/proc/self/status``).

``RssAnon`` counts anonymous pages: buffers the process allocated. Memory-mapped file pages
(``RssFile``) and the page cache are not in it, so it is the figure to bound when a tool streams
a checkpoint through mmap and writes its output through the page cache.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType


def rss_kib() -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile`` in KiB (empty dict where /proc is missing)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


def anon_bytes() -> int:
    return rss_kib().get("RssAnon", 0) * 1024


class PeakAnonMemory:
    """Context manager sampling ``RssAnon`` every ``interval`` seconds in a thread.

    ``peak`` and ``baseline`` are bytes; ``growth`` = peak - baseline.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, anon_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> PeakAnonMemory:
        self.baseline = anon_bytes()
        self.peak = self.baseline
        self._thread = threading.Thread(target=self._run, name="kiln-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, anon_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.baseline
