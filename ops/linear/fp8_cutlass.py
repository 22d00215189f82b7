"""CUTLASS backend of ``fp8_linear`` on sm90 (H100/H200): ops/cutlass/sm90_fp8_gemm.cu through ctypes.

``fp8_gemm_cutlass(x, x_scale, w, w_scale, bias, out_dtype, config)`` computes what
``fp8_gemm`` (ops/linear/fp8_gemm.py) computes with fast accumulation:

* ``x``: ``[M, K]`` float8_e4m3fn, contiguous; ``x_scale``: ``[M, 1]`` or ``[1]`` float32;
* ``w``: ``[N, K]`` float8_e4m3fn, contiguous; ``w_scale``: ``[N]`` float32;
* ``bias``: ``[N]`` or None; ``out_dtype``: bf16 only; N and K multiples of ``ALIGN``, any M;
* ``config``: the name of one of the library's instantiations (``config_names()``), such as
  ``"pp_128x128x128_c2x1"``: schedule (``pp`` ping-pong, ``co`` cooperative), tile M x N x K, cluster
  M x N, ``_sk`` stream-K; default ``config_for(M, N, K)``.

``config_for`` looks ``(M bucket, N, K)`` up in ``TABLE`` (the fastest instantiation per launch in a
chain of distinct weights on the H200, bench/results/2026-11-29_h200_fp8_cutlass_sweep.json), else
takes the bucket's ``BUCKET_DEFAULTS`` entry (up to 1024: the instantiation that was never more than
10-19% off the best over the four measured shapes; above: the one measured), else None: M <= 64 was
not measured, and ``fp8_linear`` runs its GEMV or cuBLAS there.

The library is loaded once per process (``load_library``); a launch reads nothing on the host and
needs no workspace (the stream-K instantiations of a ``KF_SWEEP`` build do: a per-device buffer that
grows at a shape's first call, which must then run outside capture), so it can be captured in a CUDA
graph.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

from kiln.ops.common.launch import CutlassUnavailable, capability, sm_count
from kiln.ops.common.quant import FP8_DTYPE
from kiln.ops.linear.fp8_gemm import m_bucket

ABI = 1  # kf_abi() of the library this module drives
ALIGN = 16  # N, K: 16-byte rows of FP8 operands for TMA

# (M bucket of ops/fp8_gemm.m_bucket, N, K) -> instantiation: Llama-3.1-8B's qkv, o, gate_up, down.
TABLE: dict[tuple[float, int, int], str] = {
    (128, 4096, 4096): "pp_64x64x128_c1x1",
    (128, 4096, 14336): "pp_64x64x128_c1x1",
    (128, 6144, 4096): "pp_64x96x128_c1x1",
    (128, 14336, 4096): "pp_64x128x128_c2x1",
    (256, 4096, 4096): "pp_64x128x128_c1x1",
    (256, 4096, 14336): "pp_64x128x128_c1x1",
    (256, 6144, 4096): "pp_128x96x128_c1x1",
    (256, 14336, 4096): "co_128x256x128_c2x1",
    (512, 4096, 4096): "pp_64x256x128_c1x1",
    (512, 4096, 14336): "pp_64x256x128_c1x1",
    (512, 6144, 4096): "co_128x192x128_c2x1",
    (512, 14336, 4096): "pp_128x128x128_c2x1",
    (1024, 4096, 4096): "co_128x256x128_c2x1",
    (1024, 4096, 14336): "co_128x256x128_c2x1",
    (1024, 6144, 4096): "pp_128x128x128_c2x1",
    (1024, 14336, 4096): "pp_64x256x128_c1x1",
}
BUCKET_DEFAULTS: dict[float, str] = {
    128: "pp_64x96x128_c1x1",
    256: "pp_64x128x128_c1x1",
    512: "pp_64x128x128_c1x1",
    1024: "pp_128x128x128_c2x1",
    # Above 1024 only this one was measured (M = 4096, single timing, four 8B products: 1.78-1.94x
    # bf16, against cuBLAS with precise accumulation's 1.65-1.80x;
    # bench/results/2026-11-29_h200_fp8_linear_cutlass.json).
    math.inf: "pp_128x128x128_c2x1",
}


_LIB: ctypes.CDLL | None = None
_LIB_PATH: Path | None = None
_WORKSPACE: dict[int, torch.Tensor] = {}  # per device
_RETIRED: list[torch.Tensor] = []  # outgrown workspaces: a captured graph may still point into them


def load_library(path: str | Path) -> None:
    """Load the compiled ops/cutlass/sm90_fp8_gemm.cu for this process (again: no-op)."""
    global _LIB, _LIB_PATH
    path = Path(path).resolve()
    if _LIB is not None and path == _LIB_PATH:
        return
    if not path.is_file():
        raise CutlassUnavailable(f"CUTLASS FP8 GEMM library {path} does not exist")
    lib = ctypes.CDLL(str(path))
    abi = lib.kf_abi() if hasattr(lib, "kf_abi") else None
    if abi != ABI:
        raise CutlassUnavailable(f"CUTLASS FP8 GEMM library {path} has ABI {abi}, kiln drives ABI {ABI}")
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    lib.kf_config_name.restype = ctypes.c_char_p
    lib.kf_config_name.argtypes = [i32]
    lib.kf_workspace.restype = ctypes.c_longlong
    lib.kf_workspace.argtypes = [i32] * 5
    lib.kf_run.restype = i32
    lib.kf_run.argtypes = [i32, vp, vp, vp, vp, vp, vp, i32, i32, i32, i32, vp, vp]
    names = {lib.kf_config_name(i).decode() for i in range(lib.kf_num_configs())}
    missing = sorted((set(TABLE.values()) | set(BUCKET_DEFAULTS.values())) - names)
    if missing:
        raise CutlassUnavailable(f"CUTLASS FP8 GEMM library {path} lacks the instantiations {missing} that "
                                 "kiln's tables name: rebuild it (kiln compile ... --force)")  # fmt: skip
    _LIB, _LIB_PATH = lib, path
    _config_index.cache_clear()
    _workspace_bytes.cache_clear()


def loaded() -> bool:
    return _LIB is not None


def library_path() -> Path | None:
    """The library loaded in this process, if any."""
    return _LIB_PATH


def _library() -> ctypes.CDLL:
    if _LIB is None:
        raise CutlassUnavailable(
            "fp8_linear: the CUTLASS FP8 GEMM backend was asked for but no library is loaded in this "
            "process: call kiln.ops.linear.fp8_cutlass.load_library(path)"
        )
    return _LIB


def config_for(m: int, n: int, k: int) -> str | None:
    """The measured instantiation for this product, or None (see the module docstring)."""
    bucket = m_bucket(m)
    return TABLE.get((bucket, n, k)) or BUCKET_DEFAULTS.get(bucket)


def resolve_config(m: int, n: int, k: int) -> str:
    """What ``fp8_gemm_cutlass`` runs without a ``config``: ``config_for``, else the largest bucket's."""
    return config_for(m, n, k) or BUCKET_DEFAULTS[math.inf]


