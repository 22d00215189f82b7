"""Building the CUTLASS grouped-GEMM library of the fused MoE op (ops/cutlass/sm90_grouped.cu) at
compile time, and deciding whether an artifact uses it (``kiln compile --moe-backend``).

``build_library(dest)`` compiles the source with nvcc for ``sm_90a`` against the CUTLASS headers
into ``dest/LIB_NAME`` (about a minute; static cudart, so it loads without a CUDA toolkit). Where
things come from, first match wins:

* the library: ``KILN_CUTLASS_LIB`` (a prebuilt file, copied as is), else the build cache
  ``KILN_CUTLASS_CACHE`` (default ``~/.cache/kiln/cutlass``, keyed by the source, the flags, the
  nvcc version and the CUTLASS version), else nvcc;
* nvcc: ``KILN_NVCC``, ``$CUDA_HOME/bin/nvcc``, then ``PATH``;
* the headers: ``KILN_CUTLASS_DIR`` (a folder holding ``include/cutlass/cutlass.h``: a CUTLASS
  checkout), else the ``cutlass_library`` package of the ``nvidia-cutlass`` wheel (its
  ``source/``; found without importing it).

``cutlass_backend(...)`` applies ``--moe-backend``: ``triton`` uses nothing here; ``cutlass`` and
``auto`` need a CUDA sm90 device and bf16 experts, build the library into the artifact's
``kernels/`` and load it into this process (the tuner times it, the warm-up runs it). ``cutlass``
fails with a message naming the fix when it cannot; ``auto`` records why and keeps Triton.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from kiln.errors import KilnError

LIB_NAME = "cutlass_moe_sm90.so"
ARCH = "sm_90a"
FLAGS = ("-std=c++17", "--expt-relaxed-constexpr", f"-arch={ARCH}", "-O3", "-DNDEBUG",
         "-Xcompiler=-fPIC", "-shared")  # fmt: skip
MOE_BACKENDS = ("triton", "cutlass", "auto")


class CutlassBuildError(KilnError):
    pass


def source_file() -> Path:
    import kiln.ops

    return Path(kiln.ops.__file__).parent / "cutlass" / "sm90_grouped.cu"


def cutlass_dir() -> Path:
    """The CUTLASS source folder (``include/`` and ``tools/util/include/`` under it)."""
    env = os.environ.get("KILN_CUTLASS_DIR")
    if env:
        root = Path(env)
        if not (root / "include" / "cutlass" / "cutlass.h").is_file():
            raise CutlassBuildError(
                f"KILN_CUTLASS_DIR={env} holds no include/cutlass/cutlass.h; point it at a CUTLASS "
                "checkout (or unset it to use the nvidia-cutlass wheel's headers)"
            )
        return root
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.origin:
        root = Path(spec.origin).parent / "source"
        if (root / "include" / "cutlass" / "cutlass.h").is_file():
            return root
    raise CutlassBuildError(
        "CUTLASS headers not found: --moe-backend cutlass compiles ops/cutlass/sm90_grouped.cu against "
        "them. Install the nvidia-cutlass wheel (`pip install nvidia-cutlass==4.2.0.0`: its "
        "cutlass_library/source/include), set KILN_CUTLASS_DIR to a CUTLASS checkout, or compile "
        "with --moe-backend triton"
    )


def find_nvcc() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for cand in (
        os.environ.get("KILN_NVCC"),
        home and os.path.join(home, "bin", "nvcc"),
        shutil.which("nvcc"),
    ):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise CutlassBuildError(
        "nvcc not found: --moe-backend cutlass compiles ops/cutlass/sm90_grouped.cu with it. Install "
        "the CUDA toolkit (12.4 or newer) and put nvcc on PATH, set CUDA_HOME or KILN_NVCC, point "
        "KILN_CUTLASS_LIB at a prebuilt library, or compile with --moe-backend triton"
    )


def nvcc_command(nvcc: str, cutlass: Path, out: Path) -> list[str]:
    inc = [f"-I{cutlass / 'include'}", f"-I{cutlass / 'tools' / 'util' / 'include'}"]
    return [nvcc, *FLAGS, *inc, str(source_file()), "-o", str(out)]


def _cache_key(nvcc: str, cutlass: Path) -> str:
    ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    h = hashlib.sha256(source_file().read_bytes())
    for part in (" ".join(FLAGS), ver, (cutlass / "include" / "cutlass" / "version.h").read_text()):
        h.update(part.encode())
    return h.hexdigest()[:24]


def build_library(dest: str | Path, verbose: bool = False) -> dict[str, Any]:
    """Put the library at ``dest/LIB_NAME``; returns ``{"path", "source", "seconds", "cached"}``
    (``source``: "prebuilt", "cache" or "nvcc")."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / LIB_NAME
    t0 = time.perf_counter()
    prebuilt = os.environ.get("KILN_CUTLASS_LIB")
    if prebuilt:
        if not os.path.isfile(prebuilt):
            raise CutlassBuildError(
                f"KILN_CUTLASS_LIB={prebuilt} does not exist; unset it to build with nvcc"
            )
        shutil.copyfile(prebuilt, out)
        return {"path": str(out), "source": "prebuilt", "seconds": time.perf_counter() - t0}
    nvcc, cutlass = find_nvcc(), cutlass_dir()
    cache = Path(os.environ.get("KILN_CUTLASS_CACHE") or Path.home() / ".cache" / "kiln" / "cutlass")
    cached = cache / f"{_cache_key(nvcc, cutlass)}.so"
    origin = "cache"
    if not cached.is_file():
        origin = "nvcc"
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f"{cached.stem}.{os.getpid()}.tmp.so"
        cmd = nvcc_command(nvcc, cutlass, tmp)
        if verbose:
            print(
                f"[kiln compile] building the CUTLASS MoE library (about a minute): {' '.join(cmd)}",
                flush=True,
            )
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            raise CutlassBuildError(
                f"nvcc failed ({p.returncode}) building {source_file().name} against {cutlass}:\n"
                f"{(p.stderr or p.stdout)[-2000:]}\nFix the toolkit (CUDA 12.4+ for sm_90a) or compile "
                "with --moe-backend triton"
            )
        os.replace(tmp, cached)  # atomic: a concurrent build never sees half a file
    shutil.copyfile(cached, out)
    return {"path": str(out), "source": origin, "seconds": time.perf_counter() - t0}


