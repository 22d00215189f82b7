"""Checks of a weight pack against pack.json and against the model: file sizes and headers
(always), the xxh3 hash of each header (``verify``; the tensor data is checked by the loader once
it has landed, :mod:`weights.integrity`), completeness (``expected``), and for :func:`verify_pack`
every tensor's wsum64 and the sha256 of every file. Every error names the file and the tensor at
fault and says how to fix it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kiln.weights.checksum import hex64
from kiln.weights.index import PackError, PackIndex, RankIndex
from kiln.weights.integrity import CORRUPT, by_file, check_header, check_sums, file_sums
from kiln.weights.st_format import SafetensorsError, dtype_name, read_header
from kiln.weights.writer import sha256_file

Expected = dict[str, tuple[tuple[int, ...], "torch.dtype | str"]]


def check_rank_files(pack_dir: Path, ri: RankIndex, verify: bool = False) -> None:
    """Sizes and headers of rank ``ri``'s files against pack.json (see the module docstring); with
    ``verify`` each header's bytes against its recorded xxh3 first (a header altered in a way the
    other checks would not see, or would report as a disagreement rather than as corruption)."""
    files = by_file(ri)
    for f in ri.files:
        path = pack_dir / f.name
        if not path.is_file():
            raise PackError(
                f"{path} is missing (rank {ri.rank}); the pack is incomplete. Re-run `kiln pack`."
            )
        size = path.stat().st_size
        if size != f.bytes:
            past = sorted((t for t in files[f.name] if t.offset + t.nbytes > size), key=lambda t: t.offset)
            what = (
                f"truncated; tensors past the end: {', '.join(t.name for t in past)}"
                if size < f.bytes
                else "too long"
            )
            raise PackError(
                f"{path} is {size} bytes but pack.json records {f.bytes}: {what}. Re-run `kiln pack`."
            )
        if verify:
            check_header(path, f, files[f.name])
        try:
            hdr = read_header(path)
        except SafetensorsError as e:
            raise PackError(f"{e}. Re-run `kiln pack`.") from e
        if hdr.data_start != f.data_start:
            raise PackError(
                f"{path}: the header ends at byte {hdr.data_start} but pack.json says {f.data_start}. {CORRUPT}"
            )
        mine = {t.name: t for t in files[f.name]}
        if set(hdr.tensors) != set(mine):
            extra = sorted(set(hdr.tensors) - set(mine))
            lost = sorted(set(mine) - set(hdr.tensors))
            raise PackError(
                f"{path}: header and pack.json disagree: only in the file {extra[:8]}, only in pack.json {lost[:8]}"
            )
        for name, info in hdr.tensors.items():
            t = mine[name]
            if info.shape != t.shape or dtype_name(info.dtype) != t.dtype or info.begin != t.offset:
                raise PackError(
                    f"{path}: tensor {name} is {list(info.shape)} {dtype_name(info.dtype)} at byte {info.begin} in "
                    f"the file but pack.json says {list(t.shape)} {t.dtype} at byte {t.offset}. Re-run `kiln pack`."
                )


def check_expected(ri: RankIndex, expected: Expected) -> None:
    """Every expected parameter present once with its shape and dtype, nothing else."""
    missing = sorted(set(expected) - set(ri.tensors))
    unexpected = sorted(set(ri.tensors) - set(expected))
    if missing or unexpected:
        raise PackError(
            f"rank {ri.rank} pack does not match the model's parameters: missing {len(missing)} "
            f"{missing[:10]}, unexpected {len(unexpected)} {unexpected[:10]}. Was it packed for another "
            "model, tp or quantization?"
        )
    for name, (shape, dt) in expected.items():
        t = ri.tensors[name]
        if tuple(shape) != t.shape or dtype_name(dt) != t.dtype:
            raise PackError(
                f"tensor {name}: the pack holds {list(t.shape)} {t.dtype}, the model expects "
                f"{list(shape)} {dtype_name(dt)}. Re-pack for this model configuration."
            )


def check_sha256(pack_dir: Path, ri: RankIndex, threads: int = 8) -> None:
    """sha256 of every file of the rank; on a mismatch, name the tensors whose bytes changed (by
    their wsum64)."""
    paths = [pack_dir / f.name for f in ri.files]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(paths)))) as pool:
        digests = list(pool.map(sha256_file, paths))
    for f, path, got in zip(ri.files, paths, digests):
        if got == f.sha256:
            continue
        mine = [t for t in ri.tensors.values() if t.file == f.name]
        bad = [t.name for t, s in zip(mine, file_sums(pack_dir, mine, threads)) if hex64(s) != t.wsum64]
        where = (
            f"changed tensor(s): {', '.join(bad[:10])}"
            if bad
            else "no tensor's wsum64 differs: the header changed, or pack.json"
        )
        raise PackError(
            f"{path}: sha256 {got[:16]}... does not match pack.json ({f.sha256[:16]}...); {where}. {CORRUPT}"
        )


def verify_pack(pack_dir: str | Path, threads: int = 8) -> PackIndex:
    """Check every rank's files: sizes, headers (and their xxh3), every tensor's wsum64 read from
    its file (a mismatch names the tensor and byte range), then sha256. Returns the index."""
    pack_dir = Path(pack_dir)
    index = PackIndex.load(pack_dir)
    for ri in index.ranks:
        check_rank_files(pack_dir, ri, verify=True)
        tensors = list(ri.tensors.values())
        check_sums(pack_dir, tensors, file_sums(pack_dir, tensors, threads))
        check_sha256(pack_dir, ri, threads)
    return index
