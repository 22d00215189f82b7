"""Paged attention of a few new tokens per request, split over the keys: speculative verification.

``torch.ops.kiln.verify_attention(q, k_cache, v_cache, block_table, req_rows, seq_lens, qo_indptr,
sm_scale, page_size, num_splits, logit_cap, tree_mask=None) -> out``: extend attention's contract
(ops/attention/extend.py: request ``b``'s new tokens are rows ``qo_indptr[b]:qo_indptr[b+1]`` of
``q`` at positions ``seq_lens[b] - n_b + j``, causal within the chunk, their K/V already in the
cache; rows past ``qo_indptr[B]`` zeros; token trees through ``tree_mask`` as extend's) for 16-bit
caches without a sliding window, and decode attention's split plan (ops/attention/decode.py ``_split_plan``, ``num_splits`` 0 = chosen from the
batch and the block table's width).

Why: a verify step brings ``k + 1`` tokens per request (runtime/speculative.py). The extend kernel
walks a request's whole context in one program per query tile and KV-head pack (at batch 1, 8
programs on 132 SMs for Llama-3.1-8B's 8 KV heads): 21 us a layer at 512 tokens on the H100 against
the decode kernel's 7 (docs/speculative.md section 7). Here a program owns a tile of ``QTILE`` new
tokens of one request (tiles numbered request by request, as extend's ``find_tile`` numbers them)
for one KV head and one split of the request's keys, as decode's split kernel owns one token: rows
are ``tokens x GQA group`` (each K/V block read once for all of them), each row masked at its own
position; the splits' partials are merged per token and head by a second kernel (decode's merge,
finding the token's request with ``find_tile``). ``QTILE`` is the batch's tokens per request rounded
up to a power of two (at most ``MAX_ROWS`` rows a program), so any chunk is right and few tokens
per request are fast (``paged_attention`` sends it steps of at most ``FEW_TOKENS`` tokens per
request on average and ``MAX_TOKENS`` in all, ops/attention/paged.py). The float32 partials of
``T x Hq x num_splits x Dv`` are bounded by ``PARTIALS_BYTES`` (fewer splits past it).

Grid ``(Hkv, cdiv(T, QTILE) + B, num_splits)``; tiles past the requests' zero the padding rows.
float32 accumulation, exp2 with log2(e) folded into the scale, as decode's kernel.

Specializations: these kernels run in eager extend steps of any batch and length, so what varies
from step to step must not make a new Triton specialization (the runtime compiles nothing: every
kernel comes from the artifact's warm-up). The request, token and split counts are not specialized
(``do_not_specialize``), the scan width is fixed (``SCAN_REQS``) and so is the merge's tile of
splits (``MERGE_TILE``, looped over the active splits), and the partials' pointers are float32 even with
one split (decode.py ``split_partials``); only ``QTILE`` (:func:`qtile`: 1, 2, 4, 8 or 16 tokens) varies, and the
compile's warm-up runs each (compiler/build.py ``EXTEND_WARMUP``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.attention.decode import (
    DecodeConfig,
    _block_kv,
    _block_slots,
    _merge_splits,
    _split_plan,
    choose_num_splits,
    default_config,
    softmax_block,
    split_partials,
    tl_dot,
    tl_softcap,
)
from kiln.ops.attention.extend import find_tile
from kiln.ops.attention.reference import check_attention, empty_attention_out, extend_attention_ref
from kiln.ops.common.launch import interpreting, next_pow2, pdl_args, pdl_trigger, pdl_wait
from kiln.ops.common.op import kiln_op

FEW_TOKENS = 16  # paged_attention's bound on new tokens per request (on average) for this kernel
MAX_TOKENS = 512  # and on a step's tokens (a long prefill chunk beside decodes goes to extend's tiles)
MAX_ROWS = 64  # a program's query rows: tokens x GQA group, padded to a power of two
MIN_CHUNK = 32  # the fewest keys a split takes (decode's plan: one key block)
# programs per SM the automatic split count aims at (decode's 8 gave splits of 32 keys at batch 8 x 512
# tokens, slower than extend; 2 matched the best split size of the MIN_CHUNK sweep at batch 1 and 8,
# bench/results/2026-12-06_h200_s29b_*)
PROGRAMS_PER_SM = 2
PARTIALS_BYTES = 64 << 20  # the split partials' bound: fewer splits where T x Hq x Dv is large
SCAN_REQS = 64  # requests per round of the kernels' qo_indptr scans (fixed: not a specialization)
# splits the merge reads per pass (fixed: not a specialization). A tile sized for the most splits the
# engine's block table allows (64) took 82 us at batch 32 x 512 tokens with 2 splits, against 62 us
# with a tile of 2 (bench/results/2026-12-06_h100_s30f_*, s30g_*); 16 is not timed yet
MERGE_TILE = 16


def qtile(num_tokens: int, num_reqs: int, group: int) -> int:
    """Tokens per program: the step's tokens per request rounded up to a power of two, at most
    ``MAX_ROWS // group`` (the one launch parameter that varies with the step)."""
    return max(1, min(next_pow2(-(-num_tokens // max(num_reqs, 1))), MAX_ROWS // group))


@triton.jit
def _verify_plan(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """Decode's split plan (``_split_plan``, no window) with splits of at least ``MIN_CHUNK`` keys
    (a multiple of ``BLOCK_N``): ``(base, chunk, active)``, shared by the split and merge kernels."""
    _lo, base, chunk, _active = _split_plan(seq_len, num_splits, 0, BLOCK_N, False)
    chunk = tl.maximum(chunk, MIN_CHUNK)
    span = seq_len - base
    return base, chunk, (span + chunk - 1) // chunk


@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "num_splits"])
def _verify_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, rows_ptr, lens_ptr, indptr_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, tm_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, stride_ot, stride_oh,
    num_reqs, num_tokens, num_q_heads, num_splits, sm_scale, logit_cap,
    GROUP: tl.constexpr, QTILE: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, SCAN: tl.constexpr, HAS_CAP: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
    TREE: tl.constexpr = False,  # token trees: tm_ptr [T] int64 ancestor bitmasks (else unused)
):  # fmt: skip
    # grid (Hkv, cdiv(T, QTILE) + B, num_splits): a tile of QTILE tokens of one request (tiles
    # numbered request by request, extend.py's find_tile) x one KV head's group x one split's keys
    pdl_trigger(PDL)
    pdl_wait(PDL)
    kvh = tl.program_id(0)
    t = tl.program_id(1)
    split = tl.program_id(2)
    r, before = find_tile(indptr_ptr, num_reqs, t, QTILE, SCAN)
    i = tl.arange(0, ROWS)
    heads = kvh * GROUP + i % GROUP  # [ROWS]
    rows_ok = i < QTILE * GROUP
    dv = tl.arange(0, BLOCK_DV)
    o_cols = out_ptr + heads[:, None] * stride_oh + dv[None, :]
    if r >= num_reqs:  # a padding tile: zero the rows past qo_indptr[B] (split 0)
        if split == 0:
            pad = tl.load(indptr_ptr + num_reqs) + (t - before) * QTILE + i // GROUP
            zmask = rows_ok & (pad < num_tokens)
            zeros = tl.zeros([ROWS, BLOCK_DV], out_ptr.dtype.element_ty)
            tl.store(
                o_cols + pad.to(tl.int64)[:, None] * stride_ot,
                zeros,
                mask=zmask[:, None] & (dv[None, :] < DV),
            )
        return
    tok0 = tl.load(indptr_ptr + r)
    n = tl.load(indptr_ptr + r + 1) - tok0
    seq_len = tl.load(lens_ptr + r)
    base, chunk, active = _verify_plan(seq_len, num_splits, BLOCK_N, MIN_CHUNK)
    if split >= tl.maximum(active, 1):
        return  # no keys here (split 0 stays to write an empty request's zeros)
    j = (t - before) * QTILE + i // GROUP  # [ROWS]: each row's token within the chunk
    qmask = rows_ok & (j < n)
    limit = seq_len - n + j + 1  # [ROWS]: the row sees keys < limit
    start = base + split * chunk  # this program takes keys [start, end)
    end = tl.minimum(tl.minimum(start + chunk, seq_len), tl.max(tl.where(qmask, limit, 0), 0))
    row = tl.load(rows_ptr + r).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    tok = (tok0 + j).to(tl.int64)
    prefix = seq_len - n  # the chunk's first key position
    if TREE:
        tree_bits = tl.load(tm_ptr + tok, mask=qmask, other=0).to(tl.int64)  # [ROWS]
    else:
        tree_bits = tok  # unused
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=qmask[:, None] & (d[None, :] < D),
        other=0.0,
    )  # [ROWS, BLOCK_D]
    qk_scale = sm_scale * 1.4426950408889634  # log2(e) folded in: softmax runs on exp2
    m_i = tl.full([ROWS], -1.0e30, tl.float32)  # finite: exp2(m_i - m_new) never NaN
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        kmask = offs < end
        slot = _block_slots(bt_ptr + row * stride_bt, offs, end, PAGE)
        k, v, _ks, _vs = _block_kv(
            k_base, v_base, k_base, v_base, slot, stride_ks, stride_vs, 0, 0, d, dv, kmask, D, DV, False,
            q_ptr.dtype.element_ty,
        )  # fmt: skip
        s = tl_dot(q, tl.trans(k), PREC, UPCAST)  # [ROWS, BLOCK_N] f32
        if HAS_CAP:
            s = tl_softcap(s * sm_scale, logit_cap) * 1.4426950408889634
        else:
            s = s * qk_scale
        vis = offs[None, :] < limit[:, None]  # limit <= end: kmask too
        if TREE:  # a key of the chunk only where the row's bit of its node is set (extend.py's rule)
            rel = offs - prefix  # [BLOCK_N] node index of the key in the chunk
            bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)[None, :]) & 1
            vis = vis & ((rel < 0)[None, :] | (bit != 0))
        acc, m_i, l_i = softmax_block(tl.where(vis, s, float("-inf")), v, m_i, l_i, acc, PREC, UPCAST)
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]  # [ROWS, BLOCK_DV]; zeros without keys
    omask = qmask[:, None] & (dv[None, :] < DV)
    if active <= 1:  # the request's only split: the output itself
        tl.store(o_cols + tok[:, None] * stride_ot, o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # [ROWS]
        first = (tok * num_q_heads + heads) * num_splits  # [ROWS]
        tl.store(mid_lse_ptr + first + split, lse, mask=qmask)
        tl.store(mid_o_ptr + (first + split)[:, None] * DV + dv[None, :], o, mask=omask)


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _verify_merge_kernel(
    mid_o_ptr, mid_lse_ptr, lens_ptr, indptr_ptr, out_ptr, stride_ot, stride_oh, num_reqs, num_q_heads,
    num_splits, DV: tl.constexpr, BLOCK_DV: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_CHUNK: tl.constexpr, SCAN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # grid (T, Hq, cdiv(Dv, BLOCK_DV)): merges the active splits of one token's head
    pdl_trigger(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    r, _ = find_tile(indptr_ptr, num_reqs, t, 1, SCAN)  # tiles of one token: t's request
    if r >= num_reqs:
        return  # a padding row: zeroed by the split kernel
    seq_len = tl.load(lens_ptr + r)
    _base, _chunk, active = _verify_plan(seq_len, num_splits, BLOCK_N, MIN_CHUNK)
    if active <= 1:
        return  # the split kernel wrote this request's rows directly
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    rows = tl.zeros([1], tl.int64) + (t.to(tl.int64) * num_q_heads + h) * num_splits  # [1]
    out = _merge_splits(mid_o_ptr, mid_lse_ptr, rows, rows >= 0, dv, active, 1, DV, BLOCK_DV, TILE)
    o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dv[None, :] < DV)


def verify_attention_ref(q, k_cache, v_cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale, page_size,
                         num_splits, logit_cap, tree_mask=None):  # fmt: skip
    """Extend attention's reference (no window; ``num_splits`` unused)."""
    return extend_attention_ref(
        q, k_cache, v_cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale, page_size, -1, logit_cap,
        None, None, tree_mask,
    )  # fmt: skip


def check_verify(q, k_cache, v_cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale, page_size,
                 num_splits, logit_cap, tree_mask=None):  # fmt: skip
    """``kiln::verify_attention``'s argument check (both paths)."""
    check_attention(q, k_cache, v_cache, page_size)
    if k_cache.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"verify_attention: 16- or 32-bit caches only, got {k_cache.dtype}.")
    if qo_indptr.shape[0] != req_rows.shape[0] + 1:
        raise ValueError(
            f"verify_attention: qo_indptr has {qo_indptr.shape[0]} entries, expected B + 1 = "
            f"{req_rows.shape[0] + 1}."
        )
    if num_splits < 0:
        raise ValueError(f"verify_attention: num_splits must be >= 0 (0 = auto), got {num_splits}.")
    if tree_mask is not None and (tree_mask.dtype != torch.int64 or tuple(tree_mask.shape) != (q.shape[0],)):
        raise ValueError(
            f"verify_attention: tree_mask must be an int64 [T] = [{q.shape[0]}] tensor (one ancestor "
            f"bitmask per token), got {tree_mask.dtype} {list(tree_mask.shape)}."
        )


@kiln_op("verify_attention", ref=verify_attention_ref, check=check_verify, fake=empty_attention_out)
def verify_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    req_rows: torch.Tensor, seq_lens: torch.Tensor, qo_indptr: torch.Tensor, sm_scale: float,
    page_size: int, num_splits: int, logit_cap: float, tree_mask: torch.Tensor | None = None, *,
    config: DecodeConfig | None = None,
    min_chunk: int = MIN_CHUNK,
    merge_tile: int = MERGE_TILE,
) -> torch.Tensor:  # fmt: skip
    """Paged attention of a few new tokens per request ``[T, Hq, D] -> [T, Hq, Dv]`` (the module
    docstring): the Triton kernels; ``tree_mask`` ``[T]`` int64 ancestor bitmasks of token trees
    (extend attention's, ops/attention/extend.py), else None. ``config`` as decode's (its block size
    and launch);
    ``min_chunk``: the fewest keys a split takes, ``merge_tile`` the splits the merge reads per pass
    (benchmarks sweep them)."""
    t, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    bsz = req_rows.shape[0]
    out = torch.empty(t, hq, dv, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    max_len = block_table.shape[1] * page_size
    if num_splits == 0:  # auto: decode's rule at PROGRAMS_PER_SM, a program per request, KV head, split
        num_splits = choose_num_splits(max(bsz, 1), max_len, hkv, programs_per_sm=PROGRAMS_PER_SM)
    num_splits = max(1, min(num_splits, PARTIALS_BYTES // (t * hq * dv * 4)))  # float32 partials
    group = hq // hkv
    tile = qtile(t, bsz, group)  # tokens per pass
    cfg = config or default_config(d, dv)
    min_chunk = -(-max(min_chunk, 1) // cfg.block_n) * cfg.block_n  # whole key blocks
    mid_o, mid_lse = split_partials(out, num_splits)
    block_table = block_table.to(torch.int32)
    block_dv = max(16, next_pow2(dv))
    pdl = pdl_args(q)
    _verify_split_kernel[(hkv, triton.cdiv(t, tile) + bsz, num_splits)](
        q, k_cache, v_cache, block_table, req_rows, seq_lens, qo_indptr, out, mid_o, mid_lse,
        seq_lens if tree_mask is None else tree_mask,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1), bsz, t, hq, num_splits, float(sm_scale),
        float(logit_cap), GROUP=group, QTILE=tile, ROWS=max(16, next_pow2(tile * group)), D=d,
        BLOCK_D=max(16, next_pow2(d)), DV=dv, BLOCK_DV=block_dv, PAGE=page_size, BLOCK_N=cfg.block_n,
        MIN_CHUNK=min_chunk, SCAN=SCAN_REQS, HAS_CAP=logit_cap > 0, PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
        TREE=tree_mask is not None,
    )  # fmt: skip
    if num_splits > 1:
        block_dv = min(64, block_dv)
        _verify_merge_kernel[(t, hq, triton.cdiv(dv, block_dv))](
            mid_o, mid_lse, seq_lens, qo_indptr, out, out.stride(0), out.stride(1), bsz, hq, num_splits,
            DV=dv, BLOCK_DV=block_dv, TILE=merge_tile, BLOCK_N=cfg.block_n,
            MIN_CHUNK=min_chunk, SCAN=SCAN_REQS, num_warps=4, **pdl,
        )  # fmt: skip
    return out
