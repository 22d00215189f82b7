"""FP8 helpers (ops/common/quant.py): round-trip error bound, scale shapes, zero rows, and the Triton-side
rounding helpers the fused kernels use (checked bit for bit against torch's casts)."""

import pytest
import torch
import triton
import triton.language as tl

from kiln.ops.common.launch import interpreting
from kiln.ops.common.quant import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_SCALE,
    dequantize_fp8,
    fp8_error_bound,
    quantize_fp8_per_channel,
    quantize_fp8_per_token,
    quantize_fp8_static,
    tl_quantize_fp8,
    tl_quantize_fp8_rcp,
    tl_round,
)


def _assert_within_bound(x, q, scale):
    err = (dequantize_fp8(q, scale) - x.float()).abs()
    bound = fp8_error_bound(x, scale)
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item():.3e}"


@pytest.mark.parametrize("shape", [(48, 100), (3, 40, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_channel_roundtrip_within_bound(shape, dtype):
    w = (torch.randn(shape) * torch.logspace(-3, 2, shape[-2]).unsqueeze(-1)).to(dtype)
    q, s = quantize_fp8_per_channel(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == w.shape[:-1]
    torch.testing.assert_close(s, w.float().abs().amax(-1) / FP8_MAX, rtol=1e-6, atol=0)
    # every row reaches the top of the e4m3 range exactly once scaled
    assert torch.all(q.float().abs().amax(-1) == FP8_MAX)
    _assert_within_bound(w, q, s)


def test_per_token_roundtrip_and_zero_row():
    x = torch.randn(6, 130) * 5
    x[2] = 0.0
    q, s = quantize_fp8_per_token(x)
    assert q.shape == x.shape and s.shape == (6, 1) and s.dtype == torch.float32
    assert s[2, 0].item() == pytest.approx(FP8_MIN_SCALE) and torch.all(q[2].float() == 0)
    assert torch.isfinite(q.float()).all()
    _assert_within_bound(x, q, s)


def test_static_saturates_and_bounds():
    x = torch.randn(4, 64) * 3
    scale = torch.tensor([0.01])  # 448 * 0.01 = 4.48: some values saturate
    q = quantize_fp8_static(x, scale)
    assert torch.isfinite(q.float()).all() and q.float().abs().max() == FP8_MAX
    inside = x.abs() <= FP8_MAX * scale
    err = (dequantize_fp8(q, scale) - x).abs()
    assert torch.all(err[inside] <= fp8_error_bound(x, scale)[inside])
    torch.testing.assert_close(dequantize_fp8(q, scale)[~inside].abs(), torch.full_like(x[~inside], 4.48))


def test_dequantize_per_channel_scale_broadcasts_over_k():
    w = torch.randn(8, 8)  # square: a wrong broadcast would go unnoticed by shape alone
    q, s = quantize_fp8_per_channel(w)
    torch.testing.assert_close(dequantize_fp8(q, s), q.float() * s[:, None])
    assert dequantize_fp8(q, s, torch.bfloat16).dtype == torch.bfloat16


def test_subnormal_bound():
    scale = torch.tensor([1.0])
    x = torch.linspace(-(2.0**-6), 2.0**-6, 1001)  # the subnormal range of e4m3
    _assert_within_bound(x, quantize_fp8_static(x, scale), scale)


@triton.jit
def _quant_kernel(X, S, Q, B, N, BLOCK: tl.constexpr, ROUND_IN_F32: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0)
    tl.store(Q + offs, tl_quantize_fp8(x, tl.load(S), ROUND_IN_F32), mask=mask)
    tl.store(B + offs, tl_round(x, tl.bfloat16, ROUND_IN_F32).to(tl.bfloat16), mask=mask)


# Under the interpreter the integer rounding is what makes the casts exact; compiled on a GPU both
# the hardware cast alone and the integer rounding must match torch.
_ROUND_MODES = [True] if interpreting() else [True, False]


@pytest.mark.parametrize("round_in_f32", _ROUND_MODES)
def test_triton_fp8_and_bf16_rounding_match_torch(round_in_f32):
    dev = "cpu" if interpreting() else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("compiled Triton needs a GPU; run under TRITON_INTERPRET=1 on CPU")
    # Every e4m3 value, the midpoints between neighbours (ties to even), their float32 neighbours,
    # values past the range (saturate) and random ones; scale 1 so the division is exact.
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mid, mid.nextafter(mid + 1), mid.nextafter(mid - 1), torch.tensor([500.0, -1e4])])
    x = torch.cat([x, torch.randn(2000) * 50, torch.randn(500) * 1e-3])
    x = x.to(dev)
    n = x.numel()
    q = torch.full((n,), float("nan"), dtype=FP8_DTYPE, device=dev)
    b = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=dev)
    _quant_kernel[(1,)](
        x, torch.ones(1, device=dev), q, b, n, BLOCK=triton.next_power_of_2(n), ROUND_IN_F32=round_in_f32
    )
    ref = x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(b.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


@triton.jit
def _quant_div_vs_rcp_kernel(X, S, QD, QR, N, BLOCK: tl.constexpr, ROUND_IN_F32: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0)
    s = tl.load(S)
    tl.store(QD + offs, tl_quantize_fp8(x, s, ROUND_IN_F32), mask=mask)
    tl.store(QR + offs, tl_quantize_fp8_rcp(x, s, tl.math.div_rn(1.0, s), ROUND_IN_F32), mask=mask)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's 3e38 / 1e-12
@pytest.mark.parametrize("round_in_f32", _ROUND_MODES)
@pytest.mark.parametrize("scale", [1.0, 0.02, 3.7 / 448, 1e-12, 123.456, 2.0**-20 * 3])
def test_reciprocal_quantize_matches_division_bit_for_bit(round_in_f32, scale):
    dev = "cpu" if interpreting() else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("compiled Triton needs a GPU; run under TRITON_INTERPRET=1 on CPU")
    g = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    s32 = torch.tensor([scale], dtype=torch.float32)
    # quotients on and next to the e4m3 ties (the cases a one-ulp error would flip), signed zeros,
    # overflowing values, random ones
    near = torch.cat([mid, mid.nextafter(mid + 1), mid.nextafter(mid - 1)]) * s32
    near = torch.cat([near, near.nextafter(near * 2), near.nextafter(torch.zeros_like(near))])
    x = torch.cat(
        [
            near,
            torch.tensor([0.0, -0.0, 3e38, -3e38, 1e-30, -1e-30]),
            torch.randn(3000, generator=g) * 200 * s32,
            torch.randn(500, generator=g) * 1e-3 * s32,
        ]
    ).to(dev)
    n = x.numel()
    qd = torch.empty(n, dtype=FP8_DTYPE, device=dev)
    qr = torch.empty(n, dtype=FP8_DTYPE, device=dev)
    _quant_div_vs_rcp_kernel[(1,)](
        x, s32.to(dev), qd, qr, n, BLOCK=triton.next_power_of_2(n), ROUND_IN_F32=round_in_f32
    )
    ref = (x / s32.to(dev)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    assert torch.equal(qd.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(qr.view(torch.uint8), ref.view(torch.uint8))
