"""Fused QKV split + optional QK-norm + RoPE + paged KV-cache write: ``kiln::qkv_rope_kvwrite``.

Inputs (``T`` new tokens, ``S`` slots in the pool, ``P`` rows in the rotary table):

* ``qkv``       ``[T, (Hq + 2 Hkv) * D]`` bf16/f16/f32: the fused projection output, q heads, then
  k heads, then v heads (row stride free, unit column stride).
* ``positions`` ``[T]`` int64: rotary position of each token, ``0 <= p < P`` (not checked on the
  device: a check would need a host sync).
* ``cos_sin``   ``[P, rot]`` f32: ``rope_cos_sin_cache`` (cos in the first half, sin in the second).
* ``k_cache``, ``v_cache`` ``[S, Hkv, D]``: one layer's view of the pool ``[L, S, Hkv, D]``
  (unit stride on ``D``); mutated in place.
* ``out_slots`` ``[T]`` int64: pool row of each token; padding rows carry 0 (the reserved sink).
* ``q_norm_w``, ``k_norm_w`` ``[D]`` or None: Qwen3's per-head RMSNorm weights.
* ``k_scale``, ``v_scale`` ``[S, Hkv]`` float32, with ``float8_e4m3fn`` caches only (else None):
  one layer's view of the pool's per-row scales ``[L, S, Hkv]``; mutated in place.

Per token: RMSNorm each q and k head when its weight is given (float32 statistics, normalized
value cast to the input dtype, then times the weight, exactly like transformers'
``Qwen3RMSNorm``), rotate the first ``rot`` dims of q and k (NeoX or GPT-J pairs, float32 math),
write k and v (cast to the cache dtype) to row ``out_slots[t]`` of the caches, and return
``q [T, Hq, D]`` in ``qkv``'s dtype.

FP8 caches: each k and v head row ``x`` (float32: what a bf16 cache would get cast, after the norm
and the rotation for k) is stored as ``fp8(x * (448 / amax))``, ``amax = max |x|`` over the row's
``D`` values, and ``amax / 448`` goes to its ``[slot, head]`` scale, so the row stands for
``cache.float() * scale`` (:func:`quantize_kv_rows`, the reference's quantizer, gives the same
bytes). A row of zeros stores zeros and scale 0 (the multiplier's ``amax`` is floored at
``KV_AMAX_FLOOR``, which only rows below it notice).

One Triton program handles one token and a block of ``BLOCK_H`` heads of the concatenated
``q | k | v`` head list, so any head counts work; the grid depends on shapes only and nothing is
read back to the host (CUDA-graph safe). Nothing besides ``q`` and the cache rows (and their
scales) is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.attention.reference import FP8_KV_DTYPE, check_kv_scales, kv_scale_args
from kiln.ops.attention.rope import apply_rope_ref
from kiln.ops.common.launch import interpreting, next_pow2, pdl_args, pdl_trigger, pdl_wait, prewait
from kiln.ops.common.op import kiln_op
from kiln.ops.common.quant import FP8_MAX, round_e4m3_in_f32

KV_AMAX_FLOOR = 1e-30  # FP8 rows: the quantizing multiplier is 448 / max(amax, this) (finite for amax 0)


# --------------------------------------------------------------------------- reference
def head_rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm over the last dim of ``x [..., D]``: float32 statistics, the
    normalized value cast back to ``x.dtype``, then multiplied by ``w [D]`` (result dtype is
    torch's promotion of the two)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def quantize_kv_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 KV-cache rows: float32 ``x [..., D]`` -> ``(fp8 [..., D], scale [...] float32)`` with
    ``fp8 = x * (448 / amax)`` rounded to nearest even, ``scale = amax / 448`` (IEEE float32 math,
    as the kernel does); ``fp8.float() * scale[..., None]`` stands for ``x``. Zero rows: zeros, 0."""
    amax = x.abs().amax(-1)
    fp8_max = torch.full_like(amax, FP8_MAX)  # tensor / tensor: IEEE division (torch turns a scalar
    inv = fp8_max / amax.clamp(min=KV_AMAX_FLOOR)  # numerator into reciprocal * scalar)
    return (x * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE), amax / fp8_max


