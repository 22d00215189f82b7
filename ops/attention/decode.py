"""Paged decode attention: split-KV flash-decoding, GQA-grouped.

``torch.ops.kiln.decode_attention(q, k_cache, v_cache, block_table, req_rows, seq_lens, sm_scale,
page_size, num_splits, sliding_window, logit_cap, k_scale=None, v_scale=None) -> out``

* q ``[B, Hq, D]``, k_cache ``[S, Hkv, D]``, v_cache ``[S, Hkv, Dv]`` (q's float dtype, or both
  ``float8_e4m3fn``; the last dim contiguous), block_table ``[R, M]`` int32, req_rows / seq_lens
  ``[B]`` int32.
* FP8 caches: k_scale / v_scale ``[S, Hkv]`` float32, row ``(s, h)`` standing for
  ``cache[s, h].float() * scale[s, h]`` (reference.py); None for other caches.
* out ``[B, Hq, Dv]`` in q's dtype. Request ``b``'s query sits at position ``seq_lens[b] - 1`` and
  sees keys ``0..seq_lens[b]-1`` (the last ``sliding_window`` of them if ``sliding_window > 0``);
  ``logit_cap > 0`` soft-caps the scaled scores. A request with ``seq_lens[b] == 0`` gets zeros.

Split kernel: grid ``(Hkv, B, num_splits)``: the KV heads of a request run side by side, so the
slices of one cache row (``[Hkv, D]``, contiguous) are read together. Each program takes all ``Hq / Hkv`` query heads of one
KV head (padded to 16 rows for ``tl.dot``), so every K/V row is read once per group, and walks its
share of the keys: ``ceil(span / num_splits)`` rounded up to the key block, computed in the kernel
from ``seq_lens`` (``_split_plan``) so that one launch serves every length (CUDA-graph safe). A
bucket's ``num_splits`` is sized for the block table's capacity, so a short request has far fewer
*active* splits (those that get keys: ``ceil(span / chunk)``, e.g. 10 of 128 at 600 tokens); the
others exit at once and write nothing. A request with at most one active split (and every request
when ``num_splits == 1``) is written straight to ``out`` by its split 0, zeros for
``seq_lens[b] == 0``. Otherwise each active split writes a partial output ``[B, Hq, num_splits, Dv]``
and its log-sum-exp (base 2, ``[B, Hq, num_splits]``, float32), and a second kernel, grid
``(B, Hq, cdiv(Dv, 64))``, merges each head's active partials (it recomputes the active count from
``seq_lens`` with the same ``_split_plan``). (A merge by the last split to arrive, in the split
kernel, measured slower on the H200 and was removed: docs/decode_budget.md, "Removed variants".)
Accumulation is float32 throughout.

FP8 caches (``KV_FP8``, a constexpr: the other caches compile to the kernel without it): K and V
tiles are converted to float16 (one instruction per two e4m3 values on sm_90, whose values float16
holds exactly; bfloat16 needs a second conversion per value: 901 instructions per 64-key block
against 716, and q and the weights round finer in float16), q too, for float16 dots (float32 q:
float32 dots); the scores of key ``n`` are multiplied by its ``k_scale`` (folded into the softmax
scale) and the softmax weights of key ``n`` by its ``v_scale`` over the block's largest (kept in
[0, 1], float16's normal range) before P @ V, whose result takes that largest back (the denominator
sums the unscaled weights). Scales load with their rows' masks (0 for masked keys). An FP8 cache's
split kernel takes no pre-wait loads (the ``attn`` part of the ``prewait`` setting applies to 16-bit
caches only): held across the wait, the first block's rows and scales made ptxas spill (412 bytes,
bench/kernel_probe.py) and lose the asynchronous copies, and on the H100 (session 34,
``test_decode_engine_sweep``) the kernel took 0.359 ms with them and 0.267 without at batch 256 x
1024 keys, page 16 (0.426 and 0.282 at page 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.ops.attention.reference import (
    check_attention,
    decode_attention_ref,
    empty_attention_out,
    kv_scale_args,
)
from kiln.ops.common.launch import interpreting, next_pow2, pdl_args, pdl_trigger, pdl_wait, prewait
from kiln.ops.common.op import kiln_op

MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (q load, partial write) dominates
MAX_SPLITS = 128
ONE_SPLIT_PROGRAMS_PER_SM = 3  # from this many (batch x KV heads) programs per SM, no split


def choose_num_splits(
    batch: int, max_seq_len: int, num_kv_heads: int, num_sms: int = 132, programs_per_sm: int = 8
) -> int:
    """Split-KV factor for a decode bucket.

    Aims at about ``programs_per_sm`` (eight) programs per SM (``batch * num_kv_heads * splits``;
    verify attention, whose programs carry several tokens each, aims at fewer), so the memory system
    sees enough loads in flight and the last wave is short, while giving every split at least
    ``MIN_KEYS_PER_SPLIT`` keys of a ``max_seq_len`` sequence. Shorter sequences use fewer splits
    on their own: the kernel sizes splits from the actual length, and the rest exit at once.
    Once the batch alone gives ``ONE_SPLIT_PROGRAMS_PER_SM`` programs per SM, one split: no
    partials, no merge (batch 64, 8 KV heads, 512 keys on the H200: 53.9 us with one split vs 65.2
    us with three, bench/results/2026-12-04_h200_s17c_*).
    """
    if batch < 1 or num_kv_heads < 1 or max_seq_len < 1:
        raise ValueError(
            f"choose_num_splits: batch ({batch}), max_seq_len ({max_seq_len}) and num_kv_heads "
            f"({num_kv_heads}) must all be >= 1."
        )
    if batch * num_kv_heads >= ONE_SPLIT_PROGRAMS_PER_SM * num_sms:
        return 1
    want = math.ceil(programs_per_sm * num_sms / (batch * num_kv_heads))
    by_len = max(1, max_seq_len // MIN_KEYS_PER_SPLIT)
    return max(1, min(want, by_len, MAX_SPLITS))


def split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernels' partial outputs ``[B, H, num_splits, W]`` and base-2 log-sum-exps ``[B, H,
    num_splits]`` (float32) for an output ``out [B, H, W]``; with one split none are written (the
    kernel writes ``out`` directly) and a one-element float32 placeholder stands in for both, so the
    kernel's pointer types (part of a Triton kernel's identity) are those of several splits: an eager
    step with one split needs no kernel the warm-up did not build."""
    if num_splits == 1:
        placeholder = torch.empty(1, dtype=torch.float32, device=out.device)
        return placeholder, placeholder
    b, h, w = out.shape
    mid_o = torch.empty(b, h, num_splits, w, dtype=torch.float32, device=out.device)
    return mid_o, torch.empty(b, h, num_splits, dtype=torch.float32, device=out.device)


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 32  # keys per iteration
    num_warps: int = 4
    num_stages: int = 2


