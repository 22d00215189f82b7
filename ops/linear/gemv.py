"""Skinny GEMM (GEMV) for decode: ``y [M, N] = x [M, K] @ W [N, K]^T (+ bias)`` with ``M`` small.

At batch 1..8 a linear layer is a pass over its weight: the kernel's only job is to stream ``W``
at HBM bandwidth. Each program owns ``BLOCK_N`` rows of ``W`` (and, with split-K, one slice of
``K``), walks ``K`` in ``BLOCK_K`` chunks with 16-byte vector loads, and applies every chunk to all
``M`` rows of ``x`` at once, so ``W`` is read exactly once. Accumulation is float32; the output is
rounded once to the activation dtype (as cuBLAS does), or kept in float32 (``out_dtype``: a float32
MoE router, ops/moe/router.py).

Ops (``torch.ops.kiln.*``); ``x [T, K]`` and ``w [N, K]`` of one dtype (bf16, fp16 or fp32), ``w``
row-major, ``bias [N]`` or None:

* ``linear(x, w, bias, max_m) -> [T, N]``: what ``compiler/layers.py: Linear`` calls for non-FP8
  weights whose role is in the GEMV plan. The GEMV kernel when ``1 <= T <= max_m`` on a device
  that runs Triton, ``torch.nn.functional.linear`` (cuBLAS) otherwise. The choice is made in the op
  body at call time, so one exported graph with a dynamic T serves prefill (cuBLAS) and decode
  (GEMV); ``max_m`` is a constant of the call site in the graph.
* ``linear_silu_mul(x, w, bias, max_m) -> [T, I]``: ``w`` is ``[2I, K]`` with the gate rows ``[0, I)``
  and the up rows ``[I, 2I)`` (the packed ``mlp.gate_up.weight``). ``silu(gate) * up`` with the
  roundings of ``linear`` followed by ``silu_and_mul`` (gate and up rounded to the activation
  dtype, silu in float32 rounded, product rounded). Small T: one GEMV whose programs load the
  matching gate and up rows and write the activation directly; otherwise ``F.linear`` then
  ``silu_and_mul``.

Switches: the GEMV plan (``gemv_plan``) says, per linear role (``attn``: qkv and o; ``mlp``:
gate_up and down; ``router``: the MoE router, compiler/moe_layer.py), up to which T a decode call
takes the GEMV (and, in the folded batch-1 graph, runs the RMSNorm in front of qkv, gate_up and
the router inside that GEMV: ops/linear/norm_linear.py). ``kiln compile --gemv-plan``
(``CompileOptions.gemv_plan``: ``0``, ``1``/``all``, or ``attn:1,mlp:2``-style lists; default
``DEFAULT_PLAN``) sets it; the model build passes it to the layers, the roles left out trace plain
``aten.linear`` (cuBLAS), the others ``kiln::linear`` with their ``max_m``, and the manifest records
the plan (``kernel_choices.gemv_plan``). At run time (read at call time, so at CUDA-graph capture for
decode graphs) the ``gemv`` setting off (``--no-gemv``, ``EngineOptions.gemv``, ``KILN_GEMV=0``:
kiln/settings.py) sends every call to cuBLAS. On CPU the ops run cuBLAS's stand-in ``F.linear``
unless ``KILN_TRITON_ON_CPU=1`` with ``TRITON_INTERPRET=1`` (ops/common/launch.py), so CPU artifacts are
unchanged.

Kernels, picked by ``use_dot``:

* ``_gemv_fma_kernel`` (CUDA cores; default for ``M <= 2``, takes ``M <= 4``): the W tile is
  loaded as ``[BLOCK_N, BLOCK_K / VEC, VEC]`` (``VEC`` elements = one 16-byte load per thread);
  each x row keeps a ``[BLOCK_N, BLOCK_K / VEC]`` float32 accumulator, summed inside each thread
  per step; the cross-thread reduction happens once, after the K loop. x is loaded through
  pointers of the W tile's shape (broadcast over rows) so it arrives in the same register layout
  (repeat loads hit L1) and the loop has no layout conversion. There is no software pipeline on
  this path: bytes in flight are one step's loads times the resident programs.
* ``_gemv_dot_kernel`` (tensor cores; default for ``M >= 3``): swap-AB, ``acc [BLOCK_N, 16] +=
  W_tile @ x_tile^T`` with x padded to 16 rows (mma.sync below 64 W rows, wgmma from 64); the W
  tiles go through Triton's multi-stage cp.async pipeline (``num_stages``). The padded rows cost
  tensor-core time only, which is plentiful at these intensities.

Both were cross-compiled for sm_90 (no GPU here) at the Llama-3.1-8B shapes: no spills, no
layout conversion inside the K loop, 16-byte global loads (FMA) or cp.async + mma (DOT). Neither
has been timed yet: ``bench/test_bench_gemv.py`` measures them and sweeps the launch parameters.

Split-K (``split_k > 1``, atomic-free): program ``(n, s)`` covers ``K`` slice ``s``, writes float32
partials to a ``[split_k, M, N_partial]`` workspace, and ``_splitk_reduce_kernel`` sums them, adds
the bias and applies the epilogue. For N = 4096 at M = 1 there are only ``4096 / BLOCK_N`` row
slabs; a narrow ``BLOCK_N`` or split-K puts enough loads in flight on 132 SMs.

Launch parameters: ``gemv_config(m, n, k, gate_up, ...)``: ``TUNED`` (measured winners, keyed by
``(next_pow2(M), N, K, gate_up, dtype bytes)``) first, then ``heuristic_config``. Every parameter
can be overridden by keyword on :func:`gemv`. The choice depends on ``M`` only through
``next_pow2(M)`` and ``M`` is not specialized by Triton, so the compile warm-up (decode buckets
1, 2, 4, 8) compiles every kernel a T <= 8 launch can need. (Exceptions: an artifact with
``--max-batch-size`` < 8 whose prefill chunks of 5..8 tokens would pick a kernel the warm-up never
ran, only if ``TUNED`` gives M class 8 a different config than class 4; a plan's ``max_m`` > 8.
Triton then compiles at run time, once, into the artifact's cache.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton
import triton.language as tl

from kiln import settings
from kiln.ops.activation.silu_and_mul import silu_and_mul_ref
from kiln.ops.common import launch
from kiln.ops.common.launch import interpreting, next_pow2, pdl_args, pdl_trigger, pdl_wait
from kiln.ops.common.op import DIRECT, kiln_op
from kiln.ops.common.quant import FP8_DTYPE, add_rounded, tl_add_row, tl_round

DEFAULT_MAX_M = 8
# KILN_PREWAIT=slab: the W elements a thread may hold for a whole-slab first step. At 64 the
# one-row qkv and o rungs of Qwen3-30B-A3B cross-compile (sm_90, the launches' alignment) to 80
# and 72 registers, against 39 and 42 for the first-step version.
SLAB_MAX_ELEMS = 64
# ... and, for a GEMV without a fused norm, at most this many programs per SM. Measured on the H200
# (bench/results/2026-12-02_h200_s13b_*): the whole-slab o GEMV of Qwen3-30B-A3B (1024 programs,
# 72 registers: 7 a SM resident) gained 1.5% end to end; that of Llama-3.1-8B (2048 programs) cost
# its step bench 1.6%. The qkv GEMVs with the norm (2560 / 3072 programs) gained or held even.
SLAB_MAX_PER_SM = 8
DEFAULT_SMS = 132  # H200: the configs' default where no device is given
# The "SM count" of launches off the GPU (the interpreter tests): the H200's 132 would shrink the
# tiny test models' blocks to 2 rows, 8x the programs the interpreter runs one by one, for the same
# kernel branches (the GPU tests run the H200's launches).
INTERPRETER_SMS = 8
DOT_M = 16  # tensor-core tiles pad x to 16 rows
FMA_MAX_M = 4  # the CUDA-core kernel keeps one accumulator per x row, up to 4
REDUCE_BLOCK = 256


# qkv and o; gate_up and down (compiler/layers.py); MoE router (compiler/moe_layer.py); MLA's
# per-head latent maps (compiler/mla_layer.py: kiln::mla_head_matmul instead of batched matmuls)
ROLES = ("attn", "mlp", "router", "latent")
# The plan a compile uses by default (kiln/settings.py gemv_plan): every role at T = 1, cuBLAS from
# T = 2. On the
# H200 the tuned GEMV beats cuBLAS on each Llama-3.1-8B and Qwen3-30B-A3B projection at T = 1 when
# launched back to back as in a decode step (``TUNED`` below; 8-19% per launch, 30-42% for the o
# projections); from T = 2 the tensor-core path is untuned and lost at T = 8. The MoE router
# ([E, H], 128 x 2048 for Qwen3-30B-A3B) took 4.9 us per cuBLAS launch in the batch-1 profile.
DEFAULT_PLAN = settings.SETTINGS["gemv_plan"].default  # "attn:1,mlp:1,router:1"


def gemv_plan(spec: str = DEFAULT_PLAN) -> dict[str, int]:
    """The compile-time plan (``kiln compile --gemv-plan``): role -> the largest T whose call takes
    the GEMV (roles left out: the graph traces plain ``aten.linear``, cuBLAS at every T).

    ``spec``: ``0`` or empty, no role; ``1`` or ``all``, every role up to ``DEFAULT_MAX_M``; or a
    comma list of ``ROLE`` (up to ``DEFAULT_MAX_M``) or ``ROLE:M``, e.g. ``attn:1``."""
    spec = spec.strip()
    if spec in ("", "0"):
        return {}
    if spec in ("1", "all"):
        return dict.fromkeys(ROLES, DEFAULT_MAX_M)
    plan: dict[str, int] = {}
    for part in spec.split(","):
        role, _, m = part.strip().partition(":")
        if role not in ROLES or (m and not m.isdigit()):
            raise ValueError(
                f"--gemv-plan: bad entry {part!r} in {spec!r}; use 0, 1/all, or a comma list of "
                f"ROLE or ROLE:MAX_T with ROLE one of {', '.join(ROLES)} (e.g. attn:1,mlp:1)."
            )
        if max_t := int(m or DEFAULT_MAX_M):
            plan[role] = max_t
    return plan


def gemv_enabled() -> bool:
    """The run-time ``gemv`` setting (kiln/settings.py): off (``--no-gemv``, ``KILN_GEMV=0``) sends
    every ``kiln::linear`` call to cuBLAS whatever the graph's ``max_m``; on follows the graph."""
    return settings.value("gemv")


