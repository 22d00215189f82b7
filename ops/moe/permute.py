"""MoE pairs sorted by expert without padding, for grouped GEMMs that take one contiguous row range
per expert (ops/moe/cutlass.py): sort, gather the token rows, and the weighted un-sort + top-k sum.

Pair ``p = t * k + j`` is token ``t``'s ``j``-th expert choice (``topk_ids [T, k]`` int32, global
ids; ``expert_map [E_global]`` int32 global -> local slot or -1, or None when ids are local).

* ``moe_sort(topk_ids, expert_map, E) -> (dst [P], counts [E], starts [E])`` int32: ``dst[p]`` is
  pair ``p``'s row in the expert-sorted order (the local pairs fill rows ``0 .. n_local - 1``, grouped
  by expert, expert 0 first, pair order inside an expert), ``-1`` for another rank's expert;
  ``counts[e]`` local pairs of expert ``e``; ``starts[e]`` its first row (exclusive cumsum).
* ``gather_rows(x [T, H], dst, k, a [P, H])``: ``a[dst[p]] = x[p // k]`` for the local pairs (rows
  ``n_local ..`` are left unwritten).
* ``unsort_combine(y [P, H], dst, topk_weights [T, k] f32, out [T, H])``:
  ``out[t] = round(sum_j round(y[dst[t * k + j]] * topk_weights[t, j]))`` over the local pairs, the
  sum in float32 and rounded once to ``out``'s dtype: the rounding of ops/moe/fused.py's w2 epilogue
  (the routing weight multiplies the rounded down projection) and combine.

Kernels (no host sync, shapes from ``T``, ``k``, ``E`` only, so all of it is CUDA-graph safe): per
chunk of pairs a per-expert count (``moe_align``'s count kernel), one program scanning the counts
over chunks into per-chunk offsets, ``counts`` and ``starts``, then per chunk each pair's rank in
its expert placed at ``starts[e] + chunk offset + rank`` (``moe_align``'s scatter kernel, writing
``dst``); the gather and the combine are one
program per (row, column block). Every kernel is launched with PDL (ops/common/launch.py) and waits first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.common.launch import interpreting, next_pow2, pdl_args, pdl_trigger, pdl_wait, use_triton
from kiln.ops.common.quant import tl_round
from kiln.ops.moe.align import CHUNK, SCAN_ROWS, count_kernel, scan_counts, scatter_kernel

# ---- torch references -----------------------------------------------------------------------------


def moe_sort_ref(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch (a stable sort by local expert); same outputs as ``moe_sort``."""
    flat = topk_ids.reshape(-1).long()  # [P]
    local = expert_map.long()[flat] if expert_map is not None else flat  # [P], -1: another rank's
    ok = (local >= 0) & (local < num_experts)
    key = torch.where(ok, local, num_experts)
    order = torch.sort(key, stable=True).indices  # [P] sorted row -> pair
    dst = torch.empty_like(order)
    dst[order] = torch.arange(order.numel(), device=flat.device)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]  # [E]
    starts = torch.cumsum(counts, 0) - counts
    dst = torch.where(ok, dst, -1)
    return dst.to(torch.int32), counts.to(torch.int32), starts.to(torch.int32)


