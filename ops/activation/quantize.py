"""Dynamic per-token FP8 (e4m3fn) quantization of an activation no fused kernel produced.

Op ``torch.ops.kiln.quantize_fp8_rows(x [T, K]) -> (q fp8 [T, K], s [T, 1] float32)``, ``x``
bf16/fp16/fp32: ``s = max(row amax / 448, FP8_MIN_SCALE)``, ``q = saturate(x / s)`` rounded to
nearest even: bit for bit ``ops/common/quant.py: quantize_fp8_per_token``, its reference. What the
FP8 linears take where no norm or activation kernel quantized their input (the attention output
before ``o``; the MoE experts' input).

Kernel: one program per row, walking it twice in ``BLOCK``-wide pieces (the amax, then the
quantized values): one launch instead of the abs, amax, divide, clamp and cast of the torch ops.
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
    quantize_fp8_per_token,
    tl_dynamic_scale,
    tl_quantize_fp8,
)

MAX_BLOCK = 4096  # piece width: a row of up to this many elements is one piece


@triton.jit
def _quant_rows_kernel(
    X, Q, S, K, stride_x, stride_q, BLOCK: tl.constexpr, MIN_SCALE: tl.constexpr, RF: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    pdl_trigger(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(X + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    s = tl_dynamic_scale(tl.max(amax, axis=0), MIN_SCALE)
    tl.store(S + row, s)
    for k0 in range(0, K, BLOCK):
        m = k0 + offs < K
        v = tl.load(X + row * stride_x + k0 + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Q + row * stride_q + k0 + offs, tl_quantize_fp8(v, s, RF), mask=m)


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"quantize_fp8_rows: x must be [T, K] bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}"
        )


@kiln_op("quantize_fp8_rows", ref=quantize_fp8_per_token, check=_check)
def quantize_fp8_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K] -> (q fp8 [T, K], s [T, 1] f32)`` (module docstring)."""
    t, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = x.new_empty((t, k), dtype=FP8_DTYPE)
    s = x.new_empty((t, 1), dtype=torch.float32)
    if t:
        block = min(next_pow2(k), MAX_BLOCK)
        _quant_rows_kernel[(t,)](
            x, q, s, k, x.stride(0), q.stride(0), BLOCK=block, MIN_SCALE=FP8_MIN_SCALE, RF=interpreting(),
            num_warps=max(1, min(8, block // 512)), **pdl_args(x),
        )  # fmt: skip
    return q, s
