"""Stage 2: a checkpoint as a stream of ``(name, tensor)`` in a stable order.

Order: files as :mod:`weights.discover` lists them; within a safetensors file, tensors by data
offset (sequential reads); within a ``.bin``/``.pt`` file, by name.

Two ways to read a safetensors shard:

* ``readahead=0`` (default): memory-mapped (``safetensors.safe_open``). Tensors are views of the
  page cache; the stream itself holds no anonymous memory.
* ``readahead=k > 0``: ``k`` worker threads read whole shards into host buffers ahead of the
  consumer (useful on network or cold disks, where reads should overlap the consumer's work).

**Memory bound (read-ahead).** At most ``k + 1`` shard buffers exist at once: the one being
consumed and ``k`` read ahead. Peak host memory held by the stream is therefore
``(k + 1) x largest shard``, provided the consumer drops each tensor before asking for the one after
next (the packer copies every piece out at once). ``StreamStats.peak_buffered_bytes`` records the
accounted peak; ``tests/weights/test_stream.py`` measures the process's anonymous RSS against it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kiln.weights.discover import CheckpointError, WeightFiles
from kiln.weights.st_format import Header, read_header


@dataclass
class StreamStats:
    tensors: int = 0
    bytes: int = 0
    buffered_bytes: int = 0  # shard buffers alive now (read-ahead only)
    peak_buffered_bytes: int = 0


@dataclass(frozen=True)
class SourceInfo:
    """Shape, dtype and file of one checkpoint tensor, known before any data is read."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str
    nbytes: int


class CheckpointStream:
    """Iterate ``(name, tensor)`` over a checkpoint's weight files; see the module docstring.

    Safetensors headers are read up front: :attr:`infos` lists every tensor (shape, dtype, file)
    and a tensor stored in two files fails here, naming both.
    """

    def __init__(self, files: WeightFiles, readahead: int = 0) -> None:
        if readahead < 0:
            raise ValueError(f"readahead must be >= 0, got {readahead}")
        self.files = files
        self.readahead = readahead
        self.stats = StreamStats()
        self._lock = threading.Lock()
        self.headers: list[Header] = []
        self.infos: dict[str, SourceInfo] = {}
        if files.format == "safetensors":
            for f in files.files:
                h = read_header(f)
                self.headers.append(h)
                for t in h.tensors.values():
                    prev = self.infos.get(t.name)
                    if prev is not None:
                        raise CheckpointError(
                            f"tensor {t.name!r} is stored in both {prev.file} and {f.name}; the "
                            "directory mixes two copies of the weights. Remove one set (or add an index)."
                        )
                    self.infos[t.name] = SourceInfo(t.name, t.shape, t.dtype, f.name, t.nbytes)

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data to stream (0 for .bin/.pt, whose sizes are unknown up front)."""
        return sum(i.nbytes for i in self.infos.values())

    def fingerprint(self, model_dir: Path) -> dict[str, Any]:
        """sha256 over config.json and every weight file's name, size and header (cheap, not the data),
        and the files' names and sizes; no path, so a copy of the checkpoint gives the same dict."""
        h = hashlib.sha256()
        cfg = model_dir / "config.json"
        if cfg.is_file():
            h.update(cfg.read_bytes())
        files = []
        headers = {hd.path: hd.raw for hd in self.headers}
        for p in self.files.files:
            size = p.stat().st_size
            files.append({"name": p.name, "bytes": size})
            h.update(f"{p.name}\0{size}\0".encode())
            h.update(headers.get(p, b""))
        return {"fingerprint": h.hexdigest(), "files": files}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.files.format == "pt":
            yield from self._iter_pt()
        elif self.readahead == 0:
            yield from self._iter_mmap()
        else:
            yield from self._iter_readahead()

    # ------------------------------------------------------------------ readers
    def _count(self, t: torch.Tensor) -> None:
        self.stats.tensors += 1
        self.stats.bytes += t.numel() * t.element_size()

    def _iter_mmap(self) -> Iterator[tuple[str, torch.Tensor]]:
        for h in self.headers:
            with safe_open(str(h.path), framework="pt", device="cpu") as f:
                for name in h.tensors:  # offset order
                    t = f.get_tensor(name)
                    self._count(t)
                    yield name, t

    def _load_whole(self, h: Header) -> torch.Tensor:
        buf = torch.empty(h.file_size, dtype=torch.uint8)
        with open(h.path, "rb") as f:
            mv = buf.numpy().data.cast("B")
            got = 0
            while got < h.file_size:
                n = f.readinto(mv[got:])
                if not n:
                    raise CheckpointError(f"{h.path} shrank while being read ({got} of {h.file_size} bytes)")
                got += n
        return buf

    def _account(self, delta: int) -> None:
        with self._lock:
            self.stats.buffered_bytes += delta
            self.stats.peak_buffered_bytes = max(self.stats.peak_buffered_bytes, self.stats.buffered_bytes)

    def _iter_readahead(self) -> Iterator[tuple[str, torch.Tensor]]:
        pending: deque[tuple[Header, Future[torch.Tensor]]] = deque()
        todo = iter(self.headers)
        with ThreadPoolExecutor(max_workers=self.readahead, thread_name_prefix="kiln-readahead") as pool:

            def submit() -> None:
                h = next(todo, None)
                if h is not None:
                    self._account(h.file_size)  # counted from submission: the buffer exists from then
                    pending.append((h, pool.submit(self._load_whole, h)))

            for _ in range(self.readahead):
                submit()
            while pending:
                h, fut = pending.popleft()
                buf = fut.result()
                del fut
                submit()  # keeps `readahead` shards in flight beside the one consumed now
                for name, info in h.tensors.items():
                    t = buf[info.begin : info.end].view(info.dtype).view(info.shape)
                    self._count(t)
                    yield name, t
                    del t
                del buf
                self._account(-h.file_size)

    def _iter_pt(self) -> Iterator[tuple[str, torch.Tensor]]:
        for p in self.files.files:
            sd = _load_pt(p)
            for name in sorted(sd):
                t = sd[name]
                if not isinstance(t, torch.Tensor):
                    raise CheckpointError(f"{p.name}: entry {name!r} is a {type(t).__name__}, not a tensor")
                if name in self.infos:
                    raise CheckpointError(
                        f"tensor {name!r} is stored in both {self.infos[name].file} and {p.name}; "
                        "remove one copy of the weights."
                    )
                self.infos[name] = SourceInfo(
                    name, tuple(t.shape), t.dtype, p.name, t.numel() * t.element_size()
                )
                self._count(t)
                yield name, t
            del sd


def _load_pt(p: Path) -> dict[str, torch.Tensor]:
    """``torch.load`` with ``weights_only=True`` (never executes pickled code), mmapped when the
    file is in the zip format."""
    try:
        try:
            sd = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) format cannot be mmapped
            sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{p} could not be loaded with torch.load(weights_only=True): {e}. kiln never unpickles "
            "arbitrary objects; convert the checkpoint to safetensors."
        ) from e
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise CheckpointError(f"{p} holds a {type(sd).__name__}, not a state dict of tensors")
    return sd
