"""The artifact's on-disk format below the manifest's fields: file names, the schema version, the
hashes, the build log and the error every refusal raises. Shared by the compiler (which writes an
artifact) and the runtime (which reads it); neither imports the other, both import this module and
:mod:`kiln.manifest` (the typed fields of ``manifest.json``).

``manifest.json`` (schema :data:`SCHEMA_VERSION`) holds, besides the model facts:

* ``versions``: ``torch``, ``triton``, ``cuda``, ``python``, ``kiln`` (:func:`kiln_version`) and
  ``kernel_sources`` (:func:`kernel_source_hash`: sha256 over the sorted relative paths and bytes of
  the ``kiln.ops`` sources, .py and CUTLASS .cu, computed the same way at compile and at load);
* ``files``: every file of the artifact but ``manifest.json`` and ``build-log.json``, relative POSIX
  path -> ``{"size": bytes, "xxh3_128": hex}``, or for the weight data files
  ``{"size": bytes, "checked_by": "weights/pack.json"}`` (the pack loader checks those against the
  block hashes pack.json records while it streams them; pack.json itself has a hash here);
* ``manifest_xxh3_128``: :func:`manifest_digest` of the manifest's own content without that field
  (canonical JSON), so any edit of the manifest is detected.

``build-log.json`` (:data:`BUILD_LOG`) holds what differs between two compiles of the same
checkpoint with the same options and versions (timings, the source path, the time, the host, build
cache hits, measured tuning timings); it is in no table and no comparison. Every other file of an
artifact is reproducible to the byte.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

from kiln.errors import KilnError

# 2: kiln::linear takes max_m; kernels carry PDL. 3: norm_folds, the residual arguments of
# kiln::linear / kiln::fused_moe and rmsnorm_linear's folded. 4: versions.kiln and
# versions.kernel_sources, xxh3 file table, manifest_xxh3_128, build-log.json. 5: typed
# (kiln.manifest), kernel_choices.page_size dropped (kv.page_size is the one). 6: kernel_choices.gemv
# renamed gemv_plan (the --gemv-plan flag's name). Older artifacts: rebuild.
SCHEMA_VERSION = 6
MANIFEST = "manifest.json"
BUILD_LOG = "build-log.json"
HASH_KEY = "xxh3_128"  # per-file hash in ``files``
CHECKED_BY_KEY = "checked_by"  # weight data files: checked by the pack loader against this file
PACK_INDEX = "weights/pack.json"
# The checkpoint's tokenizer files the compiler copies into the artifact (those present); the
# compile cache keys on them and the Hub download fetches them (kiln/compile_cache.py, kiln/hub.py).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
MANIFEST_HASH_KEY = "manifest_xxh3_128"
KERNEL_SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".h", ".cpp")
_PARALLEL_FROM = 16  # files: below this, hashing in threads costs more than it saves
REBUILD = "rebuild it on this machine with `kiln compile MODEL_DIR -o ART --force`"
RECOPY = f"copy it again or {REBUILD}"


class ArtifactError(KilnError):
    """An artifact that cannot be used here: missing, altered, damaged or built for another machine
    (the message names the file or field and ends with the fix)."""


def kiln_version() -> str:
    import kiln

    return kiln.__version__


def sources_hash(root: Path) -> str:
    """sha256 over the sorted relative paths, sizes and bytes of the files under ``root`` whose
    suffix is in ``KERNEL_SOURCE_SUFFIXES`` (``__pycache__`` left out)."""
    files = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.suffix in KERNEL_SOURCE_SUFFIXES and "__pycache__" not in p.parts and p.is_file()
    )
    h = hashlib.sha256()
    for rel in files:
        data = (root / rel).read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def kernel_source_hash() -> str:
    """:func:`sources_hash` of the installed ``kiln.ops`` package (its .py and the CUTLASS .cu
    sources), the same at compile and at load; computed once per process (about 1 ms)."""
    import kiln.ops

    return sources_hash(Path(kiln.ops.__file__).resolve().parent)


def file_digest(path: Path, chunk: int = 8 << 20) -> str:
    """xxh3-128 (hex) of a file's bytes."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def bytes_digest(data: bytes) -> str:
    """xxh3-128 (hex) of bytes already read (a file checked as it is used)."""
    return xxhash.xxh3_128(data).hexdigest()


def file_digests(root: Path, rels: Iterable[str], threads: int = 8) -> dict[str, str]:
    """``{rel: file_digest(root / rel)}``, read in ``threads`` threads when there are many files
    (file reads release the GIL: a Triton cache is thousands of small files)."""
    rels = list(rels)
    if len(rels) < _PARALLEL_FROM or threads <= 1:
        return {rel: file_digest(root / rel) for rel in rels}
    with ThreadPoolExecutor(max_workers=min(threads, os.cpu_count() or 1, len(rels))) as pool:
        return dict(zip(rels, pool.map(lambda rel: file_digest(root / rel), rels)))


def canonical_json(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """xxh3-128 (hex) of the manifest's canonical JSON without its ``manifest_xxh3_128`` field."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_HASH_KEY}
    return xxhash.xxh3_128(canonical_json(body)).hexdigest()


def is_weight_data(rel: str) -> bool:
    """A weight pack's data file (checked by the pack loader, not by the file table's hash)."""
    return rel.startswith("weights/") and rel.endswith(".safetensors")


def gpu_arch(device: Any) -> str:
    """``sm_90`` style for a CUDA device (a ``torch.device`` or a string such as ``"cuda:0"``),
    ``cpu`` otherwise: what the compiler records and the runtime compares (imports torch)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(dev)
    return f"sm_{major}{minor}"


def write_build_log(root: Path, log: dict[str, Any]) -> None:
    """Write ``root/build-log.json``: what differs between two compiles of the same inputs (timings,
    source path, time, host, build-cache hits, measured timings). No check reads it."""
    (root / BUILD_LOG).write_text(json.dumps(log, indent=2, sort_keys=True, default=str) + "\n")
