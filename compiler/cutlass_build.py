"""Building kiln's CUTLASS libraries at compile time, and deciding whether an artifact uses them:

* ``MOE``: the fused MoE op's grouped GEMM (ops/cutlass/sm90_grouped.cu; ``kiln compile --moe-backend``);
* ``FP8``: fp8_linear's dense FP8 GEMMs (ops/cutlass/sm90_fp8_gemm.cu; ``--quant fp8``, unless
  ``--no-fp8-cutlass``).

``build_library(dest, lib=MOE)`` compiles the source with nvcc for ``sm_90a`` against the CUTLASS
headers into ``dest/lib.name`` (one to three minutes; static cudart, so it loads without a CUDA
toolkit). Where things come from, first match wins (the variables are compile settings of
kiln/settings.py, read through it):

* the library: ``lib.env`` (``KILN_CUTLASS_LIB`` or ``KILN_CUTLASS_FP8_LIB``: a prebuilt file,
  copied as is), else the build cache
  ``KILN_CUTLASS_CACHE`` (default ``~/.cache/kiln/cutlass``, keyed by the source, the flags, the
  nvcc version and the CUTLASS version), else nvcc;
* nvcc: ``KILN_NVCC``, ``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``), then ``PATH``;
* the headers: ``KILN_CUTLASS_DIR`` (a folder holding ``include/cutlass/cutlass.h``: a CUTLASS
  checkout), else the ``cutlass_library`` package (:data:`CUTLASS_MODULE`) of the ``nvidia-cutlass``
  wheel (:data:`CUTLASS_DISTRIBUTION`, what ``pip install 'kiln[cutlass]'`` installs; its
  ``source/``; found without importing it).

``fp8_library(...)`` builds ``FP8`` for an FP8 compile on an sm90 GPU, or records why not.
``cutlass_backend(...)`` applies ``--moe-backend``: ``triton`` uses nothing here; ``cutlass`` and
``auto`` need a CUDA sm90 device and bf16 experts, build the library into the artifact's
``kernels/`` and load it into this process (the tuner times it, the warm-up runs it). ``cutlass``
fails with a message naming the fix when it cannot; ``auto`` records why and keeps Triton.
"""

from __future__ import annotations

import dataclasses
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

from kiln import settings
from kiln.errors import KilnError

ARCH = "sm_90a"
FLAGS = ("-std=c++17", "--expt-relaxed-constexpr", f"-arch={ARCH}", "-O3", "-DNDEBUG",
         "-Xcompiler=-fPIC", "-shared", "--split-compile=4")  # fmt: skip
MOE_BACKENDS = ("triton", "cutlass", "auto")
# Where the CUTLASS headers come from: the distribution the ``cutlass`` extra of pyproject.toml names
# (tests/compiler/test_cutlass_extra.py checks the two agree) and the module of it found here.
CUTLASS_DISTRIBUTION = "nvidia-cutlass"
CUTLASS_VERSION = "4.2.0.0"  # the headers ops/cutlass/*.cu were built and measured against
CUTLASS_MODULE = "cutlass_library"


@dataclasses.dataclass(frozen=True)
class CutlassLib:
    source: str  # under ops/cutlass/
    name: str  # the built file
    setting: str  # kiln/settings.py: a prebuilt file to copy instead of building
    what: str  # for messages
    fallback: str  # the compile flag that does without it

    @property
    def env(self) -> str:
        """The environment variable of ``setting`` (for messages)."""
        return str(settings.SETTINGS[self.setting].env)


MOE = CutlassLib("sm90_grouped.cu", "cutlass_moe_sm90.so", "cutlass_lib", "MoE grouped-GEMM",
                 "--moe-backend triton")  # fmt: skip
FP8 = CutlassLib("sm90_fp8_gemm.cu", "cutlass_fp8_sm90.so", "cutlass_fp8_lib", "FP8 GEMM",
                 "--no-fp8-cutlass")  # fmt: skip
LIB_NAME = MOE.name


class CutlassBuildError(KilnError):
    pass


def source_file(lib: CutlassLib = MOE) -> Path:
    import kiln.ops

    return Path(kiln.ops.__file__).parent / "cutlass" / lib.source


def cutlass_dir(lib: CutlassLib = MOE) -> Path:
    """The CUTLASS source folder (``include/`` and ``tools/util/include/`` under it)."""
    env = settings.value("cutlass_dir")
    if env:
        root = Path(env)
        if not (root / "include" / "cutlass" / "cutlass.h").is_file():
            raise CutlassBuildError(
                f"KILN_CUTLASS_DIR={env} holds no include/cutlass/cutlass.h; point it at a CUTLASS "
                "checkout (or unset it to use the nvidia-cutlass wheel's headers)"
            )
        return root
    spec = importlib.util.find_spec(CUTLASS_MODULE)
    if spec is not None and spec.origin:
        root = Path(spec.origin).parent / "source"
        if (root / "include" / "cutlass" / "cutlass.h").is_file():
            return root
    raise CutlassBuildError(
        f"CUTLASS headers not found: the {lib.what} library (ops/cutlass/{lib.source}) compiles against "
        f"them. Install the {CUTLASS_DISTRIBUTION} wheel (`pip install 'kiln[cutlass]'` or `pip install "
        f"{CUTLASS_DISTRIBUTION}=={CUTLASS_VERSION}`: its {CUTLASS_MODULE}/source/include), set "
        f"KILN_CUTLASS_DIR to a CUTLASS checkout, or compile with {lib.fallback}"
    )