def default_config(head_dim: int, v_head_dim: int, kv_fp8: bool = False) -> DecodeConfig:
    """The launch for a head size and cache format. H200 sweep at the engine's shapes (batch 64 / 512
    tokens and 256 / 1024, Llama-3.1-8B heads, `test_decode_engine_sweep`,
    bench/results/2026-12-04_h200_s20c_*): 32-key blocks beat 64 for a 16-bit cache (page 16:
    0.319 vs 0.354 ms at 256 / 1024; page 1: 0.353 vs 0.493). For an FP8 cache, without its
    pre-wait loads (module docstring), 128-key blocks on 4 warps were best at all four shapes on the
    H100 (session 34: 0.267 ms at 256 / 1024 page 16 against 0.314 for the earlier 32-key blocks on
    2 warps with 3 stages, 0.282 vs 0.307 at page 1, 0.0465 vs 0.0491 ms at 64 / 512)."""
    if interpreting():
        return DecodeConfig(block_n=16, num_warps=1, num_stages=1)
    if max(head_dim, v_head_dim) > 128:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    if kv_fp8:
        return DecodeConfig(block_n=128, num_warps=4, num_stages=2)
    return DecodeConfig(block_n=32, num_warps=4, num_stages=2)


@triton.jit
def tl_softcap(s, cap):
    # cap * tanh(s / cap), through exp of a non-positive argument (never overflows)
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def tl_dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: the Triton 3.9 interpreter multiplies bf16 tiles as their raw uint16 bits; the
    # tests run through it with float32 operands (same values: bf16 -> f32 is exact).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def softmax_block(s, v, m_i, l_i, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One key block of the online softmax: scores ``s [M, N]`` (log2 units, masked keys -inf) and
    values ``v [N, W]`` into the running max ``m_i [M]``, sum ``l_i [M]`` and ``acc [M, W]``
    (float32); returns ``(acc, m_i, l_i)``. ``m_i`` starts finite, so ``exp2(m_i - m_new)`` is
    never NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl_dot(p.to(v.dtype), v, PREC, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _split_plan(seq_len, num_splits, sliding_window, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """How one request's keys are dealt to the splits; shared by the split kernel and the merge
    so that they agree on which splits wrote a partial.

    Keys ``[lo, seq_len)`` are visible. Split ``s`` takes ``[base + s * chunk, min(base + (s + 1) *
    chunk, seq_len))``, ``base`` being ``lo`` rounded down to the key block and ``chunk`` a whole
    number of key blocks. Splits ``0..active-1`` get keys (split 0 at least one visible key, the
    others only visible keys); ``active`` is 0 for ``seq_len == 0`` and at most ``num_splits``.
    """
    lo = seq_len * 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - sliding_window, 0)
    base = (lo // BLOCK_N) * BLOCK_N
    span = seq_len - base  # >= 0
    # ceil divisions spelled out (tl.cdiv is a nested jit call, slow in the interpreter)
    chunk = ((span + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    safe = tl.maximum(chunk, 1)
    active = (span + safe - 1) // safe
    return lo, base, chunk, active


@triton.jit
def _merge_splits(
    mid_o_ptr, mid_lse_ptr, rows, hmask, dv, active,
    H: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """Merges the partials of splits ``0..active-1`` of ``H`` heads, columns ``dv``: ``rows [H]``
    (int64) is each head's first partial row (``(b * Hq + h) * num_splits``), ``hmask [H]`` its
    validity. Returns ``[H, BLOCK_DV]`` float32, zeros where no split had keys. Partials are read
    with ``.cg`` (from L2, not L1)."""
    m = tl.full([H], -1.0e30, tl.float32)  # finite sentinel: -inf lse (masked) weighs 0
    l = tl.zeros([H], tl.float32)
    acc = tl.zeros([H, BLOCK_DV], tl.float32)
    for s0 in range(0, active, TILE):
        s = s0 + tl.arange(0, TILE)
        smask = (s < active)[:, None] & hmask[None, :]  # [TILE, H]
        idx = rows[None, :] + s[:, None]  # [TILE, H]
        lse = tl.load(mid_lse_ptr + idx, mask=smask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(
            mid_o_ptr + idx[:, :, None] * DV + dv[None, None, :],
            mask=smask[:, :, None] & (dv[None, None, :] < DV),
            other=0.0,
            cache_modifier=".cg",
        )  # o: [TILE, H, BLOCK_DV]
        m_new = tl.maximum(m, tl.max(lse, 0))  # [H]
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new[None, :])  # [TILE, H]
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        l = l * alpha + tl.sum(w, 0)
        m = m_new
    return acc / tl.where(l > 0.0, l, 1.0)[:, None]


@triton.jit
def _cache_rows(base, slot, stride, cols, rmask, NCOLS: tl.constexpr, KV_FP8: tl.constexpr, DT: tl.constexpr):
    """Rows ``slot`` ``[BLOCK_N]`` of one head of a K or V cache, ``[BLOCK_N, len(cols)]``; rows off
    ``rmask`` and columns from ``NCOLS`` read 0. FP8 rows (``KV_FP8``) come converted to ``DT``
    (the dots' dtype), still unscaled."""
    x = tl.load(
        base + slot[:, None] * stride + cols[None, :],
        mask=rmask[:, None] & (cols[None, :] < NCOLS),
        other=0.0,
    )
    if KV_FP8:
        x = x.to(DT)
    return x


@triton.jit
def kv_row_scales(base, slot, stride, rmask, KV_FP8: tl.constexpr):
    """FP8 caches: the scales of rows ``slot`` ``[BLOCK_N]`` of one KV head (``base`` points at the
    head's column of ``[S, Hkv]``), 0 off ``rmask``; else a dummy 0 (never used)."""
    if KV_FP8:
        return tl.load(base + slot * stride, mask=rmask, other=0.0)
    else:
        return 0.0


@triton.jit
def _block_kv(
    k_base, v_base, ks_base, vs_base, slot, stride_ks, stride_vs, stride_kss, stride_vss, d, dv, rmask,
    D: tl.constexpr, DV: tl.constexpr, KV_FP8: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    """One key block of one KV head, rows ``slot`` ``[BLOCK_N]`` (``rmask`` off: zeros): ``(k, v, k
    scales, v scales)``, K and V loaded together so both reads are in flight before the scores need
    them (FP8: rows in ``DT``, unscaled; else the scales are dummy zeros)."""
    k = _cache_rows(k_base, slot, stride_ks, d, rmask, D, KV_FP8, DT)  # [BLOCK_N, BLOCK_D]
    v = _cache_rows(v_base, slot, stride_vs, dv, rmask, DV, KV_FP8, DT)  # [BLOCK_N, BLOCK_DV]
    ks = kv_row_scales(ks_base, slot, stride_kss, rmask, KV_FP8)  # [BLOCK_N]
    vs = kv_row_scales(vs_base, slot, stride_vss, rmask, KV_FP8)
    return k, v, ks, vs


@triton.jit
def _block_slots(bt_row, offs, end, PAGE: tl.constexpr):
    """Cache slots of key positions ``offs`` ``[BLOCK_N]`` through one block-table row (past
    ``end``: page 0's slots, masked out by the caller)."""
    page = tl.load(bt_row + offs // PAGE, mask=offs < end, other=0)
    return page.to(tl.int64) * PAGE + offs % PAGE


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, rows_ptr, lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, ks_ptr, vs_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
    stride_ob, stride_oh, stride_kss, stride_ksh, stride_vss, stride_vsh,
    num_q_heads, num_splits, sm_scale, logit_cap, sliding_window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr,
    PREWAIT: tl.constexpr = False,  # step inputs and the first block's cached K/V before the wait
    KV_FP8: tl.constexpr = False,  # fp8 caches with per-row scales ks_ptr / vs_ptr [S, Hkv]
):  # fmt: skip
    # programmatic dependent launch (ops/common/launch.py): wait before any access, except PREWAIT's
    # loads of what nothing in the graph writes (the step inputs, keys cached by earlier steps)
    pdl_trigger(PDL)
    if not PREWAIT:
        pdl_wait(PDL)
    kvh = tl.program_id(0)  # a request's KV heads side by side: they read the same cache rows
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    lo, base, chunk, active = _split_plan(seq_len, num_splits, sliding_window, BLOCK_N, HAS_WINDOW)
    if split >= tl.maximum(active, 1):
        if PREWAIT:
            pdl_wait(PDL)  # every program waits (ops/common/launch.py)
        return  # no keys here: write nothing (split 0 stays to write an empty request's zeros)
    row = tl.load(rows_ptr + b).to(tl.int64)
    start = base + split * chunk  # this program takes keys [start, end)
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g  # [GROUP_PAD]
    hmask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    ks_base = ks_ptr + kvh * stride_ksh  # FP8: this head's column of the scales
    vs_base = vs_ptr + kvh * stride_vsh
    if KV_FP8 and q_ptr.dtype.element_ty != tl.float32:
        DT = tl.float16  # FP8 tiles and q (see the module docstring)
    else:
        DT = q_ptr.dtype.element_ty
    tl.static_assert(not (PREWAIT and KV_FP8), "an FP8 cache takes no pre-wait loads (module docstring)")
    if PREWAIT:  # the first block's cached keys now; the new one (seq_len - 1) after the wait
        offs0 = start + tl.arange(0, BLOCK_N)
        kmask0 = offs0 < end
        if HAS_WINDOW:
            kmask0 = kmask0 & (offs0 >= lo)
        slot0 = _block_slots(bt_ptr + row * stride_bt, offs0, end, PAGE)  # [BLOCK_N]
        old0 = kmask0 & (offs0 != seq_len - 1)
        k_pre, v_pre, ks_pre, vs_pre = _block_kv(
            k_base, v_base, ks_base, vs_base, slot0, stride_ks, stride_vs, stride_kss, stride_vss, d, dv,
            old0, D, DV, KV_FP8, DT,
        )  # fmt: skip
        pdl_wait(PDL)
        new0 = kmask0 & (offs0 == seq_len - 1)  # [BLOCK_N]: the row the kernel before wrote
        k_new, v_new, _ks, _vs = _block_kv(
            k_base, v_base, ks_base, vs_base, slot0, stride_ks, stride_vs, stride_kss, stride_vss, d, dv,
            new0, D, DV, KV_FP8, DT,
        )  # fmt: skip
        k_pre = tl.where(new0[:, None], k_new, k_pre)
        v_pre = tl.where(new0[:, None], v_new, v_pre)
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=hmask[:, None] & (d[None, :] < D),
        other=0.0,
    ).to(DT)  # q: [GROUP_PAD, BLOCK_D]
    qk_scale = sm_scale * 1.4426950408889634  # log2(e) folded in: softmax runs on exp2

    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)  # finite: exp2(m_i - m_new) never NaN
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        kmask = offs < end
        if HAS_WINDOW:
            kmask = kmask & (offs >= lo)
        if PREWAIT:  # (nested: a constexpr and a tensor in one condition compile as a tensor)
            if n0 == start:
                k, v, ks, vs = k_pre, v_pre, ks_pre, vs_pre  # loaded before the wait
            else:
                k, v, ks, vs = _block_kv(
                    k_base, v_base, ks_base, vs_base, _block_slots(bt_ptr + row * stride_bt, offs, end, PAGE),
                    stride_ks, stride_vs, stride_kss, stride_vss, d, dv, kmask, D, DV, KV_FP8, DT,
                )  # fmt: skip
        else:
            k, v, ks, vs = _block_kv(
                k_base, v_base, ks_base, vs_base, _block_slots(bt_ptr + row * stride_bt, offs, end, PAGE),
                stride_ks, stride_vs, stride_kss, stride_vss, d, dv, kmask, D, DV, KV_FP8, DT,
            )  # fmt: skip
        s = tl_dot(q, tl.trans(k), PREC, UPCAST)  # [GROUP_PAD, BLOCK_N] f32
        if HAS_CAP:
            if KV_FP8:  # key n's scale, folded into the softmax scale
                s = tl_softcap(s * (ks * sm_scale)[None, :], logit_cap) * 1.4426950408889634
            else:
                s = tl_softcap(s * sm_scale, logit_cap) * 1.4426950408889634
        elif KV_FP8:
            s = s * (ks * qk_scale)[None, :]
        else:
            s = s * qk_scale
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:  # value row n's scale on its weights (the denominator l_i sums them unscaled)
            v_top = tl.max(vs, 0)  # the block's largest: the weights stay in [0, 1]
            v_top = tl.where(v_top > 0.0, v_top, 1.0)
            p = p * (vs / v_top)[None, :]
            acc = acc * alpha[:, None] + tl_dot(p.to(v.dtype), v, PREC, UPCAST) * v_top
        else:
            acc = acc * alpha[:, None] + tl_dot(p.to(v.dtype), v, PREC, UPCAST)
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]  # [GROUP_PAD, BLOCK_DV]; zeros without keys
    omask = hmask[:, None] & (dv[None, :] < DV)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dv[None, :]
    if active <= 1:  # the only split of this request (or an empty one; always when DIRECT)
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=omask)
    elif not DIRECT:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # [GROUP_PAD]
        first = (b.to(tl.int64) * num_q_heads + heads) * num_splits  # [GROUP_PAD]
        tl.store(mid_lse_ptr + first + split, lse, mask=hmask)
        tl.store(mid_o_ptr + (first + split)[:, None] * DV + dv[None, :], o, mask=omask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, lens_ptr, out_ptr, stride_ob, stride_oh, num_q_heads, num_splits,
    sliding_window, DV: tl.constexpr, BLOCK_DV: tl.constexpr, TILE: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, PDL: tl.constexpr,
    PREWAIT: tl.constexpr = False,  # the request's length (a step input) before the wait
):  # fmt: skip
    # grid (B, Hq, cdiv(Dv, BLOCK_DV)): merges the active splits of one head for BLOCK_DV columns
    pdl_trigger(PDL)
    if not PREWAIT:
        pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    _lo, _base, _chunk, active = _split_plan(seq_len, num_splits, sliding_window, BLOCK_N, HAS_WINDOW)
    if PREWAIT:
        pdl_wait(PDL)  # on every path (ops/common/launch.py)
    if active <= 1:
        return  # the split kernel wrote this request's output directly
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    rows = tl.zeros([1], tl.int64) + (b.to(tl.int64) * num_q_heads + h) * num_splits  # [1]
    hmask = rows >= 0  # [1], true: the one head is always valid
    out = _merge_splits(mid_o_ptr, mid_lse_ptr, rows, hmask, dv, active, 1, DV, BLOCK_DV, TILE)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dv[None, :] < DV)


def check_decode(q, k_cache, v_cache, block_table, req_rows, seq_lens, sm_scale, page_size, num_splits,
                 sliding_window, logit_cap, k_scale=None, v_scale=None):  # fmt: skip
    """``kiln::decode_attention``'s argument check (both paths)."""
    check_attention(q, k_cache, v_cache, page_size, k_scale, v_scale)
    if num_splits < 0:
        raise ValueError(f"decode_attention: num_splits must be >= 0 (0 = auto), got {num_splits}.")


@kiln_op("decode_attention", ref=decode_attention_ref, check=check_decode, fake=empty_attention_out)
def decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    req_rows: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, page_size: int, num_splits: int,
    sliding_window: int, logit_cap: float, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, *, config: DecodeConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """Paged decode attention ``[B, Hq, D] -> [B, Hq, Dv]`` (the module docstring): the Triton
    kernels; ``k_scale``/``v_scale`` ``[S, Hkv]`` float32 with FP8 caches, else None. ``config``
    overrides the block size and launch parameters (benchmarks sweep it)."""
    bsz, hq, d = q.shape
    stride_qb, stride_qh = q.stride(0), q.stride(1)
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    if num_splits == 0:  # auto: from the batch and the block table's context capacity
        num_splits = choose_num_splits(max(bsz, 1), block_table.shape[1] * page_size, hkv)
    group = hq // hkv
    cfg = config or default_config(d, dv, k_scale is not None)
    out = torch.empty(bsz, hq, dv, dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    direct = num_splits == 1
    mid_o, mid_lse = split_partials(out, num_splits)
    block_table = block_table.to(torch.int32)
    block_dv = max(16, next_pow2(dv))
    pdl = pdl_args(q)
    ks, vs, scale_strides = kv_scale_args(k_scale, v_scale, k_cache)
    _decode_split_kernel[(hkv, bsz, num_splits)](
        q, k_cache, v_cache, block_table, req_rows, seq_lens, out, mid_o, mid_lse, ks, vs,
        stride_qb, stride_qh, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), block_table.stride(0), out.stride(0), out.stride(1), *scale_strides,
        hq, num_splits, float(sm_scale), float(logit_cap), int(sliding_window),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), D=d,
        BLOCK_D=max(16, next_pow2(d)), DV=dv, BLOCK_DV=block_dv, PAGE=page_size,
        BLOCK_N=cfg.block_n,
        HAS_CAP=logit_cap > 0, HAS_WINDOW=sliding_window > 0, DIRECT=direct,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
        PREWAIT=prewait("attn") and k_scale is None, KV_FP8=k_scale is not None,
    )  # fmt: skip
    if not direct:
        block_dv = min(64, block_dv)
        _decode_merge_kernel[(bsz, hq, triton.cdiv(dv, block_dv))](
            mid_o, mid_lse, seq_lens, out, out.stride(0), out.stride(1), hq, num_splits,
            int(sliding_window), DV=dv, BLOCK_DV=block_dv, TILE=min(64, next_pow2(num_splits)),
            BLOCK_N=cfg.block_n, HAS_WINDOW=sliding_window > 0, num_warps=4,
            PREWAIT=prewait("attn"), **pdl,
        )  # fmt: skip
    return out
