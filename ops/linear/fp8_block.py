"""Block-scaled FP8 linear (the DeepSeek-V3 / Hugging Face ``fp8`` "fine-grained" format, W8A8).

Op ``torch.ops.kiln.fp8_block_linear(x, w, w_scale, bias) -> y [M, N]`` (dtype of ``x``):

* ``x``: ``[M, K]`` bf16, fp16 or fp32 activations, quantized here per token per 128-column group;
* ``w``: ``[N, K]`` float8_e4m3fn; ``w_scale``: ``[ceil(N/128), ceil(K/128)]`` float32, one
  dequantization factor per 128 x 128 block: ``W[i, j] = w[i, j] * w_scale[i // 128, j // 128]``
  (a checkpoint's ``weight_scale_inv``, which despite its name multiplies);
* ``bias``: ``[N]`` (any float dtype) or None.

Activations (``quantize_fp8_groups``): for each token ``t`` and group ``g`` (columns ``128 g ..
128 g + 127``, the last one ragged when ``K % 128``) ``xs[t, g] = max(amax / 448, FP8_MIN_SCALE)``
and ``xq = saturate(x / xs)`` rounded to nearest even (ops/common/quant.py's convention, per group).
Then ``y[t, n] = sum_g xs[t, g] * w_scale[n // 128, g] * sum_{k in g} xq[t, k] * w[n, k] + bias[n]``,
rounded once to ``x``'s dtype. The reference (``fp8_block_linear_ref``: the CPU path, the fake and
the tests' oracle) computes exactly that: both operands dequantized to float32 and one float32
matmul (so it differs from the kernel only in float32 summation order).

Kernel (``_fp8_block_kernel``): one program per ``BLOCK_M x BLOCK_N`` output tile (``GROUP_M`` row
blocks side by side), the K loop in steps of one 128-column group: the FP8 dot of the step starts
from zero and is added to the float32 accumulator times the token's group scale and the weight
block's scale (the promotion into float32 every 128 products that DeepSeek-V3 describes). Two
ways to get ``xq``, a launch-config field (``Fp8BlockConfig.prequant``):

* on the fly (``prequant=False``): each program loads its ``[BLOCK_M, 128]`` slice of ``x`` and
  quantizes it (amax, scale, divide, round) before the dot: no extra kernel, no FP8 copy of ``x``,
  but every N tile repeats the quantization of its rows. Chosen up to ``PREQUANT_MIN_M - 1``
  tokens, where the product is bound by reading the weight and the repeated work is hidden.
* pre-quantized (``prequant=True``): ``_quant_groups_kernel`` writes ``xq [M, K]`` fp8 and ``xs
  [M, ceil(K/128)]`` first (bit for bit ``quantize_fp8_groups``), then the GEMM loads FP8 tiles (half
  the bytes of a bf16 tile) and one scale per row and step. Chosen from ``PREQUANT_MIN_M`` tokens,
  where the GEMM is compute-bound and per-tile quantization would cost tensor-core time.

The threshold and the tile sizes of ``BUCKETS`` are first guesses, not measured yet:
``bench/test_bench_fp8_block.py`` times both ways (``block_on_the_fly``, ``block_prequant``) at Llama-3.1-8B and
DeepSeek-V3 shapes on a GPU to set them. Small M also splits K (``split_k``, while the tiles do not
fill the SMs): each slice writes a float32 partial and ``_splitk_reduce_kernel`` sums them in order
(deterministic), adds the bias and rounds. Rows past ``M`` and columns past ``N`` re-read valid ones
(results not stored); ragged K groups load zeros. Under the Triton interpreter the FP8 products
run in float32 (exact for e4m3 operands) and roundings follow ``tl_round`` / ``round_e4m3_in_f32``.

Also here, shared with ``kiln.weights`` (pack-time block quantization) and the tests:
``quantize_fp8_block`` / ``dequantize_fp8_block`` (weights ``[..., N, K]`` per 128 x 128 block) and
``quantize_fp8_groups`` (activations per token per 128 columns).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.ops.common.launch import (
    capability,
    grouped_tile,
    interpreting,
    pdl_args,
    pdl_trigger,
    pdl_wait,
    sm_count,
)
from kiln.ops.common.op import kiln_op
from kiln.ops.common.quant import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_SCALE,
    amax_scale,
    tl_dynamic_scale,
    tl_quantize_fp8,
    tl_round,
)

BLOCK = 128  # the weight block (both dims) and the activation group: the only size served
DEFAULT_SMS = 132  # H100/H200; where no device can be asked (the interpreter)
PREQUANT_MIN_M = 65  # from this many tokens x is quantized by its own kernel first (module docstring)
QUANT_GROUPS = 16  # (token, 128-column group) pairs one program of _quant_groups_kernel quantizes
REDUCE_BLOCK_M, REDUCE_BLOCK_N = 16, 256


# ---- torch: quantization helpers and the reference ------------------------------------------------


def block_grid(n: int, k: int) -> tuple[int, int]:
    """``(ceil(n / 128), ceil(k / 128))``: the scale shape of an ``[n, k]`` weight."""
    return -(-n // BLOCK), -(-k // BLOCK)


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block weight quantization: ``w [..., N, K]`` (any float dtype) -> ``(w_fp8 [..., N, K]
    float8_e4m3fn, scale [..., ceil(N/128), ceil(K/128)] float32)`` with ``scale = max(block amax /
    448, FP8_MIN_SCALE)`` and ``w ≈ dequantize_fp8_block(w_fp8, scale)`` within one e4m3 rounding."""
    if w.dim() < 2:
        raise ValueError(f"quantize_fp8_block: w must be [..., N, K], got shape {tuple(w.shape)}")
    *lead, n, k = w.shape
    sn, sk = block_grid(n, k)
    wf = F.pad(w.float(), (0, sk * BLOCK - k, 0, sn * BLOCK - n))
    blocks = wf.reshape(*lead, sn, BLOCK, sk, BLOCK)
    scale = amax_scale(blocks.abs().amax(dim=(-3, -1)))  # [..., sn, sk]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(*lead, sn * BLOCK, sk * BLOCK)[..., :n, :k].contiguous(), scale


