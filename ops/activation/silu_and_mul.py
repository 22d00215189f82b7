"""SiLU-and-mul (the gated MLP activation), optionally fused with FP8 (e4m3fn) quantization.

Ops (``torch.ops.kiln.*``), ``x: [T, 2I]`` bf16/fp16/fp32 holding the gate in ``x[:, :I]`` and the up
projection in ``x[:, I:]``:

* ``silu_and_mul(x) -> y [T, I]`` (dtype of ``x``), ``y = silu(gate) * up``
* ``silu_and_mul_quant(x, scale) -> (y fp8 [T, I], s)``: ``scale`` ``[1]`` float32 is static (``s`` is
  a copy of it); ``None`` is dynamic per token, ``s: [T, 1]`` float32 ``= max(row amax / 448, FP8_MIN_SCALE)``.

Rounding follows the Hugging Face MLP in the activation dtype: ``silu(gate)`` is computed in float32
and rounded to the activation dtype, the product with ``up`` is rounded again (and quantized from
that value).

Kernels: without dynamic quantization a 2-D grid ``(T, cdiv(I, BLOCK))`` of independent chunks; with
it one program per row (the row amax is needed before any element can be stored): a row of
``I <= MAX_BLOCK`` stays in registers, a longer one is walked twice (amax, then quantize).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.common.launch import interpreting, next_pow2, pdl_args, pdl_trigger, pdl_wait
from kiln.ops.common.op import kiln_op
from kiln.ops.common.quant import (
    FP8_DTYPE,
    FP8_MIN_SCALE,
    QUANT_DYNAMIC,
    QUANT_NONE,
    QUANT_STATIC,
    quantize_fp8,
    tl_dynamic_scale,
    tl_quantize_fp8,
    tl_round,
)

MAX_BLOCK = 16384  # widest row kept in registers for dynamic quantization
NARROW_ROWS = 16  # up to this many rows, 256-wide column blocks (a few rows still fill many SMs)
CHUNK = 4096  # piece width for wider rows

# ---- torch references -----------------------------------------------------------------------------


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I] -> silu(x[:, :I]) * x[:, I:]`` in ``x.dtype``, silu in float32."""
    i = x.shape[-1] // 2
    g = torch.nn.functional.silu(x[:, :i].float()).to(x.dtype)  # [T, I]
    return (g.float() * x[:, i:].float()).to(x.dtype)


