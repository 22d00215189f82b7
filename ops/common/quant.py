"""FP8 (float8_e4m3fn) quantization helpers: plain torch, shared by the ops and by ``kiln.weights``.

Convention (the one ``torch._scaled_mm`` uses): a scale is a *dequantization* factor,
``x ≈ x_fp8.float() * scale``, and quantizing divides by it: ``x_fp8 = clamp(x / scale, ±448)``.
Dynamic scales are ``amax / 448`` over the quantized group (a weight row, a token), clamped below
by ``FP8_MIN_SCALE`` so an all-zero group quantizes to zeros instead of NaN.

Error bound of one e4m3 rounding (round to nearest even, 3 mantissa bits): for a scaled value
``v = x / scale`` in the normal range (``|v| >= 2**-6``) the relative rounding error is at most
half an ulp, ``2**-4 * |v|``; below it (subnormals, spacing ``2**-9``) the absolute error is at most
``2**-10``. With ``|v| <= 448`` (amax scaling or a clamp) the dequantized error is therefore
``|dequantize(quantize(x)) - x| <= max(2**-4 * |x|, 2**-10 * scale)``, plus the clamp error for
values a static scale cannot reach. ``fp8_error_bound`` returns that bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_MIN_SCALE = 1e-12  # guards all-zero rows against division by zero
# a fused op's output quantization (its QUANT constexpr): none, static (one scale given), dynamic per row
QUANT_NONE, QUANT_STATIC, QUANT_DYNAMIC = 0, 1, 2
FP8_REL_ERROR = 2.0**-4  # half an ulp of a 3-bit mantissa, relative to the value
FP8_SUBNORMAL_ABS_ERROR = 2.0**-10  # half the subnormal spacing 2**-9, in scaled units


def _to_fp8(v: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their scale -> float8_e4m3fn (saturating)."""
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """Dequantization scale from an absolute maximum (float32): ``max(amax / 448, FP8_MIN_SCALE)``,
    ``amax / 448`` the correctly rounded float32 quotient on every device, as the kernels'
    ``tl_dynamic_scale`` (``div_rn``) computes it.

    Not ``amax.float() / 448``: on CUDA tensors torch divides by a Python scalar as a product with
    its float32 reciprocal, one ulp off the quotient for about half of the amaxes, and bf16
    activations put about 0.1% of the scaled values ``x / scale`` exactly on an e4m3 rounding
    midpoint (``x = 1.9375``, ``amax = 3.5``: 248, between 240 and 256), where a scale one ulp off
    rounds the other way; at DeepSeek-V3's expert shape that moved the GPU reference of block-FP8
    ``fused_moe`` 1-2% from the kernels (H200, twenty-second session). The quotient is taken in
    float64 and rounded once: ``amax / 448 = (amax / 64) / 7`` is never closer than 1/14 ulp to a
    float32 midpoint, so the float64 result (within 2**-52 of it) rounds to the right float32."""
    return (amax.double() / FP8_MAX).float().clamp(min=FP8_MIN_SCALE)


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel weight quantization.

    Args:
        w: ``[..., N, K]`` weight (any float dtype): ``[N, K]`` for a linear layer, ``[E, N, K]``
            for stacked experts.

    Returns:
        ``(w_fp8 [..., N, K] float8_e4m3fn, scale [..., N] float32)`` with
        ``w ≈ w_fp8.float() * scale[..., None]``.
    """
    if w.dim() < 2:
        raise ValueError(f"quantize_fp8_per_channel: w must be [..., N, K], got shape {tuple(w.shape)}")
    wf = w.float()
    scale = amax_scale(wf.abs().amax(dim=-1))  # [..., N]
    return _to_fp8(wf / scale.unsqueeze(-1)), scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization.

    Args:
        x: ``[T, K]`` activations (any float dtype).

    Returns:
        ``(x_fp8 [T, K] float8_e4m3fn, scale [T, 1] float32)``, ``scale = max(row amax / 448, 1e-12)``.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_per_token: x must be [T, K], got shape {tuple(x.shape)}")
    xf = x.float()
    scale = amax_scale(xf.abs().amax(dim=-1, keepdim=True))  # [T, 1]
    return _to_fp8(xf / scale), scale


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static quantization with a given scale (``[1]`` float32 per tensor, or anything that
    broadcasts against ``x``). Values beyond ``448 * scale`` saturate."""
    return _to_fp8(x.float() / scale.float())


