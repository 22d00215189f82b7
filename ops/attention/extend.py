"""Paged extend (prefill) attention: new tokens over a cached prefix, causal within the chunk.

``torch.ops.kiln.extend_attention(q, k_cache, v_cache, block_table, req_rows, seq_lens, qo_indptr,
sm_scale, page_size, sliding_window, logit_cap, k_scale=None, v_scale=None, tree_mask=None) -> out``

* q ``[T, Hq, D]``; k_cache ``[S, Hkv, D]``, v_cache ``[S, Hkv, Dv]``; block_table ``[R, M]``
  int32; req_rows, seq_lens ``[B]`` int32; qo_indptr ``[B + 1]`` int32 with ``qo_indptr[0] == 0``.
* FP8 caches (``float8_e4m3fn``): k_scale / v_scale ``[S, Hkv]`` float32 (row ``(s, h)`` stands
  for ``cache[s, h].float() * scale[s, h]``); None for other caches.
* Request ``b``'s new tokens are rows ``qo_indptr[b]:qo_indptr[b+1]`` of ``q``, at positions
  ``seq_lens[b] - n_b + j``; their K/V are already in the cache. Query ``i`` sees keys ``j <= i``
  (and ``i - j < sliding_window`` when that is > 0); ``logit_cap > 0`` soft-caps the scores.
* out ``[T, Hq, Dv]`` in q's dtype; rows past ``qo_indptr[B]`` (bucket padding) are zeros.
* Token trees (speculative verification, runtime/spec_tree.py): ``tree_mask`` ``[T]`` int64, row
  ``i`` a bitmask over its request's chunk: bit ``j`` set iff the chunk's token ``j`` is an
  ancestor of token ``i`` or ``i`` itself (chunks of at most 64 tokens, each token's parent earlier
  in the chunk). Token ``i`` then sees the whole prefix and, of the chunk, only the tokens of its
  bits (still only ``j <= i``). The chunk's K/V sit in slots by token index (positions ``seq_lens[b]
  - n_b + j``, as without a mask); the RoPE positions they were written with (prefix + depth) are
  the caller's. Sliding windows are refused with a tree (their distances would be by depth). None
  (the default) is plain causal attention, the kernel compiled without the tree code (``TREE``).

Kernel: flash attention (online softmax in float32, ``exp2`` with log2(e) folded into the scale,
``tl.dot`` for QK^T and PV). A program owns ``BLOCK_M`` rows of a query tile: ``BLOCK_M // PACK``
tokens of one request times ``PACK`` query heads that share a KV head (GQA packing: K/V tiles are
read once for the pack). The grid is ``(cdiv(T, BLOCK_M // PACK) + B, Hq / PACK)``, computed from
shapes only; each program finds its (request, tile) by scanning ``qo_indptr`` (later tiles, which
see more keys, are handed out first), and programs past the work zero the padding rows or exit.
Keys below the tile's first query position are visited without masks; the causal diagonal and
sliding windows with masks (with a tree, every key of the chunk is masked). FP8 caches (the
``KV_FP8`` constexpr) as in decode.py: tiles converted to q's dtype, key scales on the score columns
(folded into the softmax scale), value scales on the softmax weights before P @ V (the denominator
sums them unscaled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.ops.attention.decode import kv_row_scales, tl_dot, tl_softcap
from kiln.ops.attention.reference import (
    check_attention,
    empty_attention_out,
    extend_attention_ref,
    kv_scale_args,
)
from kiln.ops.common.launch import interpreting, next_pow2
from kiln.ops.common.op import kiln_op


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int = 128  # rows of a query tile (tokens x packed heads)
    block_n: int = 64  # keys per iteration
    pack: int = 0  # query heads per program; 0 = the largest divisor of the GQA group <= max_pack
    max_pack: int = 0  # bound for the automatic pack; 0 = the whole group when it fits
    num_warps: int = 8
    num_stages: int = 2


def default_config(head_dim: int, v_head_dim: int, dtype: torch.dtype = torch.bfloat16) -> ExtendConfig:
    if interpreting():
        return ExtendConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:  # exact fp32 dots run on FMA units: small tiles avoid spills
        return ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
    if max(head_dim, v_head_dim) > 128:
        return ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    # H200 sweep (bench/results/2026-11-29_h200_sweeps.json, 4096 new tokens over a 4096 prefix):
    # packing 2 heads beat packing the whole group of 4 (53.2% vs 48.4% of the bf16 matmul rate)
    return ExtendConfig(block_m=128, block_n=64, max_pack=2, num_warps=8, num_stages=2)


def _resolve_pack(cfg: ExtendConfig, group: int) -> int:
    if cfg.pack:
        if group % cfg.pack or cfg.block_m < cfg.pack:
            raise ValueError(
                f"extend_attention: pack ({cfg.pack}) must divide the GQA group ({group}) and be "
                f"<= block_m ({cfg.block_m})."
            )
        return cfg.pack
    # the whole group (or max_pack heads) when it leaves at least 16 tokens per tile, else the
    # largest divisor that does
    limit = cfg.max_pack or group
    return max(
        p
        for p in range(1, min(group, limit) + 1)
        if group % p == 0 and cfg.block_m // p >= min(16, cfg.block_m)
    )


@triton.jit
def _extend_step(
    q, acc, m_i, l_i, n0, q_pos, kv_end, row, k_base, v_base, bt_ptr, stride_bt, stride_ks,
    stride_vs, sm_scale, logit_cap, sliding_window, ks_base, vs_base, stride_kss, stride_vss,
    tree_bits, prefix,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
    TREE: tl.constexpr,
):  # fmt: skip
    """One key block: online-softmax update of ``acc [BLOCK_M, BLOCK_DV]``, ``m_i``, ``l_i``.
    ``TREE``: ``tree_bits [BLOCK_M]`` int64 are the rows' ancestor masks over the chunk, which
    starts at key position ``prefix`` (unused otherwise)."""
    kpos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    kvalid = kpos < kv_end  # always true in the unmasked phase (blocks end before kv_end)
    if MASKED:
        page = tl.load(bt_ptr + row * stride_bt + kpos // PAGE, mask=kvalid, other=0)
    else:
        page = tl.load(bt_ptr + row * stride_bt + kpos // PAGE)
    slot = page.to(tl.int64) * PAGE + kpos % PAGE  # [BLOCK_N]
    k_ptrs = k_base + slot[:, None] * stride_ks + d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=kvalid[:, None] & (d[None, :] < D), other=0.0)
    elif D != BLOCK_D:
        k = tl.load(k_ptrs, mask=d[None, :] < D, other=0.0)
    else:
        k = tl.load(k_ptrs)  # unmasked phase: whole blocks of existing keys
    # k: [BLOCK_N, BLOCK_D]
    if KV_FP8:  # fp8 rows -> q's dtype (exact), their scales (0 for masked keys)
        k = k.to(q.dtype)
        ks = kv_row_scales(ks_base, slot, stride_kss, kvalid, KV_FP8)  # [BLOCK_N]
        vs = kv_row_scales(vs_base, slot, stride_vss, kvalid, KV_FP8)
    s = tl_dot(q, tl.trans(k), PREC, UPCAST)  # [BLOCK_M, BLOCK_N] f32
    if HAS_CAP:
        if KV_FP8:  # key n's scale, folded into the softmax scale
            s = tl_softcap(s * (ks * sm_scale)[None, :], logit_cap) * 1.4426950408889634
        else:
            s = tl_softcap(s * sm_scale, logit_cap) * 1.4426950408889634
        qk_scale = 1.0
    elif KV_FP8:
        s = s * (ks * (sm_scale * 1.4426950408889634))[None, :]
        qk_scale = 1.0
    else:
        qk_scale = sm_scale * 1.4426950408889634  # applied below in one FMA with the max
    if MASKED:
        vis = (kpos[None, :] <= q_pos[:, None]) & kvalid[None, :]
        if HAS_WINDOW:
            vis = vis & (q_pos[:, None] - kpos[None, :] < sliding_window)
        if TREE:  # a key of the chunk only where the row's bit of its node is set
            rel = kpos - prefix  # [BLOCK_N] node index of the key in the chunk
            bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)[None, :]) & 1
            vis = vis & ((rel < 0)[None, :] | (bit != 0))
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # log2 units
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_base + slot[:, None] * stride_vs + dv[None, :]
    if MASKED:
        v = tl.load(v_ptrs, mask=kvalid[:, None] & (dv[None, :] < DV), other=0.0)
    elif DV != BLOCK_DV:
        v = tl.load(v_ptrs, mask=dv[None, :] < DV, other=0.0)
    else:
        v = tl.load(v_ptrs)
    # v: [BLOCK_N, BLOCK_DV]
    if KV_FP8:  # value row n's scale on its weights (l_i above summed them unscaled)
        v = v.to(q.dtype)
        p = p * vs[None, :]
    acc = acc * alpha[:, None] + tl_dot(p.to(v.dtype), v, PREC, UPCAST)
    return acc, m_new, l_i


@triton.jit
def find_tile(indptr_ptr, num_reqs, t, TOK: tl.constexpr, SCAN: tl.constexpr):
    """The request of query tile ``t``, tiles numbered request by request (``cdiv(n_b, TOK)`` for
    request ``b``'s ``n_b`` new tokens, from ``qo_indptr``): ``(count, before)``, ``count`` the
    requests whose tiles all come before ``t`` (so ``t``'s request, or ``num_reqs`` past the last
    tile) and ``before`` their tiles. ``qo_indptr`` is scanned ``SCAN`` requests at a time; a request's
    end counts the tiles of every request before it, done or not (a request still open at the end of
    one round must count in the next: the 70-request test)."""
    count = t * 0
    before = t * 0
    scanned = t * 0  # tiles of every request scanned so far
    for b0 in range(0, num_reqs, SCAN):
        idx = b0 + tl.arange(0, SCAN)
        valid = idx < num_reqs
        lo_b = tl.load(indptr_ptr + idx, mask=valid, other=0)
        hi_b = tl.load(indptr_ptr + idx + 1, mask=valid, other=0)
        tiles = (hi_b - lo_b + TOK - 1) // TOK  # [SCAN], 0 where not valid
        done = valid & (scanned + tl.cumsum(tiles, 0) <= t)
        count += tl.sum(done.to(tl.int32), 0)
        before += tl.sum(tl.where(done, tiles, 0), 0)
        scanned += tl.sum(tiles, 0)
    return count, before


@triton.jit(do_not_specialize=["num_reqs", "num_tokens"])  # any step's counts: one kernel
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, rows_ptr, lens_ptr, indptr_ptr, ks_ptr, vs_ptr, tm_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, stride_ot,
    stride_oh, stride_kss, stride_ksh, stride_vss, stride_vsh, num_reqs, num_tokens, sm_scale,
    logit_cap, sliding_window,
    GROUP: tl.constexpr, PACK: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SCAN: tl.constexpr, HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr = False,  # fp8 caches with per-row scales ks_ptr / vs_ptr [S, Hkv]
    TREE: tl.constexpr = False,  # token trees: tm_ptr [T] int64 ancestor bitmasks (else unused)
):  # fmt: skip
    TOK = BLOCK_M // PACK  # tokens per tile (constexpr)
    t = tl.num_programs(0) - 1 - tl.program_id(0)  # tile index; late (long) tiles start first
    h0 = tl.program_id(1) * PACK
    kvh = h0 // GROUP

    count, before = find_tile(indptr_ptr, num_reqs, t, TOK, SCAN)

    r = tl.arange(0, BLOCK_M)
    tok = r // PACK  # token of each row within the tile
    head = h0 + r % PACK  # [BLOCK_M]
    rows_ok = r < TOK * PACK
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    o_cols = out_ptr + head[:, None] * stride_oh + dv[None, :]
    if count < num_reqs:
        b = count
        qo_start = tl.load(indptr_ptr + b)
        ext = tl.load(indptr_ptr + b + 1) - qo_start
        seq_len = tl.load(lens_ptr + b)
        row = tl.load(rows_ptr + b).to(tl.int64)
        prefix = seq_len - ext
        m0 = (t - before) * TOK  # first token of the tile within the chunk
        tok = m0 + tok
        rmask = rows_ok & (tok < ext)
        q_pos = prefix + tok  # [BLOCK_M]
        q_rows = (qo_start + tok).to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=rmask[:, None] & (d[None, :] < D),
            other=0.0,
        )  # q: [BLOCK_M, BLOCK_D]
        if TREE:
            tree_bits = tl.load(tm_ptr + q_rows, mask=rmask, other=0).to(tl.int64)  # [BLOCK_M]
        else:
            tree_bits = q_pos  # unused

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: fully masked blocks give p = 0
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        ks_base = ks_ptr + kvh * stride_ksh  # FP8: this head's column of the scales
        vs_base = vs_ptr + kvh * stride_vsh
        first = prefix + m0  # position of the tile's first query
        kv_end = prefix + tl.minimum(m0 + TOK, ext)  # one past the last visible key
        if HAS_WINDOW:
            lo = (tl.maximum(first - sliding_window + 1, 0) // BLOCK_N) * BLOCK_N
            full_end = lo  # windows are masked everywhere
        else:
            lo = 0
            if TREE:  # the chunk's keys are seen by some rows only
                full_end = (prefix // BLOCK_N) * BLOCK_N
            else:
                full_end = (first // BLOCK_N) * BLOCK_N  # keys every query of the tile sees
        for n0 in range(lo, full_end, BLOCK_N):
            acc, m_i, l_i = _extend_step(
                q, acc, m_i, l_i, n0, q_pos, kv_end, row, k_base, v_base, bt_ptr, stride_bt,
                stride_ks, stride_vs, sm_scale, logit_cap, sliding_window, ks_base, vs_base, stride_kss,
                stride_vss, tree_bits, prefix, D, BLOCK_D, DV, BLOCK_DV, PAGE, BLOCK_N, False, HAS_CAP,
                HAS_WINDOW, PREC, UPCAST, KV_FP8, TREE,
            )  # fmt: skip
        for n0 in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _extend_step(
                q, acc, m_i, l_i, n0, q_pos, kv_end, row, k_base, v_base, bt_ptr, stride_bt,
                stride_ks, stride_vs, sm_scale, logit_cap, sliding_window, ks_base, vs_base, stride_kss,
                stride_vss, tree_bits, prefix, D, BLOCK_D, DV, BLOCK_DV, PAGE, BLOCK_N, True, HAS_CAP,
                HAS_WINDOW, PREC, UPCAST, KV_FP8, TREE,
            )  # fmt: skip
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            o_cols + q_rows[:, None] * stride_ot,
            o.to(out_ptr.dtype.element_ty),
            mask=rmask[:, None] & (dv[None, :] < DV),
        )
    else:
        # padding tile: zero rows past qo_indptr[B]
        pad_rows = tl.load(indptr_ptr + num_reqs) + (t - before) * TOK + tok
        zmask = rows_ok & (pad_rows < num_tokens)
        zeros = tl.zeros([BLOCK_M, BLOCK_DV], out_ptr.dtype.element_ty)
        tl.store(
            o_cols + pad_rows.to(tl.int64)[:, None] * stride_ot,
            zeros,
            mask=zmask[:, None] & (dv[None, :] < DV),
        )


def check_extend(q, k_cache, v_cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale, page_size,
                 sliding_window, logit_cap, k_scale=None, v_scale=None, tree_mask=None):  # fmt: skip
    """``kiln::extend_attention``'s argument check (both paths)."""
    check_attention(q, k_cache, v_cache, page_size, k_scale, v_scale)
    if qo_indptr.shape[0] != req_rows.shape[0] + 1:
        raise ValueError(
            f"extend_attention: qo_indptr has {qo_indptr.shape[0]} entries, expected B + 1 = "
            f"{req_rows.shape[0] + 1}."
        )
    if tree_mask is not None:
        if tree_mask.dtype != torch.int64 or tuple(tree_mask.shape) != (q.shape[0],):
            raise ValueError(
                f"extend_attention: tree_mask must be an int64 [T] = [{q.shape[0]}] tensor (one ancestor "
                f"bitmask per token), got {tree_mask.dtype} {list(tree_mask.shape)}."
            )
        if sliding_window > 0:
            raise ValueError(
                f"extend_attention: tree_mask cannot be combined with sliding_window ({sliding_window}); "
                "pass sliding_window=-1 or no tree."
            )


@kiln_op("extend_attention", ref=extend_attention_ref, check=check_extend, fake=empty_attention_out)
def extend_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    req_rows: torch.Tensor, seq_lens: torch.Tensor, qo_indptr: torch.Tensor, sm_scale: float, page_size: int,
    sliding_window: int, logit_cap: float, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None, *,
    config: ExtendConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """Paged extend attention ``[T, Hq, D] -> [T, Hq, Dv]`` (the module docstring): the Triton
    kernel; ``k_scale``/``v_scale`` ``[S, Hkv]`` float32 with FP8 caches, else None; ``tree_mask``
    ``[T]`` int64 ancestor bitmasks of token trees, else None (causal chunks). ``config``
    overrides tile sizes, GQA packing and launch parameters (benchmarks sweep it)."""
    t, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    group = hq // hkv
    num_reqs = req_rows.shape[0]
    cfg = config or default_config(d, dv, q.dtype)
    pack = _resolve_pack(cfg, group)
    out = torch.empty(t, hq, dv, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    tok = cfg.block_m // pack
    grid = (triton.cdiv(t, tok) + num_reqs, hq // pack)
    block_table = block_table.to(torch.int32)
    ks, vs, scale_strides = kv_scale_args(k_scale, v_scale, k_cache)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, block_table, req_rows, seq_lens, qo_indptr, ks, vs,
        seq_lens if tree_mask is None else tree_mask, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), block_table.stride(0), out.stride(0), out.stride(1), *scale_strides,
        num_reqs, t, float(sm_scale), float(logit_cap), int(sliding_window),
        GROUP=group, PACK=pack, D=d, BLOCK_D=max(16, next_pow2(d)), DV=dv,
        BLOCK_DV=max(16, next_pow2(dv)), PAGE=page_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        SCAN=64, HAS_CAP=logit_cap > 0, HAS_WINDOW=sliding_window > 0,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, KV_FP8=k_scale is not None,
        TREE=tree_mask is not None,
    )  # fmt: skip
    return out
