"""Pack integrity: what the packer records and the loader checks (:mod:`weights.index` lists the
fields).

* Each file's header, bytes ``[0, data_start)``: ``header_xxh3``, checked before any data is read
  (:func:`check_header`; a mismatch names the tensors whose header entries changed).
* Each tensor's data: its wsum64 (:mod:`weights.checksum`), computed by the packer's writer threads
  as it writes the tensor, and checked after a load where the data landed: on a CUDA device by one
  kernel over the loader's arena, on the CPU by numpy on threads (:func:`check_sums` compares; a
  mismatch names each tensor, its file and byte range). :func:`file_sums` computes them from the
  files themselves (the CUDA ``direct`` path, ``kiln pack --verify``).
* Each whole file: ``sha256`` (:func:`hash_file`, for external tools and ``kiln pack --verify``).

Every mismatch is a :class:`~kiln.weights.index.PackError` saying the file is corrupt and how to
replace it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kiln.weights.checksum import hex64, wsum64_many
from kiln.weights.index import PackError, PackFile, PackTensor, RankIndex
from kiln.weights.st_format import DTYPE_NAMES, TORCH_TO_ST
from kiln.weights.writer import HASH_CHUNK

CORRUPT = "The file is corrupt: copy it again, or re-run `kiln pack` / `kiln compile`."


@dataclass(frozen=True)
class FileHashes:
    """What :func:`hash_file` records for one file."""

    sha256: str
    header_xxh3: str


def pread_exact(fd: int, out: memoryview, offset: int, path: Path) -> None:
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if n <= 0:
            raise PackError(f"{path}: unexpected end of file at byte {offset + got}; the file is truncated.")
        got += n


def hash_file(path: str | Path, data_start: int) -> FileHashes:
    """sha256 of the whole file and xxh3 of its header, reading it once in 1 MiB pieces (hashlib
    releases the GIL, so files hash in parallel on threads)."""
    path = Path(path)
    sha = hashlib.sha256()
    buf = memoryview(bytearray(HASH_CHUNK))
    fd = os.open(path, os.O_RDONLY)
    try:
        header = bytearray()
        size = os.fstat(fd).st_size
        for pos in range(0, size, HASH_CHUNK):
            view = buf[: min(HASH_CHUNK, size - pos)]
            pread_exact(fd, view, pos, path)
            sha.update(view)
            if pos < data_start:
                header += view[: data_start - pos]
    finally:
        os.close(fd)
    return FileHashes(sha.hexdigest(), hex64(xxhash.xxh3_64_intdigest(header)))


def check_sums(pack_dir: Path, tensors: Sequence[PackTensor], got: Sequence[int]) -> None:
    """``got[i]`` (wsum64 of the data loaded for ``tensors[i]``) against pack.json; raises naming
    every tensor that differs, with its file and byte range."""
    bad = [t for t, g in zip(tensors, got) if hex64(g) != t.wsum64]
    if not bad:
        return
    where = "; ".join(
        f"tensor {t.name} ({pack_dir / t.file} bytes [{t.offset}, {t.offset + t.nbytes}))" for t in bad[:8]
    )
    more = f"; and {len(bad) - 8} more" if len(bad) > 8 else ""
    raise PackError(
        f"weight data does not match the wsum64 checksum pack.json records: {where}{more}. {CORRUPT}"
    )


def file_sums(pack_dir: Path, tensors: Sequence[PackTensor], threads: int = 8) -> list[int]:
    """wsum64 of each tensor's bytes as they are in its file (memory-mapped: the page cache, no
    copy), on ``threads`` threads."""
    maps = {f: np.memmap(pack_dir / f, dtype=np.uint8, mode="r") for f in sorted({t.file for t in tensors})}
    return wsum64_many([maps[t.file][t.offset : t.offset + t.nbytes] for t in tensors], threads)


def check_header(path: Path, f: PackFile, tensors: list[PackTensor]) -> None:
    """The header bytes ``[0, data_start)`` against ``header_xxh3``; a mismatch names the tensors
    whose header entries differ from pack.json."""
    with open(path, "rb", buffering=0) as fh:
        raw = fh.read(f.data_start)
    if len(raw) == f.data_start and hex64(xxhash.xxh3_64_intdigest(raw)) == f.header_xxh3:
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
