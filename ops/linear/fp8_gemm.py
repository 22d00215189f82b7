"""FP8 GEMM in Triton: ``y [M, N] = (x [M, K] @ w [N, K]^T) * x_scale * w_scale (+ bias)``.

``fp8_gemm(x, x_scale, w, w_scale, bias, out_dtype)`` takes what ``fp8_linear`` takes (ops/linear/fp8_linear.py
routes there with ``KILN_FP8_GEMM=triton``):

* ``x``: ``[M, K]`` float8_e4m3fn, unit last stride; ``x_scale``: ``[M, 1]`` (per token) or ``[1]``
  (per tensor) float32;
* ``w``: ``[N, K]`` float8_e4m3fn, row-major (K-major, as Hopper's FP8 tensor cores want both
  operands); ``w_scale``: ``[N]`` float32 (per output channel);
* ``bias``: ``[N]`` (any float dtype) or None; ``out_dtype``: bf16, fp16 or fp32.

The product accumulates in float32; the epilogue scales by ``x_scale[m] * w_scale[n]``, adds the
bias and rounds once to ``out_dtype``, as ``torch._scaled_mm`` does (and ``fp8_linear_ref``, the
reference in torch). With ``fast_accum=False`` (this
function's default) the tensor cores' reduced-precision FP8 accumulation is promoted into the float32 accumulator after every ``BLOCK_K`` products (``max_num_imprecise_acc``);
``fast_accum=True`` (``KILN_FP8_FAST_ACCUM=1``, fp8_linear's default: its docstring has the measured
errors) leaves the promotion to the hardware (faster, less accurate over long K).

Kernel: one program per ``BLOCK_M x BLOCK_N`` output tile, ``GROUP_M`` row blocks side by side for
L2 reuse of ``w``; ``num_stages`` software pipelining of the K loop; operands through pointer loads
or (config ``tma``) TMA descriptors. (A stream-K variant, one even range of (tile, K step)
iterations per SM with last-arrival fix-up, measured 1.5-3x slower than the best tiles at M = 256 on
the H200, bench/results/2026-11-29_h200_fp8_sweep_streamk.json, and was removed.) Rows past ``M`` (and columns
past ``N``) re-read valid rows, so the operand loads carry no M/N masks; their results are not
stored. Split-K (``split_k > 1``, for small M, where the tiles alone do not fill the GPU): program
``(tile, s)`` covers K slice ``s`` and writes its float32 partial to a ``[split_k, M, N]``
workspace; a second kernel sums the slices in order (deterministic), then applies the epilogue, or
(config ``fused``) the last slice to arrive at a tile's counter does that itself.

Launch configuration: ``fp8_gemm_config(m, n, k)`` looks ``(M bucket, N, K)`` up in ``TABLE``
(measured entries, written as ``Fp8GemmConfig`` strings such as ``"m64n128k128g8w4s4k2"``), else
takes the bucket's default from ``BUCKET_DEFAULTS`` with split-K chosen so that the programs cover
the GPU's SMs. Every field can be overridden by keyword (``fp8_gemm(..., config=...)`` or
``fp8_gemm(..., block_n=256, split_k=2)``); ``bench/test_bench_fp8_linear.py::test_fp8_gemm_sweep``
times candidate configurations on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kiln.ops.common.launch import ArrivalCounters, grouped_tile, interpreting, sm_count
from kiln.ops.common.quant import FP8_DTYPE, tl_round

DEFAULT_SMS = 132  # H100/H200; used where no device can be asked (the interpreter)
REDUCE_BLOCK_M, REDUCE_BLOCK_N = 16, 256
# one per output tile of a fused split-K launch
COUNTERS = ArrivalCounters(1 << 12, "fp8_gemm's fused split-K", "the split-K reduce kernel")


@dataclasses.dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch parameters. ``split_k=0`` means automatic (see ``auto_split_k``)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    split_k: int = 1
    tma: bool = False  # operand tiles through TMA descriptors (else pointer loads)
    fused: bool = False  # split-K: the last-arriving slice sums the partials (else a second kernel)

    def __str__(self) -> str:
        return (
            f"m{self.block_m}n{self.block_n}k{self.block_k}g{self.group_m}"
            f"w{self.num_warps}s{self.num_stages}k{self.split_k}"
            f"{'t' if self.tma else ''}{'f' if self.fused else ''}"
        )

    @classmethod
    def parse(cls, text: str) -> Fp8GemmConfig:
        """The inverse of ``str``: ``"m64n128k128g8w4s4k2"`` (what the sweep records), with ``t``
        (TMA) and ``f`` (fused split-K reduction) appended when set: ``"m128n128k128g8w8s4k2tf"``."""
        m = re.fullmatch(r"m(\d+)n(\d+)k(\d+)g(\d+)w(\d+)s(\d+)k(\d+)(t?)(f?)", text.strip())
        if m is None:
            raise ValueError(f"fp8_gemm: bad config string {text!r} (want e.g. 'm64n128k128g8w4s4k2tf')")
        *ints, tma, fused = m.groups()
        block_m, block_n, block_k, group_m, num_warps, num_stages, split_k = (int(v) for v in ints)
        return cls(block_m, block_n, block_k, group_m, num_warps, num_stages, split_k, bool(tma), bool(fused))

    def check(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"fp8_gemm: {name} must be a power of two >= 16, got {v}")
        if self.block_k < 32:
            raise ValueError(f"fp8_gemm: block_k must be >= 32 (the FP8 MMA's K), got {self.block_k}")
        if self.group_m < 1 or self.num_stages < 1 or self.split_k < 0:
            raise ValueError(f"fp8_gemm: bad config {self!r}")
        if self.tma and max(self.block_m, self.block_n, self.block_k) > 256:
            raise ValueError(f"fp8_gemm: a TMA tile is at most 256 per dimension, got {self}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"fp8_gemm: num_warps must be a power of two <= 16, got {self.num_warps}")


# Largest M of each bucket (the last one is open-ended).
M_BUCKETS = (16, 64, 128, 256, 512, 1024, math.inf)

# Per bucket, when (bucket, N, K) has no TABLE entry. Unmeasured guesses: 64-row tiles (one
# warpgroup) up to 256 tokens, 128 x 128 tiles over two warpgroups above; automatic split-K up to 512.
BUCKET_DEFAULTS: dict[float, Fp8GemmConfig] = {
    16: Fp8GemmConfig(64, 64, 128, 8, 4, 4, 0),
    64: Fp8GemmConfig(64, 64, 128, 8, 4, 4, 0),
    128: Fp8GemmConfig(64, 128, 128, 8, 4, 4, 0),
    256: Fp8GemmConfig(64, 128, 128, 8, 4, 4, 0),
    512: Fp8GemmConfig(128, 128, 128, 8, 8, 4, 0),
    1024: Fp8GemmConfig(128, 128, 128, 8, 8, 4, 1),
    math.inf: Fp8GemmConfig(128, 128, 128, 8, 8, 4, 1),
}

# Measured winners, (M bucket, N, K) -> config string, from test_fp8_gemm_sweep on the H200 (fast
# accumulation, per launch in a chain of distinct weights; the fastest over
# bench/results/2026-11-29_h200_fp8_sweep_{tma,streamk,occupancy}.json; every entry is in SWEEP_CONFIGS).
# fp8_linear's ``auto`` backend runs the Triton kernel exactly where this has an entry.
TABLE: dict[tuple[float, int, int], str] = {
    (256, 4096, 4096): "m64n64k128g8w4s5k1t",
    (256, 6144, 4096): "m64n64k128g8w4s4k1t",
    (256, 14336, 4096): "m128n256k128g8w8s3k1t",
    (256, 4096, 14336): "m64n128k128g8w4s4k2tf",
    (512, 4096, 4096): "m64n128k128g8w4s4k1t",
    (512, 6144, 4096): "m64n128k128g8w4s3k1t",
    (512, 14336, 4096): "m128n256k128g8w8s3k1t",
    (512, 4096, 14336): "m128n128k128g8w8s4k1t",
}


# Candidates bench/test_bench_fp8_linear.py::test_fp8_gemm_sweep times (and checks against the
# float32 reference) at M = 256 and 512 and Llama-3.1-8B's N, K, for filling TABLE. First the best
# of the TMA / fused split-K sweep (bench/results/2026-11-29_h200_fp8_sweep_tma.json). That sweep
# showed that what counts at M = 256 is how many programs fit on an SM at once (shared memory per
# program = stages x (BLOCK_M + BLOCK_N) x BLOCK_K bytes, 227 KB per SM): the tiles must fill the
# 132 SMs in one balanced wave. So the rest are small tiles with few stages, 3 to 7 programs per SM.
SWEEP_CONFIGS = (
    "m64n64k128g8w4s5k1t", "m64n128k128g8w4s5k1t", "m64n128k128g8w4s4k1t", "m128n64k128g8w4s4k1t",
    "m128n256k128g8w8s3k1t", "m64n128k128g8w4s4k2tf", "m128n128k128g8w8s4k1t", "m128n128k128g8w8s4k2tf",
    "m64n64k128g8w4s3k1t", "m64n64k128g8w4s4k1t", "m64n64k128g8w4s2k1t", "m64n64k256g8w4s2k1t",
    "m64n64k256g8w4s3k1t", "m64n128k128g8w4s2k1t", "m64n128k256g8w4s2k1t", "m64n64k128g8w4s3k2tf",
    "m64n64k128g8w4s4k2tf", "m64n128k128g8w4s2k2tf", "m64n128k128g8w4s3k1t",
)  # fmt: skip


def m_bucket(m: int) -> float:
    return next(b for b in M_BUCKETS if m <= b)


def warmup_tokens(max_tokens: int) -> list[int]:
    """One token count per M bucket up to ``max_tokens`` (the bucket's top, capped): running an FP8
    model at each compiles every launch config its linears can pick (M is not specialized)."""
    return sorted({min(int(b), max_tokens) for b in M_BUCKETS if b != math.inf} | {max_tokens})


def tuned(m: int, n: int, k: int) -> bool:
    """Whether ``TABLE`` holds a measured config for this product (fp8_linear's ``auto`` backend)."""
    return (m_bucket(m), n, k) in TABLE


def tma_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether TMA descriptors can describe both operands: 16-byte aligned bases and row strides
    (K a multiple of 16 for FP8). Configs with ``tma`` fall back to pointer loads otherwise."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in (x, w))


def num_sms(device: torch.device) -> int:
    return sm_count(device, DEFAULT_SMS)


def auto_split_k(m: int, n: int, k: int, cfg: Fp8GemmConfig, sms: int = DEFAULT_SMS) -> int:
    """Double split-K while the programs still fit in one wave on ``sms`` SMs and every slice keeps at
    least 4 ``BLOCK_K`` steps (at most 8 slices)."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    k_blocks = triton.cdiv(k, cfg.block_k)
    split = 1
    while split < 8 and tiles * split * 2 <= sms and k_blocks >= 4 * split * 2:
        split *= 2
    return split


@functools.cache
def _parsed(entry: str) -> Fp8GemmConfig:
    """A TABLE entry parsed once (fp8_linear looks its config up on every call)."""
    return Fp8GemmConfig.parse(entry)


def fp8_gemm_config(
    m: int, n: int, k: int, sms: int = DEFAULT_SMS, config: Fp8GemmConfig | None = None, **overrides: Any
) -> Fp8GemmConfig:
    """The launch configuration for an ``[m, k] x [n, k]^T`` product (see the module docstring):
    ``config`` if given, else ``TABLE[(bucket, n, k)]``, else ``BUCKET_DEFAULTS[bucket]``; then the
    keyword ``overrides`` (field names of ``Fp8GemmConfig``); then ``split_k=0`` resolved."""
    if config is None:
        bucket = m_bucket(m)
        entry = TABLE.get((bucket, n, k))
        config = _parsed(entry) if entry is not None else BUCKET_DEFAULTS[bucket]
    if overrides:
        config = dataclasses.replace(config, **overrides)
    if config.split_k == 0:
        config = dataclasses.replace(config, split_k=auto_split_k(m, n, k, config, sms))
    config.check()
    return config


# ---- Triton kernels -------------------------------------------------------------------------------


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, C, A_SCALE, B_SCALE, BIAS, stride_cm, stride_as, HAS_BIAS: tl.constexpr, RF: tl.constexpr):  # fmt: skip
    """float32 ``acc [BM, BN]`` * row scale * column scale (+ bias) -> ``C`` (rounded once)."""
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_s = tl.load(A_SCALE + offs_m * stride_as, mask=m_mask, other=0.0)  # [BM]
    b_s = tl.load(B_SCALE + offs_n, mask=n_mask, other=0.0)  # [BN]
    y = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        y += tl.load(BIAS + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ty = C.dtype.element_ty
    c_ptrs = C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, tl_round(y, out_ty, RF).to(out_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _mma(a, b, acc, FAST_ACCUM: tl.constexpr, UPCAST: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc += a [BM, BK] @ b [BK, BN]`` (FP8; float32 in the interpreter)."""
    if UPCAST:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif FAST_ACCUM:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    A,  # [M, K] fp8, unit last stride
    B,  # [N, K] fp8, unit last stride
    A_DESC,  # TMA descriptor of A, block [BLOCK_M, BLOCK_K] (TMA), else None
    B_DESC,  # TMA descriptor of B, block [BLOCK_N, BLOCK_K] (TMA), else None
    C,  # [M, N] out
    A_SCALE,  # [M] f32 (stride_as 1) or [1] (stride_as 0)
    B_SCALE,  # [N] f32
    BIAS,  # [N] or a dummy
    P,  # [SPLIT_K, M, N] f32 partials (SPLIT_K > 1) or a dummy
    CNT,  # [>= tiles] int32 arrival counters, all zero (FUSED) or a dummy
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_as,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FUSED: tl.constexpr,  # SPLIT_K > 1: the last slice to arrive sums the partials and stores C
    TMA: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks (pointer loads)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FAST_ACCUM: tl.constexpr,  # False: promote the FP8 MMA accumulation every BLOCK_K products
    UPCAST: tl.constexpr,  # interpreter: multiply in float32 (exact for e4m3 products)
    ROUND_IN_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_m, num_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)  # BLOCK_K steps per slice
    k_lo = pid_k * steps * BLOCK_K
    k_hi = tl.minimum(k_lo + steps * BLOCK_K, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TMA:  # out-of-bounds rows and K columns of a tile load as zeros
        for k in range(k_lo, k_hi, BLOCK_K):
            a = A_DESC.load([pid_m * BLOCK_M, k])  # [BM, BK]
            b = B_DESC.load([pid_n * BLOCK_N, k])  # [BN, BK]
            acc = _mma(a, b.T, acc, FAST_ACCUM, UPCAST, BLOCK_K)
    else:
        rows_a = (offs_m % M).to(tl.int64)  # rows past M re-read valid ones (results not stored)
        rows_b = (offs_n % N).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = A + rows_a[:, None] * stride_am + (k_lo + offs_k)[None, :]  # [BM, BK]
        b_ptrs = B + rows_b[None, :] * stride_bn + (k_lo + offs_k)[:, None]  # [BK, BN], K-major
        for k in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=(k + offs_k)[None, :] < K, other=0.0)
                b = tl.load(b_ptrs, mask=(k + offs_k)[:, None] < K, other=0.0)
            acc = _mma(a, b, acc, FAST_ACCUM, UPCAST, BLOCK_K)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    if SPLIT_K == 1:
        _epilogue(acc, offs_m, offs_n, M, N, C, A_SCALE, B_SCALE, BIAS, stride_cm, stride_as, HAS_BIAS, ROUND_IN_F32)  # fmt: skip
    else:
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        part = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]  # [BM, BN] within a slice
        slice_size = M.to(tl.int64) * N
        tl.store(P + pid_k * slice_size + part, acc, mask=mask)
        if FUSED:
            # Last-arrival reduction, the ordering argument of ops/common/launch.py ArrivalCounters:
            # bar.sync + the atomic's gpu-scope release publish this CTA's partial; the
            # slice that reads old == SPLIT_K - 1 acquires all of them, loads them with .cg (L1 is
            # not coherent across SMs), resets the counter and sums the slices in order 0..S-1,
            # the separate reduce kernel's order, so both paths give the same bits.
            tl.debug_barrier()
            old = tl.atomic_add(CNT + pid, 1, sem="acq_rel", scope="gpu")
            if old == SPLIT_K - 1:
                tl.atomic_xchg(CNT + pid, 0, sem="relaxed", scope="gpu")
                tot = tl.load(P + part, mask=mask, other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):
                    tot += tl.load(P + s * slice_size + part, mask=mask, other=0.0, cache_modifier=".cg")
                _epilogue(tot, offs_m, offs_n, M, N, C, A_SCALE, B_SCALE, BIAS, stride_cm, stride_as, HAS_BIAS, ROUND_IN_F32)  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _splitk_reduce_kernel(
    P, C, A_SCALE, B_SCALE, BIAS, M, N, stride_cm, stride_as,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROUND_IN_F32: tl.constexpr,
):  # fmt: skip
    """Sum the ``SPLIT_K`` float32 partials in order, then the epilogue."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptrs = P + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    slice_size = M.to(tl.int64) * N
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ptrs + s * slice_size, mask=mask, other=0.0)
    _epilogue(acc, offs_m, offs_n, M, N, C, A_SCALE, B_SCALE, BIAS, stride_cm, stride_as, HAS_BIAS, ROUND_IN_F32)  # fmt: skip


# ---- launcher -------------------------------------------------------------------------------------


def fp8_gemm(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, *, fast_accum: bool = False,
             config: Fp8GemmConfig | None = None, **overrides: Any) -> torch.Tensor:  # fmt: skip
    """``[M, K] fp8 x [N, K] fp8 -> [M, N]`` ``out_dtype`` with the Triton kernel (see the module
    docstring; arguments as ``fp8_linear`` checks them). ``config`` / ``overrides``: see
    ``fp8_gemm_config``. Launches on CUDA, or in the interpreter (``TRITON_INTERPRET=1``)."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"fp8_gemm: need x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_gemm: x and w must be {FP8_DTYPE}, got {x.dtype} and {w.dtype}")
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:  # nothing to multiply: the bias alone
        y.copy_((bias.float() if bias is not None else torch.zeros(n, device=x.device)).expand(m, n))
        return y
    cfg = fp8_gemm_config(m, n, k, num_sms(x.device), config, **overrides)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    xs = x_scale.reshape(-1)
    stride_as = xs.stride(0) if xs.numel() > 1 else 0
    ws = w_scale.reshape(-1).contiguous()
    b = bias.contiguous() if bias is not None else ws
    interp = interpreting()
    split = cfg.split_k
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    counters = COUNTERS.get(x.device, tiles) if split > 1 and cfg.fused else None
    a_desc = b_desc = None
    if cfg.tma and tma_ok(x, w):
        a_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [cfg.block_m, cfg.block_k])
        b_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [cfg.block_n, cfg.block_k])
    _fp8_gemm_kernel[(tiles, split)](
        x, w, a_desc, b_desc, y, xs, ws, b, part, counters if counters is not None else xs,
        m, n, k, x.stride(0), w.stride(0), y.stride(0), stride_as,
        HAS_BIAS=bias is not None, SPLIT_K=split, FUSED=counters is not None, TMA=a_desc is not None,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        FAST_ACCUM=fast_accum, UPCAST=interp, ROUND_IN_F32=interp,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1 and counters is None:
        _splitk_reduce_kernel[(triton.cdiv(m, REDUCE_BLOCK_M), triton.cdiv(n, REDUCE_BLOCK_N))](
            part, y, xs, ws, b, m, n, y.stride(0), stride_as,
            HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK_M=REDUCE_BLOCK_M, BLOCK_N=REDUCE_BLOCK_N,
            ROUND_IN_F32=interp, num_warps=4,
        )  # fmt: skip
    return y
