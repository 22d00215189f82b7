"""FP8 (e4m3fn) linear layer with per-token activation scales and per-channel weight scales.

Op ``torch.ops.kiln.fp8_linear(x, x_scale, w, w_scale, bias, out_dtype) -> [T, N]``:

* ``x``: ``[T, K]`` float8_e4m3fn; ``x_scale``: ``[T, 1]`` (per token) or ``[1]`` (per tensor) float32
* ``w``: ``[N, K]`` float8_e4m3fn; ``w_scale``: ``[N]`` float32 (per output channel)
* ``bias``: ``[N]`` or None; ``out_dtype``: bf16, fp16 or fp32
* ``y[t, n] = x_scale[t] * w_scale[n] * sum_k x[t, k] * w[n, k] + bias[n]``

CUDA, compute capability >= 9.0: ``torch._scaled_mm`` with row-wise scales. Its rules: the first
operand row-major, the second column-major (so ``w.t()`` of a contiguous ``[N, K]`` weight), scales
float32 ``[T, 1]`` and ``[1, N]`` contiguous, ``K`` and ``N`` divisible by 16. Where cuBLAS lacks
row-wise scaling (before CUDA 12.9) torch falls back to a CUTLASS kernel that only writes bf16, so
other output dtypes are computed in bf16 and cast there. Shapes ``_scaled_mm`` cannot take (K or N
not a multiple of 16) and older GPUs use the reference, with a one-time warning that says how to fix
it. CPU: the reference (``fp8_linear_ref``: the float32 product of the FP8 values, then the scales).

Backends (``fp8_linear_forward(..., backend=...)``; the op reads the ``fp8_gemm`` setting at call
time, so at CUDA-graph capture for decode graphs: ``--fp8-gemm``, ``EngineOptions.fp8_gemm``,
``KILN_FP8_GEMM``, kiln/settings.py): ``cublas`` is the above; ``triton`` runs ops/linear/fp8_gemm.py's
kernel on CUDA GPUs of compute capability >= 8.9 (any N and K; others fall back to the cuBLAS rules)
and, with ``KILN_TRITON_ON_CPU=1`` under ``TRITON_INTERPRET=1``, on CPU tensors; ``cutlass`` runs
ops/linear/fp8_cutlass.py's warp-specialized CUTLASS kernels (sm90, bf16 output, N and K multiples of 16;
the library must be loaded: an FP8 artifact compiled on an H100/H200 carries it and the loader loads
it; others fall back to the cuBLAS rules). ``auto`` (default) takes, in this order, ops/linear/gemv.py's GEMV with FP8 operands for
decode-sized products (1 <= M <= ``FP8_GEMV_MAX_M``, Triton devices, ``--no-gemv`` / ``KILN_GEMV=0``
turns it off),
``cutlass`` where
the library is loaded and ``fp8_cutlass.config_for`` has an instantiation (M >= 65),
``triton`` where ``fp8_gemm.TABLE`` holds a measured launch config (M of 129..512 at Llama-3.1-8B's
N, K), else ``cublas``. On the H200 the CUTLASS kernels were 1.59-2.00x bf16 ``F.linear`` at M = 256
and 1.68-1.93x at M = 512 and 1024, against the Triton kernel's 1.41-1.71x at M = 256
(bench/results/2026-11-29_h200_fp8_cutlass_sweep.json).

Accumulation: FP8 tensor cores sum each MMA's products at reduced precision. Fast accumulation
leaves it at that; precise accumulation promotes the sum into float32 every 128 products.
The ``fp8_fast_accum`` setting (``--fp8-fast-accum``, ``KILN_FP8_FAST_ACCUM``): ``auto`` (default)
is fast in the Triton kernel and precise in cuBLAS;
``1`` is fast in both; ``0`` is precise in both. The CUTLASS kernels always accumulate fast (under
``0``, ``auto`` does not pick them). cuBLAS stays precise under ``auto`` for two reasons.
It has no fast row-wise kernel for some shapes: ``CUBLAS_STATUS_NOT_SUPPORTED`` at M <= 7, N = 4096,
K = 14336 on the H200 with CUDA 13.0. And it meets the 1.5x target without one at the M where
``auto`` sends products to it.

Errors measured on the H200, against the exact float32 product of the FP8 values, with a bf16 output
(relative):

| accumulation | K = 4096 | K = 14336 |
|---|---|---|
| fast | 2.1e-3 | 3.3e-3 |
| precise | 1.7e-3 | 1.7e-3 |

Most of the precise figure is the bf16 rounding. The activation's own per-token FP8 rounding is
about 3e-2, ten times more. Precise accumulation costs the Triton kernel 10-30% at M = 256..512
(bench/results/2026-11-29_h200_fp8_sweep_tma.json).
"""