# ---- torch references -----------------------------------------------------------------------------


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 product (+ bias) rounded once to ``x.dtype``: what the kernel computes."""
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def gate_up_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu_and_mul(gemv_ref(x, w, bias))``: ``[M, 2I] -> [M, I]`` with the activation's roundings."""
    return silu_and_mul_ref(gemv_ref(x, w, bias))


# ---- Triton kernels -------------------------------------------------------------------------------


@triton.jit
def _act(g, u, GATE_UP: tl.constexpr, DT: tl.constexpr, ROUND_IN_F32: tl.constexpr):
    """float32 sums (bias included) -> output values rounded to ``DT`` (as float32): ``g`` itself, or
    with ``GATE_UP`` ``silu(g) * u`` with the roundings of ``linear`` + ``silu_and_mul``."""
    if GATE_UP:
        g = tl_round(g, DT, ROUND_IN_F32)
        u = tl_round(u, DT, ROUND_IN_F32)
        a = tl_round(g / (1.0 + tl.exp(-g)), DT, ROUND_IN_F32)
        y = tl_round(a * u, DT, ROUND_IN_F32)
    else:
        y = tl_round(g, DT, ROUND_IN_F32)
    return y


@triton.jit
def _load_f32(ptrs, mask, EVEN_K: tl.constexpr):
    if EVEN_K:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _k_step(X, w, wu, x_ptrs, r_ptrs, n_ptrs, dk, xo1, xo2, xo3, k_mask, g0, g1, g2, g3, u0, u1, u2, u3, ss,
            BLOCK_M: tl.constexpr, GATE_UP: tl.constexpr, EVEN_K: tl.constexpr, ROUND_IN_F32: tl.constexpr,
            NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_G: tl.constexpr):  # fmt: skip
    """One K step of ``_gemv_fma_kernel`` on the W tiles ``w`` (and ``wu`` with GATE_UP), ``dk``
    columns past the program's first: loads the x rows (NORM: the one row ``g * (x + residual)``,
    its squares summed into ``ss``) and accumulates."""
    x0 = _load_f32(x_ptrs + dk, k_mask, EVEN_K)
    if NORM:  # one row: x0 <- g * h, ss += h * h
        if HAS_RES:
            x0 = tl_round(x0 + _load_f32(r_ptrs + dk, k_mask, EVEN_K), X.dtype.element_ty, ROUND_IN_F32)
        ss += tl.sum(x0 * x0, axis=2)
        if HAS_G:
            x0 = x0 * _load_f32(n_ptrs + dk, k_mask, EVEN_K)
    x1 = x0
    x2 = x0
    x3 = x0
    if BLOCK_M > 1:
        x1 = _load_f32(x_ptrs + dk + xo1, k_mask, EVEN_K)
    if BLOCK_M > 2:
        x2 = _load_f32(x_ptrs + dk + xo2, k_mask, EVEN_K)
        x3 = _load_f32(x_ptrs + dk + xo3, k_mask, EVEN_K)
    g0, g1, g2, g3 = _fma4(g0, g1, g2, g3, w, x0, x1, x2, x3, BLOCK_M)
    if GATE_UP:
        u0, u1, u2, u3 = _fma4(u0, u1, u2, u3, wu, x0, x1, x2, x3, BLOCK_M)
    return g0, g1, g2, g3, u0, u1, u2, u3, ss


