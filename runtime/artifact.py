"""Opening an artifact: its typed manifest (``kiln.manifest``) checked against this machine.

:func:`open_artifact` refuses, in one line naming the file or field and the fix:

* a manifest that is not JSON, has another schema version, was edited after the compile (its own
  hash), or lacks a field the runtime reads (or holds the wrong type) (:meth:`Manifest.load`);
* an artifact built by another kiln (``versions.kiln``) or from other kernel sources
  (``versions.kernel_sources``), for another GPU architecture, torch or triton;
* a file that is missing or has another size (always), or whose bytes do not hash to the recorded
  xxh3 (``verify``, the default of the engine: every file but the weight data, which the pack loader
  checks; :func:`check_hashes`, which the loader runs on a thread while the weights stream in).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kiln import artifact_format as fmt
from kiln.artifact_format import REBUILD, RECOPY, ArtifactError
from kiln.manifest import FileEntry, Manifest, Versions


@dataclass(frozen=True)
class Artifact:
    """An opened artifact: where it is and its typed manifest (read fields as ``art.manifest.kv``)."""

    root: Path
    manifest: Manifest

    @property
    def dtype(self) -> torch.dtype:
        """The activation (and KV) dtype, ``manifest.dtype`` as a torch dtype."""
        return getattr(torch, self.manifest.dtype)

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"


def _check_build(built: Versions) -> None:
    """The kiln and kernel sources the artifact was built with are this process's."""
    for key, here, what, why in (
        ("kiln", fmt.kiln_version(), "this is kiln", "by another kiln"),
        (
            "kernel_sources",
            fmt.kernel_source_hash(),
            "this kiln's kernel sources (kiln.ops) hash to",
            "from other kernel sources",
        ),
    ):
        if getattr(built, key) != here:
            raise ArtifactError(
                f"manifest field 'versions.{key}' is {getattr(built, key)!r} but {what} {here!r}: the "
                f"artifact was built {why}, its graphs and kernels may not match this code; {REBUILD}."
            )


def _check_versions(built: Versions, device: torch.device) -> None:
    import triton

    if built.torch != torch.__version__:
        raise ArtifactError(
            f"manifest field 'versions.torch' is {built.torch!r} but this machine runs torch "
            f"{torch.__version__}; exported graphs are tied to the torch version: {REBUILD}."
        )
    if device.type == "cuda" and built.triton != triton.__version__:
        raise ArtifactError(
            f"manifest field 'versions.triton' is {built.triton!r} but this machine runs triton "
            f"{triton.__version__}; the precompiled kernels would not be used: {REBUILD}."
        )


def open_artifact(path: str | Path, device: str | torch.device = "cpu", verify: bool = False) -> Artifact:
    """Read ``path/manifest.json`` and check it against this machine and the files (module
    docstring); ``verify`` adds the hash of every file the manifest hashes (not the weight data:
    pass ``verify`` to ``kiln.weights.load_pack`` for those)."""
    root = Path(path)
    m = Manifest.load(root)
    _check_build(m.versions)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ArtifactError(
            "the artifact is to run on cuda but no CUDA device is visible; pass device='cpu'."
        )
    here = fmt.gpu_arch(dev)
    if m.gpu_arch != here:
        raise ArtifactError(
            f"manifest field 'gpu_arch' is {m.gpu_arch!r} but the device here is {here}: {REBUILD}."
        )
    _check_versions(m.versions, dev)
    for rel, info in m.files.items():
        check_size(root, rel, info)
    art = Artifact(root, m)
    if verify:
        check_hashes(art)
    return art


def check_hashes(art: Artifact) -> None:
    """Raise unless every file the manifest hashes (all but the weight data) has its recorded
    xxh3; the loader runs this on a thread beside the weight stream."""
    files = art.manifest.files
    hashed = [rel for rel, info in files.items() if info.xxh3_128 is not None]
    for rel, got in fmt.file_digests(art.root, hashed).items():
        _compare(rel, files[rel], got)


def one_line(err: BaseException, limit: int = 300) -> str:
    """``err`` as ``Type: message`` on one line (for messages that wrap a library's error)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def check_size(root: Path, rel: str, info: FileEntry) -> None:
    p = root / rel
    if not p.is_file():
        raise ArtifactError(f"artifact file {rel} listed in the manifest is missing; {RECOPY}.")
    size = p.stat().st_size
    if size != info.size:
        raise ArtifactError(
            f"artifact file {rel} has {size} bytes, the manifest says {info.size}: the copy is "
            f"truncated or altered; {RECOPY}."
        )


def _compare(rel: str, info: FileEntry, got: str) -> None:
    if got != info.xxh3_128:
        raise ArtifactError(
            f"artifact file {rel} fails its hash check (xxh3-128 {got}, the manifest records "
            f"{info.xxh3_128}): it was altered or damaged; {RECOPY}."
        )


def check_file(root: Path, rel: str, info: FileEntry) -> None:
    """Raise unless ``root / rel`` has the manifest's size and hash (``info``)."""
    check_size(root, rel, info)
    _compare(rel, info, fmt.file_digest(root / rel))


def check_bytes(rel: str, info: FileEntry, data: bytes) -> None:
    """Raise unless ``data`` (the bytes just read from ``rel``) hash to the manifest's ``info``."""
    _compare(rel, info, fmt.bytes_digest(data))