def qkv_rope_kvwrite_ref(qkv, positions, cos_sin, k_cache, v_cache, out_slots, num_q_heads, num_kv_heads,
                         head_dim, rotary_dim, is_neox, q_norm_w, k_norm_w, eps, k_scale,
                         v_scale):  # fmt: skip
    """Plain-torch composition with the op's contract (writes the caches, returns q): the op's
    reference, and, run on fake tensors, its shape rule. FP8 caches: rows quantized by
    :func:`quantize_kv_rows`, scales written to ``k_scale``/``v_scale``."""
    t = qkv.shape[0]
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    q = qkv[:, : hq * d].reshape(t, hq, d)  # q: [T, Hq, D]
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)  # k: [T, Hkv, D]
    v = qkv[:, (hq + hkv) * d :].reshape(t, hkv, d)  # v: [T, Hkv, D]
    if q_norm_w is not None:
        q = head_rmsnorm_ref(q, q_norm_w, eps)
    if k_norm_w is not None:
        k = head_rmsnorm_ref(k, k_norm_w, eps)
    q = apply_rope_ref(q, positions, cos_sin, rotary_dim, is_neox).to(qkv.dtype)
    slots = out_slots.long()
    if k_cache.dtype == FP8_KV_DTYPE:  # the float32 rows the kernel quantizes
        for cache, scale, x in (
            (k_cache, k_scale, apply_rope_ref(k.float(), positions, cos_sin, rotary_dim, is_neox)),
            (v_cache, v_scale, v.float()),
        ):
            rows, row_scales = quantize_kv_rows(x)  # [T, Hkv, D], [T, Hkv]
            cache[slots] = rows
            scale[slots] = row_scales
        return q
    k = apply_rope_ref(k, positions, cos_sin, rotary_dim, is_neox)
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)
    return q


# --------------------------------------------------------------------------- kernel
@triton.jit
def _rne_bf16(x, ON: tl.constexpr):
    """Round float32 ``x`` to the nearest-even bfloat16 value (kept in float32) when ``ON``.

    The Triton interpreter truncates float32 -> bfloat16 casts where the GPU rounds to nearest
    even; the launcher turns this on under the interpreter only, so CPU tests see GPU numerics.
    """
    if ON:
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        x = b.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _normed(x, rstd, src_ptr, w_ptr, offs, offs_ok, rows, ROUND: tl.constexpr, RNE: tl.constexpr):
    """Qwen3RMSNorm on the tile ``x [BH, N]`` (dims ``offs [N]``) for the heads flagged in ``rows``:
    ``x * rstd`` cast to the input dtype, times ``w[offs]``, cast again when ``ROUND``."""
    in_dtype = src_ptr.dtype.element_ty
    y = _rne_bf16(x * rstd[:, None], RNE).to(in_dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs_ok, other=0.0).to(tl.float32)  # [N]
    y = y * w[None, :]
    if ROUND:
        y = _rne_bf16(y, RNE).to(in_dtype).to(tl.float32)
    return tl.where(rows[:, None], y, x)


@triton.jit
def _store_head(
    dst,  # [BH, 1] pointers to the first element of each head's destination row
    oa,
    ob,
    op,
    a_off,
    b_off,
    p_off,
    m_rot,
    m_pass,
    rows,
    RNE: tl.constexpr,
    HAS_PASS: tl.constexpr,
):
    dt = dst.dtype.element_ty
    m = rows[:, None]
    tl.store(dst + a_off[None, :], _rne_bf16(oa, RNE).to(dt), mask=m_rot & m)
    tl.store(dst + b_off[None, :], _rne_bf16(ob, RNE).to(dt), mask=m_rot & m)
    if HAS_PASS:
        tl.store(dst + p_off[None, :], _rne_bf16(op, RNE).to(dt), mask=m_pass & m)


@triton.jit
def _fp8_rows(x, inv, ROUND_IN_F32: tl.constexpr):
    """FP8 rows: float32 tile ``x [BH, N]`` times its row's ``inv = 448 / amax`` ``[BH]``, clamped to
    +-448; rounded to the e4m3 grid here under the interpreter (whose cast truncates), else by the
    store's cast (round to nearest even)."""
    v = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    if ROUND_IN_F32:
        v = round_e4m3_in_f32(v)
    return v


