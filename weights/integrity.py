"""xxh3 block hashes of pack files: computed once at pack time, checked at every load.

A pack file is its safetensors header, bytes ``[0, data_start)``, then its tensor data, cut into
``block_bytes`` blocks from ``data_start`` (the last one shorter). ``pack.json`` records the xxh3-64
of the header and of every block (:mod:`weights.index`). xxh3 runs at 10-20 GB/s a core and
releases the GIL, so the loader's reader threads check each block right after reading it, in
parallel, for a small fraction of the read's cost (``kiln.weights.reader``).

Here: :func:`hash_file` (the packer: sha256 of the whole file and the xxh3 hashes, in one pass),
:class:`FileCheck` (one file's expected hashes; checks a buffer holding whole blocks and names the
byte range and tensors of a bad one), :func:`check_header` and :func:`verify_blocks` (a threaded
pass over every block of a rank, for the loads that do not stream through staging buffers, and
for ``kiln pack --verify``). Every mismatch is a :class:`~kiln.weights.index.PackError` naming the
file, the byte range and the tensors, and saying the file is corrupt.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kiln.weights.index import PackError, PackFile, PackTensor, RankIndex
from kiln.weights.st_format import DTYPE_NAMES, TORCH_TO_ST
from kiln.weights.writer import HASH_CHUNK, crc32_range

xxh3 = xxhash.xxh3_64_intdigest  # releases the GIL
CORRUPT = "The file is corrupt: copy it again, or re-run `kiln pack` / `kiln compile`."


def hex64(x: int) -> str:
    return f"{x:016x}"


@dataclass(frozen=True)
class FileHashes:
    """What :func:`hash_file` records for one file."""

    sha256: str
    header_xxh3: str
    blocks_xxh3: tuple[str, ...]


def pread_exact(fd: int, out: memoryview, offset: int, path: Path) -> None:
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if n <= 0:
            raise PackError(f"{path}: unexpected end of file at byte {offset + got}; the file is truncated.")
        got += n


def hash_file(path: str | Path, data_start: int, block_bytes: int) -> FileHashes:
    """sha256 of the whole file and xxh3 of its header and of each data block, reading it once in
    1 MiB pieces (both hashes release the GIL, so files hash in parallel on threads)."""
    path = Path(path)
    sha = hashlib.sha256()
    buf = memoryview(bytearray(HASH_CHUNK))

    def feed(fd: int, begin: int, end: int) -> str:
        h = xxhash.xxh3_64()
        for pos in range(begin, end, HASH_CHUNK):
            view = buf[: min(HASH_CHUNK, end - pos)]
            pread_exact(fd, view, pos, path)
            sha.update(view)
            h.update(view)
        return hex64(h.intdigest())

    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        header = feed(fd, 0, data_start)
        blocks = tuple(feed(fd, b, min(b + block_bytes, size)) for b in range(data_start, size, block_bytes))
    finally:
        os.close(fd)
    return FileHashes(sha.hexdigest(), header, blocks)


class FileCheck:
    """One file's expected block hashes and the tensors it holds (sorted by offset), to check
    buffers as they are read and to say what a bad block holds."""

    def __init__(self, path: Path, f: PackFile, tensors: list[PackTensor], block_bytes: int) -> None:
        self.path = path
        self.file = f
        self.block_bytes = block_bytes
        self.expected = [int(h, 16) for h in f.blocks_xxh3]
        self.tensors = sorted((t for t in tensors if t.nbytes), key=lambda t: t.offset)
        self._starts = [t.offset for t in self.tensors]

    def check(self, buf: memoryview, begin: int) -> None:
        """``buf`` holds file bytes ``[begin, begin + len(buf))``: whole blocks (the last one may
        end at the end of the file). Raises on the first block whose hash differs."""
        rel = begin - self.file.data_start
        if rel < 0 or rel % self.block_bytes:
            raise AssertionError(
                f"{self.path}: byte {begin} is not on the {self.block_bytes}-byte block grid"
            )
        k = rel // self.block_bytes
        for off in range(0, len(buf), self.block_bytes):
            if xxh3(buf[off : off + self.block_bytes]) != self.expected[k]:
                raise self.failure(k)
            k += 1

    def block_range(self, k: int) -> tuple[int, int]:
        begin = self.file.data_start + k * self.block_bytes
        return begin, min(begin + self.block_bytes, self.file.bytes)

    def failure(self, k: int) -> PackError:
        """The error for block ``k``: its byte range, the tensors it overlaps and, by their crc32,
        which of them changed (read again here: an error path)."""
        begin, end = self.block_range(k)
        i = max(0, bisect.bisect_right(self._starts, begin) - 1)
        held = []
        for t in self.tensors[i:]:
            if t.offset >= end:
                break
            if t.offset + t.nbytes > begin:
                held.append(t)
        changed = [
            t.name
            for t in held
            if t.crc32 and crc32_range(self.path, t.offset, t.offset + t.nbytes) != t.crc32
        ]
        names = ", ".join(t.name for t in held[:10]) + (
            f" and {len(held) - 10} more" if len(held) > 10 else ""
        )
        what = f"; changed: {', '.join(changed[:10])}" if changed else ""
        return PackError(
            f"{self.path}: bytes [{begin}, {end}) (block {k} of {len(self.expected)}) do not match the xxh3 "
            f"hash pack.json records; they hold tensor(s) {names}{what}. {CORRUPT}"
        )


def check_header(path: Path, f: PackFile, tensors: list[PackTensor]) -> None:
    """The header bytes ``[0, data_start)`` against ``header_xxh3``; a mismatch names the tensors
    whose header entries differ from pack.json."""
    with open(path, "rb", buffering=0) as fh:
        raw = fh.read(f.data_start)
    if len(raw) == f.data_start and hex64(xxh3(raw)) == f.header_xxh3:
        return
    raise PackError(
        f"{path}: header bytes [0, {f.data_start}) do not match the xxh3 hash pack.json records "
        f"({_header_diagnosis(raw, f.data_start, tensors)}). {CORRUPT}"
    )


def _header_diagnosis(raw: bytes, data_start: int, tensors: list[PackTensor]) -> str:
    if len(raw) < 8:
        return "the file is too short"
    (n,) = struct.unpack("<Q", raw[:8])
    if n != data_start - 8:
        return f"its length prefix says {n} bytes, pack.json {data_start - 8}"
    try:
        doc = json.loads(raw[8:])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        pos = 8 + (e.pos if isinstance(e, json.JSONDecodeError) else e.start)
        near = [(raw.rfind(json.dumps(t.name).encode(), 0, pos + 1), t.name) for t in tensors]
        at, name = max(near, default=(-1, ""))
        return f"not valid JSON at byte {pos}" + (
            f", in or after the entry of tensor {name}" if at >= 0 else ""
        )
    if not isinstance(doc, dict):
        return "not a JSON object"
    doc.pop("__metadata__", None)
    want = {
        t.name: {
            "dtype": TORCH_TO_ST[DTYPE_NAMES[t.dtype]],
            "shape": list(t.shape),
            "data_offsets": [t.offset - data_start, t.offset - data_start + t.nbytes],
        }
        for t in tensors
    }
    changed = [name for name, e in want.items() if doc.get(name) != e]
    changed += [f"{name} (not in pack.json)" for name in doc if name not in want]
    if changed:
        return f"changed entries: tensor(s) {', '.join(changed[:10])}"
    return "its __metadata__ or padding changed; every tensor entry is intact"


def by_file(ri: RankIndex) -> dict[str, list[PackTensor]]:
    out: dict[str, list[PackTensor]] = {f.name: [] for f in ri.files}
    for t in ri.tensors.values():
        out.setdefault(t.file, []).append(t)
    return out


def file_checks(pack_dir: Path, ri: RankIndex, block_bytes: int) -> dict[str, FileCheck]:
    files = by_file(ri)
    return {f.name: FileCheck(pack_dir / f.name, f, files[f.name], block_bytes) for f in ri.files}


def verify_blocks(pack_dir: Path, ri: RankIndex, block_bytes: int, threads: int = 8) -> None:
    """Read and check every data block of rank ``ri``'s files on ``threads`` threads; raises for
    the first bad block found (the other threads then stop)."""
    checks = file_checks(pack_dir, ri, block_bytes)
    jobs = [(c, k) for c in checks.values() for k in range(len(c.expected))]
    if not jobs:
        return
    local = threading.local()
    failed = threading.Event()  # the other threads stop early
    fds: dict[str, int] = {}
    try:
        for name in checks:
            fds[name] = os.open(pack_dir / name, os.O_RDONLY)

        def one(job: tuple[FileCheck, int]) -> None:
            c, k = job
            if failed.is_set():
                return
            if not hasattr(local, "buf"):
                local.buf = memoryview(bytearray(block_bytes))
            begin, end = c.block_range(k)
            view = local.buf[: end - begin]
            try:
                pread_exact(fds[c.file.name], view, begin, c.path)
                c.check(view, begin)
            except BaseException:
                failed.set()
                raise

        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(jobs)))) as pool:
            for _ in pool.map(one, jobs):
                pass
    finally:
        for fd in fds.values():
            os.close(fd)
