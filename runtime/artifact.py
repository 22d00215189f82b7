"""Reading and validating an artifact's ``manifest.json``.

The runtime refuses an artifact that does not match the machine (schema, torch/triton versions,
GPU architecture) or whose files do not match their recorded sizes (always) and sha256 (on
request), with a message naming the field and how to rebuild.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.errors import KilnError

# 2: kiln::linear takes max_m; kernels carry PDL. 3: norm_folds, the residual arguments of
# kiln::linear / kiln::fused_moe and rmsnorm_linear's folded (older artifacts: rebuild)
SCHEMA_VERSION = 3
REBUILD = "rebuild it on this machine with `kiln compile MODEL_DIR -o ART --force`"


class ArtifactError(KilnError):
    pass


def _sha256(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def device_arch(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor}"
    return "cpu"


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


def _check_versions(m: dict[str, Any], device: torch.device) -> None:
    import triton

    built = m.get("versions", {})
    if built.get("torch") != torch.__version__:
        raise ArtifactError(
            f"manifest field 'versions.torch' is {built.get('torch')!r} but this machine runs torch "
            f"{torch.__version__}; exported graphs are tied to the torch version: {REBUILD}."
        )
    if device.type == "cuda" and built.get("triton") != triton.__version__:
        raise ArtifactError(
            f"manifest field 'versions.triton' is {built.get('triton')!r} but this machine runs triton "
            f"{triton.__version__}; the precompiled kernels would not be used: {REBUILD}."
        )


def open_artifact(path: str | Path, device: str | torch.device = "cpu", verify: bool = False) -> Artifact:
    """Read ``path/manifest.json`` and check it against this machine; ``verify`` adds sha256 checks."""
    root = Path(path)
    mf = root / "manifest.json"
    if not mf.is_file():
        raise ArtifactError(
            f"{root} is not a kiln artifact (no manifest.json); build one with `kiln compile`."
        )
    try:
        m = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{mf} is not valid JSON ({e}); {REBUILD}.") from e
    if m.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(
            f"manifest field 'schema_version' is {m.get('schema_version')!r}; this kiln reads "
            f"{SCHEMA_VERSION}: {REBUILD}."
        )
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ArtifactError(
            "the artifact is to run on cuda but no CUDA device is visible; pass device='cpu'."
        )
    here = device_arch(dev)
    if m.get("gpu_arch") != here:
        raise ArtifactError(
            f"manifest field 'gpu_arch' is {m.get('gpu_arch')!r} but the device here is {here}: {REBUILD}."
        )
    _check_versions(m, dev)
    for rel, info in m.get("files", {}).items():
        p = root / rel
        if not p.is_file():
            raise ArtifactError(
                f"artifact file {rel} listed in the manifest is missing; copy it again or {REBUILD}."
            )
        size = p.stat().st_size
        if size != info["size"]:
            raise ArtifactError(
                f"artifact file {rel} has {size} bytes, the manifest says {info['size']}: the copy is "
                f"truncated or altered; copy it again or {REBUILD}."
            )
        if verify:
            check_sha256(root, rel, info)
    return Artifact(root, m)


def check_sha256(root: Path, rel: str, info: dict[str, Any]) -> None:
    """Raise unless ``root / rel`` hashes to the manifest's ``info["sha256"]``."""
    if _sha256(root / rel) != info["sha256"]:
        raise ArtifactError(f"artifact file {rel} fails its sha256 check; copy it again or {REBUILD}.")