@triton.jit
def _qkv_rope_kvwrite_kernel(
    qkv_ptr,
    pos_ptr,
    cs_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    q_ptr,
    qw_ptr,
    kw_ptr,
    ks_ptr,  # FP8 caches: per-row scales [S, Hkv] (else a dummy, never touched)
    vs_ptr,
    stride_qkv_t,
    stride_cs_p,
    stride_k_s,
    stride_k_h,
    stride_v_s,
    stride_v_h,
    stride_ks_s,
    stride_ks_h,
    stride_vs_s,
    stride_vs_h,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    ROT: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_QN: tl.constexpr,
    HAS_KN: tl.constexpr,
    ROUND_QN: tl.constexpr,  # round the normed q to the input dtype after the weight multiply
    ROUND_KN: tl.constexpr,
    RNE_IN: tl.constexpr,  # interpreter only: round-to-nearest-even for bf16 casts (see _rne_bf16)
    RNE_K: tl.constexpr,
    RNE_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (ops/common/launch.py)
    PREWAIT: tl.constexpr = False,  # position, cos/sin row and slot before the wait (KILN_PREWAIT)
    KV_FP8: tl.constexpr = False,  # fp8 caches: rows quantized with their amax, scales to ks/vs_ptr
    RNE_FP8: tl.constexpr = False,  # interpreter only: round to the e4m3 grid before the cast
    AMAX_FLOOR: tl.constexpr = 0.0,  # KV_AMAX_FLOOR (FP8 only)
):
    # One program: token t, heads h of the concatenated q | k | v head list. Each head row of D
    # values is three tiles: the first and second members of the rotation pairs (a, b) and the
    # pass-through dims past ROT (p).
    pdl_trigger(PDL)
    if not PREWAIT:
        pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    is_q = h < HQ
    is_k = (h >= HQ) & (h < HQ + HKV)
    is_v = (h >= HQ + HKV) & (h < HQ + 2 * HKV)
    h_ok = h < HQ + 2 * HKV
    HALF = ROT // 2
    HAS_PASS = ROT < D
    i = tl.arange(0, BLOCK_HALF)  # [BHALF] pair index
    i_ok = i < HALF
    if IS_NEOX:  # pairs (i, i + rot/2)
        a_off = i
        b_off = i + HALF
    else:  # pairs (2i, 2i + 1)
        a_off = 2 * i
        b_off = 2 * i + 1
    m_rot = h_ok[:, None] & i_ok[None, :]  # [BH, BHALF]
    p_off = ROT + tl.arange(0, BLOCK_PASS)  # [BPASS]
    p_ok = p_off < D
    m_pass = h_ok[:, None] & p_ok[None, :]  # [BH, BPASS]
    # step inputs (copied before the graph runs) and the cos/sin table: no kernel writes them
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cs_row = cs_ptr + pos * stride_cs_p
    cos = tl.load(cs_row + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]  # [1, BHALF]
    sin = tl.load(cs_row + HALF + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if PREWAIT:
        pdl_wait(PDL)

    row = qkv_ptr + t * stride_qkv_t + h[:, None] * D  # [BH, 1]
    a = tl.load(row + a_off[None, :], mask=m_rot, other=0.0).to(tl.float32)  # a: [BH, BHALF]
    b = tl.load(row + b_off[None, :], mask=m_rot, other=0.0).to(tl.float32)  # b: [BH, BHALF]
    p = tl.zeros((BLOCK_H, BLOCK_PASS), dtype=tl.float32)
    if HAS_PASS:
        p = tl.load(row + p_off[None, :], mask=m_pass, other=0.0).to(tl.float32)  # p: [BH, BPASS]

    if HAS_QN or HAS_KN:
        ss = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)
        if HAS_PASS:
            ss += tl.sum(p * p, axis=1)
        rstd = tl.rsqrt(ss / D + eps)  # [BH]
        if HAS_QN:
            a = _normed(a, rstd, qkv_ptr, qw_ptr, a_off, i_ok, is_q, ROUND_QN, RNE_IN)
            b = _normed(b, rstd, qkv_ptr, qw_ptr, b_off, i_ok, is_q, ROUND_QN, RNE_IN)
            if HAS_PASS:
                p = _normed(p, rstd, qkv_ptr, qw_ptr, p_off, p_ok, is_q, ROUND_QN, RNE_IN)
        if HAS_KN:
            a = _normed(a, rstd, qkv_ptr, kw_ptr, a_off, i_ok, is_k, ROUND_KN, RNE_IN)
            b = _normed(b, rstd, qkv_ptr, kw_ptr, b_off, i_ok, is_k, ROUND_KN, RNE_IN)
            if HAS_PASS:
                p = _normed(p, rstd, qkv_ptr, kw_ptr, p_off, p_ok, is_k, ROUND_KN, RNE_IN)

    # rotary on q and k heads: (a, b) -> (a cos - b sin, b cos + a sin); v heads pass through
    oa = tl.where(is_v[:, None], a, a * cos - b * sin)
    ob = tl.where(is_v[:, None], b, b * cos + a * sin)

    hq_i = tl.where(is_q, h, 0)
    q_dst = q_ptr + t * (HQ * D) + hq_i[:, None] * D  # q is contiguous [T, Hq, D]
    _store_head(q_dst, oa, ob, p, a_off, b_off, p_off, m_rot, m_pass, is_q, RNE_IN, HAS_PASS)
    hk_i = tl.where(is_k, h - HQ, 0)
    k_dst = k_ptr + slot * stride_k_s + hk_i[:, None] * stride_k_h
    hv_i = tl.where(is_v, h - HQ - HKV, 0)
    v_dst = v_ptr + slot * stride_v_s + hv_i[:, None] * stride_v_h
    if KV_FP8:  # each k and v head row over its three tiles: amax, then x * (448 / amax) and amax / 448
        amax = tl.maximum(tl.max(tl.abs(oa), axis=1), tl.max(tl.abs(ob), axis=1))  # [BH]
        if HAS_PASS:
            amax = tl.maximum(amax, tl.max(tl.abs(p), axis=1))
        inv = tl.math.div_rn(448.0, tl.maximum(amax, AMAX_FLOOR))
        row_scale = tl.math.div_rn(amax, 448.0)
        qa = _fp8_rows(oa, inv, RNE_FP8)
        qb = _fp8_rows(ob, inv, RNE_FP8)
        qp = _fp8_rows(p, inv, RNE_FP8)
        _store_head(k_dst, qa, qb, qp, a_off, b_off, p_off, m_rot, m_pass, is_k, False, HAS_PASS)
        tl.store(ks_ptr + slot * stride_ks_s + hk_i * stride_ks_h, row_scale, mask=is_k)
        _store_head(v_dst, qa, qb, qp, a_off, b_off, p_off, m_rot, m_pass, is_v, False, HAS_PASS)
        tl.store(vs_ptr + slot * stride_vs_s + hv_i * stride_vs_h, row_scale, mask=is_v)
    else:
        _store_head(k_dst, oa, ob, p, a_off, b_off, p_off, m_rot, m_pass, is_k, RNE_K, HAS_PASS)
        _store_head(v_dst, oa, ob, p, a_off, b_off, p_off, m_rot, m_pass, is_v, RNE_V, HAS_PASS)