def find_nvcc(lib: CutlassLib = MOE) -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")  # the toolkit's own, process-level
    for cand in (
        settings.value("nvcc"),
        home and os.path.join(home, "bin", "nvcc"),
        shutil.which("nvcc"),
    ):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise CutlassBuildError(
        f"nvcc not found: the {lib.what} library compiles ops/cutlass/{lib.source} with it. Install "
        "the CUDA toolkit (12.4 or newer) and put nvcc on PATH, set CUDA_HOME or KILN_NVCC, point "
        f"{lib.env} at a prebuilt library, or compile with {lib.fallback}"
    )


def nvcc_command(nvcc: str, cutlass: Path, out: Path, lib: CutlassLib = MOE) -> list[str]:
    inc = [f"-I{cutlass / 'include'}", f"-I{cutlass / 'tools' / 'util' / 'include'}"]
    return [nvcc, *FLAGS, *inc, str(source_file(lib)), "-o", str(out)]


def _cache_key(nvcc: str, cutlass: Path, lib: CutlassLib) -> str:
    ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    h = hashlib.sha256(source_file(lib).read_bytes())
    for part in (" ".join(FLAGS), ver, (cutlass / "include" / "cutlass" / "version.h").read_text()):
        h.update(part.encode())
    return h.hexdigest()[:24]


def build_library(dest: str | Path, verbose: bool = False, lib: CutlassLib = MOE) -> dict[str, Any]:
    """Put the library at ``dest/lib.name``; returns ``{"path", "source", "seconds"}``
    (``source``: "prebuilt", "cache" or "nvcc")."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / lib.name
    t0 = time.perf_counter()
    prebuilt = settings.value(lib.setting)
    if prebuilt:
        if not os.path.isfile(prebuilt):
            raise CutlassBuildError(f"{lib.env}={prebuilt} does not exist; unset it to build with nvcc")
        shutil.copyfile(prebuilt, out)
        return {"path": str(out), "source": "prebuilt", "seconds": time.perf_counter() - t0}
    nvcc, cutlass = find_nvcc(lib), cutlass_dir(lib)
    cache = Path(settings.value("cutlass_cache")).expanduser()
    cached = cache / f"{Path(lib.name).stem}-{_cache_key(nvcc, cutlass, lib)}.so"
    origin = "cache"
    if not cached.is_file():
        origin = "nvcc"
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f"{cached.stem}.{os.getpid()}.tmp.so"
        cmd = nvcc_command(nvcc, cutlass, tmp, lib)
        if verbose:
            print(
                f"[kiln compile] building the CUTLASS {lib.what} library (one to three minutes, cached "
                f"after): {' '.join(cmd)}",
                flush=True,
            )
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            raise CutlassBuildError(
                f"nvcc failed ({p.returncode}) building {lib.source} against {cutlass}:\n"
                f"{(p.stderr or p.stdout)[-2000:]}\nFix the toolkit (CUDA 12.4+ for sm_90a) or compile "
                f"with {lib.fallback}"
            )
        os.replace(tmp, cached)  # atomic: a concurrent build never sees half a file
    shutil.copyfile(cached, out)
    return {"path": str(out), "source": origin, "seconds": time.perf_counter() - t0}


def _not_sm90(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "needs --device cuda (the kernel is CUDA code)"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"runs on sm_90 GPUs (H100/H200) only; this GPU is sm_{major}{minor}"
    return None


def _unusable(device: torch.device, dtype: str, quant: str | None) -> str | None:
    """Why this compile cannot use the CUTLASS MoE backend (None: it can)."""
    if device.type == "cuda" and (dtype != "bfloat16" or quant is not None):
        return f"needs bf16 experts (--dtype bfloat16, no --quant); this compile has {dtype}, quant {quant}"
    return _not_sm90(device)


def fp8_library(
    enabled: bool, device: torch.device, quant: str | None, kernels_dir: Path, verbose: bool = False
) -> dict[str, Any]:
    """What the manifest records under ``kernel_choices.fp8`` for an FP8 compile: the ``FP8`` library
    built into ``kernels_dir`` and loaded in this process (the warm-up runs it), or why not (a
    warning when it was wanted but cannot be built or loaded: fp8_linear then runs Triton and cuBLAS)."""
    if quant != "fp8":
        return {}
    why = "--no-fp8-cutlass" if not enabled else _not_sm90(device)
    from kiln.ops.linear import fp8_cutlass

    if why is None:
        try:
            built = build_library(kernels_dir, verbose=verbose, lib=FP8)
            try:
                fp8_cutlass.load_library(built["path"])
            except (OSError, RuntimeError) as err:
                Path(built["path"]).unlink(missing_ok=True)
                raise CutlassBuildError(f"the built {FP8.name} does not load ({err})") from err
        except CutlassBuildError as err:
            why = str(err)[:500]
            warnings.warn(f"kiln compile: FP8 GEMMs without CUTLASS (Triton and cuBLAS): {err}", stacklevel=2)
    if why is not None:
        return {"note": f"no CUTLASS FP8 GEMM library: {why}"}
    rel = Path(built["path"]).resolve().relative_to(kernels_dir.resolve().parent).as_posix()
    return {"library": rel, "arch": ARCH, "abi": fp8_cutlass.ABI, "build": built["source"],
            "build_seconds": round(built["seconds"], 1)}  # fmt: skip


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
    from kiln.ops.moe import cutlass as moe_cutlass

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
