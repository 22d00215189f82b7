"""Reading and validating an artifact's ``manifest.json`` (format: ``kiln.artifact_format``).

:func:`open_artifact` refuses, in one line naming the file or field and the fix:

* a manifest that is not JSON, has another schema version, was edited after the compile (its own
  hash), or lacks a field the runtime reads (or holds the wrong type);
* an artifact built by another kiln (``versions.kiln``) or from other kernel sources
  (``versions.kernel_sources``), for another GPU architecture, torch or triton;
* a file that is missing or has another size (always), or whose bytes do not hash to the recorded
  xxh3 (``verify``, the default of the engine: every file but the weight data, which the pack loader
  checks; :func:`check_hashes`, which the loader runs on a thread while the weights stream in).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln import artifact_format as fmt
from kiln.errors import KilnError

SCHEMA_VERSION = fmt.SCHEMA_VERSION
REBUILD = "rebuild it on this machine with `kiln compile MODEL_DIR -o ART --force`"
RECOPY = f"copy it again or {REBUILD}"


class ArtifactError(KilnError):
    pass


def device_arch(device: torch.device) -> str:
    return fmt.gpu_arch_of(torch.cuda.get_device_capability(device) if device.type == "cuda" else None)


@dataclass(frozen=True)
class Artifact:
    root: Path
    manifest: dict[str, Any]

    @property
    def model(self) -> dict[str, Any]:
        return self.manifest["model"]

    @property
    def kv(self) -> dict[str, Any]:
        return self.manifest["kv"]

    @property
    def rope(self) -> dict[str, Any]:
        return self.manifest["rope"]

    @property
    def graphs(self) -> dict[str, dict[str, Any]]:
        return self.manifest["graphs"]

    @property
    def decode_buckets(self) -> list[int]:
        return list(self.manifest["decode_buckets"])

    @property
    def max_seq_len(self) -> int:
        return int(self.manifest["max_seq_len"])

    @property
    def chunk_size(self) -> int:
        return int(self.manifest["chunk_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.manifest["dtype"])

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    @property
    def eos_token_ids(self) -> list[int]:
        return [int(x) for x in self.manifest.get("eos_token_ids") or []]


def _read_manifest(root: Path) -> dict[str, Any]:
    """The parsed manifest, checked for schema, integrity (its own hash) and field types."""
    mf = root / fmt.MANIFEST
    if not mf.is_file():
        raise ArtifactError(
            f"{root} is not a kiln artifact (no manifest.json); build one with `kiln compile`."
        )
    try:
        m = json.loads(mf.read_bytes())
    except (ValueError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise ArtifactError(f"{mf} is not valid JSON ({e}); {RECOPY}.") from None
    if not isinstance(m, dict):
        raise ArtifactError(f"{mf} holds {type(m).__name__}, not a manifest object; {RECOPY}.")
    if m.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(
            f"manifest field 'schema_version' is {m.get('schema_version')!r}; this kiln reads "
            f"{SCHEMA_VERSION}: {REBUILD}."
        )
    recorded = m.get(fmt.MANIFEST_HASH_KEY)
    try:
        actual = fmt.manifest_digest(m)
    except ValueError:  # NaN or infinity: never written by kiln compile
        actual = "(not canonical JSON)"
    if recorded != actual:
        raise ArtifactError(
            f"{mf} was altered after `kiln compile` (field '{fmt.MANIFEST_HASH_KEY}' is {recorded!r}, its "
            f"content hashes to {actual!r}); {RECOPY}."
        )
    problem = fmt.field_problem(m)
    if problem is not None:
        raise ArtifactError(f"{mf}: field {problem}; {RECOPY}.")
    return m


def _check_build(m: dict[str, Any]) -> None:
    """The kiln and kernel sources the artifact was built with are this process's."""
    built = m["versions"]
    for key, here, what, why in (
        ("kiln", fmt.kiln_version(), "this is kiln", "by another kiln"),
        (
            "kernel_sources",
            fmt.kernel_source_hash(),
            "this kiln's kernel sources (kiln.ops) hash to",
            "from other kernel sources",
        ),
    ):
        if built[key] != here:
            raise ArtifactError(
                f"manifest field 'versions.{key}' is {built[key]!r} but {what} {here!r}: the artifact was "
                f"built {why}, its graphs and kernels may not match this code; {REBUILD}."
            )