def config_names() -> list[str]:
    lib = _library()
    return [lib.kf_config_name(i).decode() for i in range(lib.kf_num_configs())]


@functools.cache
def _config_index(name: str) -> int:
    names = config_names()
    if name not in names:
        raise ValueError(f"fp8_gemm_cutlass: no config {name!r} in the library; it has {names}")
    return names.index(name)


def unsupported(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> str | None:
    """Why this call cannot run here (None: it can). It needs a loaded library, an sm90 GPU, a bf16
    output, contiguous operands at 16-byte aligned addresses (TMA), N and K multiples of ``ALIGN``."""
    if _LIB is None:
        return "no library is loaded"
    if not x.is_cuda or out_dtype != torch.bfloat16:
        return f"it takes CUDA tensors and a bf16 output (got {x.device}, {out_dtype})"
    cap = capability(x.device)
    if cap[0] != 9:
        return f"it runs on sm_90 GPUs only (this one is sm_{cap[0]}{cap[1]})"
    n, k = w.shape
    if n % ALIGN or k % ALIGN:
        return f"N={n} and K={k} must be multiples of {ALIGN}"
    if not (x.is_contiguous() and w.is_contiguous()) or x.data_ptr() % 16 or w.data_ptr() % 16:
        return "x and w must be contiguous at 16-byte aligned addresses"
    return None


def supports(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> bool:
    return unsupported(x, w, out_dtype) is None


def _workspace(device: torch.device, nbytes: int) -> torch.Tensor:
    buf = _WORKSPACE.get(device.index)
    if buf is None or buf.numel() < nbytes:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "fp8_gemm_cutlass: the first call of a shape needs workspace and must run outside CUDA "
                "graph capture (warm up first)"
            )
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=device)
        _WORKSPACE[device.index] = buf
    return buf


