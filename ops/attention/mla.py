"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent cache, in absorbed form.

The layer (transformers' ``DeepseekV2Attention`` / ``DeepseekV3Attention``; ``H`` heads,
``r = kv_lora_rank``, ``dn = qk_nope_head_dim``, ``dr = qk_rope_head_dim``, ``dv = v_head_dim``):

* ``q = q_proj(x)`` or ``q_b_proj(rmsnorm(q_a_proj(x)))``, ``[T, H, dn + dr]`` = ``[q_nope | q_pe]``;
* ``kv_a_proj_with_mqa(x) = [c | k_pe]`` ``[T, r + dr]``; ``c_kv = kv_a_layernorm(c)``;
* RoPE on ``q_pe`` and ``k_pe`` (one ``k_pe`` shared by all heads);
* expanded form: ``kv_b_proj(c_kv)`` viewed ``[T, H, dn + dv]`` = ``[k_nope | v]``, key
  ``[k_nope | k_pe]``, score ``(q_nope . k_nope + q_pe . k_pe) * sm_scale`` (:func:`mla_softmax_scale`).

Absorbed form. ``kv_b_proj.weight [H * (dn + dv), r]`` viewed ``[H, dn + dv, r]`` splits into
``w_kc = [:, :dn, :]`` ``[H, dn, r]`` and ``w_vc = [:, dn:, :]`` transposed, ``[H, r, dv]``
(:func:`split_kv_b_proj`; the packs' ``layers.{i}.attn.w_kc`` / ``w_vc``, compiler/mappings.py).
Since ``q_nope . (w_kc[h] c) = (w_kc[h]^T q_nope) . c`` and ``sum_j p_j w_vc[h]^T c_j = w_vc[h]^T
sum_j p_j c_j``, attention runs over ONE cached row per token, key ``[c_kv | k_pe]`` and value
``c_kv``: :func:`absorb_q` maps ``q_nope`` into the latent space before, :func:`apply_uv` maps the
latent output to ``[T, H, dv]`` after (both batched matmuls over heads, in the graph as aten).

The latent cache: per layer ``cache [num_pages, page_size, r + dr]`` (576 wide for DeepSeek), row
``[c_kv | k_pe]`` (normalized latent, roped k_pe), in the activation dtype, or the same slots flat,
``cache [S, 1, r + dr]``: the KV pool's ``k_cache[layer]`` of an MLA artifact (one "head" of
``r + dr`` per slot; compiler/mla_layer.py passes it as is, since a view in pages of a pool whose
size is dynamic in the graph is not expressible). Token position ``p`` of block-table row ``row`` is
slot ``s = block_table[row, p // P] * P + p % P``, stored at ``cache[s // C, s % C]`` with ``C =
cache.shape[1]`` (``P`` or 1); a slot of the runtime's ``out_slots`` likewise. The metadata is the
GQA ops' (docs/internals.md): ``block_table [R, M]`` int32, ``req_rows``, ``seq_lens [B]`` int32
(lengths including this step's tokens, already written), ``qo_indptr [B + 1]`` int32 for extend.

Ops (``torch.ops.kiln.*``; outputs in ``q_latent``'s dtype, float32 accumulation):

* ``mla_kv_write(latent [T, r], k_pe [T, dr], cache, out_slots [T] i64) -> ()``: mutates
  ``cache``; padding rows carry slot 0 (the sink).
* ``mla_decode(q_latent [B, H, r], q_pe [B, H, dr], cache, block_table, req_rows, seq_lens,
  sm_scale, page_size, num_splits) -> [B, H, r]``: one query per request at ``seq_lens[b] - 1``
  (zeros for ``seq_lens[b] == 0``); ``num_splits = 0`` picks the split-KV factor.
* ``mla_extend(q_latent [T, H, r], q_pe [T, H, dr], cache, block_table, req_rows, seq_lens,
  qo_indptr, sm_scale, page_size, tree_mask=None) -> [T, H, r]``: request ``b``'s new tokens are
  rows ``qo_indptr[b]:qo_indptr[b+1]`` at positions ``seq_lens[b] - n_b + j``; causal, full over the
  prefix; rows past ``qo_indptr[B]`` are zeros. ``tree_mask`` ``[T]`` int64: token trees
  (speculative verification), a chunk key only where the query's ancestor bitmask has its bit, as
  GQA extend attention takes them (ops/attention/extend.py).
* ``mla_attention(..., qo_indptr, sm_scale, page_size, num_splits, tree_mask=None)``: ``mla_decode``
  when ``T == B`` without a tree mask, else ``mla_extend`` (one graph serves both, as
  ``kiln::paged_attention``).

Kernels. ``mla_decode``: split-KV flash decoding, grid ``(cdiv(H, BLOCK_H), B, num_splits)``; a
program takes ``BLOCK_H`` heads of one request and its share of the keys, loads each key block's
latent tile ``[BLOCK_N, r]`` and rope tile ``[BLOCK_N, dr]`` once for all its heads, and uses the
latent tile twice (scores and P @ V). Splits plan their keys from ``seq_lens`` in the kernel (one
launch serves every length; CUDA-graph safe); multi-split requests merge in a second kernel by
log-sum-exp (base 2). ``mla_kv_write``: one program per token (the model's layers write through
``kiln::mla_rope_kvwrite`` instead, the same row with kv_a's norm and RoPE fused: mla_rope.py).
``mla_extend``: flash attention in the absorbed form, modelled on extend.py's kernel. A program
owns a query tile of ``BLOCK_M`` rows, ``BLOCK_M // PACK`` new tokens of one request times
``PACK`` heads (all heads share the latent, so a key tile is loaded once for all of them), and
``BLOCK_V`` columns of the latent output (all ``r`` by default; a narrower block recomputes the
scores, a lever for register pressure). Grid ``(cdiv(T, BLOCK_M // PACK) + B, cdiv(H, PACK),
cdiv(r, BLOCK_V))`` from shapes only: each program finds its (request, tile) by scanning
``qo_indptr`` (later tiles first), programs past the work zero the padding rows, nothing is read on
the host (CUDA-graph safe). Key blocks below the tile's first query run unmasked; the diagonal and
the end masked. Online softmax in exp2, float32 accumulation, ``P`` rounded to the cache dtype
before ``P @ c``. The expanded prefill for long prompts is docs/mla.md's plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kiln.ops.attention.decode import (
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    _decode_merge_kernel,
    _split_plan,
    softmax_block,
    split_partials,
    tl_dot,
)
from kiln.ops.attention.extend import find_tile
from kiln.ops.attention.reference import tree_visible
from kiln.ops.common.launch import interpreting, next_pow2, pdl_args, pdl_trigger, pdl_wait, sm_count
from kiln.ops.common.op import kiln_op

LOG2E = 1.4426950408889634
MAX_WAVES = 4  # the split plan looks at up to this many waves of resident programs
WAVE_SLACK = 0.1  # ... and the fewest waves within this of the best cost (mla_num_splits)
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------- weights and scale
def split_kv_b_proj(
    weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``kv_b_proj.weight [H * (dn + dv), r]`` -> ``(w_kc [H, dn, r], w_vc [H, r, dv])``,
    contiguous: head ``h``'s rows ``h * (dn + dv) + [0, dn)`` are its key part, the next ``dv`` its
    value part (transposed)."""
    h, dn, dv = num_heads, qk_nope_head_dim, v_head_dim
    if weight.dim() != 2 or weight.shape[0] != h * (dn + dv):
        raise ValueError(
            f"kv_b_proj.weight must be [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] = "
            f"[{h * (dn + dv)}, r], got {list(weight.shape)}."
        )
    w = weight.reshape(h, dn + dv, weight.shape[1])
    return w[:, :dn].contiguous(), w[:, dn:].transpose(1, 2).contiguous()


def absorb_q(q_nope: torch.Tensor, w_kc: torch.Tensor) -> torch.Tensor:
    """``q_nope [T, H, dn]`` into the latent space: ``[T, H, r]``, ``q_latent[t, h] = q_nope[t, h] @
    w_kc[h]`` (``w_kc [H, dn, r]``). A view of a ``[H, T, r]`` result: last dim contiguous."""
    return torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)


def apply_uv(o_latent: torch.Tensor, w_vc: torch.Tensor) -> torch.Tensor:
    """The latent attention output ``[T, H, r]`` to the heads' values: ``[T, H, dv]``,
    ``o[t, h] = o_latent[t, h] @ w_vc[h]`` (``w_vc [H, r, dv]``). A view of a ``[H, T, dv]`` result."""
    return torch.bmm(o_latent.transpose(0, 1), w_vc).transpose(0, 1)


def mla_softmax_scale(qk_head_dim: int, scaling: dict[str, Any] | None) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` when the rope scaling
    is not ``default`` and has a non-zero ``mscale_all_dim`` (DeepSeek's YaRN; transformers'
    ``yarn_apply_mscale``), ``mscale(s, m) = 0.1 * m * ln(s) + 1`` for ``s > 1``, else 1.
    ``scaling`` as ops/attention/rope.py takes it (``type`` or ``rope_type``)."""
    scale = qk_head_dim**-0.5
    scaling = scaling or {}
    kind = scaling.get("type") or scaling.get("rope_type") or "default"
    m_all = scaling.get("mscale_all_dim")
    if kind != "default" and m_all:
        factor = float(scaling["factor"])
        m = 0.1 * float(m_all) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return scale


# --------------------------------------------------------------------------- references
def _rows(
    cache: torch.Tensor, block_table: torch.Tensor, row: int, length: int, page_size: int
) -> torch.Tensor:
    """Cached rows ``[length, r + dr]`` of positions ``0..length-1`` of block-table row ``row``."""
    pos = torch.arange(length, device=cache.device)
    slots = block_table[row, pos // page_size].long() * page_size + pos % page_size
    return cache[slots // cache.shape[1], slots % cache.shape[1]]


def mla_attend(q_latent, q_pe, rows, q_pos, sm_scale, tree_mask=None):
    """One request, absorbed form, float32: ``q_latent [n, H, r]``, ``q_pe [n, H, dr]`` at positions
    ``q_pos [n]`` over ``rows [L, r + dr]`` (positions ``0..L-1``); with ``tree_mask [n]`` (the
    chunk's ancestor bitmasks, the chunk the last ``n`` rows) a chunk key only under its bit.
    Returns ``[n, H, r]``."""
    r = q_latent.shape[-1]
    c, pe = rows[:, :r].float(), rows[:, r:].float()  # [L, r], [L, dr]
    s = torch.einsum("nhr,lr->hnl", q_latent.float(), c) + torch.einsum("nhd,ld->hnl", q_pe.float(), pe)
    visible = torch.arange(rows.shape[0], device=rows.device)[None, :] <= q_pos[:, None]  # [n, L]
    if tree_mask is not None:
        visible = visible & tree_visible(tree_mask, rows.shape[0] - q_latent.shape[0], rows.shape[0])
    p = torch.softmax((s * sm_scale).masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hnl,lr->nhr", p, c)


def mla_extend_ref(
    q_latent, q_pe, cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale, page_size, tree_mask=None
):
    """``kiln::mla_extend``, plain torch (module docstring): a host loop over requests."""
    out = torch.zeros(q_latent.shape, dtype=torch.float32, device=q_latent.device)
    indptr = qo_indptr.tolist()
    for b, (row, seq_len) in enumerate(zip(req_rows.tolist(), seq_lens.tolist())):
        lo, hi = indptr[b], indptr[b + 1]
        if hi > lo:
            q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q_latent.device)
            rows = _rows(cache, block_table, row, seq_len, page_size)
            tm = None if tree_mask is None else tree_mask[lo:hi]
            out[lo:hi] = mla_attend(q_latent[lo:hi], q_pe[lo:hi], rows, q_pos, sm_scale, tm)
    return out.to(q_latent.dtype)


def mla_decode_ref(q_latent, q_pe, cache, block_table, req_rows, seq_lens, sm_scale, page_size, num_splits):
    """``kiln::mla_decode``, plain torch: extend with one token per request (``num_splits`` unused)."""
    qo_indptr = torch.arange(q_latent.shape[0] + 1, dtype=torch.int32, device=q_latent.device)
    return mla_extend_ref(
        q_latent, q_pe, cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale, page_size
    )


def mla_kv_write_ref(latent, k_pe, cache, out_slots):
    """``kiln::mla_kv_write``, plain torch: ``cache[s // C, s % C] = [latent | k_pe]`` per token
    (``C = cache.shape[1]``: the page size, or 1 for a flat cache)."""
    slots = out_slots.long()
    page = cache.shape[1]
    cache[slots // page, slots % page] = torch.cat([latent, k_pe], -1).to(cache.dtype)


def empty_mla_out(q_latent: torch.Tensor, *_: object) -> torch.Tensor:
    """The attention ops' output, uninitialized: ``q_latent``'s shape and dtype (their fake)."""
    return q_latent.new_empty(q_latent.shape)


# --------------------------------------------------------------------------- checks
def check_mla(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, page_size: int) -> None:
    """What every MLA attention op checks first: 3-D ``q_latent [T, H, r]`` and ``q_pe [T, H, dr]``,
    ``cache [num_pages, page_size, r + dr]`` or ``[S, 1, r + dr]`` of their (float) dtype,
    contiguous last dims."""
    if q_latent.dim() != 3 or q_pe.dim() != 3 or q_latent.shape[:2] != q_pe.shape[:2]:
        raise ValueError(
            f"mla: q_latent {list(q_latent.shape)} and q_pe {list(q_pe.shape)} must be [T, H, r] and "
            "[T, H, qk_rope_head_dim] with the same T and H."
        )
    width = q_latent.shape[2] + q_pe.shape[2]
    if page_size < 1 or cache.dim() != 3 or cache.shape[1] not in (page_size, 1) or cache.shape[2] != width:
        raise ValueError(
            f"mla: cache must be [num_pages, page_size={page_size}, kv_lora_rank + qk_rope_head_dim="
            f"{width}] (page_size >= 1) or the flat [num_slots, 1, {width}], got {list(cache.shape)}."
        )
    if q_latent.dtype not in ACT_DTYPES or q_pe.dtype != q_latent.dtype or cache.dtype != q_latent.dtype:
        raise ValueError(
            f"mla: q_latent, q_pe and cache must share one dtype of {ACT_DTYPES} (no FP8 latent cache "
            f"yet), got {q_latent.dtype}, {q_pe.dtype}, {cache.dtype}."
        )
    if q_latent.stride(-1) != 1 or q_pe.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("mla: q_latent, q_pe and cache need a contiguous last dimension.")


def check_mla_decode(q_latent, q_pe, cache, block_table, req_rows, seq_lens, sm_scale, page_size, num_splits):
    """``kiln::mla_decode``'s argument check (both paths)."""
    check_mla(q_latent, q_pe, cache, page_size)
    if req_rows.shape[0] != q_latent.shape[0] or seq_lens.shape[0] != q_latent.shape[0]:
        raise ValueError(
            f"mla_decode: req_rows ({req_rows.shape[0]}) and seq_lens ({seq_lens.shape[0]}) must have one "
            f"entry per query row (B = {q_latent.shape[0]})."
        )
    if num_splits < 0:
        raise ValueError(f"mla_decode: num_splits must be >= 0 (0 = auto), got {num_splits}.")


def check_mla_extend(
    q_latent, q_pe, cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale, page_size, tree_mask=None
):
    """``kiln::mla_extend``'s argument check (both paths)."""
    check_mla(q_latent, q_pe, cache, page_size)
    if tree_mask is not None and (
        tree_mask.dtype != torch.int64 or tuple(tree_mask.shape) != (q_latent.shape[0],)
    ):
        raise ValueError(
            f"mla_extend: tree_mask must be an int64 [T] = [{q_latent.shape[0]}] tensor (one ancestor "
            f"bitmask per token), got {tree_mask.dtype} {list(tree_mask.shape)}."
        )
    if qo_indptr.shape[0] != req_rows.shape[0] + 1 or seq_lens.shape[0] != req_rows.shape[0]:
        raise ValueError(
            f"mla_extend: qo_indptr has {qo_indptr.shape[0]} entries and seq_lens {seq_lens.shape[0]}; "
            f"expected B + 1 = {req_rows.shape[0] + 1} and B."
        )


def check_mla_kv_write(latent, k_pe, cache, out_slots):
    """``kiln::mla_kv_write``'s argument check (both paths)."""
    t = latent.shape[0]
    if latent.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != t or out_slots.shape != (t,):
        raise ValueError(
            f"mla_kv_write: latent {list(latent.shape)}, k_pe {list(k_pe.shape)} and out_slots "
            f"{list(out_slots.shape)} must be [T, kv_lora_rank], [T, qk_rope_head_dim] and [T]."
        )
    width = latent.shape[1] + k_pe.shape[1]
    if cache.dim() != 3 or cache.shape[2] != width or cache.stride(-1) != 1:
        raise ValueError(
            f"mla_kv_write: cache must be [num_pages, page_size, {width}] with a contiguous last dim, "
            f"got {list(cache.shape)}."
        )
    if cache.dtype not in ACT_DTYPES or latent.dtype != cache.dtype or k_pe.dtype != cache.dtype:
        raise ValueError(
            f"mla_kv_write: latent, k_pe and cache must share one dtype of {ACT_DTYPES}, got "
            f"{latent.dtype}, {k_pe.dtype}, {cache.dtype}."
        )
    if out_slots.dtype != torch.int64 or latent.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError("mla_kv_write: out_slots must be int64; latent and k_pe need a contiguous last dim.")


# --------------------------------------------------------------------------- kernels
@triton.jit
def _mla_kv_write_kernel(
    lat_ptr, pe_ptr, cache_ptr, slot_ptr, stride_lt, stride_pt, stride_cp, stride_ct,
    R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    PAGE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_trigger(PDL)
    pdl_wait(PDL)  # the latent and k_pe are the kernels' before this one
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    dst = cache_ptr + (slot // PAGE) * stride_cp + (slot % PAGE) * stride_ct
    r = tl.arange(0, BLOCK_R)
    x = tl.load(lat_ptr + t * stride_lt + r, mask=r < R)
    tl.store(dst + r, x, mask=r < R)
    e = tl.arange(0, BLOCK_DR)
    y = tl.load(pe_ptr + t * stride_pt + e, mask=e < DR)
    tl.store(dst + R + e, y, mask=e < DR)


@triton.jit
def _mla_decode_split_kernel(
    ql_ptr, qp_ptr, cache_ptr, bt_ptr, rows_ptr, lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    stride_lb, stride_lh, stride_pb, stride_ph, stride_cp, stride_ct, stride_bt, stride_ob, stride_oh,
    num_heads, num_splits, sm_scale,
    R: tl.constexpr, BLOCK_R: tl.constexpr, DR: tl.constexpr, BLOCK_DR: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_trigger(PDL)
    pdl_wait(PDL)  # every program, before any load (ops/common/launch.py)
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    _lo, _base, chunk, active = _split_plan(seq_len, num_splits, 0, BLOCK_N, False)  # decode.py's
    if split >= tl.maximum(active, 1):
        return  # no keys here (split 0 stays to write an empty request's zeros)
    row = tl.load(rows_ptr + b).to(tl.int64)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    r = tl.arange(0, BLOCK_R)
    e = tl.arange(0, BLOCK_DR)
    b64 = b.to(tl.int64)
    ql = tl.load(
        ql_ptr + b64 * stride_lb + heads[:, None] * stride_lh + r[None, :],
        mask=hmask[:, None] & (r[None, :] < R),
        other=0.0,
    )  # ql: [BLOCK_H, BLOCK_R]
    qp = tl.load(
        qp_ptr + b64 * stride_pb + heads[:, None] * stride_ph + e[None, :],
        mask=hmask[:, None] & (e[None, :] < DR),
        other=0.0,
    )  # qp: [BLOCK_H, BLOCK_DR]
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): softmax on exp2
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    bt_row = bt_ptr + row * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        kmask = offs < end
        page = tl.load(bt_row + offs // PAGE, mask=kmask, other=0).to(tl.int64)
        tok = cache_ptr + page * stride_cp + (offs % PAGE).to(tl.int64) * stride_ct  # [BLOCK_N] rows
        c = tl.load(tok[:, None] + r[None, :], mask=kmask[:, None] & (r[None, :] < R), other=0.0)
        pe = tl.load(tok[:, None] + R + e[None, :], mask=kmask[:, None] & (e[None, :] < DR), other=0.0)
        # c: [BLOCK_N, BLOCK_R] (key and value), pe: [BLOCK_N, BLOCK_DR]; read once for BLOCK_H heads
        s = tl_dot(ql, tl.trans(c), PREC, UPCAST) + tl_dot(qp, tl.trans(pe), PREC, UPCAST)
        s = tl.where(kmask[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        acc, m_i, l_i = softmax_block(s, c, m_i, l_i, acc, PREC, UPCAST)
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]  # zeros for an empty request
    omask = hmask[:, None] & (r[None, :] < R)
    if active <= 1:  # the request's only split (always when DIRECT)
        o_ptrs = out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + r[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=omask)
    elif not DIRECT:
        first = (b64 * num_heads + heads) * num_splits  # [BLOCK_H]
        tl.store(mid_lse_ptr + first + split, m_i + tl.log2(l_i), mask=hmask)
        tl.store(mid_o_ptr + (first + split)[:, None] * R + r[None, :], o, mask=omask)


@triton.jit
def _load_rows(ptrs, kvalid, cols, limit, MASKED: tl.constexpr, COL_MASK: tl.constexpr):
    """A key tile ``ptrs [BLOCK_N, C]``: rows masked by ``kvalid`` when ``MASKED``, columns by
    ``cols < limit`` when ``COL_MASK`` (masked elements 0); unmasked loads otherwise."""
    if MASKED:
        if COL_MASK:
            x = tl.load(ptrs, mask=kvalid[:, None] & (cols[None, :] < limit), other=0.0)
        else:
            x = tl.load(ptrs, mask=kvalid[:, None], other=0.0)
    elif COL_MASK:
        x = tl.load(ptrs, mask=cols[None, :] < limit, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _mla_extend_step(
    ql, qp, acc, m_i, l_i, n0, q_pos, kv_end, bt_row, cache_ptr, stride_cp, stride_ct, v0, qk_scale,
    tree_bits, prefix,
    R: tl.constexpr, BLOCK_R: tl.constexpr, DR: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_V: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, TREE: tl.constexpr,
):  # fmt: skip
    """One key block: online-softmax update of ``acc [BLOCK_M, BLOCK_V]`` (latent columns ``v0 +
    [0, BLOCK_V)``), ``m_i``, ``l_i`` (log2 units). ``MASKED``: the causal diagonal and the end.
    ``TREE``: ``tree_bits [BLOCK_M]`` int64, the rows' ancestor masks over the chunk that starts at
    key position ``prefix`` (extend.py's tree path)."""
    kpos = n0 + tl.arange(0, BLOCK_N)
    kvalid = kpos < kv_end  # all true in the unmasked phase
    if MASKED:
        page = tl.load(bt_row + kpos // PAGE, mask=kvalid, other=0)
    else:
        page = tl.load(bt_row + kpos // PAGE)
    tok = cache_ptr + page.to(tl.int64) * stride_cp + (kpos % PAGE).to(tl.int64) * stride_ct  # [BLOCK_N]
    r = tl.arange(0, BLOCK_R)
    e = tl.arange(0, BLOCK_DR)
    c = _load_rows(tok[:, None] + r[None, :], kvalid, r, R, MASKED, R != BLOCK_R)  # [BLOCK_N, BLOCK_R]
    pe = _load_rows(tok[:, None] + R + e[None, :], kvalid, e, DR, MASKED, DR != BLOCK_DR)
    s = tl_dot(ql, tl.trans(c), PREC, UPCAST) + tl_dot(qp, tl.trans(pe), PREC, UPCAST)  # [BLOCK_M, BLOCK_N]
    if MASKED:
        vis = (kpos[None, :] <= q_pos[:, None]) & kvalid[None, :]
        if TREE:  # a key of the chunk only where the row's bit of its node is set
            rel = kpos - prefix  # [BLOCK_N] node index of the key in the chunk
            bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)[None, :]) & 1
            vis = vis & ((rel < 0)[None, :] | (bit != 0))
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if BLOCK_V == BLOCK_R:
        v = c  # the latent tile is the value
    else:  # this program's columns of it (the scores above took all of them)
        cols = v0 + tl.arange(0, BLOCK_V)
        v = _load_rows(tok[:, None] + cols[None, :], kvalid, cols, R, MASKED, R % BLOCK_V != 0)
    acc = acc * alpha[:, None] + tl_dot(p.to(v.dtype), v, PREC, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _mla_extend_kernel(
    ql_ptr, qp_ptr, cache_ptr, bt_ptr, rows_ptr, lens_ptr, indptr_ptr, out_ptr, tm_ptr,
    stride_lt, stride_lh, stride_pt, stride_ph, stride_cp, stride_ct, stride_bt, stride_ot, stride_oh,
    num_reqs, num_tokens, num_heads, sm_scale,
    R: tl.constexpr, BLOCK_R: tl.constexpr, DR: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_V: tl.constexpr, PAGE: tl.constexpr, PACK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SCAN: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    TREE: tl.constexpr = False,  # token trees: tm_ptr [T] int64 ancestor bitmasks (else unused)
):  # fmt: skip
    TOK = BLOCK_M // PACK  # tokens per tile (constexpr)
    t = tl.num_programs(0) - 1 - tl.program_id(0)  # tile index: late (long) tiles start first
    count, before = find_tile(indptr_ptr, num_reqs, t, TOK, SCAN)  # t's request (extend.py)

    i = tl.arange(0, BLOCK_M)
    tok = i // PACK  # row i: token tok of the tile, head h0 + i % PACK
    heads = tl.program_id(1) * PACK + i % PACK
    hmask = heads < num_heads
    v0 = tl.program_id(2) * BLOCK_V
    cols = v0 + tl.arange(0, BLOCK_V)
    o_cols = out_ptr + heads[:, None] * stride_oh + cols[None, :]
    cmask = cols[None, :] < R
    if count < num_reqs:
        b = count
        qo_start = tl.load(indptr_ptr + b)
        ext = tl.load(indptr_ptr + b + 1) - qo_start
        seq_len = tl.load(lens_ptr + b)
        row = tl.load(rows_ptr + b).to(tl.int64)
        prefix = seq_len - ext
        m0 = (t - before) * TOK  # the tile's first token within the request's new ones
        tok = m0 + tok
        rmask = hmask & (tok < ext)
        q_pos = prefix + tok
        q_rows = (qo_start + tok).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        e = tl.arange(0, BLOCK_DR)
        h64 = heads.to(tl.int64)  # absorb_q's q_latent is a [H, T, r] view: head stride T * r
        ql = tl.load(
            ql_ptr + q_rows[:, None] * stride_lt + h64[:, None] * stride_lh + r[None, :],
            mask=rmask[:, None] & (r[None, :] < R),
            other=0.0,
        )  # [BLOCK_M, BLOCK_R]
        qp = tl.load(
            qp_ptr + q_rows[:, None] * stride_pt + h64[:, None] * stride_ph + e[None, :],
            mask=rmask[:, None] & (e[None, :] < DR),
            other=0.0,
        )  # [BLOCK_M, BLOCK_DR]
        if TREE:
            tree_bits = tl.load(tm_ptr + q_rows, mask=rmask, other=0).to(tl.int64)  # [BLOCK_M]
        else:
            tree_bits = q_pos  # unused
        qk_scale = sm_scale * 1.4426950408889634  # log2(e): softmax on exp2
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: fully masked blocks give p = 0
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        bt_row = bt_ptr + row * stride_bt
        first = prefix + m0  # the tile's first query position
        kv_end = prefix + tl.minimum(m0 + TOK, ext)  # one past the last key it sees
        if TREE:  # the chunk's keys are seen by some rows only
            full_end = (prefix // BLOCK_N) * BLOCK_N
        else:
            full_end = (first // BLOCK_N) * BLOCK_N  # key blocks every query of the tile sees whole
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _mla_extend_step(
                ql, qp, acc, m_i, l_i, n0, q_pos, kv_end, bt_row, cache_ptr, stride_cp, stride_ct, v0,
                qk_scale, tree_bits, prefix, R, BLOCK_R, DR, BLOCK_DR, BLOCK_V, PAGE, BLOCK_N, False, PREC,
                UPCAST, TREE,
            )  # fmt: skip
        for n0 in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _mla_extend_step(
                ql, qp, acc, m_i, l_i, n0, q_pos, kv_end, bt_row, cache_ptr, stride_cp, stride_ct, v0,
                qk_scale, tree_bits, prefix, R, BLOCK_R, DR, BLOCK_DR, BLOCK_V, PAGE, BLOCK_N, True, PREC,
                UPCAST, TREE,
            )  # fmt: skip
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            o_cols + q_rows[:, None] * stride_ot, o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask
        )
    else:  # a padding tile: zero its rows past qo_indptr[B]
        pad = (tl.load(indptr_ptr + num_reqs) + (t - before) * TOK + tok).to(tl.int64)
        zeros = tl.zeros([BLOCK_M, BLOCK_V], out_ptr.dtype.element_ty)
        tl.store(o_cols + pad[:, None] * stride_ot, zeros, mask=(hmask & (pad < num_tokens))[:, None] & cmask)


# --------------------------------------------------------------------------- ops
@kiln_op("mla_kv_write", ref=mla_kv_write_ref, check=check_mla_kv_write, mutates_args=("cache",))
def mla_kv_write_triton(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, out_slots: torch.Tensor
) -> None:
    """Write ``[latent | k_pe]`` to row ``out_slots[t]`` of the latent cache (module docstring)."""
    t, r = latent.shape
    if t == 0:
        return
    _mla_kv_write_kernel[(t,)](
        latent, k_pe, cache, out_slots, latent.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        R=r, DR=k_pe.shape[1], BLOCK_R=next_pow2(r), BLOCK_DR=next_pow2(k_pe.shape[1]), PAGE=cache.shape[1],
        num_warps=4, **pdl_args(latent),
    )  # fmt: skip


@dataclass(frozen=True)
class MLADecodeConfig:
    block_h: int = 16  # heads per program (tl.dot needs >= 16 rows)
    block_n: int = 32  # keys per iteration: a [32, 512] latent tile
    num_warps: int = 4
    num_stages: int = 2
    # programs an SM holds at once, whose waves the split plan counts (mla_num_splits): what
    # the launch's registers allow, as compiled by Triton 3.6 for the H100 (bench/conftest.py
    # kernel_resources): 211 registers a thread x 4 warps -> two
    resident: int = 2

    @property
    def label(self) -> str:
        """``h16-n32-w4-s2``."""
        return f"h{self.block_h}-n{self.block_n}-w{self.num_warps}-s{self.num_stages}"


def default_decode_config(heads: int) -> MLADecodeConfig:
    """The launch for ``heads`` query heads. Measured on an H100 (``bench/test_bench_mla.py -k
    decode_sweep``, docs/mla.md): at 16 heads (memory-bound) the default, 32 keys x 16 heads on 4
    warps, is the best or within 2% of it at every shape (84% of read bandwidth at batch 256 x 32k);
    at 64 heads and more (compute-bound: V3 at tp 1) 64-head blocks on 8 warps read each latent tile
    once for 64 heads, 1.29x faster than 16-head blocks at batch 64 x 8k. That launch takes 250
    registers a thread on 8 warps: one program an SM."""
    if interpreting():
        return MLADecodeConfig(block_h=16, block_n=16, num_warps=1, num_stages=1)
    if heads >= 64:
        return MLADecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=2, resident=1)
    return MLADecodeConfig()


def mla_num_splits(
    batch: int, max_seq_len: int, heads: int, config: MLADecodeConfig | None = None, num_sms: int = 132
) -> int:
    """The split-KV factor of an MLA decode of ``batch`` requests over ``heads`` query heads (the
    op's choice for ``num_splits = 0``). The latent is one KV head that every head block of
    ``config`` (default: :func:`default_decode_config`) reads, so a split adds ``P`` = head blocks x
    batch programs, which run in waves of ``config.resident`` programs an SM.

    Time follows the waves (``ceil(P s / slots)``) times the keys a split walks (``1 / s``). Of the
    split counts within ``WAVE_SLACK`` of the best such cost (at most ``MAX_WAVES`` waves, at least
    ``MIN_KEYS_PER_SPLIT`` keys a split) the plan takes those with the fewest waves, and of them the
    most splits. Measured on the H100 at 16 heads (session 34, explicit split counts): batch 64 x 8k
    read at 74.5% of bandwidth with 4 splits (256 programs, one wave of 264), 72.7% with 8 (two
    waves), 53.4% with 5 (a second wave of 56 programs) and 64.0% with 34 (more waves cost more than
    the model says: hence the fewest waves near the best); 32 x 8k best at 8 (68.7%), 64 x 4k at 4
    (67.2%). The earlier target, eight programs an SM, took 17 splits at 64 x 8k (71.7%)."""
    if heads < 1 or num_sms < 1:
        raise ValueError(f"mla_num_splits: heads ({heads}) and num_sms ({num_sms}) must be >= 1.")
    cfg = config or default_decode_config(heads)
    programs = triton.cdiv(heads, cfg.block_h) * max(batch, 1)
    slots = cfg.resident * num_sms
    most = min(max(1, max_seq_len // MIN_KEYS_PER_SPLIT), MAX_SPLITS, max(1, MAX_WAVES * slots // programs))
    plans = [(triton.cdiv(programs * s, slots), s) for s in range(1, most + 1)]  # (waves, splits)
    best = min(w / s for w, s in plans)
    _waves, fewer = min((w, -s) for w, s in plans if w / s <= best * (1 + WAVE_SLACK))
    return -fewer


@kiln_op("mla_decode", ref=mla_decode_ref, check=check_mla_decode, fake=empty_mla_out)
def mla_decode_triton(
    q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
    req_rows: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, page_size: int, num_splits: int,
    *, config: MLADecodeConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """Split-KV MLA decode ``[B, H, r] -> [B, H, r]`` (module docstring); ``config`` overrides the
    launch (benchmarks sweep it)."""
    bsz, heads, r = q_latent.shape
    dr = q_pe.shape[2]
    cfg = config or default_decode_config(heads)
    head_blocks = triton.cdiv(heads, cfg.block_h)
    if num_splits == 0:
        num_splits = mla_num_splits(
            bsz, block_table.shape[1] * page_size, heads, cfg, sm_count(q_latent.device, 132)
        )
    out = torch.empty(bsz, heads, r, dtype=q_latent.dtype, device=q_latent.device)
    if bsz == 0:
        return out
    direct = num_splits == 1
    mid_o, mid_lse = split_partials(out, num_splits)
    block_table = block_table.to(torch.int32)
    block_r = max(16, next_pow2(r))
    pdl = pdl_args(q_latent)
    # the kernel addresses position p as page * stride_page + (p % P) * stride_token; a flat cache
    # (one slot per row) is the same with pages of P rows
    paged = cache.shape[1] == page_size
    stride_page, stride_token = (
        (cache.stride(0), cache.stride(1)) if paged else (page_size * cache.stride(0), cache.stride(0))
    )
    _mla_decode_split_kernel[(head_blocks, bsz, num_splits)](
        q_latent, q_pe, cache, block_table, req_rows, seq_lens, out, mid_o, mid_lse,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), stride_page,
        stride_token, block_table.stride(0), out.stride(0), out.stride(1), heads, num_splits,
        float(sm_scale), R=r, BLOCK_R=block_r, DR=dr, BLOCK_DR=max(16, next_pow2(dr)), PAGE=page_size,
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, DIRECT=direct,
        PREC="ieee" if q_latent.dtype == torch.float32 else "tf32", UPCAST=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )  # fmt: skip
    if not direct:
        block_m = min(64, block_r)  # decode.py's merge: the partials' layout and split plan are its own
        _decode_merge_kernel[(bsz, heads, triton.cdiv(r, block_m))](
            mid_o, mid_lse, seq_lens, out, out.stride(0), out.stride(1), heads, num_splits, 0,
            DV=r, BLOCK_DV=block_m, TILE=min(64, next_pow2(num_splits)), BLOCK_N=cfg.block_n,
            HAS_WINDOW=False, num_warps=4, **pdl,
        )  # fmt: skip
    return out


@dataclass(frozen=True)
class MLAExtendConfig:
    block_m: int = 64  # query rows of a tile: block_m // pack tokens x pack heads
    block_n: int = 32  # keys per iteration: a [32, r + dr] latent tile
    block_v: int = 0  # latent output columns per program; 0 = all r (else each block recomputes the scores)
    pack: int = 0  # heads per tile, a power of two <= block_m; 0 = min(block_m, next_pow2(H))
    num_warps: int = 8
    num_stages: int = 2


def default_extend_config(dtype: torch.dtype) -> MLAExtendConfig:
    if interpreting():
        return MLAExtendConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:  # exact fp32 dots run on FMA units: small tiles avoid spills
        return MLAExtendConfig(block_m=16, block_n=16, block_v=128, num_warps=4, num_stages=1)
    return MLAExtendConfig()  # untuned on a GPU yet (bench/test_bench_mla.py sweeps it)


def _extend_tiling(cfg: MLAExtendConfig, heads: int, r: int) -> tuple[int, int, int]:
    """``(pack, block_r, block_v)`` of a launch; raises ``ValueError`` for a config that cannot run."""
    block_r = max(16, next_pow2(r))
    pack = cfg.pack or min(cfg.block_m, next_pow2(heads))
    block_v = cfg.block_v or block_r
    pow2 = all(x == next_pow2(x) for x in (cfg.block_m, cfg.block_n, pack, block_v))
    if not pow2 or cfg.block_m < 16 or cfg.block_n < 16 or pack > cfg.block_m or not 16 <= block_v <= block_r:
        raise ValueError(
            f"mla_extend: config {cfg} needs powers of two with block_m, block_n >= 16, pack <= block_m "
            f"and 16 <= block_v <= {block_r} (kv_lora_rank {r} rounded up)."
        )
    return pack, block_r, block_v


@kiln_op("mla_extend", ref=mla_extend_ref, check=check_mla_extend, fake=empty_mla_out)
def mla_extend_triton(
    q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
    req_rows: torch.Tensor, seq_lens: torch.Tensor, qo_indptr: torch.Tensor, sm_scale: float, page_size: int,
    tree_mask: torch.Tensor | None = None, *, config: MLAExtendConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """MLA extend ``[T, H, r] -> [T, H, r]`` (module docstring): the flash kernel, grid from shapes
    only (CUDA-graph safe); ``tree_mask`` ``[T]`` int64 ancestor bitmasks of token trees (extend.py's
    meaning), else None (causal chunks); ``config`` overrides the tiling and launch (benchmarks
    sweep it)."""
    t, heads, r = q_latent.shape
    dr = q_pe.shape[2]
    num_reqs = req_rows.shape[0]
    cfg = config or default_extend_config(q_latent.dtype)
    pack, block_r, block_v = _extend_tiling(cfg, heads, r)
    out = torch.empty(t, heads, r, dtype=q_latent.dtype, device=q_latent.device)
    if t == 0:
        return out
    block_table = block_table.to(torch.int32)
    paged = cache.shape[1] == page_size  # a flat cache: pages of P rows of one slot (mla_decode_triton)
    stride_page, stride_token = (
        (cache.stride(0), cache.stride(1)) if paged else (page_size * cache.stride(0), cache.stride(0))
    )
    grid = (triton.cdiv(t, cfg.block_m // pack) + num_reqs, triton.cdiv(heads, pack), triton.cdiv(r, block_v))
    _mla_extend_kernel[grid](
        q_latent, q_pe, cache, block_table, req_rows, seq_lens, qo_indptr, out,
        seq_lens if tree_mask is None else tree_mask,  # tm_ptr: any tensor when TREE is off
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), stride_page, stride_token,
        block_table.stride(0), out.stride(0), out.stride(1), num_reqs, t, heads, float(sm_scale),
        R=r, BLOCK_R=block_r, DR=dr, BLOCK_DR=max(16, next_pow2(dr)), BLOCK_V=block_v, PAGE=page_size,
        PACK=pack, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SCAN=64,
        PREC="ieee" if q_latent.dtype == torch.float32 else "tf32", UPCAST=interpreting(),
        TREE=tree_mask is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def by_step(decode: Any, extend: Any) -> Any:
    """``kiln::mla_attention``'s parameters over a decode and an extend function taking their ops':
    ``decode`` when ``T == B`` (one new token per request) without a tree mask, else ``extend``
    (with the tree mask when there is one: a tree step of roots alone is still a tree chunk)."""

    def mla_attention(
        q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
        req_rows: torch.Tensor, seq_lens: torch.Tensor, qo_indptr: torch.Tensor, sm_scale: float,
        page_size: int, num_splits: int, tree_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """MLA decode when ``T == B`` without a tree mask, MLA extend otherwise (the module docstring)."""
        if tree_mask is None and q_latent.shape[0] == req_rows.shape[0]:
            return decode(
                q_latent, q_pe, cache, block_table, req_rows, seq_lens, sm_scale, page_size, num_splits
            )
        return extend(
            q_latent, q_pe, cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale, page_size, tree_mask
        )

    return mla_attention


mla_attention_ref = by_step(mla_decode_ref, mla_extend_ref)
mla_attention_forward = kiln_op(
    "mla_attention",
    ref=mla_attention_ref,
    check=by_step(check_mla_decode, check_mla_extend),
    fake=empty_mla_out,
)(by_step(mla_decode_triton, mla_extend_triton))
