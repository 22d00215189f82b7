"""The artifact's on-disk format, shared by the compiler (which writes it) and the runtime (which
reads it); neither imports the other, both import this module.

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
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

# 2: kiln::linear takes max_m; kernels carry PDL. 3: norm_folds, the residual arguments of
# kiln::linear / kiln::fused_moe and rmsnorm_linear's folded. 4: versions.kiln and
# versions.kernel_sources, xxh3 file table, manifest_xxh3_128, build-log.json (older artifacts: rebuild)
SCHEMA_VERSION = 4
MANIFEST = "manifest.json"
BUILD_LOG = "build-log.json"
HASH_KEY = "xxh3_128"  # per-file hash in ``files``
CHECKED_BY_KEY = "checked_by"  # weight data files: checked by the pack loader against this file
PACK_INDEX = "weights/pack.json"
MANIFEST_HASH_KEY = "manifest_xxh3_128"
KERNEL_SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".h", ".cpp")
_PARALLEL_FROM = 16  # files: below this, hashing in threads costs more than it saves


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


def gpu_arch_of(capability: tuple[int, int] | None) -> str:
    """``sm_90`` style for a CUDA device's compute capability, ``cpu`` for None."""
    return "cpu" if capability is None else f"sm_{capability[0]}{capability[1]}"


# What the runtime reads, with its type: checked before any field is used, so a manifest that lacks
# one or holds the wrong type is refused naming the field (not a KeyError deep in the loader).
_INT, _STR, _BOOL, _NUM, _DICT, _LIST = (
    "an integer",
    "a string",
    "a boolean",
    "a number",
    "an object",
    "a list",
)
FIELDS: dict[str, str] = {
    "schema_version": _INT,
    MANIFEST_HASH_KEY: _STR,
    "versions": _DICT,
    "versions.torch": _STR,
    "versions.triton": _STR,
    "versions.kiln": _STR,
    "versions.kernel_sources": _STR,
    "gpu_arch": _STR,
    "dtype": _STR,
    "tp": _INT,
    "model": _DICT,
    "max_seq_len": _INT,
    "max_batch_size": _INT,
    "chunk_size": _INT,
    "decode_buckets": _LIST,
    "graphs": _DICT,
    "graphs.model": _DICT,
    "kv": _DICT,
    "kv.num_layers": _INT,
    "kv.num_kv_heads": _INT,
    "kv.head_dim": _INT,
    "kv.v_head_dim": _INT,
    "kv.page_size": _INT,
    "kv.bytes_per_token": _INT,
    "kv.dtype": _STR,
    "rope": _DICT,
    "rope.rotary_dim": _INT,
    "rope.base": _NUM,
    "rope.scaling": _DICT,
    "rope.is_neox": _BOOL,
    "vocab_size": _INT,
    "eos_token_ids": _LIST,
    "tokenizer_files": _LIST,
    "norm_folds": _DICT,
    "kernel_choices": _DICT,
    "files": _DICT,
}


def _is(value: Any, kind: str) -> bool:
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _NUM:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, {_STR: str, _BOOL: bool, _DICT: dict, _LIST: list}[kind])


def _get(doc: dict[str, Any], parts: Iterable[str]) -> tuple[bool, Any]:
    cur: Any = doc
    for part in parts:
        if not isinstance(cur, dict) or part not in cur:
            return False, None
        cur = cur[part]
    return True, cur


def _kind_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)  # fmt: skip


def _checks(m: dict[str, Any]) -> Iterator[tuple[str, tuple[bool, Any], str]]:
    """``(field name, (found, value), expected kind)`` of every field the runtime reads."""
    for dotted, kind in FIELDS.items():
        yield dotted, _get(m, dotted.split(".")), kind
    graphs = m.get("graphs") if isinstance(m.get("graphs"), dict) else {}
    for name, g in graphs.items():
        yield f"graphs.{name}", (True, g), _DICT
        yield f"graphs.{name}.file", _get(m, ("graphs", name, "file")), _STR
        if isinstance(g, dict) and "python" in g:
            for key, kind in (("file", _STR), ("weight_keys", _LIST), ("num_inputs", _INT), ("output", _STR)):
                yield f"graphs.{name}.python.{key}", _get(m, ("graphs", name, "python", key)), kind
    files = m.get("files") if isinstance(m.get("files"), dict) else {}
    for rel, info in files.items():
        yield f"files.{rel}", (True, info), _DICT
        yield f"files.{rel}.size", _get(m, ("files", rel, "size")), _INT
        key = CHECKED_BY_KEY if is_weight_data(rel) else HASH_KEY
        yield f"files.{rel}.{key}", _get(m, ("files", rel, key)), _STR


def field_problem(manifest: dict[str, Any]) -> str | None:
    """The first field the runtime reads that is missing or of the wrong type, as ``"'kv.page_size'
    is missing"`` or ``"'tp' is a string, not an integer"``; None when every one is usable."""
    for name, (found, value), kind in _checks(manifest):
        if not found:
            return f"'{name}' is missing"
        if not _is(value, kind):
            return f"'{name}' is {_kind_name(value)}, not {kind}"
    if not manifest["decode_buckets"] or not all(_is(b, _INT) and b > 0 for b in manifest["decode_buckets"]):
        return "'decode_buckets' must be a non-empty list of positive integers"
    if not all(_is(t, _INT) for t in manifest["eos_token_ids"]):
        return "'eos_token_ids' must be a list of integers"
    if not all(isinstance(t, str) for t in manifest["tokenizer_files"]):
        return "'tokenizer_files' must be a list of strings"
    return None