def gather_rows_ref(x: torch.Tensor, dst: torch.Tensor, top_k: int) -> torch.Tensor:
    """``a [P, H]`` with ``a[dst[p]] = x[p // k]``; rows no local pair lands on are zero."""
    a = x.new_zeros((dst.numel(), x.shape[1]))
    ok = dst >= 0
    pairs = torch.arange(dst.numel(), device=x.device)[ok]
    a[dst[ok].long()] = x[pairs // top_k]
    return a


def unsort_combine_ref(y: torch.Tensor, dst: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``out [T, H]`` in ``y``'s dtype (see the module docstring for the rounding)."""
    t, k = topk_weights.shape
    d = dst.reshape(t, k).long()
    rows = y[d.clamp_min(0)].float() * topk_weights.float()[:, :, None]  # [T, k, H]
    rows = torch.where((d >= 0)[:, :, None], rows.to(y.dtype).float(), 0.0)
    return rows.sum(1).to(y.dtype)


# ---- Triton kernels -------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_chunks"])
def _scan_kernel(
    COUNTS,  # in: [C, E] per-chunk counts; out: the exclusive prefix over chunks
    TOTAL, STARTS,  # out: [E] local pairs per expert, and their exclusive cumsum
    num_chunks, E,
    E_PAD: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_trigger(PDL)
    pdl_wait(PDL)
    run, experts, emask = scan_counts(COUNTS, num_chunks, E, E_PAD, ROWS)
    tl.store(TOTAL + experts, run, mask=emask)
    tl.store(STARTS + experts, tl.cumsum(run, axis=0) - run, mask=emask)


@triton.jit
def _gather_kernel(X, DST, A, H, top_k, stride_x, stride_a, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    p = tl.program_id(0).to(tl.int64)
    row = tl.load(DST + p)
    if row >= 0:
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = offs < H
        v = tl.load(X + (p // top_k) * stride_x + offs, mask=m)
        tl.store(A + row.to(tl.int64) * stride_a + offs, v, mask=m)


@triton.jit
def _combine_kernel(
    Y, DST, TOPK_W, OUT, H, K, stride_y, stride_o,
    BLOCK_H: tl.constexpr, RF: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Y: [P, H] expert outputs in sorted order; OUT: [T, H]
    pdl_trigger(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    out_ty = OUT.dtype.element_ty
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(K):
        row = tl.load(DST + t * K + j)
        tw = tl.load(TOPK_W + t * K + j)
        use = hmask & (tl.zeros([BLOCK_H], dtype=tl.int32) + row >= 0)  # broadcast the scalar
        y = tl.load(Y + tl.maximum(row, 0).to(tl.int64) * stride_y + offs, mask=use, other=0.0)
        acc += tl.where(use, tl_round(y.to(tl.float32) * tw, out_ty, RF), 0.0)
    tl.store(OUT + t * stride_o + offs, tl_round(acc, out_ty, RF).to(out_ty), mask=hmask)


# ---- launchers ------------------------------------------------------------------------------------


def moe_sort(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dst [P], counts [E], starts [E])`` int32 (module docstring); the reference off the GPU
    unless the kernels run in the interpreter."""
    if not use_triton(topk_ids):
        return moe_sort_ref(topk_ids, expert_map, num_experts)
    ids = topk_ids.contiguous().reshape(-1)  # [P]
    p = ids.numel()
    dst = ids.new_empty((p,), dtype=torch.int32)
    if p == 0:
        return dst, *ids.new_zeros((2, num_experts), dtype=torch.int32)
    total = ids.new_empty((num_experts,), dtype=torch.int32)  # both written by the scan
    starts = ids.new_empty((num_experts,), dtype=torch.int32)
    chunks = triton.cdiv(p, CHUNK)
    e_pad = next_pow2(num_experts)
    emap = expert_map if expert_map is not None else ids
    counts = ids.new_empty((chunks, num_experts), dtype=torch.int32)
    common = dict(HAS_MAP=expert_map is not None, CHUNK_=CHUNK, E_PAD=e_pad, **pdl_args(ids))
    warps = 8 if e_pad >= 128 else 4  # the [CHUNK, E_PAD] one-hot lives in registers
    count_kernel[(chunks,)](ids, emap, counts, p, num_experts, **common, num_warps=warps)
    _scan_kernel[(1,)](
        counts, total, starts, chunks, num_experts,
        E_PAD=e_pad, ROWS=min(SCAN_ROWS, max(1, 4096 // e_pad)), **pdl_args(ids),
    )  # fmt: skip
    scatter_kernel[(chunks,)](
        ids, emap, counts, starts, dst, p, num_experts, **common, TO_DST=True, num_warps=warps
    )
    return dst, total, starts


def _row_block(h: int) -> tuple[int, int]:
    block = min(next_pow2(h), 1024)
    return block, max(1, min(4, block // 256))


def gather_rows(x: torch.Tensor, dst: torch.Tensor, top_k: int, a: torch.Tensor) -> None:
    """``a[dst[p]] = x[p // top_k]`` for every local pair (Triton); ``x``, ``a`` unit last stride."""
    p, h = dst.numel(), x.shape[1]
    if p == 0:
        return
    if x.stride(1) != 1 or a.stride(1) != 1:
        raise ValueError("gather_rows: x and a need a unit last stride")
    block, warps = _row_block(h)
    _gather_kernel[(p, triton.cdiv(h, block))](
        x, dst, a, h, top_k, x.stride(0), a.stride(0), BLOCK_H=block, num_warps=warps, **pdl_args(x)
    )


def unsort_combine(y: torch.Tensor, dst: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor) -> None:
    """``out [T, H]`` = the weighted top-k sum of the sorted rows ``y [P, H]`` (Triton)."""
    t, k = topk_weights.shape
    h = y.shape[1]
    if t == 0:
        return
    if y.stride(1) != 1 or out.stride(1) != 1 or not topk_weights.is_contiguous():
        raise ValueError(
            "unsort_combine: y and out need a unit last stride, topk_weights a contiguous layout"
        )
    block, warps = _row_block(h)
    _combine_kernel[(t, triton.cdiv(h, block))](
        y, dst, topk_weights, out, h, k, y.stride(0), out.stride(0),
        BLOCK_H=block, RF=interpreting(), num_warps=warps, **pdl_args(y),
    )  # fmt: skip