def _check_versions(m: dict[str, Any], device: torch.device) -> None:
    import triton

    built = m["versions"]
    if built["torch"] != torch.__version__:
        raise ArtifactError(
            f"manifest field 'versions.torch' is {built['torch']!r} but this machine runs torch "
            f"{torch.__version__}; exported graphs are tied to the torch version: {REBUILD}."
        )
    if device.type == "cuda" and built["triton"] != triton.__version__:
        raise ArtifactError(
            f"manifest field 'versions.triton' is {built['triton']!r} but this machine runs triton "
            f"{triton.__version__}; the precompiled kernels would not be used: {REBUILD}."
        )


def open_artifact(path: str | Path, device: str | torch.device = "cpu", verify: bool = False) -> Artifact:
    """Read ``path/manifest.json`` and check it against this machine and the files (module
    docstring); ``verify`` adds the hash of every file the manifest hashes (not the weight data:
    pass ``verify`` to ``kiln.weights.load_pack`` for those)."""
    root = Path(path)
    m = _read_manifest(root)
    _check_build(m)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ArtifactError(
            "the artifact is to run on cuda but no CUDA device is visible; pass device='cpu'."
        )
    here = device_arch(dev)
    if m["gpu_arch"] != here:
        raise ArtifactError(
            f"manifest field 'gpu_arch' is {m['gpu_arch']!r} but the device here is {here}: {REBUILD}."
        )
    _check_versions(m, dev)
    if m["tp"] != 1:
        raise ArtifactError(
            f"manifest field 'tp' is {m['tp']}: tensor parallelism needs the multi-GPU runtime (not built "
            "yet); compile with --tp 1."
        )
    if m["dtype"] not in ("float32", "bfloat16", "float16"):
        raise ArtifactError(f"manifest field 'dtype' is {m['dtype']!r}, not a dtype kiln compiles; {RECOPY}.")
    for rel, info in m["files"].items():
        check_size(root, rel, info)
    art = Artifact(root, m)
    if verify:
        check_hashes(art)
    return art


def check_hashes(art: Artifact) -> None:
    """Raise unless every file the manifest hashes (all but the weight data) has its recorded
    xxh3; the loader runs this on a thread beside the weight stream."""
    files = art.manifest["files"]
    hashed = [rel for rel, info in files.items() if fmt.HASH_KEY in info]
    for rel, got in fmt.file_digests(art.root, hashed).items():
        _compare(rel, files[rel], got)


def one_line(err: BaseException, limit: int = 300) -> str:
    """``err`` as ``Type: message`` on one line (for messages that wrap a library's error)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def check_size(root: Path, rel: str, info: dict[str, Any]) -> None:
    p = root / rel
    if not p.is_file():
        raise ArtifactError(f"artifact file {rel} listed in the manifest is missing; {RECOPY}.")
    size = p.stat().st_size
    if size != info["size"]:
        raise ArtifactError(
            f"artifact file {rel} has {size} bytes, the manifest says {info['size']}: the copy is "
            f"truncated or altered; {RECOPY}."
        )


def _compare(rel: str, info: dict[str, Any], got: str) -> None:
    if got != info.get(fmt.HASH_KEY):
        raise ArtifactError(
            f"artifact file {rel} fails its hash check (xxh3-128 {got}, the manifest records "
            f"{info.get(fmt.HASH_KEY)}): it was altered or damaged; {RECOPY}."
        )


def check_file(root: Path, rel: str, info: dict[str, Any]) -> None:
    """Raise unless ``root / rel`` has the manifest's size and hash (``info``)."""
    check_size(root, rel, info)
    _compare(rel, info, fmt.file_digest(root / rel))


def check_bytes(rel: str, info: dict[str, Any], data: bytes) -> None:
    """Raise unless ``data`` (the bytes just read from ``rel``) hash to the manifest's ``info``."""
    _compare(rel, info, fmt.bytes_digest(data))