from __future__ import annotations

import warnings

import torch

from kiln import settings
from kiln.ops.common.launch import capability, use_triton
from kiln.ops.common.op import kiln_op
from kiln.ops.common.quant import FP8_DTYPE
from kiln.ops.linear import fp8_cutlass
from kiln.ops.linear.fp8_gemm import fp8_gemm, tuned
from kiln.ops.linear.gemv import gemv, gemv_enabled

# ``auto`` runs decode-sized products (1 <= M <= this) on ops/linear/gemv.py's CUDA-core GEMV with FP8
# operands: a pass over the FP8 weight, where cuBLAS's FP8 GEMMs are tile kernels. On the H200 it
# beat cuBLAS at M = 1 and 2 on all four Llama-3.1-8B products and lost at M = 4 on gate_up
# (bench/results/2026-11-29_h200_fp8_gemv_sweep.json; 8B decode at batch 4: 662 vs 761 tok/s).
FP8_GEMV_MAX_M = 2

ACCUM_MODES = settings.SETTINGS["fp8_fast_accum"].choices  # ("auto", "0", "1")


def use_fast_accum(backend: str) -> bool:
    """Whether ``backend`` (``cublas`` or ``triton``) accumulates fast under the ``fp8_fast_accum``
    setting (read at call time; see the module docstring)."""
    mode = settings.value("fp8_fast_accum")
    return mode == "1" or (mode == "auto" and backend == "triton")


BACKENDS = settings.SETTINGS["fp8_gemm"].choices  # ("auto", "cutlass", "triton", "cublas")


def fp8_backend(backend: str | None = None) -> str:
    """``backend``, else the ``fp8_gemm`` setting (default ``auto``), checked."""
    b = backend if backend is not None else settings.value("fp8_gemm")
    if b not in BACKENDS:
        raise ValueError(f"fp8_linear: backend must be one of {BACKENDS} (KILN_FP8_GEMM), got {b!r}")
    return b


def fp8_linear_ref(x, x_scale, w, w_scale, bias, out_dtype) -> torch.Tensor:
    """What every backend computes, in plain torch (the op on CPU; the tests' oracle): the float32
    product of the FP8 values (exact products, float32 sums), ``[T, K] x [N, K] -> [T, N]``, scaled
    per row by ``x_scale`` and per column by ``w_scale``, plus the bias, rounded once to ``out_dtype``."""
    y = (x.float() @ w.float().t()) * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _cublas_rowwise() -> bool:
    """cuBLAS has row-wise scaled FP8 GEMMs (any output dtype) from CUDA 12.9 on; before that torch
    routes row-wise scaling to a bf16-output CUTLASS kernel."""
    v = torch.version.cuda or "0.0"
    major, minor = (int(p) for p in v.split(".")[:2])
    return (major, minor) >= (12, 9)


