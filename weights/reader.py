"""Stage 7: one rank's weight pack onto a device, checked.

Always checked (cheap): ``pack.json`` parses, is of this kiln's format version and has this rank;
every file exists with the size ``pack.json`` records (a short file names the tensors past its
end); every safetensors header agrees with ``pack.json`` (names, shapes, dtypes, offsets); with
``expected``, the pack holds exactly the parameters the model declares with their shapes and
dtypes (missing and unexpected names listed).

Integrity (``verify=True``, the default; :mod:`weights.integrity`): every tensor loaded is checked
against the wsum64 checksum ``pack.json`` records (:mod:`weights.checksum`), where it landed, after
the load; each header's xxh3 is checked with the headers, before any data is read. Nothing hashes
on the reader threads (they are the bottleneck of a load: any work there costs its time).

* Staged on CUDA: once the copies are done (the caller's stream waits for the copy streams), one
  Triton kernel sums every tensor of the arena (milliseconds: it reads the device's memory at
  terabytes a second), then one small device-to-host read brings the sums back to compare. The
  kernel comes from the artifact's precompiled cache (``kiln compile`` warms it up).
* CPU (staged or direct): numpy sums the loaded tensors on ``threads`` threads.
* CUDA ``staging="direct"``: numpy sums the tensors in the files (memory-mapped) before the load.

A mismatch raises :class:`PackError` naming each tensor that differs, its file and byte range; no
tensor of a failed load is returned. ``verify=False``: sizes and headers only.

Loading:

* CPU: each tensor read straight into its own buffer (``preadv``, several threads).
* CUDA, ``staging="pinned"`` (default; also runs on a CPU device with plain buffers, for tests):
  all tensors of the rank live in one device allocation (the arena), each at a 256-byte-aligned
  offset, in file order, so a file's tensors are as contiguous in the arena as in the file
  (:func:`plan_staging`). Each file's data is cut into ``chunk_bytes`` chunks from its first data
  byte, regardless of tensor boundaries. ``threads`` reader threads take chunks in turn; each one
  owns a ring of ``buffers_per_thread`` pinned buffers: it ``preadv``-s a chunk into the next
  buffer, issues the host-to-device copy of the whole chunk itself (one copy per chunk, more only
  where a tensor's alignment padding falls inside it) on one of ``copy_streams`` side streams,
  records an event, and moves on; a buffer is refilled once its event is done. No central thread
  hands buffers around and nothing synchronizes the device in the loop, so reads from the page
  cache and PCIe transfers overlap with up to ``threads * buffers_per_thread`` chunks in flight.
  On return the caller's current stream waits for the side streams: use the tensors on that
  stream or synchronize first (with ``verify`` the host has already waited for the check, which
  follows the copies on that stream; without it nothing waits on the host).
* CUDA, ``staging="direct"``: ``safetensors.safe_open(device=...)`` (the baseline).

The returned tensors are views into the arena: usable like any tensor, but resizing one (``resize_``,
``set_``) or expecting it to free memory on its own does not work; the arena is freed when the last
of them is dropped.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.weights.checksum import ALIGN, as_bytes, device_wsum64, wsum64_many
from kiln.weights.index import PackIndex, PackTensor
from kiln.weights.integrity import check_sums, file_sums, pread_exact
from kiln.weights.st_format import DTYPE_NAMES
from kiln.weights.verify import Expected, check_expected, check_rank_files

# load_pack's ``placed`` callback: the tensors it will return, once they have their memory
Placed = Callable[[dict[str, torch.Tensor]], None]

DEVICE_ALIGN = ALIGN  # 256: the checksum kernel's wide loads rely on it


@dataclass(frozen=True)
class LoadOptions:
    """How :func:`load_pack` stages the data (see the module docstring). ``threads``: reader
    threads (also the checksum threads of CPU loads); ``chunk_bytes``: bytes per read and per
    host-to-device copy (one pinned buffer); ``buffers_per_thread``: pipeline depth of each reader (pinned memory is ``threads *
    buffers_per_thread * chunk_bytes`` at most); ``copy_streams``: CUDA streams the readers issue
    their copies on (reader ``k`` uses stream ``k % copy_streams``)."""

    staging: str = "auto"  # auto | pinned | direct
    threads: int = max(2, min(16, os.cpu_count() or 2))
    # defaults from the H200 sweep (bench/results/2026-11-29_h200_weights_load_run2.json): 16
    # threads, 8 MiB, depth 2, 2 streams = 38.7 GB/s, 97% of the page-cache ceiling; depth 3 and
    # one stream gave 82%
    chunk_bytes: int = 8 * 1024 * 1024
    buffers_per_thread: int = 2
    copy_streams: int = 2


def load_pack(
    pack_dir: str | Path,
    rank: int,
    device: str | torch.device = "cpu",
    expected: Expected | None = None,
    verify: bool = True,
    options: LoadOptions | None = None,
    placed: Placed | None = None,
) -> dict[str, torch.Tensor]:
    """Load rank ``rank`` of the pack in ``pack_dir`` onto ``device``; returns ``{name: tensor}``.

    ``expected``: ``{name: (shape, dtype)}`` of the model's parameters (dtype as ``torch.dtype`` or its
    name); the pack must match it exactly. ``verify``: check every header's xxh3 and every
    tensor's wsum64 against pack.json (see the module docstring); ``False`` checks sizes and
    headers only. Raises :class:`~kiln.weights.index.PackError` naming the file and tensor at fault.
    ``placed(tensors)``: called on this thread with the tensors to be returned once each has its
    memory, before their data (staged and CPU loads: before the reads begin, a staged device arena
    zeroed first, on the caller's stream, so that work reading the tensors early reads zeros or
    weights, never stale memory; a direct load: after it). What uses them before this returns
    learns their addresses and shapes, not their values (the engine captures its CUDA graphs so).
    """
    pack_dir = Path(pack_dir)
    opts = options or LoadOptions()
    index = PackIndex.load(pack_dir)
    ri = index.rank(rank)
    check_rank_files(pack_dir, ri, verify)
    if expected is not None:
        check_expected(ri, expected)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    tensors = sorted(ri.tensors.values(), key=lambda t: (t.file, t.offset))
    staging = opts.staging
    if staging == "auto":
        staging = "pinned" if dev.type == "cuda" else "direct"
    if staging not in ("pinned", "direct"):
        raise ValueError(f"staging must be auto, pinned or direct, got {opts.staging!r}")
    if staging == "pinned":  # on a CPU device: the same pipeline with plain buffers (tests)
        out, arena, offsets = _load_staged(pack_dir, tensors, dev, opts, placed)
        if verify and dev.type == "cuda":
            check_sums(pack_dir, tensors, device_wsum64(arena, offsets, [t.nbytes for t in tensors]))
    elif dev.type == "cpu":
        out = _load_cpu(pack_dir, tensors, opts.threads, placed)
    else:
        if verify:
            check_sums(pack_dir, tensors, file_sums(pack_dir, tensors, opts.threads))
        out = _load_direct(pack_dir, tensors, dev)
        if placed is not None:
            placed(out)
    if verify and dev.type == "cpu":
        check_sums(pack_dir, tensors, wsum64_many([as_bytes(out[t.name]) for t in tensors], opts.threads))
    return out


def _empty(t: PackTensor, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(t.shape, dtype=DTYPE_NAMES[t.dtype], device=device)


def _bytes_of(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.uint8)


def _open_all(pack_dir: Path, tensors: list[PackTensor]) -> dict[str, int]:
    return {f: os.open(pack_dir / f, os.O_RDONLY) for f in sorted({t.file for t in tensors})}


def _load_cpu(
    pack_dir: Path, tensors: list[PackTensor], threads: int, placed: Placed | None
) -> dict[str, torch.Tensor]:
    out = {t.name: _empty(t) for t in tensors}
    if placed is not None:
        placed(out)
    fds = _open_all(pack_dir, tensors)
    try:

        def read(t: PackTensor) -> None:
            if t.nbytes:
                mv = _bytes_of(out[t.name]).numpy().data.cast("B")
                pread_exact(fds[t.file], mv, t.offset, pack_dir / t.file)

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


# One device copy: (byte offset in the chunk's staging buffer, byte offset in the arena, bytes).
Run = tuple[int, int, int]
# Contiguous bytes [begin, end) of one file, read with one preadv, copied with one copy per run (one
# run unless a tensor's alignment padding in the arena falls inside the chunk).
Chunk = tuple[str, int, int, tuple[Run, ...]]  # file, begin, end, runs


@dataclass(frozen=True)
class StagingPlan:
    """The arena layout and the chunks of a staged load (:func:`plan_staging`)."""

    arena_bytes: int
    offsets: list[int]  # arena byte offset of each tensor, in the order given
    segments: list[tuple[str, int, int, int]]  # file, file offset, arena offset, bytes
    chunk_bytes: int

    def extents(self) -> list[int]:
        """Lengths of the file ranges chunks are cut from (maximal file-contiguous ranges)."""
        out: list[int] = []
        prev = None
        for f, fb, _, n in self.segments:
            if prev is not None and prev[0] == f and prev[1] == fb:
                out[-1] += n
            else:
                out.append(n)
            prev = (f, fb + n)
        return out

    def num_chunks(self) -> int:
        return sum(-(-n // self.chunk_bytes) for n in self.extents())

    def max_chunk_bytes(self) -> int:
        return min(self.chunk_bytes, max(self.extents(), default=0))

    def chunks(self) -> Iterator[Chunk]:
        """Each file range cut every ``chunk_bytes`` from its start, regardless of tensor boundaries
        (the tensors of a pack file tile its data, so a file's chunks start at ``data_start + k *
        chunk_bytes``); a chunk's runs are the maximal
        pieces contiguous in both the file and the arena. A generator: the reader threads pull from
        it, so a large pack's chunk list is never built up front."""
        cb = self.chunk_bytes
        cur: list | None = None  # [file, begin, end, runs] of the chunk being filled
        for f, fbegin, abegin, n in self.segments:
            done = 0
            while done < n:
                if cur is None or cur[0] != f or cur[2] != fbegin + done or cur[2] - cur[1] >= cb:
                    if cur is not None:
                        yield (cur[0], cur[1], cur[2], tuple(cur[3]))
                    if n - done >= cb:  # fast path: a whole chunk inside this segment
                        yield (f, fbegin + done, fbegin + done + cb, ((0, abegin + done, cb),))
                        done += cb
                        cur = None
                        continue
                    cur = [f, fbegin + done, fbegin + done, []]
                k = min(n - done, cb - (cur[2] - cur[1]))
                cur[3].append((cur[2] - cur[1], abegin + done, k))
                cur[2] += k
                done += k
        if cur is not None:
            yield (cur[0], cur[1], cur[2], tuple(cur[3]))


