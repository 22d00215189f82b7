"""Writing ``manifest.json`` and ``build-log.json``: what the runtime needs to know about an
artifact (and nothing it would have to re-derive from the architecture), and, apart, how this one
build went. The format (file table, self-hash, versions) is ``kiln.artifact_format``'s, which the
runtime reads with ``kiln.runtime.artifact`` (neither side imports the other)."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch
import triton

from kiln.artifact_format import (
    BUILD_LOG,
    CHECKED_BY_KEY,
    HASH_KEY,
    MANIFEST,
    MANIFEST_HASH_KEY,
    PACK_INDEX,
    SCHEMA_VERSION,
    file_digests,
    gpu_arch_of,
    is_weight_data,
    kernel_source_hash,
    kiln_version,
    manifest_digest,
)


def gpu_arch(device: str) -> str:
    """``sm_90`` style for CUDA devices, ``cpu`` otherwise."""
    if device.startswith("cuda"):
        return gpu_arch_of(torch.cuda.get_device_capability(torch.device(device)))
    return "cpu"


def versions() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "kiln": kiln_version(),
        "kernel_sources": kernel_source_hash(),
    }


def file_table(root: Path) -> dict[str, dict[str, Any]]:
    """Size and xxh3-128 of every file under ``root`` (relative POSIX paths, sorted) but the manifest
    and the build log; the weight data files get their size and ``checked_by`` pack.json instead of
    a hash (the pack loader checks their blocks against it while it streams them)."""
    rels = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.relative_to(root).as_posix() not in (MANIFEST, BUILD_LOG)
    )
    digests = file_digests(root, [r for r in rels if not is_weight_data(r)])
    return {
        rel: {"size": (root / rel).stat().st_size}
        | ({CHECKED_BY_KEY: PACK_INDEX} if is_weight_data(rel) else {HASH_KEY: digests[rel]})
        for rel in rels
    }


def write_manifest(root: Path, body: dict[str, Any]) -> dict[str, Any]:
    """Write ``root/manifest.json``: ``body`` with the schema version, the file table and the
    manifest's own hash. Returns the manifest."""
    manifest = {"schema_version": SCHEMA_VERSION, **body, "files": file_table(root)}
    manifest[MANIFEST_HASH_KEY] = manifest_digest(manifest)
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def write_build_log(root: Path, log: dict[str, Any]) -> None:
    """Write ``root/build-log.json``: what differs between two compiles of the same inputs (timings,
    source path, time, host, build-cache hits, measured timings). No check reads it."""
    (root / BUILD_LOG).write_text(json.dumps(log, indent=2, sort_keys=True, default=str) + "\n")