def scaled_mm_supported(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """None if ``torch._scaled_mm`` can run this product, else the reason it cannot."""
    if not x.is_cuda:
        return "not a CUDA tensor"
    cap = capability(x.device)
    if cap < (9, 0):
        return f"row-wise scaled FP8 GEMMs need compute capability >= 9.0, this GPU is {cap[0]}.{cap[1]}"
    n, k = w.shape
    if k % 16 or n % 16:
        return f"torch._scaled_mm needs K and N divisible by 16, got N={n}, K={k}"
    return None


def triton_fp8_supported(x: torch.Tensor) -> str | None:
    """None if ops/linear/fp8_gemm.py's kernel can run on ``x``'s device, else the reason it cannot."""
    if not x.is_cuda:
        return None if use_triton(x) else "not a CUDA tensor (and the Triton interpreter is off)"
    cap = capability(x.device)
    if cap < (8, 9):
        return f"FP8 tensor-core dots need compute capability >= 8.9, this GPU is {cap[0]}.{cap[1]}"
    return None


def scaled_mm_rowwise(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype,
                      fast_accum: bool | None = None) -> torch.Tensor:  # fmt: skip
    """``torch._scaled_mm`` with row-wise scales; the op's arguments (checked), ``fast_accum`` None:
    the ``fp8_fast_accum`` setting."""
    t, n = x.shape[0], w.shape[0]
    x = x.contiguous()  # row-major [T, K]
    w = w.contiguous()  # [N, K]; w.t() is the column-major [K, N] operand
    sa = x_scale.float().reshape(-1, 1)
    sa = (sa.expand(t, 1) if sa.shape[0] == 1 else sa).contiguous()  # [T, 1]
    sb = w_scale.float().reshape(1, n).contiguous()  # [1, N]
    mm_dtype = out_dtype if out_dtype == torch.bfloat16 or _cublas_rowwise() else torch.bfloat16
    # cuBLAS takes a fused bias only with a 16-bit output; a float32 output adds it afterwards.
    b = bias.to(mm_dtype) if bias is not None and mm_dtype != torch.float32 else None
    y = torch._scaled_mm(
        x,
        w.t(),
        scale_a=sa,
        scale_b=sb,
        bias=b,
        out_dtype=mm_dtype,
        use_fast_accum=use_fast_accum("cublas") if fast_accum is None else fast_accum,
    )
    if bias is not None and b is None:
        y = y + bias.to(y.dtype)
    return y if mm_dtype == out_dtype else y.to(out_dtype)


_warned: set[str] = set()


def _check(x, x_scale, w, w_scale, bias, out_dtype) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_linear: need x [T, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_linear: x and w must be {FP8_DTYPE}, got {x.dtype} and {w.dtype}")
    t, n = x.shape[0], w.shape[0]
    if x_scale.dtype != torch.float32 or x_scale.numel() not in (1, t) or x_scale.dim() > 2:
        raise ValueError(f"fp8_linear: x_scale must be [T={t}, 1] or [1] float32, got {tuple(x_scale.shape)}")
    if w_scale.dtype != torch.float32 or w_scale.shape != (n,):
        raise ValueError(
            f"fp8_linear: w_scale must be [N={n}] float32, got {tuple(w_scale.shape)} {w_scale.dtype}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fp8_linear: bias must be [N={n}], got {tuple(bias.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_linear: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")


def auto_backend(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> str:
    """What ``auto`` runs for this product (module docstring)."""
    m, (n, k) = x.shape[0], w.shape
    if m <= FP8_GEMV_MAX_M and gemv_enabled() and w.stride(1) == 1 and triton_fp8_supported(x) is None:
        return "gemv"
    if (
        fp8_cutlass.config_for(m, n, k) is not None
        and use_fast_accum("triton")  # the fp8_fast_accum setting; False only for "0"
        and fp8_cutlass.supports(x, w, out_dtype)
    ):
        return "cutlass"
    return "triton" if tuned(m, n, k) else "cublas"


@kiln_op("fp8_linear", ref=fp8_linear_ref, check=_check)
def fp8_linear_forward(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``[T, K] fp8 x [N, K] fp8 -> [T, N]`` ``out_dtype``, scaled per token and per channel (+ bias):
    the op's launch on a device that runs Triton (unchecked: the op's body runs ``_check`` first).
    The backend (``backend``, else the ``fp8_gemm`` setting; module docstring), the cuBLAS rules or
    the reference."""
    if x.shape[0] == 0:
        return x.new_empty((0, w.shape[0]), dtype=out_dtype)
    b = requested = fp8_backend(backend)
    if b == "auto":
        b = auto_backend(x, w, out_dtype)  # its "gemv" and "cutlass" have been checked
    if b == "cutlass" and requested == "cutlass" and not fp8_cutlass.supports(x, w, out_dtype):
        b = "cublas"  # the cuBLAS rules below
    if b == "triton" and triton_fp8_supported(x) is not None:
        b = "cublas"
    if b == "gemv":
        return gemv(x, w, bias, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype)
    if b == "cutlass":
        return fp8_cutlass.launch(x, x_scale, w, w_scale, bias, out_dtype)
    if b == "triton":
        return fp8_gemm(x, x_scale, w, w_scale, bias, out_dtype, fast_accum=use_fast_accum("triton"))
    if x.is_cuda:
        why = scaled_mm_supported(x, w)
        if why is None:
            return scaled_mm_rowwise(x, x_scale, w, w_scale, bias, out_dtype)
        if why not in _warned:
            _warned.add(why)
            warnings.warn(
                f"fp8_linear: {why}; using the slow float32 reference path. Pad the weight's N and K "
                "to multiples of 16 when packing (or quantize this layer to bf16) to get the FP8 GEMM.",
                stacklevel=2,
            )
    return fp8_linear_ref(x, x_scale, w, w_scale, bias, out_dtype)
