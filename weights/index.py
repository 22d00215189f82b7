"""``pack.json``: what a weight pack holds and how to check it.

Layout of a pack directory::

    pack.json
    rank0.safetensors                      one file per rank ...
    rank1-00001-of-00002.safetensors       ... or several, past the size limit

``pack.json`` (format ``kiln-pack``, :data:`FORMAT_VERSION`)::

    {"format": "kiln-pack", "version": 1, "created": ISO-8601, "kiln_version": "...",
     "source": {"dir": ..., "fingerprint": sha256 hex, "files": [{"name", "bytes"}]},
     "tp": N, "ep": N, "dtype": "bfloat16", "quant": null | "fp8", "model": {...},
     "ranks": [{"rank": 0,
                "files": [{"name", "bytes", "sha256"}],
                "tensors": {name: {"shape", "dtype", "file", "offset", "nbytes", "crc32",
                                   "placement"}}}]}

``offset`` is the absolute byte offset of the tensor's data in its file; ``crc32`` (hex) of its
bytes locates a corruption the file's sha256 detects. The source fingerprint
hashes config.json and every weight file's name, size and safetensors header (not the data).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

FORMAT = "kiln-pack"
FORMAT_VERSION = 1
INDEX_NAME = "pack.json"


class PackError(KilnError, ValueError):
    """A weight pack that is missing, incomplete, corrupt, or not what the model expects."""


@dataclass(frozen=True)
class PackFile:
    name: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class PackTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str
    offset: int
    nbytes: int
    crc32: str
    placement: str = ""


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
    created: str = ""
    kiln_version: str = ""
    version: int = FORMAT_VERSION

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "created": self.created,
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
                f"{FORMAT_VERSION}; re-pack with this kiln (`kiln pack`)."
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
            return cls(
                tp=int(doc["tp"]),
                ep=int(doc["ep"]),
                dtype=str(doc["dtype"]),
                quant=doc.get("quant"),
                source=dict(doc.get("source") or {}),
                ranks=ranks,
                model=dict(doc.get("model") or {}),
                created=str(doc.get("created", "")),
                kiln_version=str(doc.get("kiln_version", "")),
                version=int(doc["version"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PackError(f"{path} is malformed ({e!r}); re-run `kiln pack`.") from e

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