def silu_and_mul_quant_ref(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_and_mul_ref`` then FP8 (ops/common/quant.py ``quantize_fp8``)."""
    return quantize_fp8(silu_and_mul_ref(x), scale)


# ---- Triton kernel --------------------------------------------------------------------------------


@triton.jit
def _silu_mul(x_row, offs, mask, I, RF: tl.constexpr):
    """float32 ``silu(gate) * up`` over ``offs``, with the activation-dtype roundings of the reference."""
    act = x_row.dtype.element_ty
    g = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + I + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl_round(g / (1.0 + tl.exp(-g)), act, RF)
    return tl_round(a * u, act, RF)


@triton.jit
def _silu_mul_kernel(
    X,  # [T, 2I] gate | up
    Y,  # [T, I] activation dtype, or fp8 when quantizing
    S,  # dynamic: [T, 1] f32 scales out; static: [1] f32 copy of the scale out
    SCALE_IN,  # static: [1] f32 scale in
    I,
    stride_x,
    stride_y,
    QUANT: tl.constexpr,  # 0 none, 1 static, 2 dynamic
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,  # dynamic only: chunks per row
    ROUND_IN_F32: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (ops/common/launch.py)
):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    offs0 = tl.arange(0, BLOCK)
    if QUANT == 2:
        if NUM_CHUNKS == 1:
            mask = offs0 < I
            y = _silu_mul(x_row, offs0, mask, I, ROUND_IN_F32)  # [BLOCK] f32
            s = tl_dynamic_scale(tl.max(tl.abs(y), axis=0), MIN_SCALE)
            tl.store(S + row, s)
            tl.store(y_row + offs0, tl_quantize_fp8(y, s, ROUND_IN_F32), mask=mask)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for c in range(NUM_CHUNKS):
                offs = c * BLOCK + offs0
                amax = tl.maximum(amax, tl.abs(_silu_mul(x_row, offs, offs < I, I, ROUND_IN_F32)))
            s = tl_dynamic_scale(tl.max(amax, axis=0), MIN_SCALE)
            tl.store(S + row, s)
            for c in range(NUM_CHUNKS):
                offs = c * BLOCK + offs0
                mask = offs < I
                y = _silu_mul(x_row, offs, mask, I, ROUND_IN_F32)
                tl.store(y_row + offs, tl_quantize_fp8(y, s, ROUND_IN_F32), mask=mask)
    else:
        col = tl.program_id(1)
        offs = col * BLOCK + offs0
        mask = offs < I
        y = _silu_mul(x_row, offs, mask, I, ROUND_IN_F32)
        if QUANT == 0:
            tl.store(y_row + offs, y.to(Y.dtype.element_ty), mask=mask)
        else:
            s = tl.load(SCALE_IN)
            if (row == 0) & (col == 0):
                tl.store(S, s)
            tl.store(y_row + offs, tl_quantize_fp8(y, s, ROUND_IN_F32), mask=mask)


def launch_config(
    t: int, i: int, quant: int, max_block: int = MAX_BLOCK
) -> tuple[tuple[int, ...], int, int, int]:
    """(grid, BLOCK, NUM_CHUNKS, num_warps). Chunked grids use 1024-wide tiles (256 for decode-sized
    T, so a handful of rows still spreads over many SMs); ~8 elements per thread either way."""
    if quant == QUANT_DYNAMIC:
        block = next_pow2(i)
        if block > max_block:  # walked in CHUNK-wide pieces (wider chunks spill registers)
            block = min(CHUNK, next_pow2(max_block))
        return (t,), block, triton.cdiv(i, block), min(16, max(1, block // 512))
    block = min(next_pow2(i), 256 if t <= NARROW_ROWS else 1024)
    return (t, triton.cdiv(i, block)), block, 1, max(1, block // 256)


def silu_and_mul_launch(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    quant: int,
    y: torch.Tensor,
    s: torch.Tensor | None,
    max_block: int = MAX_BLOCK,
) -> None:
    """Run the Triton kernel into preallocated ``y [T, I]`` (and ``s`` when quantizing).

    ``x``: [T, 2I] with unit last stride; ``quant`` one of QUANT_NONE / QUANT_STATIC (``scale`` [1]
    f32, ``s`` [1]) / QUANT_DYNAMIC (``s`` [T, 1] f32).
    """
    t, two_i = x.shape
    if t == 0:
        return
    grid, block, chunks, warps = launch_config(t, two_i // 2, quant, max_block)
    pdl = pdl_args(x)
    _silu_mul_kernel[grid](
        x, y,
        s if s is not None else y,
        scale if scale is not None else x,
        two_i // 2, x.stride(0), y.stride(0),
        QUANT=quant, BLOCK=block, NUM_CHUNKS=chunks,
        ROUND_IN_F32=interpreting(), MIN_SCALE=FP8_MIN_SCALE, num_warps=warps,
        **pdl,
    )  # fmt: skip


# ---- ops -----------------------------------------------------------------------------------------


def _check(x: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or x.shape[1] % 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"silu_and_mul: x must be [T, 2I] bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32):
        raise ValueError(
            f"silu_and_mul_quant: scale must be [1] float32, got {tuple(scale.shape)} {scale.dtype}"
        )


def _run(x: torch.Tensor, scale: torch.Tensor | None, quant: int):
    """Outputs allocated, then :func:`silu_and_mul_launch`."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, i = x.shape[0], x.shape[1] // 2
    fp8 = quant != QUANT_NONE
    y = x.new_empty((t, i), dtype=FP8_DTYPE if fp8 else x.dtype)
    s = None
    if quant == QUANT_DYNAMIC:
        s = x.new_empty((t, 1), dtype=torch.float32)
    elif quant == QUANT_STATIC and scale is not None:
        scale = scale.reshape(1)
        s = torch.empty_like(scale)
        if t == 0:
            s.copy_(scale)
    silu_and_mul_launch(x, scale, quant, y, s)
    return (y, s) if fp8 else y


@kiln_op("silu_and_mul", ref=silu_and_mul_ref, check=_check)
def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I] -> silu(x[:, :I]) * x[:, I:]`` ``[T, I]``."""
    return _run(x, None, QUANT_NONE)


@kiln_op("silu_and_mul_quant", ref=silu_and_mul_quant_ref, check=_check)
def silu_and_mul_quant_triton(
    x: torch.Tensor, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_and_mul`` then FP8: ``(y fp8 [T, I], s)``; ``s`` is ``[T, 1]`` (dynamic) or ``[1]`` (static)."""
    return _run(x, scale, QUANT_DYNAMIC if scale is None else QUANT_STATIC)