def quantize_fp8(y: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the fused quantizing ops return for their output ``y [T, N]``: ``scale`` None, dynamic
    per token ``(y_fp8, s [T, 1])``; ``scale`` ``[1]`` float32, static ``(y_fp8, s [1])``, ``s`` a
    copy of it."""
    if scale is None:
        return quantize_fp8_per_token(y)
    scale = scale.reshape(1)
    return quantize_fp8_static(y, scale), scale.clone()


def dequantize_fp8(
    x_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``x_fp8.float() * scale`` in ``dtype``.

    ``scale`` either broadcasts against ``x_fp8`` with the same number of dimensions (``[T, 1]``,
    ``[1]``) or is a per-row scale of shape ``x_fp8.shape[:-1]`` (per-channel weight scales
    ``[..., N]`` for ``[..., N, K]`` weights), which is unsqueezed on the last dimension.
    """
    s = scale.float()
    if s.dim() == x_fp8.dim() - 1 and tuple(s.shape) == tuple(x_fp8.shape[:-1]):
        s = s.unsqueeze(-1)
    return (x_fp8.float() * s).to(dtype)


def fp8_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest ``|dequantize(quantize(x)) - x|`` allowed per element for values within ``448 * scale``
    (float32, broadcast like ``dequantize_fp8``'s scale)."""
    s = scale.float()
    if s.dim() == x.dim() - 1 and tuple(s.shape) == tuple(x.shape[:-1]):
        s = s.unsqueeze(-1)
    return torch.maximum(FP8_REL_ERROR * x.float().abs(), FP8_SUBNORMAL_ABS_ERROR * s)


# ---- Triton side: used by the fused kernels of every family ----------------------------------------


@triton.jit
def round_e4m3_in_f32(v):
    """Round float32 ``v`` (``|v| <= 448``) to the nearest e4m3 value, ties to even, still float32.

    Only needed under the Triton interpreter, whose float32 -> fp8 cast truncates and drops the
    carry into the exponent; after this the cast is exact. Compiled kernels use the hardware cast.
    """
    b = v.to(tl.int32, bitcast=True)
    lsb = (b >> 20) & 1  # lowest kept mantissa bit (23 - 3 = 20)
    normal = ((b + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # -1048576 = 0xFFF00000
    a = tl.abs(v) * 512.0  # subnormals: spacing 2**-9; rint via the 1.5 * 2**23 trick
    m = (((a + 12582912.0) - 12582912.0) * 0.001953125).to(tl.int32, bitcast=True)
    subnormal = (m | (b & -2147483648)).to(tl.float32, bitcast=True)  # keep the sign (and -0.0)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def tl_round(v, dtype: tl.constexpr, ROUND_IN_F32: tl.constexpr):
    """float32 ``v`` rounded to ``dtype`` (nearest even) and widened back to float32.

    Under the interpreter (``ROUND_IN_F32``) the float32 -> bfloat16 cast truncates, so bfloat16 is
    rounded with integer arithmetic first; compiled kernels use the hardware conversion.
    """
    if ROUND_IN_F32 and dtype == tl.bfloat16:
        b = v.to(tl.int32, bitcast=True)
        v = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)  # -65536 = 0xFFFF0000
    return v.to(dtype).to(tl.float32)


def add_rounded(y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + y`` summed in float32, rounded once to ``y``'s dtype: :func:`tl_add_row` in torch."""
    return (y.float() + residual.float()).to(y.dtype)


@triton.jit
def tl_add_row(
    y, Z, row, stride_z, offs, mask, ADD: tl.constexpr, DT: tl.constexpr, ROUND_IN_F32: tl.constexpr
):
    """``ADD``: ``y`` (a rounded float32 output row) plus ``Z[row, offs]`` (the residual), rounded to
    ``DT`` again, as an add after the kernel would give; else ``y``. ``row`` int64 where
    ``row * stride_z`` can pass 2^31."""
    if ADD:
        z = tl.load(Z + row * stride_z + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl_round(y + z, DT, ROUND_IN_F32)
    return y


@triton.jit
def tl_quantize_fp8(y, s, ROUND_IN_F32: tl.constexpr):
    """float32 block ``y`` divided by the float32 scale ``s`` (the IEEE quotient, as torch's
    ``y / s``), saturated to +-448 and cast to float8e4nv (round to nearest even). One reciprocal
    per call, then :func:`tl_quantize_fp8_rcp` (bit for bit the division)."""
    return tl_quantize_fp8_rcp(y, s, tl.math.div_rn(1.0, s), ROUND_IN_F32)


@triton.jit
def tl_quantize_fp8_rcp(y, s, inv_s, ROUND_IN_F32: tl.constexpr):
    """``y / s`` quantized as :func:`tl_quantize_fp8` describes, without a division per element.

    ``inv_s`` is ``1 / s`` rounded to nearest (``tl.math.div_rn``, once per scale); ``s`` and
    ``inv_s`` are scalars or broadcast against ``y``. ``q = y * inv_s`` is within an ulp of
    ``y / s``; one refinement ``q + fma(-q, s, y) * inv_s`` (the residual is exact in float32) gives
    the correctly rounded quotient (Markstein's theorem), i.e. what IEEE division (and torch's
    ``y / s``) returns, for 3 FP operations instead of a full-precision division. ``q`` is kept as
    is when it is zero (the refinement would turn -0 into +0) or past +-512 (it saturates to +-448
    either way, and an overflow to inf would make the refinement NaN).
    """
    s = tl.broadcast_to(s, y.shape)
    inv_s = tl.broadcast_to(inv_s, y.shape)
    q = y * inv_s
    refine = (tl.abs(q) < 512.0) & (q != 0.0)
    v = tl.where(refine, tl.fma(tl.fma(-q, s, y), inv_s, q), q)
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if ROUND_IN_F32:
        v = round_e4m3_in_f32(v)
    return v.to(tl.float8e4nv)


@triton.jit
def tl_dynamic_scale(amax, MIN_SCALE: tl.constexpr):
    """Per-token scale from a float32 row amax: ``max(amax / 448, MIN_SCALE)`` (IEEE division)."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), MIN_SCALE)
