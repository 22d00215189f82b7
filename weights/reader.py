"""Stage 7: one rank's weight pack onto a device, checked.

Always checked (cheap): ``pack.json`` parses and has this rank; every file exists with the size
``pack.json`` records (a short file names the tensors past its end); every safetensors header
agrees with ``pack.json`` (names, shapes, dtypes, offsets); with ``expected``, the pack holds exactly
the parameters the model declares with their shapes and dtypes (missing and unexpected names
listed). With ``verify=True`` also the sha256 of every file (a mismatch names the tensors whose
bytes changed).

Loading:

* CPU: each tensor read straight into its own buffer (``preadv``, several threads).
* CUDA, ``staging="pinned"`` (default; also runs on a CPU device with plain buffers, for tests): reader threads ``preadv`` fixed-size chunks of the files
  into a ring of pinned host buffers; the main thread issues non-blocking host-to-device copies on
  a side stream; a buffer is refilled once the event recorded after its copies has completed.
  Reads from the page cache and PCIe transfers overlap. All tensors of the rank live in one device
  allocation, each at a 256-byte-aligned offset.
* CUDA, ``staging="direct"``: ``safetensors.safe_open(device=...)`` (the baseline).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.weights.index import PackError, PackIndex, PackTensor
from kiln.weights.st_format import DTYPE_NAMES
from kiln.weights.verify import Expected, check_expected, check_rank_files, verify_rank

DEVICE_ALIGN = 256


@dataclass(frozen=True)
class LoadOptions:
    staging: str = "auto"  # auto | pinned | direct
    threads: int = max(2, min(16, os.cpu_count() or 2))  # reader threads
    chunk_bytes: int = 16 * 1024 * 1024  # one pinned staging buffer
    buffers_per_thread: int = 2


def load_pack(
    pack_dir: str | Path,
    rank: int,
    device: str | torch.device = "cpu",
    expected: Expected | None = None,
    verify: bool = False,
    options: LoadOptions | None = None,
) -> dict[str, torch.Tensor]:
    """Load rank ``rank`` of the pack in ``pack_dir`` onto ``device``; returns ``{name: tensor}``.

    ``expected``: ``{name: (shape, dtype)}`` of the model's parameters (dtype as ``torch.dtype`` or its
    name); the pack must match it exactly. ``verify``: also check sha256 of every file. Raises
    :class:`~kiln.weights.index.PackError` naming the file and tensor at fault.
    """
    pack_dir = Path(pack_dir)
    opts = options or LoadOptions()
    index = PackIndex.load(pack_dir)
    ri = index.rank(rank)
    check_rank_files(pack_dir, ri)
    if expected is not None:
        check_expected(ri, expected)
    if verify:
        verify_rank(pack_dir, ri, opts.threads)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    tensors = sorted(ri.tensors.values(), key=lambda t: (t.file, t.offset))
    staging = opts.staging
    if staging == "auto":
        staging = "pinned" if dev.type == "cuda" else "direct"
    if staging == "pinned":  # on a CPU device: the same pipeline with plain buffers (tests)
        return _load_staged(pack_dir, tensors, dev, opts)
    if staging == "direct":
        return (
            _load_cpu(pack_dir, tensors, opts.threads)
            if dev.type == "cpu"
            else _load_direct(pack_dir, tensors, dev)
        )
    raise ValueError(f"staging must be auto, pinned or direct, got {opts.staging!r}")


def _empty(t: PackTensor, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(t.shape, dtype=DTYPE_NAMES[t.dtype], device=device)


def _bytes_of(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.uint8)


def _pread_into(fd: int, out: memoryview, offset: int, path: Path) -> None:
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if n <= 0:
            raise PackError(f"{path}: unexpected end of file at byte {offset + got}; the file is truncated.")
        got += n


def _open_all(pack_dir: Path, tensors: list[PackTensor]) -> dict[str, int]:
    return {f: os.open(pack_dir / f, os.O_RDONLY) for f in sorted({t.file for t in tensors})}


def _load_cpu(pack_dir: Path, tensors: list[PackTensor], threads: int) -> dict[str, torch.Tensor]:
    out = {t.name: _empty(t) for t in tensors}
    fds = _open_all(pack_dir, tensors)
    try:

        def read(t: PackTensor) -> None:
            if t.nbytes:
                mv = memoryview(_bytes_of(out[t.name]).numpy()).cast("B")
                _pread_into(fds[t.file], mv, t.offset, pack_dir / t.file)

        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            list(pool.map(read, tensors))
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _load_direct(pack_dir: Path, tensors: list[PackTensor], dev: torch.device) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in sorted({t.file for t in tensors}):
        with safe_open(str(pack_dir / file), framework="pt", device=str(dev)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                out[name] = f.get_tensor(name)
    return out


def _device_views(tensors: list[PackTensor], dev: torch.device) -> dict[str, torch.Tensor]:
    """One device allocation for the whole rank, each tensor at a 256-byte-aligned offset."""
    offs, pos = [], 0
    for t in tensors:
        offs.append(pos)
        pos += -(-t.nbytes // DEVICE_ALIGN) * DEVICE_ALIGN
    arena = torch.empty(max(pos, 1), dtype=torch.uint8, device=dev)
    return {
        t.name: arena[o : o + t.nbytes].view(DTYPE_NAMES[t.dtype]).view(t.shape)
        for t, o in zip(tensors, offs)
    }


def _load_staged(
    pack_dir: Path, tensors: list[PackTensor], dev: torch.device, opts: LoadOptions
) -> dict[str, torch.Tensor]:
    out = _device_views(tensors, dev)
    # Chunks of contiguous file bytes; each lists the tensor pieces it carries.
    chunks: list[tuple[str, int, int, list[tuple[str, int, int, int]]]] = []
    cb = opts.chunk_bytes
    for t in tensors:
        done = 0
        while done < t.nbytes:
            if (
                not chunks
                or chunks[-1][0] != t.file
                or chunks[-1][2] != t.offset + done
                or chunks[-1][2] - chunks[-1][1] >= cb
            ):
                chunks.append((t.file, t.offset + done, t.offset + done, []))
            f, begin, end, parts = chunks[-1]
            n = min(t.nbytes - done, cb - (end - begin))
            parts.append((t.name, done, end - begin, n))  # dst byte offset, src offset in chunk, bytes
            chunks[-1] = (f, begin, end + n, parts)
            done += n
    nbuf = max(2, opts.threads * opts.buffers_per_thread)
    cuda = dev.type == "cuda"
    bufs = [
        torch.empty(cb, dtype=torch.uint8, pin_memory=cuda) for _ in range(min(nbuf, max(2, len(chunks))))
    ]
    views = [memoryview(b.numpy()).cast("B") for b in bufs]
    events: list[torch.cuda.Event | None] = [None] * len(bufs)
    free: queue.Queue[int] = queue.Queue()
    for i in range(len(bufs)):
        free.put(i)
    ready: queue.Queue[tuple[int, int] | BaseException] = queue.Queue()
    next_chunk = iter(range(len(chunks)))
    lock = threading.Lock()
    fds = _open_all(pack_dir, tensors)
    stream = torch.cuda.Stream(dev) if cuda else None
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                with lock:
                    c = next(next_chunk, None)
                if c is None:
                    return
                b = free.get()
                ev = events[b]
                if ev is not None:
                    ev.synchronize()  # its previous copies are done: safe to overwrite
                f, begin, end, _ = chunks[c]
                _pread_into(fds[f], views[b][: end - begin], begin, pack_dir / f)
                ready.put((c, b))
        except BaseException as e:
            ready.put(e)

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(max(1, opts.threads))]
    for th in threads:
        th.start()
    try:
        dst_bytes = {name: _bytes_of(x) for name, x in out.items()}
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for _ in range(len(chunks)):
                item = ready.get()
                if isinstance(item, BaseException):
                    raise item
                c, b = item
                for name, dst_off, src_off, n in chunks[c][3]:
                    dst_bytes[name][dst_off : dst_off + n].copy_(
                        bufs[b][src_off : src_off + n], non_blocking=cuda
                    )
                if cuda:  # the buffer may be refilled once its copies are done
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events[b] = ev
                free.put(b)
        if stream is not None:
            stream.synchronize()
    finally:
        stop.set()
        for _ in threads:
            free.put(0)  # unblock readers waiting for a buffer
        for th in threads:
            th.join()
        for fd in fds.values():
            os.close(fd)
    if stream is not None:
        torch.cuda.current_stream(dev).wait_stream(stream)
    return out