def _unusable(device: torch.device, dtype: str, quant: str | None) -> str | None:
    """Why this compile cannot use the CUTLASS backend (None: it can)."""
    if device.type != "cuda":
        return "needs --device cuda (the kernel is CUDA code)"
    if dtype != "bfloat16" or quant is not None:
        return f"needs bf16 experts (--dtype bfloat16, no --quant); this compile has {dtype}, quant {quant}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"runs on sm_90 GPUs (H100/H200) only; this GPU is sm_{major}{minor}"
    return None


def check_request(requested: str, device: torch.device, dtype: str, quant: str | None) -> None:
    """Fail before any work when ``--moe-backend`` is unknown, or "cutlass" cannot run here."""
    if requested not in MOE_BACKENDS:
        raise CutlassBuildError(f"--moe-backend must be one of {MOE_BACKENDS}, got {requested!r}")
    why = _unusable(device, dtype, quant) if requested == "cutlass" else None
    if why is not None:
        raise CutlassBuildError(f"--moe-backend cutlass {why}; or compile with --moe-backend triton")


def cutlass_backend(
    requested: str, device: torch.device, dtype: str, quant: str | None, measure: bool, kernels_dir: Path
) -> tuple[str, dict[str, Any]]:
    """``(backend for moe_tuning, what the manifest records about the library)``; with a library
    built into ``kernels_dir`` and loaded in this process unless the backend is "triton"."""
    check_request(requested, device, dtype, quant)
    if requested == "triton":
        return "triton", {}
    why = _unusable(device, dtype, quant)
    if why is None and requested == "auto" and not measure:
        why = "auto times both backends: add --moe-tune (on the GPU), or pick --moe-backend cutlass"
    if why is not None:
        if requested == "cutlass":
            raise CutlassBuildError(f"--moe-backend cutlass {why}; or compile with --moe-backend triton")
        warnings.warn(f"kiln compile: --moe-backend auto keeps Triton: {why}", stacklevel=2)
        return "triton", {"note": why}
    try:
        built = build_library(kernels_dir, verbose=True)
    except CutlassBuildError as err:
        if requested == "cutlass":
            raise
        warnings.warn(f"kiln compile: --moe-backend auto keeps Triton: {err}", stacklevel=2)
        return "triton", {"note": str(err)[:500]}
    from kiln.ops import moe_cutlass

    moe_cutlass.load_library(built["path"])
    rel = Path(built["path"]).resolve().relative_to(kernels_dir.resolve().parent).as_posix()
    info = {"library": rel, "arch": ARCH, "abi": moe_cutlass.ABI, "build": built["source"]}
    return requested, info | {"build_seconds": round(built["seconds"], 1)}


def drop_unused(choice: dict[str, Any], root: Path) -> None:
    """Remove the library from the artifact ``root`` when no rung of ``choice["table"]`` (JSON)
    uses it, and say so in ``choice["cutlass"]``."""
    lib = choice.get("cutlass", {}).get("library")
    if lib and not any(e.get("backend") == "cutlass" for e in json.loads(choice["table"]).values()):
        (root / lib).unlink(missing_ok=True)
        choice["cutlass"] = {"note": "no rung chose CUTLASS; library left out"}
