"""The streaming side of packing: one rank's output files, laid out before any data exists, and
a small thread pool that checksums (wsum64, :mod:`weights.checksum`) and writes finished tensors at
their offsets.

Because every packed tensor's name, shape and dtype are known from the specs, each file's
safetensors header is written first and the file is sized up front; a tensor is written the
moment its last piece arrives, in any order, and then freed. Host memory held by the writer is
bounded by ``budget_bytes`` of tensors queued or being written.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.weights.checksum import hex64, wsum64
from kiln.weights.st_format import plan_layout, pwrite_all, tensor_bytes

HASH_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class Slot:
    """Where one packed tensor goes."""

    file: str
    fd: int
    offset: int
    nbytes: int


class RankFiles:
    """``rank{r}.safetensors`` (or ``rank{r}-0000i-of-0000n.safetensors`` past ``max_file_bytes``),
    created with their headers written and their final size allocated."""

    def __init__(
        self,
        out_dir: Path,
        rank: int,
        entries: list[tuple[str, tuple[int, ...], torch.dtype]],
        max_file_bytes: int,
        metadata: dict[str, str],
    ) -> None:
        order = sorted(range(len(entries)), key=lambda i: (-entries[i][2].itemsize, i))
        groups: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for i in order:
            name, shape, dt = entries[i]
            n = dt.itemsize
            for s in shape:
                n *= s
            if groups[-1] and size + n > max_file_bytes:
                groups.append([])
                size = 0
            groups[-1].append(entries[i])
            size += n
        k = len(groups)
        self.names = [
            f"rank{rank}.safetensors" if k == 1 else f"rank{rank}-{i + 1:05d}-of-{k:05d}.safetensors"
            for i in range(k)
        ]
        self.paths = [out_dir / n for n in self.names]
        self.slots: dict[str, Slot] = {}
        self.fds: list[int] = []
        for fname, path, group in zip(self.names, self.paths, groups):
            lay = plan_layout(group, metadata)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            self.fds.append(fd)
            os.ftruncate(fd, lay.size)
            pwrite_all(fd, lay.header, 0)
            for name, shape, dt in group:
                n = dt.itemsize
                for s in shape:
                    n *= s
                self.slots[name] = Slot(fname, fd, lay.offsets[name], n)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class TensorWriter:
    """wsum64 and ``pwrite`` tensors on ``workers`` threads, at most ``budget_bytes`` queued at once."""

    def __init__(self, workers: int = 4, budget_bytes: int = 1 << 30) -> None:
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="kiln-write")
        self.budget = budget_bytes
        self.inflight = 0
        self.peak_inflight = 0
        self.cv = threading.Condition()
        self.futures: list[Future[None]] = []
        # (file, tensor name) -> wsum64 (hex) of its bytes; by file, as every rank has the same names
        self.sums: dict[tuple[str, str], str] = {}
        self.written = 0

    def submit(self, name: str, t: torch.Tensor, slot: Slot) -> None:
        t = t.contiguous()
        n = t.numel() * t.element_size()
        if n != slot.nbytes:
            raise AssertionError(f"{name}: {n} bytes to write into a {slot.nbytes}-byte slot")
        with self.cv:
            while self.inflight and self.inflight + n > self.budget:
                self.cv.wait()
            self.inflight += n
            self.peak_inflight = max(self.peak_inflight, self.inflight)
        self._reap()
        self.futures.append(self.pool.submit(self._job, name, t, slot, n))

    def _job(self, name: str, t: torch.Tensor, slot: Slot, n: int) -> None:
        try:
            mv = tensor_bytes(t)
            self.sums[(slot.file, name)] = hex64(wsum64(mv))
            pwrite_all(slot.fd, mv, slot.offset)
            del mv, t
        finally:
            with self.cv:
                self.inflight -= n
                self.written += 1
                self.cv.notify_all()

    def _reap(self) -> None:
        keep = []
        for f in self.futures:
            if f.done():
                f.result()  # re-raise a failed write (disk full, ...) at once
            else:
                keep.append(f)
        self.futures = keep

    def drain(self) -> None:
        for f in self.futures:
            f.result()
        self.futures = []

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def sha256_file(path: str | Path, begin: int = 0, end: int | None = None) -> str:
    """sha256 of ``path[begin:end]`` read in 1 MiB chunks (hashlib releases the GIL, so several
    files hash in parallel on threads)."""
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(begin)
        left = (os.fstat(f.fileno()).st_size if end is None else end) - begin
        while left > 0:
            n = f.readinto(mv[: min(HASH_CHUNK, left)])
            if not n:
                break
            h.update(mv[:n])
            left -= n
    return h.hexdigest()