@triton.jit
def _fma4(a0, a1, a2, a3, w, x0, x1, x2, x3, BLOCK_M: tl.constexpr):
    """``a_m[n, j] += sum_v w[n, j, v] * x_m[n, j, v]`` for the first ``BLOCK_M`` (<= 4) rows: the sum
    over the ``VEC`` axis stays inside a thread (one 16-byte load's worth)."""
    a0 += tl.sum(w * x0, axis=2)
    if BLOCK_M > 1:
        a1 += tl.sum(w * x1, axis=2)
    if BLOCK_M > 2:
        a2 += tl.sum(w * x2, axis=2)
        a3 += tl.sum(w * x3, axis=2)
    return a0, a1, a2, a3


@triton.jit
def _finish_row(g, u, m, M, bg, bu, offs_n, n_mask, Y, P, pid_k, stride_ym, N_OUT,
                SPLIT_K: tl.constexpr, GATE_UP: tl.constexpr, ROUND_IN_F32: tl.constexpr,
                XS, WS, stride_xs, SCALED: tl.constexpr, Z, stride_zm, ADD_Z: tl.constexpr):  # fmt: skip
    """Row ``m`` of an FMA program: reduce ``[BLOCK_N, KB]`` partial sums (``SCALED``: times
    ``XS[m] * WS[n]``), then the output (bias, epilogue, rounding, ``ADD_Z``: plus ``Z[m]``, rounded
    again) or, with split-K, the float32 partials."""
    g = tl.sum(g, axis=1)  # [BLOCK_N]
    if SCALED:  # FP8: per-token (stride_xs 1) or per-tensor (0) x scale, per-channel w scale
        xs = tl.load(XS + tl.minimum(m, M - 1) * stride_xs)
        g = g * (xs * tl.load(WS + offs_n, mask=n_mask, other=0.0))
    mask = n_mask & (offs_n * 0 + m < M)
    if SPLIT_K == 1:
        if GATE_UP:
            u = tl.sum(u, axis=1) + bu
        DT: tl.constexpr = Y.dtype.element_ty
        y = _act(g + bg, u, GATE_UP, DT, ROUND_IN_F32)
        y = tl_add_row(y, Z, m, stride_zm, offs_n, mask, ADD_Z, DT, ROUND_IN_F32)  # M x N is small
        tl.store(Y + m * stride_ym + offs_n, y.to(DT), mask=mask)
    else:
        N_P = N_OUT * 2 if GATE_UP else N_OUT
        p = P + (pid_k * M + m).to(tl.int64) * N_P + offs_n
        tl.store(p, g, mask=mask)
        if GATE_UP:
            tl.store(p + N_OUT, tl.sum(u, axis=1), mask=mask)


