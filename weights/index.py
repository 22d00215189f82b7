"""``pack.json``: what a weight pack holds and how to check it.

Layout of a pack directory::

    pack.json
    rank0.safetensors                      one file per rank ...
    rank1-00001-of-00002.safetensors       ... or several, past the size limit

``pack.json`` (format ``kiln-pack``, :data:`FORMAT_VERSION`)::

    {"format": "kiln-pack", "version": 3, "kiln_version": "...",
     "source": {"fingerprint": sha256 hex, "files": [{"name", "bytes"}]},
     "tp": N, "ep": N, "dtype": "bfloat16", "quant": null | "fp8" | "fp8-block", "model": {...},
     "ranks": [{"rank": 0,
                "files": [{"name", "bytes", "sha256", "data_start", "header_xxh3"}],
                "tensors": {name: {"shape", "dtype", "file", "offset", "nbytes", "wsum64",
                                   "placement"}}}]}

Integrity (:mod:`weights.integrity`): a file is its safetensors header, bytes ``[0, data_start)``,
then its tensor data. ``header_xxh3`` is the xxh3-64 (16 hex digits) of the header bytes, checked
before a load reads any data. ``offset`` is the absolute byte offset of a tensor's data in its
file; ``wsum64`` (16 hex digits) the checksum of its ``nbytes`` bytes (:mod:`weights.checksum`),
checked after a load where the data landed (on a GPU by one kernel over all of a rank's tensors).
``sha256`` of the whole file is kept for external tools and ``kiln pack --verify``.

The file is reproducible: the same checkpoint, options and kiln version give the same bytes (no
timestamp, no absolute path; keys in a fixed order). How one pack was made (when, from which
directory, peak memory) is :class:`PackProvenance`, returned with the index and never written
here. The source fingerprint hashes config.json and every weight file's name, size and safetensors
header (not the data).

Version history (this kiln refuses older versions with the re-pack command): 1 had no hashes but
sha256 and crc32, and recorded ``created`` and ``source.dir``; 2 had the xxh3 of every 8 MiB data
block (``block_bytes``, ``blocks_xxh3``; checked by the loader's reader threads as they read, which
cost start-up time) and a crc32 per tensor instead of ``wsum64``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

FORMAT = "kiln-pack"
FORMAT_VERSION = 3
INDEX_NAME = "pack.json"
REPACK = "re-pack with this kiln (`kiln pack`, or `kiln compile` for an artifact)"


class PackError(KilnError, ValueError):
    """A weight pack that is missing, incomplete, corrupt, or not what the model expects."""


@dataclass(frozen=True)
class PackFile:
    """One file of a rank: its size, sha256 and header hash (see the module docstring)."""

    name: str
    bytes: int
    sha256: str
    data_start: int  # first byte of tensor data (= length of the safetensors header)
    header_xxh3: str


@dataclass(frozen=True)
class PackTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str
    offset: int
    nbytes: int
    wsum64: str  # 16 hex digits (weights/checksum.py)
    placement: str = ""


@dataclass(frozen=True)
class PackProvenance:
    """How one pack was made: what differs between two packs of the same checkpoint, so it is kept
    out of pack.json. ``pack_checkpoint`` returns it as ``index.provenance``; a caller may write
    :meth:`to_json` into a build log beside the pack."""

    created: str  # ISO-8601 UTC, seconds
    source_dir: str  # the checkpoint directory, resolved
    seconds: float  # wall time of pack_checkpoint
    peak_write_queue_bytes: int  # the writer's queue at its fullest
    peak_readahead_bytes: int  # the stream's read-ahead window at its fullest (0 with mmap)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RankIndex:
    rank: int
    files: list[PackFile] = field(default_factory=list)
    tensors: dict[str, PackTensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass
class PackIndex:
    tp: int
    ep: int
    dtype: str
    quant: str | None
    source: dict[str, Any]
    ranks: list[RankIndex]
    model: dict[str, Any] = field(default_factory=dict)
    kiln_version: str = ""
    version: int = FORMAT_VERSION
    # How this pack was made; set by ``pack_checkpoint``, never written to pack.json (None once loaded).
    provenance: PackProvenance | None = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "kiln_version": self.kiln_version,
            "source": self.source,
            "tp": self.tp,
            "ep": self.ep,
            "dtype": self.dtype,
            "quant": self.quant,
            "model": self.model,
            "ranks": [
                {
                    "rank": r.rank,
                    "files": [asdict(f) for f in r.files],
                    "tensors": {
                        n: {k: (list(v) if k == "shape" else v) for k, v in asdict(t).items() if k != "name"}
                        for n, t in r.tensors.items()
                    },
                }
                for r in self.ranks
            ],
        }

    def save(self, out_dir: str | Path) -> Path:
        """Write ``pack.json`` atomically (a pack without it is not a pack)."""
        path = Path(out_dir) / INDEX_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, pack_dir: str | Path) -> PackIndex:
        path = Path(pack_dir) / INDEX_NAME
        if not path.is_file():
            raise PackError(
                f"no {INDEX_NAME} in {pack_dir}: not a kiln weight pack, or packing was interrupted "
                "(pack.json is written last). Re-run `kiln pack`."
            )
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PackError(f"{path} is not valid JSON ({e}); re-run `kiln pack`.") from e
        if doc.get("format") != FORMAT:
            raise PackError(f"{path}: 'format' is {doc.get('format')!r}, expected {FORMAT!r}.")
        if doc.get("version") != FORMAT_VERSION:
            raise PackError(
                f"{path}: pack format version {doc.get('version')} but this kiln reads version "
                f"{FORMAT_VERSION}; {REPACK}."
            )
        try:
            ranks = [
                RankIndex(
                    rank=int(r["rank"]),
                    files=[PackFile(**f) for f in r["files"]],
                    tensors={
                        n: PackTensor(name=n, **{**t, "shape": tuple(t["shape"])})
                        for n, t in r["tensors"].items()
                    },
                )
                for r in doc["ranks"]
            ]
            index = cls(
                tp=int(doc["tp"]),
                ep=int(doc["ep"]),
                dtype=str(doc["dtype"]),
                quant=doc.get("quant"),
                source=dict(doc.get("source") or {}),
                ranks=ranks,
                model=dict(doc.get("model") or {}),
                kiln_version=str(doc.get("kiln_version", "")),
                version=int(doc["version"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PackError(f"{path} is malformed ({e!r}); re-run `kiln pack`.") from e
        index._check_hash_fields(path)
        return index

    def _check_hash_fields(self, path: Path) -> None:
        for r in self.ranks:
            for f in r.files:
                if not 0 < f.data_start <= f.bytes or not _is_hex64(f.header_xxh3):
                    raise PackError(
                        f"{path}: file {f.name} records data_start {f.data_start} of {f.bytes} bytes and "
                        f"header_xxh3 {f.header_xxh3!r}; re-run `kiln pack`."
                    )
            for t in r.tensors.values():
                if not _is_hex64(t.wsum64):
                    raise PackError(
                        f"{path}: tensor {t.name} of rank {r.rank} records wsum64 {t.wsum64!r}, not 16 hex "
                        "digits; re-run `kiln pack`."
                    )

    def summary(self) -> str:
        """A few lines for the end of ``kiln pack``."""
        gib = 1024**3
        lines = [
            f"packed {sum(len(r.tensors) for r in self.ranks)} tensors, {self.nbytes / gib:.2f} GiB, "
            f"tp={self.tp} ep={self.ep} dtype={self.dtype} quant={self.quant or 'none'}"
        ]
        for r in self.ranks:
            lines.append(
                f"  rank {r.rank}: {len(r.tensors)} tensors, {r.nbytes / gib:.3f} GiB in {len(r.files)} file(s)"
            )
        m = self.model
        lines.append(
            f"  skipped {m.get('skipped_tensors', 0)} checkpoint tensor(s), dequantized {m.get('dequantized_fp8', 0)} FP8 "
            f"weight(s); source fingerprint {self.source.get('fingerprint', '')[:16]}"
        )
        return "\n".join(lines)

    def rank(self, r: int) -> RankIndex:
        if not 0 <= r < len(self.ranks):
            raise PackError(
                f"rank {r} is not in this pack (it has ranks 0..{len(self.ranks) - 1}, tp={self.tp})."
            )
        return self.ranks[r]


def _is_hex64(s: object) -> bool:
    return isinstance(s, str) and len(s) == 16 and all(c in "0123456789abcdef" for c in s)
