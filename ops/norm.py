"""RMSNorm, fused residual-add + RMSNorm, and their FP8 (e4m3fn) quantizing variants.

Ops (``torch.ops.kiln.*``), ``x: [T, H]`` bf16/fp16/fp32, ``w: [H]``, ``eps: float``:

* ``rmsnorm(x, w, eps) -> y [T, H]`` (dtype of ``x``)
* ``fused_add_rmsnorm(x, residual, w, eps) -> y``: ``residual += x`` in place, ``y = rmsnorm(residual)``
* ``rmsnorm_quant(x, w, eps, scale) -> (y fp8 [T, H], s)``
* ``fused_add_rmsnorm_quant(x, residual, w, eps, scale) -> (y fp8, s)``

Quantization: ``scale`` ``[1]`` float32 is static (``s`` is a copy of it); ``scale=None`` is dynamic
per token, ``s: [T, 1]`` float32 ``= max(row amax / 448, FP8_MIN_SCALE)``, the amax taken over the
normalized, weighted row. ``y_fp8 = clamp(y / s, +-448)`` (see ops/quant.py).

Rounding follows Hugging Face's LlamaRMSNorm exactly: the residual sum is rounded to the activation
dtype, the statistics are float32, ``normalized`` is rounded to the activation dtype before the
weight multiply, and the product is rounded again (to the activation dtype, also before quantizing).

Kernel: one program per ``ROWS`` rows (``LAUNCH_DEFAULTS``, overridable per launch). A row of
``H <= MAX_BLOCK`` stays in registers: one read of x and residual, one write of the residual and of
``y`` (and of the row's scale), whatever the quantization; a longer row is walked in chunks (sum of
squares, [amax,] then normalize and store). Quantizing costs no division per element: one IEEE
reciprocal per scale, then a multiply and one FMA refinement per element, which returns exactly the
IEEE quotient ``y / s`` (``ops/quant.py: tl_quantize_fp8_rcp``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.common import FP8_DTYPE, FP8_MIN_SCALE, interpreting, kiln_op, next_pow2, use_triton
from kiln.ops.quant import (
    quantize_fp8_per_token,
    quantize_fp8_static,
    tl_dynamic_scale,
    tl_quantize_fp8_rcp,
    tl_round,
)

MAX_BLOCK = 16384  # widest row kept in registers (16 warps, 32 floats per thread per operand)
CHUNK = 4096  # piece width for wider rows
QUANT_NONE, QUANT_STATIC, QUANT_DYNAMIC = 0, 1, 2

# ---- torch references -----------------------------------------------------------------------------


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: ``(w * (x.f32 * rsqrt(mean(x.f32**2) + eps)).to(x.dtype))`` in ``x.dtype``."""
    xf = x.float()  # [T, H]
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * n.to(x.dtype).float()).to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` (rounded to its dtype, in place), then ``rmsnorm_ref(residual)``."""
    residual.copy_((residual.float() + x.float()).to(residual.dtype))
    return rmsnorm_ref(residual, w, eps)


def _quant_ref(y: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if scale is None:
        return quantize_fp8_per_token(y)
    return quantize_fp8_static(y, scale), scale.clone()


def rmsnorm_quant_ref(
    x: torch.Tensor, w: torch.Tensor, eps: float, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _quant_ref(rmsnorm_ref(x, w, eps), scale)


def fused_add_rmsnorm_quant_ref(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _quant_ref(fused_add_rmsnorm_ref(x, residual, w, eps), scale)


# ---- Triton kernel --------------------------------------------------------------------------------


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        v = tl.load(ptrs, mask=mask, other=0.0)
    else:
        v = tl.load(ptrs)
    return v


@triton.jit
def _store(ptrs, v, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, v, mask=mask)
    else:
        tl.store(ptrs, v)


@triton.jit
def _load_sum(
    x_ptrs,
    r_ptrs,
    mask,
    HAS_RES: tl.constexpr,
    STORE_RES: tl.constexpr,
    MASKED: tl.constexpr,
    RF: tl.constexpr,
):
    """v = x (+ residual) rounded to the activation dtype, as float32; optionally stored to residual."""
    v = _load(x_ptrs, mask, MASKED).to(tl.float32)
    if HAS_RES:
        r = _load(r_ptrs, mask, MASKED).to(tl.float32)
        v = tl_round(v + r, x_ptrs.dtype.element_ty, RF)
        if STORE_RES:
            _store(r_ptrs, v.to(r_ptrs.dtype.element_ty), mask, MASKED)
    return v


@triton.jit
def _normalize(v, act: tl.constexpr, w_ptrs, cmask, rstd, MASK_COLS: tl.constexpr, RF: tl.constexpr):
    """HF rounding: normalized -> activation dtype, times the weight -> activation dtype (float32).
    ``v [ROWS, BLOCK]``, ``w_ptrs``/``cmask [1, BLOCK]``, ``rstd [ROWS, 1]``."""
    w = _load(w_ptrs, cmask, MASK_COLS).to(tl.float32)
    n = tl_round(v * rstd, act, RF)
    return tl_round(w * n, act, RF)


@triton.jit(do_not_specialize=["T"])
def _rmsnorm_kernel(
    X,  # [T, H] input
    R,  # [T, H] residual (updated in place) or a dummy
    W,  # [H] weight
    Y,  # [T, H] output: activation dtype, or fp8 when quantizing
    S,  # dynamic: [T, 1] f32 scales out; static: [1] f32 copy of the scale out
    SCALE_IN,  # static: [1] f32 scale in
    T,
    H,
    stride_x,
    stride_r,
    stride_y,
    eps,
    HAS_RES: tl.constexpr,
    QUANT: tl.constexpr,  # 0 none, 1 static, 2 dynamic
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program (a power of two)
    MASK_COLS: tl.constexpr,  # H != BLOCK * NUM_CHUNKS
    MASKED: tl.constexpr,  # MASK_COLS or ROWS > 1 (the last program may run past T)
    ROUND_IN_F32: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    pid = tl.program_id(0)
    act = X.dtype.element_ty
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    rmask = rows[:, None] < T  # [ROWS, 1]
    x_base = X + rows[:, None] * stride_x  # [ROWS, 1] row pointers
    r_base = R + rows[:, None] * stride_r
    y_base = Y + rows[:, None] * stride_y
    cols0 = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    if QUANT == 1:
        s = tl.load(SCALE_IN)
        inv = tl.math.div_rn(1.0, s)  # one IEEE reciprocal; elements multiply (tl_quantize_fp8_rcp)
        if pid == 0:
            tl.store(S, s)
    if NUM_CHUNKS == 1:
        cmask = cols0 < H
        mask = rmask & cmask
        v = _load_sum(x_base + cols0, r_base + cols0, mask, HAS_RES, True, MASKED, ROUND_IN_F32)
        rstd = 1.0 / tl.math.sqrt_rn(tl.sum(v * v, axis=1) / H + eps)  # [ROWS]
        y = _normalize(v, act, W + cols0, cmask, rstd[:, None], MASK_COLS, ROUND_IN_F32)  # [ROWS, BLOCK]
        if QUANT == 0:
            _store(y_base + cols0, y.to(Y.dtype.element_ty), mask, MASKED)
        else:
            if QUANT == 2:
                s = tl_dynamic_scale(tl.max(tl.abs(y), axis=1), MIN_SCALE)[:, None]  # [ROWS, 1]
                _store(S + rows[:, None], s, rmask, ROWS > 1)
                inv = tl.math.div_rn(tl.full([ROWS, 1], 1.0, tl.float32), s)
            _store(y_base + cols0, tl_quantize_fp8_rcp(y, s, inv, ROUND_IN_F32), mask, MASKED)
    else:
        # Pass 1: sum of squares (the residual is written only in the last pass).
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK + cols0
            v = _load_sum(
                x_base + cols, r_base + cols, rmask & (cols < H), HAS_RES, False, MASKED, ROUND_IN_F32
            )
            acc += v * v
        rstd = (1.0 / tl.math.sqrt_rn(tl.sum(acc, axis=1) / H + eps))[:, None]  # [ROWS, 1]
        if QUANT == 2:  # pass 2: amax of the normalized row
            amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
            for c in range(NUM_CHUNKS):
                cols = c * BLOCK + cols0
                cmask = cols < H
                v = _load_sum(
                    x_base + cols, r_base + cols, rmask & cmask, HAS_RES, False, MASKED, ROUND_IN_F32
                )
                y = _normalize(v, act, W + cols, cmask, rstd, MASK_COLS, ROUND_IN_F32)
                amax = tl.maximum(amax, tl.abs(y))
            s = tl_dynamic_scale(tl.max(amax, axis=1), MIN_SCALE)[:, None]  # [ROWS, 1]
            _store(S + rows[:, None], s, rmask, ROWS > 1)
            inv = tl.math.div_rn(tl.full([ROWS, 1], 1.0, tl.float32), s)
        for c in range(NUM_CHUNKS):  # last pass: residual, normalize, store
            cols = c * BLOCK + cols0
            cmask = cols < H
            mask = rmask & cmask
            v = _load_sum(x_base + cols, r_base + cols, mask, HAS_RES, True, MASKED, ROUND_IN_F32)
            y = _normalize(v, act, W + cols, cmask, rstd, MASK_COLS, ROUND_IN_F32)
            if QUANT == 0:
                _store(y_base + cols, y.to(Y.dtype.element_ty), mask, MASKED)
            else:
                _store(y_base + cols, tl_quantize_fp8_rcp(y, s, inv, ROUND_IN_F32), mask, MASKED)


# Launch shape per quantization mode for rows that stay in registers: (rows per program, num_warps;
# None = ~16 elements per thread). Pick these from ``bench/test_bench_norm.py::test_fused_add_rmsnorm_sweep``
# on the target GPU.
LAUNCH_DEFAULTS: dict[int, tuple[int, int | None]] = {
    QUANT_NONE: (1, None),
    QUANT_STATIC: (1, None),
    QUANT_DYNAMIC: (1, None),
}


def launch_config(
    h: int,
    max_block: int = MAX_BLOCK,
    quant: int = QUANT_NONE,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
) -> tuple[int, int, int, int]:
    """(BLOCK, NUM_CHUNKS, num_warps, rows per program) for rows of ``h`` elements.

    A row of ``h <= max_block`` is one register block; wider rows go in CHUNK-wide pieces (wider
    chunks spill registers). ``rows_per_program`` and ``num_warps`` override ``LAUNCH_DEFAULTS``.
    """
    block = next_pow2(h)
    if block > max_block:
        block = min(CHUNK, next_pow2(max_block))
    rows, warps = LAUNCH_DEFAULTS[quant]
    rows = rows_per_program or rows
    if rows & (rows - 1):
        raise ValueError(f"rmsnorm: rows_per_program must be a power of two, got {rows}")
    warps = num_warps or warps or min(16, max(1, block // 512))
    return block, triton.cdiv(h, block), warps, rows


def rmsnorm_launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None,
    quant: int,
    y: torch.Tensor,
    s: torch.Tensor | None,
    max_block: int = MAX_BLOCK,
    *,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Run the Triton kernel into preallocated outputs ``y`` (and ``s`` when quantizing).

    ``x``: [T, H] with unit last stride; ``residual`` like ``x`` or None; ``quant`` one of
    QUANT_NONE / QUANT_STATIC (``scale`` [1] f32, ``s`` [1]) / QUANT_DYNAMIC (``s`` [T, 1] f32).
    ``rows_per_program`` / ``num_warps`` override the launch shape (see ``launch_config``).
    """
    t, h = x.shape
    if t == 0:
        return
    block, chunks, warps, rows = launch_config(h, max_block, quant, rows_per_program, num_warps)
    r = residual if residual is not None else x
    mask_cols = h != block * chunks
    _rmsnorm_kernel[(triton.cdiv(t, rows),)](
        x, r, w, y,
        s if s is not None else y,
        scale if scale is not None else w,
        t, h, x.stride(0), r.stride(0), y.stride(0), eps,
        HAS_RES=residual is not None, QUANT=quant, BLOCK=block, NUM_CHUNKS=chunks, ROWS=rows,
        MASK_COLS=mask_cols, MASKED=mask_cols or rows > 1,
        ROUND_IN_F32=interpreting(), MIN_SCALE=FP8_MIN_SCALE, num_warps=warps,
    )  # fmt: skip


# ---- custom ops -----------------------------------------------------------------------------------


def _check(
    x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None, scale: torch.Tensor | None
) -> None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"rmsnorm: x must be [T, H] bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    if w.shape != (x.shape[1],):
        raise ValueError(f"rmsnorm: w must be [H={x.shape[1]}], got {tuple(w.shape)}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(
                f"fused_add_rmsnorm: residual must match x ({tuple(x.shape)} {x.dtype}), "
                f"got {tuple(residual.shape)} {residual.dtype} on {residual.device}"
            )
        if residual.shape[0] > 0 and residual.stride(-1) != 1:
            raise ValueError("fused_add_rmsnorm: residual is updated in place and needs a unit last stride")
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32):
        raise ValueError(f"rmsnorm_quant: scale must be [1] float32, got {tuple(scale.shape)} {scale.dtype}")


def _forward(x, residual, w, eps, scale, quant):
    """Shared body of the four ops: check, then the Triton kernel or the torch reference."""
    _check(x, w, residual, scale)
    x = x if x.stride(-1) == 1 else x.contiguous()  # [T, H]; any row stride
    w = w.contiguous()  # [H]
    scale = scale.reshape(1) if scale is not None else None
    if not use_triton(x):
        y = rmsnorm_ref(x, w, eps) if residual is None else fused_add_rmsnorm_ref(x, residual, w, eps)
        return y if quant == QUANT_NONE else _quant_ref(y, scale)
    y = x.new_empty(x.shape, dtype=FP8_DTYPE if quant != QUANT_NONE else x.dtype)
    s = None
    if quant == QUANT_DYNAMIC:
        s = x.new_empty((x.shape[0], 1), dtype=torch.float32)
    elif quant == QUANT_STATIC:
        s = scale.clone() if x.shape[0] == 0 else torch.empty_like(scale)  # else the kernel copies it
    rmsnorm_launch(x, residual, w, eps, scale, quant, y, s)
    return y if quant == QUANT_NONE else (y, s)


def _mode(scale: torch.Tensor | None) -> int:
    return QUANT_DYNAMIC if scale is None else QUANT_STATIC


def _quant_fake(x, scale):
    y = x.new_empty(x.shape, dtype=FP8_DTYPE)
    s = x.new_empty((x.shape[0], 1), dtype=torch.float32) if scale is None else scale.new_empty((1,))
    return y, s


@kiln_op("rmsnorm")
def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [T, H] -> [T, H]`` RMSNorm (see the module docstring)."""
    return _forward(x, None, w, eps, None, QUANT_NONE)


@rmsnorm.register_fake
def _(x, w, eps):
    return x.new_empty(x.shape)


@kiln_op("fused_add_rmsnorm", mutates_args=("residual",))
def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place; returns ``rmsnorm(residual)`` ``[T, H]``."""
    return _forward(x, residual, w, eps, None, QUANT_NONE)


@fused_add_rmsnorm.register_fake
def _(x, residual, w, eps):
    return x.new_empty(x.shape)


@kiln_op("rmsnorm_quant")
def rmsnorm_quant(
    x: torch.Tensor, w: torch.Tensor, eps: float, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm then FP8: ``(y fp8 [T, H], s)``; ``s`` is ``[T, 1]`` (dynamic) or ``[1]`` (static)."""
    return _forward(x, None, w, eps, scale, _mode(scale))


@rmsnorm_quant.register_fake
def _(x, w, eps, scale):
    return _quant_fake(x, scale)


@kiln_op("fused_add_rmsnorm_quant", mutates_args=("residual",))
def fused_add_rmsnorm_quant(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` in place, then ``rmsnorm_quant(residual)``: ``(y fp8 [T, H], s)``."""
    return _forward(x, residual, w, eps, scale, _mode(scale))


@fused_add_rmsnorm_quant.register_fake
def _(x, residual, w, eps, scale):
    return _quant_fake(x, scale)