@triton.jit
def _norm_chunk(X, R, G, H, XN, K, rstd, pid, HAS_RES: tl.constexpr, WRITE_H: tl.constexpr,
                WRITE_XN: tl.constexpr, CHUNK: tl.constexpr, ROUND_IN_F32: tl.constexpr,
                HAS_G: tl.constexpr):  # fmt: skip
    """A NORM program's share of ``h`` and of the normalized row (elements ``pid * CHUNK ..``), with
    ops/norm/rmsnorm.py's roundings: ``h`` and ``h * rstd`` rounded to x's dtype, times the weight (``HAS_G``),
    rounded."""
    DT: tl.constexpr = X.dtype.element_ty
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    mask = offs < K
    h = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h = tl_round(h + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32), DT, ROUND_IN_F32)
    if WRITE_H:
        tl.store(H + offs, h.to(DT), mask=mask)
    if WRITE_XN:
        xn = tl_round(h * rstd, DT, ROUND_IN_F32)
        if HAS_G:
            g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
            xn = tl_round(g * xn, DT, ROUND_IN_F32)
        tl.store(XN + offs, xn.to(DT), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _gemv_fma_kernel(
    X,  # [M, K]
    W,  # [N_W, K] row-major (N_W = N_OUT, or 2 * N_OUT for gate_up)
    B,  # [N_W] bias (any pointer when HAS_BIAS is off)
    Y,  # [M, N_OUT] output (SPLIT_K == 1)
    P,  # [SPLIT_K, M, N_W] float32 partials (SPLIT_K > 1)
    M,
    N_OUT,
    K,
    K_SPLIT,  # K elements per split (a multiple of BLOCK_K)
    stride_xm,
    stride_wn,
    stride_ym,
    UP_OFF,  # gate_up: first up row (= N_OUT)
    BLOCK_M: tl.constexpr,  # 1, 2 or 4
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,  # elements per 16-byte load
    SPLIT_K: tl.constexpr,
    GATE_UP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # every split is a whole number of BLOCK_K steps inside K: no K masks
    ROUND_IN_F32: tl.constexpr,  # the interpreter: round bf16 by hand
    PDL: tl.constexpr,  # programmatic dependent launch (ops/common/launch.py)
    XS,  # SCALED: [M] float32 x scales (stride_xs 1) or [1] (stride_xs 0); else any pointer
    WS,  # SCALED: [N_OUT] float32 w scales; else any pointer
    stride_xs,
    SCALED: tl.constexpr,  # FP8 x and W: sums times XS[m] * WS[n] (not with GATE_UP)
    R,  # NORM with HAS_RES: [K] residual row; else any pointer
    G,  # NORM: [K] RMSNorm weight; else any pointer
    H,  # WRITE_H: [K] out, x (+ residual) rounded; else any pointer
    XN,  # WRITE_XN: [K] out, the normalized row (ops/norm/rmsnorm.py's rounding); else any pointer
    eps,
    NORM: tl.constexpr = False,  # x is the RMSNorm's input (one row, no split-K; ops/linear/norm_linear.py)
    HAS_RES: tl.constexpr = False,
    WRITE_H: tl.constexpr = False,
    WRITE_XN: tl.constexpr = False,
    CHUNK: tl.constexpr = 1,  # WRITE_H / WRITE_XN: elements of K each program writes
    HAS_G: tl.constexpr = True,  # NORM: the weight G applies (off: folded into W, unit weight)
    Z=None,  # ADD_Z: [M, N_OUT] added to the rounded output (the residual); else any pointer
    stride_zm=0,
    ADD_Z: tl.constexpr = False,
    PREWAIT: tl.constexpr = False,  # the first W step loaded before pdl_wait (KILN_PREWAIT)
):
    """CUDA cores. The W tile is loaded as ``[BLOCK_N, BLOCK_K / VEC, VEC]`` so each thread owns whole
    16-byte pieces; x is loaded through pointers of the same shape (broadcast over rows) so it lands
    in the same layout with no shuffle through shared memory (repeated loads hit L1).

    ``NORM``: ``y = (W @ (g * h)) * rstd(h)`` with ``h = x (+ residual)`` rounded to x's dtype, the
    sum of squares accumulated in the K loop beside the product (rows of ``ss`` are copies), so the
    RMSNorm costs no pass of its own; then each program writes its ``CHUNK`` of ``h`` / of the
    normalized row for the layer's other consumers."""
    pdl_trigger(PDL)
    if not PREWAIT:
        pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    KB: tl.constexpr = BLOCK_K // VEC
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_OUT
    # Rows past the end re-read the last valid row (clamped, not masked) so W loads stay unmasked and
    # fully vectorized; their results are never stored. Same for x rows past M.
    rows = tl.minimum(offs_n, N_OUT - 1).to(tl.int64)[:, None, None]
    offs_k = (tl.arange(0, KB)[:, None] * VEC + tl.arange(0, VEC)[None, :])[None, :, :]  # [1, KB, VEC]
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    wg_ptrs = W + rows * stride_wn + k_lo + offs_k  # [BLOCK_N, KB, VEC]
    wu_ptrs = wg_ptrs + UP_OFF * stride_wn
    x_ptrs = X + k_lo + offs_k + 0 * rows  # [BLOCK_N, KB, VEC], every row the same
    xo1 = tl.minimum(1, M - 1).to(tl.int64) * stride_xm
    xo2 = tl.minimum(2, M - 1).to(tl.int64) * stride_xm
    xo3 = tl.minimum(3, M - 1).to(tl.int64) * stride_xm
    g0 = tl.zeros([BLOCK_N, KB], dtype=tl.float32)
    g1 = tl.zeros([BLOCK_N, KB], dtype=tl.float32)
    g2 = tl.zeros([BLOCK_N, KB], dtype=tl.float32)
    g3 = tl.zeros([BLOCK_N, KB], dtype=tl.float32)
    u0 = tl.zeros([BLOCK_N, KB], dtype=tl.float32)
    u1 = tl.zeros([BLOCK_N, KB], dtype=tl.float32)
    u2 = tl.zeros([BLOCK_N, KB], dtype=tl.float32)
    u3 = tl.zeros([BLOCK_N, KB], dtype=tl.float32)
    ss = tl.zeros([BLOCK_N, KB], dtype=tl.float32)  # NORM: sum of squares of h (rows are copies)
    r_ptrs = R + k_lo + offs_k + 0 * rows
    n_ptrs = G + k_lo + offs_k + 0 * rows
    # the pointers stay at the program's first column; step k reads dk = k - k_lo past them
    k0 = k_lo
    if PREWAIT:  # weights, which nothing in the graph writes: the first K step streams now
        w = _load_f32(wg_ptrs, k_lo + offs_k < k_hi, EVEN_K)
        wu = _load_f32(wu_ptrs, k_lo + offs_k < k_hi, EVEN_K) if GATE_UP else w
        pdl_wait(PDL)
        # the first step peeled, so its tiles are dead before the loop (no registers held across it)
        g0, g1, g2, g3, u0, u1, u2, u3, ss = _k_step(
            X, w, wu, x_ptrs, r_ptrs, n_ptrs, 0, xo1, xo2, xo3, k_lo + offs_k < k_hi,
            g0, g1, g2, g3, u0, u1, u2, u3, ss, BLOCK_M, GATE_UP, EVEN_K, ROUND_IN_F32, NORM, HAS_RES, HAS_G,
        )  # fmt: skip
        k0 = k_lo + BLOCK_K
    for k in range(k0, k_hi, BLOCK_K):
        k_mask = None if EVEN_K else k + offs_k < k_hi
        w = _load_f32(wg_ptrs + (k - k_lo), k_mask, EVEN_K)
        wu = _load_f32(wu_ptrs + (k - k_lo), k_mask, EVEN_K) if GATE_UP else w
        g0, g1, g2, g3, u0, u1, u2, u3, ss = _k_step(
            X, w, wu, x_ptrs, r_ptrs, n_ptrs, k - k_lo, xo1, xo2, xo3, k_mask,
            g0, g1, g2, g3, u0, u1, u2, u3, ss, BLOCK_M, GATE_UP, EVEN_K, ROUND_IN_F32, NORM, HAS_RES, HAS_G,
        )  # fmt: skip
    if NORM:
        rstd = 1.0 / tl.math.sqrt_rn(tl.sum(ss, axis=1) / K + eps)  # [BLOCK_N], all equal
        g0 = g0 * rstd[:, None]
        u0 = u0 * rstd[:, None]
        if WRITE_H or WRITE_XN:
            _norm_chunk(X, R, G, H, XN, K, tl.max(rstd, axis=0), pid_n, HAS_RES, WRITE_H, WRITE_XN, CHUNK,
                        ROUND_IN_F32, HAS_G)  # fmt: skip
    bg = 0.0
    bu = 0.0
    if HAS_BIAS and SPLIT_K == 1:  # with split-K the reduce kernel adds it
        bg = tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if GATE_UP:
            bu = tl.load(B + UP_OFF + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    _finish_row(g0, u0, 0, M, bg, bu, offs_n, n_mask, Y, P, pid_k, stride_ym, N_OUT, SPLIT_K, GATE_UP,
                ROUND_IN_F32, XS, WS, stride_xs, SCALED, Z, stride_zm, ADD_Z)  # fmt: skip
    if BLOCK_M > 1:
        _finish_row(g1, u1, 1, M, bg, bu, offs_n, n_mask, Y, P, pid_k, stride_ym, N_OUT, SPLIT_K, GATE_UP,
                    ROUND_IN_F32, XS, WS, stride_xs, SCALED, Z, stride_zm, ADD_Z)  # fmt: skip
    if BLOCK_M > 2:
        _finish_row(g2, u2, 2, M, bg, bu, offs_n, n_mask, Y, P, pid_k, stride_ym, N_OUT, SPLIT_K, GATE_UP,
                    ROUND_IN_F32, XS, WS, stride_xs, SCALED, Z, stride_zm, ADD_Z)  # fmt: skip
        _finish_row(g3, u3, 3, M, bg, bu, offs_n, n_mask, Y, P, pid_k, stride_ym, N_OUT, SPLIT_K, GATE_UP,
                    ROUND_IN_F32, XS, WS, stride_xs, SCALED, Z, stride_zm, ADD_Z)  # fmt: skip


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    if UPCAST or a.dtype == tl.float32:  # fp32 inputs: no tf32; the interpreter's 16-bit dot is wrong
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _gemv_dot_kernel(
    X, W, B, Y, P,  # as _gemv_fma_kernel
    M, N_OUT, K, K_SPLIT, stride_xm, stride_wn, stride_ym, UP_OFF,
    BLOCK_M: tl.constexpr,  # >= 16: x rows padded for the tensor cores
    BLOCK_N: tl.constexpr,  # >= 16
    BLOCK_K: tl.constexpr,  # >= 16
    SPLIT_K: tl.constexpr,
    GATE_UP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROUND_IN_F32: tl.constexpr,  # the interpreter: round bf16 by hand, float32 dots
    PDL: tl.constexpr,
    Z=None,  # as _gemv_fma_kernel
    stride_zm=0,
    ADD_Z: tl.constexpr = False,
):  # fmt: skip
    """Tensor cores, swap-AB: ``acc [BLOCK_N, BLOCK_M] += W_tile [BLOCK_N, BLOCK_K] @ x_tile^T``. The
    W tiles go through the software pipeline (``num_stages``) like any Triton matmul operand."""
    pdl_trigger(PDL)
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    DT: tl.constexpr = Y.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_OUT
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    rows = tl.minimum(offs_n, N_OUT - 1).to(tl.int64)[:, None]  # clamped, as in the FMA kernel
    rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)[:, None]
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    wg_ptrs = W + rows * stride_wn + k_lo + offs_k  # [BLOCK_N, BLOCK_K]
    wu_ptrs = wg_ptrs + UP_OFF * stride_wn
    x_ptrs = X + rows_x * stride_xm + k_lo + offs_k  # [BLOCK_M, BLOCK_K]
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            xt = tl.trans(tl.load(x_ptrs))  # [BLOCK_K, BLOCK_M]
            wg = tl.load(wg_ptrs)
        else:
            k_mask = k + offs_k < k_hi
            xt = tl.trans(tl.load(x_ptrs, mask=k_mask, other=0.0))
            wg = tl.load(wg_ptrs, mask=k_mask, other=0.0)
        acc_g = _dot(wg, xt, acc_g, ROUND_IN_F32)
        if GATE_UP:
            if EVEN_K:
                wu = tl.load(wu_ptrs)
            else:
                wu = tl.load(wu_ptrs, mask=k_mask, other=0.0)
            acc_u = _dot(wu, xt, acc_u, ROUND_IN_F32)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    mask = n_mask[:, None] & (offs_m < M)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc_g += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            if GATE_UP:
                acc_u += tl.load(B + UP_OFF + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        y = _act(acc_g, acc_u, GATE_UP, DT, ROUND_IN_F32)
        y = tl_add_row(
            y, Z, offs_m[None, :].to(tl.int64), stride_zm, offs_n[:, None], mask, ADD_Z, DT, ROUND_IN_F32
        )
        tl.store(Y + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None], y.to(DT), mask=mask)
    else:
        N_P = N_OUT * 2 if GATE_UP else N_OUT
        p = P + (pid_k * M + offs_m[None, :]).to(tl.int64) * N_P + offs_n[:, None]
        tl.store(p, acc_g, mask=mask)
        if GATE_UP:
            tl.store(p + N_OUT, acc_u, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _splitk_reduce_kernel(
    P,  # [SPLIT_K, M, N_P] float32
    B,
    Y,  # [M, N_OUT]
    M,
    N_OUT,
    stride_ym,
    UP_OFF,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    GATE_UP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_IN_F32: tl.constexpr,
    PDL: tl.constexpr,
    Z=None,  # as _gemv_fma_kernel
    stride_zm=0,
    ADD_Z: tl.constexpr = False,
):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_mask = offs_n < N_OUT
    N_P = N_OUT * 2 if GATE_UP else N_OUT
    g = tl.zeros([BLOCK], dtype=tl.float32)
    u = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        p = P + (s * M + row).to(tl.int64) * N_P + offs_n
        g += tl.load(p, mask=n_mask, other=0.0)
        if GATE_UP:
            u += tl.load(p + N_OUT, mask=n_mask, other=0.0)
    if HAS_BIAS:
        g += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if GATE_UP:
            u += tl.load(B + UP_OFF + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    DT: tl.constexpr = Y.dtype.element_ty
    y = _act(g, u, GATE_UP, DT, ROUND_IN_F32)
    y = tl_add_row(y, Z, row.to(tl.int64), stride_zm, offs_n, n_mask, ADD_Z, DT, ROUND_IN_F32)
    tl.store(Y + row.to(tl.int64) * stride_ym + offs_n, y.to(DT), mask=n_mask)


# ---- launch configuration -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int
    use_dot: bool


# Measured winners (bench/test_bench_gemv.py::test_gemv_sweep prints entries in this form), keyed by
# (next_pow2(M), N_out, K, gate_up, element bytes); the heuristic below serves every other shape.
# M = 1, H200, chain mode (bench/results/2026-11-29_h200_gemv_sweep_chain.json: each launch over
# distinct weights, back to back in one CUDA graph, as a decode step runs them), per launch against
# cuBLAS in the same chain: Llama-3.1-8B qkv 15.5 vs 17.7 us, o 10.8 vs 14.1, gate_up + SiLU 60.9 vs
# 65.3 (cuBLAS + silu_and_mul), down 31.8 vs 34.5; Qwen3-30B-A3B qkv 7.7 vs 8.5, o 6.8 vs 9.7.
TUNED: dict[tuple[int, int, int, bool, int], GemvConfig] = {
    (1, 6144, 4096, False, 2): GemvConfig(2, 1024, 4, 1, 1, False),
    (1, 4096, 4096, False, 2): GemvConfig(2, 1024, 4, 1, 1, False),
    (1, 14336, 4096, True, 2): GemvConfig(2, 2048, 4, 1, 1, False),
    (1, 4096, 14336, False, 2): GemvConfig(4, 1024, 8, 1, 1, False),
    (1, 5120, 2048, False, 2): GemvConfig(2, 512, 2, 1, 1, False),
    (1, 2048, 4096, False, 2): GemvConfig(2, 2048, 4, 1, 1, False),
    # M classes 8 and 16 (T = 5..16: speculative verify steps, small decode batches), tensor cores,
    # H100 (twenty-third session, bench/results/2026-12-05_h100_s23a_*.json; chain mode, 400 MB), the
    # whole chain against cuBLAS's at M = 8: qkv 164.5 vs 167.3 us, o 168.8 vs 189.9, gate_up + SiLU
    # 163.9 vs 172.0, down 172.1 vs 178.0 (81-95% of the read ceiling; the heuristic's 16-row tiles
    # 62-80%); at M = 16 within 1-16% of those.
    (8, 6144, 4096, False, 2): GemvConfig(64, 128, 4, 4, 4, True),
    (16, 6144, 4096, False, 2): GemvConfig(64, 128, 4, 4, 1, True),
    (8, 4096, 4096, False, 2): GemvConfig(64, 128, 4, 4, 2, True),
    (16, 4096, 4096, False, 2): GemvConfig(64, 128, 4, 4, 2, True),
    (8, 14336, 4096, True, 2): GemvConfig(64, 128, 4, 4, 1, True),
    (16, 14336, 4096, True, 2): GemvConfig(64, 128, 4, 4, 1, True),
    (8, 4096, 14336, False, 2): GemvConfig(64, 128, 4, 4, 2, True),
    (16, 4096, 14336, False, 2): GemvConfig(64, 128, 4, 4, 2, True),
    # FP8 operands (fp8_linear's decode path; gate_up is a plain [2I, K] product there), one graph
    # replay per call (bench/results/2026-11-29_h200_fp8_gemv_sweep.json), against cuBLAS FP8:
    # M = 1: qkv 12.1 vs 21.7 us, o 10.0 vs 18.1, gate_up 34.1 vs 51.0, down 19.6 vs 46.7;
    # M = 2: 14.8 vs 22.0, 12.2 vs 17.2, 42.7 vs 49.8, 24.8 vs 46.3 (at M = 4 gate_up lost: 68 vs 50).
    (1, 6144, 4096, False, 1): GemvConfig(4, 1024, 4, 1, 1, False),
    (1, 4096, 4096, False, 1): GemvConfig(2, 2048, 4, 1, 1, False),
    (1, 28672, 4096, False, 1): GemvConfig(2, 2048, 4, 1, 1, False),
    (1, 4096, 14336, False, 1): GemvConfig(2, 2048, 4, 1, 1, False),
    (2, 6144, 4096, False, 1): GemvConfig(4, 1024, 4, 1, 1, False),
    (2, 4096, 4096, False, 1): GemvConfig(2, 1024, 4, 1, 1, False),
    (2, 28672, 4096, False, 1): GemvConfig(4, 1024, 4, 1, 1, False),
    (2, 4096, 14336, False, 1): GemvConfig(2, 2048, 4, 1, 1, False),
}


def sm_count(device: torch.device) -> int:
    return launch.sm_count(device, INTERPRETER_SMS)


def heuristic_config(
    m: int, n_out: int, k: int, gate_up: bool, elem_bytes: int, sms: int, use_dot: bool | None = None
) -> GemvConfig:
    """A first guess (checked for registers and spills by cross-compiling for sm_90, not timed),
    meant to be replaced by ``TUNED`` entries from the GPU sweep.

    FMA path for ``M <= 2``, 4 warps: ``BLOCK_N`` the widest power of two <= 16 (8 for gate_up,
    which loads two tiles) that still makes >= 4 programs per SM, so N = 4096 gets narrow slabs
    rather than split-K; then ``BLOCK_K`` so each thread has 4 (M = 1) or 2 (M = 2) 16-byte W
    loads in flight per step (no software pipeline on this path: bytes in flight come from the
    loads of one step times the resident programs). DOT path for ``M >= 3``: 16-row W tiles,
    ``BLOCK_K`` 256, 4 stages (48 KiB of shared memory). Split-K (both paths) only while there
    are fewer than 2 programs per SM and each split keeps >= 4 K steps. ``use_dot`` forces a path.
    """
    bm = next_pow2(m)
    if use_dot is None:
        use_dot = bm > 2
    vec = 16 // elem_bytes
    warps = 4
    kp = max(16, next_pow2(k))
    if use_dot:
        block_n, block_k, stages = 16, min(256, kp), 4
    else:
        stages = 1
        block_n = (16 if bm == 1 else 8) // (2 if gate_up else 1)
        while block_n > 2 and triton.cdiv(n_out, block_n) < 4 * sms:
            block_n //= 2
        loads = (4 if bm == 1 else 2) // (2 if gate_up else 1)  # 16-byte W loads per thread per step
        block_k = max(vec, min(kp, 2048, loads * vec * 32 * warps // block_n))
    split = 1
    tiles = triton.cdiv(n_out, block_n)
    while tiles * split < 2 * sms and k // (2 * split * block_k) >= 4:
        split *= 2
    return GemvConfig(block_n, block_k, warps, stages, split, use_dot)


def gemv_config(
    m: int, n_out: int, k: int, gate_up: bool = False, elem_bytes: int = 2, sms: int = DEFAULT_SMS
) -> GemvConfig:
    """Launch parameters for an ``[m, k] x [n_out (x2 for gate_up), k]^T`` GEMV (tuned or heuristic)."""
    tuned = TUNED.get((next_pow2(m), n_out, k, gate_up, elem_bytes))
    return tuned if tuned is not None else heuristic_config(m, n_out, k, gate_up, elem_bytes, sms)


# ---- launcher -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NormIn:
    """The RMSNorm a :func:`gemv` runs on its x row first (ops/linear/norm_linear.py): ``x`` is then the
    norm's input ``[1, K]`` and ``y = rmsnorm(x (+ residual)) @ w^T``, the weight and ``rstd``
    applied around the product. ``h_out`` gets ``x + residual`` (the next residual) and ``xn_out``
    the normalized row, each ``[1, K]`` of x's dtype, when given. ``weight`` None: a unit weight
    (the norm's weight is folded into ``w``'s columns, weights/fold.py)."""

    weight: torch.Tensor | None  # [K]
    eps: float
    residual: torch.Tensor | None = None  # [1, K]
    h_out: torch.Tensor | None = None  # [1, K]
    xn_out: torch.Tensor | None = None  # [1, K]

    def check(self, x: torch.Tensor) -> None:
        k = x.shape[1]
        if x.shape[0] != 1 or k == 0 or x.dtype == FP8_DTYPE:
            raise ValueError(
                f"gemv: a fused RMSNorm takes one bf16/fp16/fp32 row, got {tuple(x.shape)} {x.dtype}"
            )
        if self.weight is not None and (self.weight.shape != (k,) or self.weight.stride(0) != 1):
            raise ValueError(
                f"gemv: the norm weight must be a contiguous [{k}], got {tuple(self.weight.shape)}"
            )
        for name in ("residual", "h_out", "xn_out"):
            t = getattr(self, name)
            if t is not None and (t.shape != (1, k) or t.dtype != x.dtype or t.stride(1) != 1):
                raise ValueError(f"gemv: norm {name} must be [1, {k}] {x.dtype} with a unit last stride")


def _norm_meta(norm: NormIn | None, x: torch.Tensor, w: torch.Tensor, grid_n: int) -> dict:
    """The fused-norm arguments of ``_gemv_fma_kernel`` (placeholders without a norm)."""
    if norm is None:
        return dict(R=w, G=w, H=w, XN=w, eps=0.0)
    k = x.shape[1]
    return dict(
        R=norm.residual if norm.residual is not None else x, G=norm.weight if norm.weight is not None else x,
        HAS_G=norm.weight is not None,
        H=norm.h_out if norm.h_out is not None else x, XN=norm.xn_out if norm.xn_out is not None else x,
        eps=float(norm.eps), NORM=True, HAS_RES=norm.residual is not None,
        WRITE_H=norm.h_out is not None, WRITE_XN=norm.xn_out is not None,
        CHUNK=next_pow2(triton.cdiv(k, grid_n)),
    )  # fmt: skip


def slab_block_k(
    cfg: GemvConfig,
    bm: int,
    k: int,
    gate_up: bool,
    norm: bool = False,
    n_out: int = 0,
    sms: int = DEFAULT_SMS,
) -> int:
    """``cfg.block_k``, or with ``KILN_PREWAIT`` naming ``gemv`` and ``slab`` (``slab_norm`` for a
    GEMV with a fused RMSNorm) all of K in one step for a one-row CUDA-core launch without split-K
    whose per-thread W elements stay within ``SLAB_MAX_ELEMS`` (so the pre-wait step is the whole
    slab). A GEMV without a norm also needs a grid of at most ``SLAB_MAX_PER_SM`` programs per SM
    (``n_out`` outputs, ``sms`` SMs): most of its programs are then resident early."""
    part = "slab_norm" if norm else "slab"
    if cfg.use_dot or bm != 1 or cfg.split_k != 1 or not (launch.prewait(part) and launch.prewait("gemv")):
        return cfg.block_k
    if not norm and triton.cdiv(n_out, cfg.block_n) > SLAB_MAX_PER_SM * sms:
        return cfg.block_k
    elems = cfg.block_n * next_pow2(k) * (2 if gate_up else 1) // (32 * cfg.num_warps)
    return next_pow2(k) if elems <= SLAB_MAX_ELEMS else cfg.block_k


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    gate_up: bool = False,
    out: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
    use_dot: bool | None = None,
    norm: NormIn | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the GEMV (no dispatch: always the Triton kernel). ``x [M, K]``, ``w [N, K]`` (``[2I, K]``
    with ``gate_up``), ``bias [N]`` / ``[2I]``; returns ``[M, N]`` / ``[M, I]`` in ``x.dtype``, or
    ``out_dtype`` (below), into ``out`` when given. Keywords override the :func:`gemv_config` choice.

    FP8 (``fp8_linear``'s decode path): ``x`` and ``w`` float8_e4m3fn with ``x_scale`` ``[M, 1]`` or
    ``[1]`` and ``w_scale`` ``[N]`` float32; ``y = (x @ w^T) * x_scale * w_scale (+ bias)`` in
    ``out_dtype`` (default bf16), on the CUDA-core kernel (M <= 4), not with ``gate_up``.
    bf16/fp16 ``x`` with ``out_dtype=torch.float32`` (no ``gate_up``, no ``residual``): the float32
    sums unrounded, ``F.linear(x.float(), w.float())`` up to the order of the sums (the products of
    two bf16/fp16 values are exact in float32): a float32 MoE router.

    ``norm`` (:class:`NormIn`): an RMSNorm on the one x row first, on the CUDA-core kernel without
    split-K (``gemv_config``'s launch, on the CUDA-core path, one split).

    ``residual`` ``[M, N]`` (x's dtype, not with ``gate_up`` or FP8): added to the rounded output
    and rounded again, ``y = residual + linear(x)`` as two launches would give it (the residual
    stream's add, done by the projection that feeds it)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv: need x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    scaled = x.dtype == FP8_DTYPE
    if scaled:
        if w.dtype != FP8_DTYPE or x_scale is None or w_scale is None or gate_up or use_dot:
            raise ValueError("gemv: FP8 x needs FP8 w, x_scale and w_scale, without gate_up or use_dot")
        if w_scale.numel() != w.shape[0] or x_scale.numel() not in (1, x.shape[0]):
            raise ValueError(f"gemv: w_scale must have {w.shape[0]} and x_scale 1 or {x.shape[0]} elements")
        use_dot = False
    elif x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"gemv: x and w must share a bf16/fp16/fp32 dtype, got {x.dtype} and {w.dtype}")
    elif out_dtype not in (None, x.dtype) and (out_dtype != torch.float32 or gate_up or residual is not None):
        raise ValueError(
            f"gemv: out_dtype must be x's ({x.dtype}) or float32 without gate_up or residual, got {out_dtype}"
        )
    odt = (out_dtype or torch.bfloat16) if scaled else (out_dtype or x.dtype)
    n_w = w.shape[0]
    if gate_up and n_w % 2:
        raise ValueError(f"gemv: gate_up needs an even number of weight rows, got {n_w}")
    if bias is not None and bias.shape != (n_w,):
        raise ValueError(f"gemv: bias must be [{n_w}], got {tuple(bias.shape)}")
    m, k = x.shape
    n_out = n_w // 2 if gate_up else n_w
    if out is None:
        out = x.new_empty((m, n_out), dtype=odt)
    elif out.shape != (m, n_out) or out.dtype != odt or (m and n_out and out.stride(1) != 1):
        raise ValueError(f"gemv: out must be [{m}, {n_out}] {odt} with unit column stride")
    if residual is not None and (
        gate_up or scaled or residual.shape != (m, n_out) or residual.dtype != odt or residual.stride(-1) != 1
    ):
        raise ValueError(
            f"gemv: residual must be [{m}, {n_out}] {odt} with a unit last stride, without gate_up or FP8"
        )
    if m == 0 or n_out == 0:
        return out
    if k == 0 and scaled:
        return out.copy_(bias.expand(m, n_out)) if bias is not None else out.zero_()
    if k == 0:
        y = gate_up_ref(x, w, bias) if gate_up else gemv_ref(x, w, bias)
        return out.copy_(y if residual is None else add_rounded(y, residual))
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    sms = sm_count(x.device)
    cfg = gemv_config(m, n_out, k, gate_up, x.element_size(), sms)
    if norm is not None:
        norm.check(x)
        if scaled or use_dot or (split_k or 1) > 1:
            raise ValueError("gemv: a fused RMSNorm runs on the CUDA-core kernel without split-K")
        if cfg.use_dot:  # a tensor-core choice: the CUDA-core path's own block sizes instead
            cfg = heuristic_config(1, n_out, k, gate_up, x.element_size(), sms, False)
        cfg = dataclasses.replace(cfg, split_k=1)  # rstd needs every program to see all of K
    if use_dot is not None and use_dot != cfg.use_dot:  # the other path's own defaults
        cfg = heuristic_config(m, n_out, k, gate_up, x.element_size(), sms, use_dot)
    chosen: dict[str, Any] = {
        name: v
        for name, v in (
            ("block_n", block_n), ("block_k", block_k), ("num_warps", num_warps),
            ("num_stages", num_stages), ("split_k", split_k), ("use_dot", use_dot),
        )
        if v is not None
    }  # fmt: skip
    cfg = dataclasses.replace(cfg, **chosen)
    bm = next_pow2(m)
    if block_k is None:
        cfg = dataclasses.replace(
            cfg, block_k=slab_block_k(cfg, bm, k, gate_up, norm is not None, n_out, sms)
        )
    if cfg.use_dot:
        bm = max(DOT_M, bm)
        if cfg.block_n < 16 or cfg.block_k < 16:
            raise ValueError(f"gemv: the tensor-core path needs block_n and block_k >= 16, got {cfg}")
    elif bm > FMA_MAX_M:
        raise ValueError(f"gemv: the FMA path takes M <= {FMA_MAX_M}, got M={m} (use_dot=True)")
    vec = 16 // x.element_size()
    if cfg.block_k < vec or cfg.block_k & (cfg.block_k - 1) or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"gemv: block_n and block_k must be powers of two, block_k >= {vec}; got {cfg}")
    # Each split covers a whole number of BLOCK_K steps; the realized split count can be lower.
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_split)
    if norm is not None and (splits != 1 or cfg.use_dot):
        raise ValueError(f"gemv: a fused RMSNorm runs on the CUDA-core kernel without split-K, got {cfg}")
    interp = interpreting()
    grid = (triton.cdiv(n_out, cfg.block_n), splits)
    part = x.new_empty((splits, m, n_w), dtype=torch.float32) if splits > 1 else out
    args = (
        x, w, bias if bias is not None else w, out, part,
        m, n_out, k, k_split, x.stride(0), w.stride(0), out.stride(0), n_out if gate_up else 0,
    )  # fmt: skip
    pdl = pdl_args(x)
    z = dict(Z=residual, stride_zm=residual.stride(0), ADD_Z=True) if residual is not None else dict(Z=w)
    meta = dict(
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=splits, GATE_UP=gate_up,
        HAS_BIAS=bias is not None, EVEN_K=k % k_split == 0, ROUND_IN_F32=interp,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )  # fmt: skip
    zk = z if splits == 1 else dict(Z=w)  # with split-K the reduce kernel adds it
    if cfg.use_dot:
        _gemv_dot_kernel[grid](*args, **meta, **zk)
    else:
        xs = x_scale.reshape(-1).float().contiguous() if x_scale is not None and scaled else w
        ws = w_scale.reshape(-1).float().contiguous() if w_scale is not None and scaled else w
        sc = dict(XS=xs, WS=ws, stride_xs=int(xs.numel() > 1), SCALED=scaled)
        _gemv_fma_kernel[grid](
            *args,
            VEC=vec,
            **sc,
            **meta,
            **_norm_meta(norm, x, w, grid[0]),
            **zk,
            PREWAIT=launch.prewait("gemv"),
        )
    if splits > 1:
        _splitk_reduce_kernel[(m, triton.cdiv(n_out, REDUCE_BLOCK))](
            part, bias if bias is not None else part, out, m, n_out, out.stride(0),
            n_out if gate_up else 0,
            SPLIT_K=splits, BLOCK=REDUCE_BLOCK, GATE_UP=gate_up, HAS_BIAS=bias is not None,
            ROUND_IN_F32=interp, num_warps=2, **pdl, **z,
        )  # fmt: skip
    return out


def compile_for(
    m: int, n_out: int, k: int, gate_up: bool, cfg: GemvConfig, dtype: torch.dtype = torch.bfloat16
) -> str | None:
    """Compile the kernels of one ``(M, N, K, gate_up, cfg)`` launch into Triton's cache by running
    it once on the current CUDA device with stand-in tensors of the same specialization (16 or 17
    weight rows instead of N: every N-derived argument keeps its divisibility class). Lets a sweep
    compile its candidates in several processes at once. Returns None, or the error's text."""
    n = 16 if n_out % 16 == 0 else 17
    try:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(2 * n if gate_up else n, k, device="cuda", dtype=dtype)
        gemv(x, w, gate_up=gate_up, **dataclasses.asdict(cfg))
        torch.cuda.synchronize()
    except Exception as err:  # reported to the caller: a config the GPU cannot run
        return f"{type(err).__name__}: {err}"
    return None


# ---- custom ops -----------------------------------------------------------------------------------


def use_gemv(x: torch.Tensor, w: torch.Tensor, max_m: int) -> bool:
    """Whether a launch of ``linear``/``linear_silu_mul``/``rmsnorm_linear`` (a device that runs
    Triton: the op's body has checked) takes the GEMV for this call (see the module docstring)."""
    return (
        1 <= x.shape[0] <= max_m
        and gemv_enabled()
        and x.dim() == 2
        and w.dim() == 2
        and x.dtype == w.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and w.stride(1) == 1
    )


def linear_ref(x, w, bias, max_m, residual=None) -> torch.Tensor:
    """``kiln::linear`` off the GEMV: cuBLAS (``F.linear``; on CPU the op's path, ``max_m`` unused).
    With ``residual`` one ``addmm`` rounds the sum once (2-D ``x``, no bias), else ``F.linear`` then
    an add."""
    if residual is None:
        return torch.nn.functional.linear(x, w, bias)
    if bias is None and x.dim() == 2:
        return torch.addmm(residual, x, w.t())
    return residual + torch.nn.functional.linear(x, w, bias)


def _check_linear(x: torch.Tensor, w: torch.Tensor, bias, max_m, residual=None) -> None:
    if residual is not None and (residual.shape != (*x.shape[:-1], w.shape[0]) or residual.dtype != x.dtype):
        raise ValueError(
            f"linear: residual must be {(*x.shape[:-1], w.shape[0])} {x.dtype}, got "
            f"{tuple(residual.shape)} {residual.dtype}"
        )


@kiln_op("linear", ref=linear_ref, check=_check_linear)
def linear_forward(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    max_m: int,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [T, K] @ w [N, K]^T (+ bias)`` ``[T, N]``: the GEMV for ``1 <= T <= max_m``, else ``F.linear``.
    ``residual [T, N]``: ``residual + linear(x)``. The GEMV adds it in its epilogue after rounding
    the product (two roundings, as a separate add); otherwise :func:`linear_ref`."""
    if use_gemv(x, w, max_m) and (residual is None or residual.stride(-1) == 1):
        return gemv(x, w, bias, residual=residual)
    return linear_ref(x, w, bias, max_m, residual)


def _silu_mul_rows(gu: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul_ref`` over the last dimension of ``gu [..., 2I]`` (any leading dimensions)."""
    return silu_and_mul_ref(gu.reshape(-1, gu.shape[-1])).reshape(*gu.shape[:-1], gu.shape[-1] // 2)


def linear_silu_mul_ref(x, w, bias, max_m) -> torch.Tensor:
    """``kiln::linear_silu_mul`` off the GEMV in torch: ``F.linear`` then ``silu_and_mul_ref`` (the
    op on CPU; ``max_m`` unused)."""
    return _silu_mul_rows(torch.nn.functional.linear(x, w, bias))


def _check_gate_up(x: torch.Tensor, w: torch.Tensor, *_) -> None:
    if w.shape[0] % 2:
        raise ValueError(f"linear_silu_mul: w must have 2I rows, got {tuple(w.shape)}")


@kiln_op("linear_silu_mul", ref=linear_silu_mul_ref, check=_check_gate_up)
def linear_silu_mul_forward(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, max_m: int
) -> torch.Tensor:
    """``silu_and_mul(x @ w^T (+ bias))`` ``[T, I]`` for ``w [2I, K]`` (gate rows, then up rows): the
    GEMV for ``1 <= T <= max_m``, else ``F.linear`` then ``kiln::silu_and_mul``."""
    if use_gemv(x, w, max_m):
        return gemv(x, w, bias, gate_up=True)
    gu = torch.nn.functional.linear(x, w, bias)
    return DIRECT["silu_and_mul"](gu) if gu.dim() == 2 else _silu_mul_rows(gu)