def _pick_block_h(num_tokens: int, num_heads: int, head_dim: int) -> int:
    """Heads per program: about 2K elements per program for prefill, fewer (more programs) for
    small batches so that decode still spreads over the SMs."""
    target = 2048 if num_tokens >= 256 else 512
    return max(1, min(next_pow2(num_heads), target // next_pow2(head_dim)))


def _check(qkv, positions, cos_sin, k_cache, v_cache, out_slots, num_q_heads, num_kv_heads, head_dim, rotary_dim,
           is_neox, q_norm_w, k_norm_w, eps, k_scale, v_scale):  # fmt: skip
    """The op's argument check (both paths)."""
    hq, hkv, d, rot = num_q_heads, num_kv_heads, head_dim, rotary_dim
    if positions.shape != qkv.shape[:1] or out_slots.shape != qkv.shape[:1]:
        raise ValueError(
            f"positions {list(positions.shape)} and out_slots {list(out_slots.shape)} must be [T] "
            f"with T = qkv.shape[0] = {qkv.shape[0]}."
        )
    if qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * hkv) * d:
        raise ValueError(
            f"qkv must be [T, (num_q_heads + 2 * num_kv_heads) * head_dim] = [T, {(hq + 2 * hkv) * d}], "
            f"got {list(qkv.shape)}."
        )
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 3 or tuple(c.shape[1:]) != (hkv, d):
            raise ValueError(f"{name} must be [S, num_kv_heads={hkv}, head_dim={d}], got {list(c.shape)}.")
        if c.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride on head_dim; pass a view of a contiguous pool.")
    if rot % 2 or not 0 < rot <= d or cos_sin.shape[-1] != rot:
        raise ValueError(
            f"rotary_dim ({rot}) must be even, in (0, head_dim={d}], and equal cos_sin's columns "
            f"({cos_sin.shape[-1]})."
        )
    check_kv_scales("qkv_rope_kvwrite", k_cache, v_cache, k_scale, v_scale)


# --------------------------------------------------------------------------- op
@kiln_op(
    "qkv_rope_kvwrite",
    ref=qkv_rope_kvwrite_ref,
    check=_check,
    mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"),
)
def qkv_rope_kvwrite_triton(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    is_neox: bool,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    eps: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    *,
    block_h: int | None = None,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused kernel (see the module docstring): returns ``q [T, Hq, D]`` in ``qkv.dtype``,
    writes the caches (FP8 caches: and ``k_scale``/``v_scale`` ``[S, Hkv]``). ``out`` (``[T, Hq,
    D]``, contiguous, ``qkv.dtype``) receives q when given (tests poison it);
    ``block_h``/``num_warps`` override the launch for benchmarks."""
    t = qkv.shape[0]
    q = out if out is not None else qkv.new_empty((t, num_q_heads, head_dim))  # q: [T, Hq, D]
    if not q.is_contiguous() or q.shape != (t, num_q_heads, head_dim):
        raise ValueError(f"out must be a contiguous [T, Hq, D] = {[t, num_q_heads, head_dim]} tensor.")
    if t == 0:
        return q
    if qkv.stride(1) != 1 or cos_sin.stride(1) != 1:
        raise ValueError("qkv and cos_sin need unit stride on their last dim.")
    total = num_q_heads + 2 * num_kv_heads
    bh = block_h or _pick_block_h(t, total, head_dim)
    grid = (t, triton.cdiv(total, bh))
    rne = interpreting() and not qkv.is_cuda
    pdl = pdl_args(qkv)
    fp8 = k_scale is not None and v_scale is not None
    ks, vs, scale_strides = kv_scale_args(k_scale, v_scale, k_cache)
    _qkv_rope_kvwrite_kernel[grid](
        qkv,
        positions,
        cos_sin,
        k_cache,
        v_cache,
        out_slots,
        q,
        q_norm_w if q_norm_w is not None else qkv,  # dummy pointer, never read
        k_norm_w if k_norm_w is not None else qkv,
        ks,
        vs,
        qkv.stride(0),
        cos_sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        *scale_strides,
        float(eps),
        HQ=num_q_heads,
        HKV=num_kv_heads,
        D=head_dim,
        ROT=rotary_dim,
        IS_NEOX=bool(is_neox),
        HAS_QN=q_norm_w is not None,
        HAS_KN=k_norm_w is not None,
        ROUND_QN=q_norm_w is not None and torch.promote_types(qkv.dtype, q_norm_w.dtype) == qkv.dtype,
        ROUND_KN=k_norm_w is not None and torch.promote_types(qkv.dtype, k_norm_w.dtype) == qkv.dtype,
        RNE_IN=rne and qkv.dtype == torch.bfloat16,
        RNE_K=rne and k_cache.dtype == torch.bfloat16,
        RNE_V=rne and v_cache.dtype == torch.bfloat16,
        BLOCK_H=bh,
        BLOCK_HALF=next_pow2(rotary_dim // 2),
        BLOCK_PASS=next_pow2(max(1, head_dim - rotary_dim)),
        PREWAIT=prewait("rope"),
        KV_FP8=fp8,
        RNE_FP8=rne and fp8,
        AMAX_FLOOR=KV_AMAX_FLOOR if fp8 else 0.0,
        num_warps=num_warps,
        **pdl,
    )
    return q


__all__ = [
    "KV_AMAX_FLOOR",
    "head_rmsnorm_ref",
    "qkv_rope_kvwrite_ref",
    "qkv_rope_kvwrite_triton",
    "quantize_kv_rows",
]