def plan_staging(tensors: list[PackTensor], chunk_bytes: int) -> StagingPlan:
    """The arena layout of a staged load; ``tensors`` sorted by ``(file, offset)``.

    Tensors in file order, each at a :data:`DEVICE_ALIGN`-aligned arena offset (padding only after
    a tensor whose size is not a multiple of it), so consecutive tensors of a file whose sizes are
    multiples of 256 bytes (every tensor of an 8B-shaped bf16 model) are contiguous in the arena
    as they are in the file, and a chunk spanning several of them is one copy.
    """
    offsets: list[int] = []
    segs: list[list] = []  # [file, file offset, arena offset, bytes], contiguous in both
    pos = 0
    for t in tensors:
        offsets.append(pos)
        if t.nbytes:
            s = segs[-1] if segs else None
            if s is not None and s[0] == t.file and s[1] + s[3] == t.offset and s[2] + s[3] == pos:
                s[3] += t.nbytes
            else:
                segs.append([t.file, t.offset, pos, t.nbytes])
        pos += -(-t.nbytes // DEVICE_ALIGN) * DEVICE_ALIGN
    return StagingPlan(pos, offsets, [tuple(x) for x in segs], max(1, chunk_bytes))


def _load_staged(
    pack_dir: Path,
    tensors: list[PackTensor],
    dev: torch.device,
    opts: LoadOptions,
    placed: Placed | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[int]]:
    """The pipeline of the module docstring; returns the tensors, the arena and their offsets in it."""
    plan = plan_staging(tensors, opts.chunk_bytes)
    arena = torch.empty(max(plan.arena_bytes, 1), dtype=torch.uint8, device=dev)
    out = {
        t.name: arena[o : o + t.nbytes].view(DTYPE_NAMES[t.dtype]).view(t.shape)
        for t, o in zip(tensors, plan.offsets)
    }
    if placed is not None:
        arena.zero_()  # on the caller's stream; the copy streams wait for it below
        placed(out)
    nchunks = plan.num_chunks()
    if not nchunks:
        return out, arena, plan.offsets
    cuda = dev.type == "cuda"
    buf_bytes = plan.max_chunk_bytes()
    nthreads = max(1, min(opts.threads, nchunks))
    depth = max(1, opts.buffers_per_thread)
    streams = (
        [torch.cuda.Stream(dev) for _ in range(max(1, min(opts.copy_streams, nthreads)))] if cuda else []
    )
    for s in streams if placed is not None else ():
        s.wait_stream(torch.cuda.current_stream(dev))  # the zeros first
    todo = plan.chunks()
    lock = threading.Lock()
    errors: list[BaseException] = []
    fds = _open_all(pack_dir, tensors)

    def reader(k: int) -> None:
        # This thread's ring: `depth` staging buffers (pinned on CUDA), allocated on first use, and
        # the event recorded after the copies out of each; a buffer is refilled once its event is
        # done (a blocking-sync event: the wait sleeps instead of spinning on a core the other
        # readers need). Nothing here waits for the other threads or synchronizes the device.
        stream = streams[k % len(streams)] if cuda else None
        bufs: list[torch.Tensor] = []
        views: list[memoryview] = []
        events: list[torch.cuda.Event] = []
        i = 0
        try:
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                while not errors:
                    with lock:
                        c = next(todo, None)
                    if c is None:
                        return
                    s = i % depth
                    i += 1
                    if s == len(bufs):
                        bufs.append(torch.empty(buf_bytes, dtype=torch.uint8, pin_memory=cuda))
                        views.append(bufs[s].numpy().data.cast("B"))
                        if cuda:
                            events.append(torch.cuda.Event(blocking=True))
                    elif cuda:
                        events[s].synchronize()
                    f, begin, end, runs = c
                    view = views[s][: end - begin]
                    pread_exact(fds[f], view, begin, pack_dir / f)
                    b = bufs[s]
                    for src, dst, n in runs:
                        arena[dst : dst + n].copy_(b[src : src + n], non_blocking=cuda)
                    if cuda:
                        events[s].record(stream)
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=reader, args=(k,), name=f"kiln-load-{k}", daemon=True)
        for k in range(nthreads)
    ]
    try:
        for th in threads:
            th.start()
    finally:
        for th in threads:
            if th.ident is not None:
                th.join()
        for fd in fds.values():
            os.close(fd)
    if errors:
        for s in streams:  # nothing may still write into memory that is about to be freed
            s.synchronize()
        raise errors[0]
    if cuda:  # the caller's stream sees the copies; the arena is not reused before they finish
        cur = torch.cuda.current_stream(dev)
        for s in streams:
            cur.wait_stream(s)
            arena.record_stream(s)
    return out, arena, plan.offsets