def _aligned(v: torch.Tensor) -> torch.Tensor:
    """``v`` contiguous at a 16-byte aligned address (the epilogue's vector loads of scales and bias)."""
    v = v.contiguous()
    return v if v.data_ptr() % 16 == 0 else v.clone()


def fp8_gemm_cutlass(
    x: torch.Tensor,  # [M, K] fp8
    x_scale: torch.Tensor,  # [M, 1] or [1] f32
    w: torch.Tensor,  # [N, K] fp8
    w_scale: torch.Tensor,  # [N] f32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
    config: str | None = None,
) -> torch.Tensor:  # [M, N] bf16
    """Checked entry point (module docstring); ``launch`` skips the checks (fp8_linear has made them)."""
    _library()
    if x.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE or out_dtype != torch.bfloat16:
        raise ValueError("fp8_gemm_cutlass: float8_e4m3fn operands and a bf16 output only")
    why = unsupported(x, w, out_dtype)
    if why is not None:
        raise ValueError(f"fp8_gemm_cutlass: {why}")
    return launch(x, x_scale, w, w_scale, bias, out_dtype, config)


@functools.lru_cache(maxsize=1024)
def _workspace_bytes(idx: int, m: int, n: int, k: int, sms: int) -> int:
    return int(_library().kf_workspace(idx, m, n, k, sms))


def launch(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
           bias: torch.Tensor | None, out_dtype: torch.dtype,
           config: str | None = None) -> torch.Tensor:  # fmt: skip
    """``fp8_gemm_cutlass`` for a call ``supports`` accepts, unchecked."""
    (m, k), n = x.shape, w.shape[0]
    if m == 0:
        return x.new_empty((0, n), dtype=out_dtype)
    if x.device.index is not None and x.device.index != torch.cuda.current_device():
        with torch.cuda.device(x.device):  # the library launches on the current device
            return launch(x, x_scale, w, w_scale, bias, out_dtype, config)
    config = config or resolve_config(m, n, k)
    sa = x_scale.reshape(-1).float()
    sa = _aligned(sa.expand(m) if sa.numel() == 1 else sa)  # [M]
    sw = _aligned(w_scale.reshape(-1).float())  # [N]
    b = _aligned(bias.float()) if bias is not None else None
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    idx, sms = _config_index(config), sm_count(x.device, 1)
    nbytes = _workspace_bytes(idx, m, n, k, sms)
    ws = _workspace(x.device, nbytes).data_ptr() if nbytes > 0 else None
    stream = torch.cuda.current_stream(x.device).cuda_stream
    st = _library().kf_run(
        idx, x.data_ptr(), w.data_ptr(), out.data_ptr(), sa.data_ptr(), sw.data_ptr(),
        b.data_ptr() if b is not None else None, m, n, k, sms, ws, stream,
    )  # fmt: skip
    if st != 0:
        raise RuntimeError(f"fp8_gemm_cutlass: CUTLASS status {st} for {config} at M={m}, N={n}, K={k}")
    return out