def expand_block_scale(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``scale [..., ceil(n/128), ceil(k/128)]`` repeated over its blocks: ``[..., n, k]`` float32."""
    s = scale.float().repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return s[..., :n, :k]


def dequantize_fp8_block(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w [..., N, K]`` fp8 times its block scales ``[..., ceil(N/128), ceil(K/128)]`` -> float32."""
    n, k = w.shape[-2:]
    if tuple(scale.shape) != (*w.shape[:-2], *block_grid(n, k)):
        raise ValueError(
            f"dequantize_fp8_block: scale must be {[*w.shape[:-2], *block_grid(n, k)]} for a weight of "
            f"shape {list(w.shape)}, got {list(scale.shape)}"
        )
    return w.float() * expand_block_scale(scale, n, k)


def quantize_fp8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization per token per 128-column group: ``x [M, K]`` -> ``(xq [M, K]
    float8_e4m3fn, xs [M, ceil(K/128)] float32)``, ``xs = max(group amax / 448, FP8_MIN_SCALE)``,
    ``xq = saturate(x / xs)`` rounded to nearest even; the last group may be ragged."""
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_groups: x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    kb = -(-k // BLOCK)
    g = F.pad(x.float(), (0, kb * BLOCK - k)).reshape(m, kb, BLOCK)
    xs = amax_scale(g.abs().amax(dim=-1))  # [M, KB]
    xq = (g / xs[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(m, kb * BLOCK)[:, :k]
    return xq, xs


def fp8_block_linear_ref(x, w, w_scale, bias) -> torch.Tensor:
    """What the kernel computes (module docstring), in plain torch: ``x`` quantized per token and
    group, both operands dequantized to float32, one float32 matmul, the bias, one rounding to
    ``x``'s dtype. The op on CPU, its fake and the tests' oracle."""
    n, k = w.shape
    xq, xs = quantize_fp8_groups(x)
    xd = xq.float() * xs.repeat_interleave(BLOCK, dim=-1)[:, :k]  # [M, K]
    y = xd @ (w.float() * expand_block_scale(w_scale, n, k)).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---- launch configuration -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fp8BlockConfig:
    """Launch parameters of ``_fp8_block_kernel``. ``split_k=0``: automatic (``auto_split_k``)."""

    block_m: int = 64
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    prequant: bool = False  # quantize x by its own kernel first (else in the GEMM's K loop)

    def check(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"fp8_block_linear: {name} must be a power of two >= 16, got {v}")
        if self.group_m < 1 or self.num_stages < 1 or self.split_k < 0:
            raise ValueError(f"fp8_block_linear: bad config {self!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"fp8_block_linear: num_warps must be a power of two <= 16, got {self.num_warps}"
            )


# (largest M of the bucket, its config). Up to 64 tokens one M tile (the bucket's top), automatic
# split-K; then pre-quantized activations. Unmeasured first guesses (module docstring).
BUCKETS: tuple[tuple[float, Fp8BlockConfig], ...] = (
    (16, Fp8BlockConfig(16, 128, 8, 4, 3, 0, False)),
    (32, Fp8BlockConfig(32, 128, 8, 4, 3, 0, False)),
    (PREQUANT_MIN_M - 1, Fp8BlockConfig(64, 128, 8, 4, 3, 0, False)),
    (256, Fp8BlockConfig(64, 128, 8, 4, 3, 1, True)),
    (math.inf, Fp8BlockConfig(128, 128, 8, 8, 3, 1, True)),
)


def auto_split_k(m: int, n: int, k: int, cfg: Fp8BlockConfig, sms: int = DEFAULT_SMS) -> int:
    """Double split-K while the programs still fit in one wave on ``sms`` SMs and every slice keeps at
    least 4 K groups (at most 8 slices)."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    groups = triton.cdiv(k, BLOCK)
    split = 1
    while split < 8 and tiles * split * 2 <= sms and groups >= 4 * split * 2:
        split *= 2
    return split


def block_config(
    m: int, n: int, k: int, sms: int = DEFAULT_SMS, config: Fp8BlockConfig | None = None
) -> Fp8BlockConfig:
    """The launch configuration for ``[m, k] x [n, k]^T``: ``config`` if given, else the ``BUCKETS``
    entry of ``m``; ``split_k=0`` resolved."""
    cfg = config if config is not None else next(c for top, c in BUCKETS if m <= top)
    if cfg.split_k == 0:
        cfg = dataclasses.replace(cfg, split_k=auto_split_k(m, n, k, cfg, sms))
    cfg.check()
    return cfg


def warmup_tokens(max_tokens: int) -> list[int]:
    """One token count per ``BUCKETS`` entry up to ``max_tokens``: running a block-FP8 model at each
    compiles every kernel specialization its linears can launch (M is not specialized; within a
    bucket of one M tile the split is fixed by N and K)."""
    return sorted({min(int(top), max_tokens) for top, _ in BUCKETS if top != math.inf} | {max_tokens})


# ---- Triton kernels -------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _quant_groups_kernel(
    X, Q, S, M, K, KB, stride_x, stride_q, stride_s,
    GROUPS: tl.constexpr, G: tl.constexpr, MIN_SCALE: tl.constexpr, RF: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program ``j``: the ``GROUPS`` (token, 128-column group) pairs ``j * GROUPS ..`` in row-major
    order (pair ``p`` is row ``p // KB``, group ``p % KB``) -> ``Q`` fp8 and ``S`` scales."""
    pdl_trigger(PDL)
    pdl_wait(PDL)
    pairs = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
    row, grp = pairs // KB, pairs % KB
    cols = grp[:, None] * G + tl.arange(0, G)[None, :]  # [GROUPS, G]
    mask = (pairs < M * KB)[:, None] & (cols < K)
    x = tl.load(X + row[:, None] * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl_dynamic_scale(tl.max(tl.abs(x), axis=1), MIN_SCALE)  # [GROUPS]
    tl.store(Q + row[:, None] * stride_q + cols, tl_quantize_fp8(x, s[:, None], RF), mask=mask)
    tl.store(S + row * stride_s + grp, s, mask=pairs < M * KB)


@triton.jit(do_not_specialize=["M"])
def _fp8_block_kernel(
    X,  # [M, K]: the activation (PREQUANT: its fp8 values), unit last stride
    XS,  # PREQUANT: [M, KB] f32 group scales, else a dummy
    W,  # [N, K] fp8, unit last stride
    WS,  # [NB, KB] f32 block scales
    BIAS,  # [N] or a dummy
    Y,  # [M, N] out (SPLIT_K == 1), or a dummy
    P,  # [SPLIT_K, M, N] f32 partials (SPLIT_K > 1), or a dummy
    M, N, K, KB,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ym,
    HAS_BIAS: tl.constexpr,
    PREQUANT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    G: tl.constexpr,  # the 128-column group: BLOCK_K
    GROUP_M: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: multiply in float32 (exact for e4m3 products)
    RF: tl.constexpr,  # interpreter: round in float32 (tl_round, round_e4m3_in_f32)
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_trigger(PDL)
    pdl_wait(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_m, num_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_x = (offs_m % M).to(tl.int64)  # rows past M re-read valid ones (results not stored)
    rows_w = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, G)
    ws_ptrs = WS + (rows_w // G) * stride_wsn  # [BN]: each column's block row of scales
    steps = tl.cdiv(KB, SPLIT_K)
    kb_lo = pid_k * steps
    kb_hi = tl.minimum(kb_lo + steps, KB)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        k = kb * G + offs_k
        kmask = k < K
        w = tl.load(W + rows_w[None, :] * stride_wn + k[:, None], mask=kmask[:, None], other=0.0)  # [G, BN]
        x_ptrs = X + rows_x[:, None] * stride_xm + k[None, :]  # [BM, G]
        if PREQUANT:
            a = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
            xs = tl.load(XS + rows_x * stride_xsm + kb)  # [BM]
        else:
            xf = tl.load(x_ptrs, mask=kmask[None, :], other=0.0).to(tl.float32)
            xs = tl_dynamic_scale(tl.max(tl.abs(xf), axis=1), MIN_SCALE)  # [BM]
            a = tl_quantize_fp8(xf, xs[:, None], RF)
        ws = tl.load(ws_ptrs + kb)  # [BN]
        if UPCAST:
            part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, w)  # FP8 MMA, float32 out; promoted below every group
        acc += part * xs[:, None] * ws[None, :]
    m_mask = offs_m < M
    n_mask = offs_n < N
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ty = Y.dtype.element_ty
        y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, tl_round(acc, out_ty, RF).to(out_ty), mask=mask)
    else:
        part_ptrs = P + pid_k * (M.to(tl.int64) * N) + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _splitk_reduce_kernel(
    P, Y, BIAS, M, N, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RF: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Sum the ``SPLIT_K`` float32 partials in order, add the bias, round once to ``Y``'s dtype."""
    pdl_trigger(PDL)
    pdl_wait(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    mask = (offs_m < M)[:, None] & n_mask[None, :]
    ptrs = P + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    slice_size = M.to(tl.int64) * N
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ptrs + s * slice_size, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ty = Y.dtype.element_ty
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, tl_round(acc, out_ty, RF).to(out_ty), mask=mask)


# ---- launch ---------------------------------------------------------------------------------------


def quantize_fp8_groups_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8_groups`` with ``_quant_groups_kernel`` (CUDA, or the interpreter); bit for bit
    the torch function. ``x`` ``[M, K]`` with a unit last stride."""
    m, k = x.shape
    kb = -(-k // BLOCK)
    xq = x.new_empty((m, k), dtype=FP8_DTYPE)
    xs = x.new_empty((m, kb), dtype=torch.float32)
    if m and k:
        _quant_groups_kernel[(triton.cdiv(m * kb, QUANT_GROUPS),)](
            x, xq, xs, m, k, kb, x.stride(0), xq.stride(0), xs.stride(0),
            GROUPS=QUANT_GROUPS, G=BLOCK, MIN_SCALE=FP8_MIN_SCALE, RF=interpreting(), num_warps=4,
            **pdl_args(x),
        )  # fmt: skip
    return xq, xs


def block_kernel_supported(x: torch.Tensor) -> str | None:
    """None if the Triton kernels can run on ``x``'s device, else why not."""
    if not x.is_cuda:
        return None  # the interpreter (use_triton decided)
    cap = capability(x.device)
    if cap < (8, 9):
        return f"FP8 tensor-core dots need compute capability >= 8.9, this GPU is {cap[0]}.{cap[1]}"
    return None


_warned: set[str] = set()


def _check(x, w, w_scale, bias) -> None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_block_linear: x must be [M, K] bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    if w.dim() != 2 or w.dtype != FP8_DTYPE or w.shape[1] != x.shape[1]:
        raise ValueError(
            f"fp8_block_linear: w must be [N, K={x.shape[1]}] {FP8_DTYPE}, got {tuple(w.shape)} {w.dtype}"
        )
    grid = block_grid(*w.shape)
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != grid:
        raise ValueError(
            f"fp8_block_linear: w_scale must be [{grid[0]}, {grid[1]}] float32 (one per 128 x 128 block of "
            f"w), got {tuple(w_scale.shape)} {w_scale.dtype}"
        )
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"fp8_block_linear: bias must be [N={w.shape[0]}], got {tuple(bias.shape)}")


@kiln_op("fp8_block_linear", ref=fp8_block_linear_ref, check=_check)
def fp8_block_linear_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    config: Fp8BlockConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] -> [M, N]`` (``x``'s dtype) through the block-scaled FP8 kernel (module docstring);
    ``config``: a launch configuration instead of ``BUCKETS``' (benchmarks). Before compute capability
    8.9 the reference, with a one-time warning."""
    m, k = x.shape
    n = w.shape[0]
    why = block_kernel_supported(x)
    if why is not None:
        if why not in _warned:
            _warned.add(why)
            warnings.warn(f"fp8_block_linear: {why}; using the slow float32 reference.", stacklevel=2)
        return fp8_block_linear_ref(x, w, w_scale, bias)
    y = x.new_empty((m, n))
    if m == 0 or n == 0:
        return y
    if k == 0:  # nothing to multiply: the bias alone
        return y.copy_(bias.expand(m, n)) if bias is not None else y.zero_()
    cfg = block_config(m, n, k, sm_count(x.device, DEFAULT_SMS), config)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    ws = w_scale.contiguous()
    kb = -(-k // BLOCK)
    if cfg.prequant:
        a, xs = quantize_fp8_groups_triton(x)
    else:
        a, xs = x, ws  # xs unused
    b = bias.contiguous() if bias is not None else ws
    interp = interpreting()
    split = cfg.split_k
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    pdl = pdl_args(x)
    _fp8_block_kernel[(tiles, split)](
        a, xs, w, ws, b, y, part, m, n, k, kb,
        a.stride(0), xs.stride(0), w.stride(0), ws.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, PREQUANT=cfg.prequant, SPLIT_K=split, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, G=BLOCK, GROUP_M=cfg.group_m, MIN_SCALE=FP8_MIN_SCALE, UPCAST=interp, RF=interp,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )  # fmt: skip
    if split > 1:
        _splitk_reduce_kernel[(triton.cdiv(m, REDUCE_BLOCK_M), triton.cdiv(n, REDUCE_BLOCK_N))](
            part, y, b, m, n, y.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK_M=REDUCE_BLOCK_M, BLOCK_N=REDUCE_BLOCK_N,
            RF=interp, num_warps=4, **pdl,
        )  # fmt: skip
    return y
