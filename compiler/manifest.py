"""Writing ``manifest.json``: what the runtime needs to know about an artifact, and nothing it
would have to re-derive from the architecture. The runtime reads it with
``kiln.runtime.artifact`` (which never imports this package); the schema is shared through the
plain JSON keys documented there."""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

import torch
import triton

# 2: kiln::linear takes max_m; kernels carry PDL. 3: norm_folds, the residual arguments of
# kiln::linear / kiln::fused_moe and rmsnorm_linear's folded (older artifacts: rebuild)
SCHEMA_VERSION = 3


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def gpu_arch(device: str) -> str:
    """``sm_90`` style for CUDA devices, ``cpu`` otherwise."""
    if device.startswith("cuda"):
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        return f"sm_{major}{minor}"
    return "cpu"


def versions() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def pack_hashes(root: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of the weight-pack files, as the pack writer recorded them in pack.json."""
    index = root / "weights" / "pack.json"
    if not index.is_file():
        return {}
    known = {}
    for rank in json.loads(index.read_text()).get("ranks", []):
        for f in rank.get("files", []):
            known[f"weights/{f['name']}"] = {"sha256": f["sha256"], "size": f["bytes"]}
    return known


def file_table(
    root: Path, exclude: tuple[str, ...] = ("manifest.json",), known: dict[str, dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under ``root`` (relative POSIX paths, sorted). Hashes in
    ``known`` are reused when the size still matches (the pack writer hashed while writing)."""
    known = known or {}
    table: dict[str, dict[str, Any]] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in exclude:
            size = p.stat().st_size
            k = known.get(rel)
            table[rel] = k if k and k["size"] == size else {"sha256": sha256_file(p), "size": size}
    return table


def write_manifest(root: Path, body: dict[str, Any]) -> dict[str, Any]:
    manifest = {"schema_version": SCHEMA_VERSION, **body, "files": file_table(root, known=pack_hashes(root))}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
