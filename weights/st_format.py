"""The safetensors file format, read and written without loading tensor data.

A safetensors file is ``u64 little-endian header length N`` + ``N`` bytes of JSON + the data
region. The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the data region; tensors tile it without gaps) plus an optional
``"__metadata__"`` dict of strings.

Here: parse and validate a header (:func:`read_header`), plan a file layout whose every tensor
starts at a multiple of its element size (:func:`plan_layout`), and write a header so the data can
then be written tensor by tensor at known offsets (the streaming pack writer relies on that).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.errors import KilnError

ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # UE8M0 block scales (quantization_config scale_fmt "ue8m0")
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}
# Names used in pack.json and in `expected` dicts: torch's own spelling without the prefix.
DTYPE_NAMES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in ST_DTYPES.values()}

MAX_HEADER = 256 * 1024 * 1024  # a header larger than this is certainly corrupt
HEADER_ALIGN = 64  # data region starts at a multiple of this (safetensors needs 8)


class SafetensorsError(KilnError, ValueError):
    """A safetensors file whose header or size does not hold together. Names the file."""


def dtype_name(d: torch.dtype | str) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    if isinstance(d, torch.dtype):
        return str(d).removeprefix("torch.")
    name = d.removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise KilnError(f"unknown dtype {d!r}; expected one of {sorted(DTYPE_NAMES)}")
    return name


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file. ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    path: Path
    data_start: int  # absolute offset of the data region
    file_size: int
    tensors: dict[str, TensorInfo]  # in file (offset) order
    metadata: dict[str, str]
    raw: bytes  # the header JSON bytes, for fingerprints

    @property
    def data_end(self) -> int:
        return max((t.end for t in self.tensors.values()), default=self.data_start)


def read_header(path: str | Path, check_size: bool = True) -> Header:
    """Parse and validate ``path``'s header.

    Checks: the length prefix is sane, the JSON parses, every entry has a known dtype and offsets
    that match its shape, entries tile the data region without gaps or overlaps, and (with
    ``check_size``) the file is exactly as long as the header says. Raises :class:`SafetensorsError`
    naming the file and, where one is at fault, the tensor.
    """
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsError(f"{p}: {size} bytes, too short to be a safetensors file")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER or 8 + n > size:
            raise SafetensorsError(
                f"{p}: header length {n} does not fit the file ({size} bytes); the file is truncated "
                "or not safetensors"
            )
        raw = f.read(n)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{p}: header is not valid JSON ({e}); the file is corrupt") from e
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{p}: header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    data_start = 8 + n
    infos: list[TensorInfo] = []
    for name, entry in doc.items():
        try:
            dt = ST_DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            b, en = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise SafetensorsError(f"{p}: tensor {name!r} has a malformed header entry {entry!r}") from err
        numel = 1
        for s in shape:
            numel *= s
        if en - b != numel * dt.itemsize or b < 0:
            raise SafetensorsError(
                f"{p}: tensor {name!r} has data_offsets {[b, en]} but shape {list(shape)} x "
                f"{entry['dtype']} needs {numel * dt.itemsize} bytes"
            )
        infos.append(TensorInfo(name, dt, shape, data_start + b, data_start + en))
    infos.sort(key=lambda t: (t.begin, t.end))
    pos = data_start
    for t in infos:
        if t.begin != pos:
            raise SafetensorsError(
                f"{p}: tensor {t.name!r} starts at byte {t.begin - data_start} of the data region, "
                f"expected {pos - data_start} (gap or overlap)"
            )
        pos = t.end
    if check_size and pos != size:
        past = [t.name for t in infos if t.end > size]
        what = f"truncated; tensors past the end: {', '.join(past)}" if past else "has trailing bytes"
        raise SafetensorsError(f"{p}: file is {size} bytes but its header describes {pos} bytes: {what}")
    return Header(p, data_start, size, {t.name: t for t in infos}, dict(meta), raw)


@dataclass(frozen=True)
class Layout:
    """A planned file: header bytes and each tensor's absolute offset."""

    header: bytes  # length prefix + JSON + padding
    offsets: dict[str, int]  # name -> absolute file offset of its data
    size: int  # total file size


def plan_layout(
    tensors: list[tuple[str, tuple[int, ...], torch.dtype]], metadata: dict[str, str] | None = None
) -> Layout:
    """Lay out ``(name, shape, dtype)`` tensors: widest element size first (so every tensor starts
    at a multiple of its element size, given the data region starts 64-byte aligned), declaration
    order within one size."""
    order = sorted(range(len(tensors)), key=lambda i: (-tensors[i][2].itemsize, i))
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = metadata
    rel: dict[str, int] = {}
    pos = 0
    for i in order:
        name, shape, dt = tensors[i]
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dt.itemsize
        doc[name] = {"dtype": TORCH_TO_ST[dt], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        rel[name] = pos
        pos += nbytes
    js = json.dumps(doc, separators=(",", ":")).encode()
    pad = (-(8 + len(js))) % HEADER_ALIGN
    js += b" " * pad
    header = struct.pack("<Q", len(js)) + js
    start = len(header)
    return Layout(header, {n: start + o for n, o in rel.items()}, start + pos)


def pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    """``os.pwrite`` until every byte is written (one call writes at most ~2 GiB on Linux)."""
    mv = memoryview(data).cast("B")
    done = 0
    while done < len(mv):
        done += os.pwrite(fd, mv[done : done + (1 << 30)], offset + done)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    assert t.is_contiguous() and t.device.type == "cpu"
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def write_tensor_file(
    path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write a small safetensors file with this module's layout (tests and synthetic checkpoints)."""
    items = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    lay = plan_layout(items, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, lay.size)
        pwrite_all(fd, lay.header, 0)
        for n, t in tensors.items():
            pwrite_all(fd, tensor_bytes(t.detach().contiguous().cpu()), lay.offsets[n])
    finally:
        os.close(fd)
