"""Paged decode attention: split-KV flash-decoding, GQA-grouped.

``torch.ops.kiln.decode_attention(q, k_cache, v_cache, block_table, req_rows, seq_lens, sm_scale,
page_size, num_splits, sliding_window, logit_cap) -> out``

* q ``[B, Hq, D]``, k_cache ``[S, Hkv, D]``, v_cache ``[S, Hkv, Dv]`` (same float dtype; the last
  dim contiguous), block_table ``[R, M]`` int32, req_rows / seq_lens ``[B]`` int32.
* out ``[B, Hq, Dv]`` in q's dtype. Request ``b``'s query sits at position ``seq_lens[b] - 1`` and
  sees keys ``0..seq_lens[b]-1`` (the last ``sliding_window`` of them if ``sliding_window > 0``);
  ``logit_cap > 0`` soft-caps the scaled scores. A request with ``seq_lens[b] == 0`` gets zeros.

Kernel: grid ``(B, Hkv, num_splits)``. Each program takes all ``Hq / Hkv`` query heads of one KV
head (padded to 16 rows for ``tl.dot``), so every K/V row is read once per group, and walks its
share of the keys: ``ceil(span / num_splits)`` rounded up to the key block, computed in the kernel
from ``seq_lens`` so that one launch serves every length (CUDA-graph safe). It writes a partial
output and its log-sum-exp (base 2); a second kernel merges the splits. Splits that get no keys
write ``lse = -inf`` and zeros, which the merge weighs by zero. ``num_splits == 1`` writes the
output directly. Accumulation is float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.ops.attention_ref import decode_attention_ref
from kiln.ops.common import interpreting, kiln_op, next_pow2, use_triton

MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (q load, partial write) dominates
MAX_SPLITS = 128


def choose_num_splits(batch: int, max_seq_len: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Split-KV factor for a decode bucket.

    Aims at about eight programs per SM (``batch * num_kv_heads * splits``), so the memory system
    sees enough loads in flight and the last wave is short, while giving every split at least
    ``MIN_KEYS_PER_SPLIT`` keys of a ``max_seq_len`` sequence. Shorter sequences use fewer splits
    on their own: the kernel sizes splits from the actual length, and the rest exit at once.
    """
    if batch < 1 or num_kv_heads < 1 or max_seq_len < 1:
        raise ValueError(
            f"choose_num_splits: batch ({batch}), max_seq_len ({max_seq_len}) and num_kv_heads "
            f"({num_kv_heads}) must all be >= 1."
        )
    want = math.ceil(8 * num_sms / (batch * num_kv_heads))
    by_len = max(1, max_seq_len // MIN_KEYS_PER_SPLIT)
    return max(1, min(want, by_len, MAX_SPLITS))


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64  # keys per iteration
    num_warps: int = 4
    num_stages: int = 2


def default_config(head_dim: int, v_head_dim: int) -> DecodeConfig:
    if interpreting():
        return DecodeConfig(block_n=16, num_warps=1, num_stages=1)
    if max(head_dim, v_head_dim) > 128:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    return DecodeConfig(block_n=64, num_warps=4, num_stages=2)


@triton.jit
def _softcap(s, cap):
    # cap * tanh(s / cap), through exp of a non-positive argument (never overflows)
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: the Triton 3.9 interpreter multiplies bf16 tiles as their raw uint16 bits; the
    # tests run through it with float32 operands (same values: bf16 -> f32 is exact).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, rows_ptr, lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
    stride_ob, stride_oh, num_q_heads, num_splits, sm_scale, logit_cap, sliding_window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    row = tl.load(rows_ptr + b).to(tl.int64)

    # keys [lo, seq_len) are visible; this program takes [start, end) of them
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - sliding_window, 0)
    base = (lo // BLOCK_N) * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(seq_len - base, num_splits), BLOCK_N) * BLOCK_N
    start = base + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g  # [GROUP_PAD]
    hmask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=hmask[:, None] & (d[None, :] < D),
        other=0.0,
    )  # q: [GROUP_PAD, BLOCK_D]
    qk_scale = sm_scale * 1.4426950408889634  # log2(e) folded in: softmax runs on exp2

    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)  # finite: exp2(m_i - m_new) never NaN
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_DV], tl.float32)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        kmask = offs < end
        if HAS_WINDOW:
            kmask = kmask & (offs >= lo)
        page = tl.load(bt_ptr + row * stride_bt + offs // PAGE, mask=offs < end, other=0)
        slot = page.to(tl.int64) * PAGE + offs % PAGE  # [BLOCK_N]
        k = tl.load(
            k_base + slot[:, None] * stride_ks + d[None, :],
            mask=kmask[:, None] & (d[None, :] < D),
            other=0.0,
        )  # k: [BLOCK_N, BLOCK_D]
        s = _dot(q, tl.trans(k), PREC, UPCAST)  # [GROUP_PAD, BLOCK_N] f32
        if HAS_CAP:
            s = _softcap(s * sm_scale, logit_cap) * 1.4426950408889634
        else:
            s = s * qk_scale
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + slot[:, None] * stride_vs + dv[None, :],
            mask=kmask[:, None] & (dv[None, :] < DV),
            other=0.0,
        )  # v: [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]  # [GROUP_PAD, BLOCK_DV]
    omask = hmask[:, None] & (dv[None, :] < DV)
    if DIRECT:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dv[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # [GROUP_PAD]
        mid = (b.to(tl.int64) * num_q_heads + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(mid_lse_ptr + mid, lse, mask=hmask)
        tl.store(mid_o_ptr + mid[:, None] * DV + dv[None, :], o, mask=omask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh, num_q_heads, num_splits,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    # grid (B, Hq, cdiv(Dv, BLOCK_DV)): merges the splits of one head for BLOCK_DV columns
    b = tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    row0 = (b.to(tl.int64) * num_q_heads + h) * num_splits
    m = tl.full([1], -1.0e30, tl.float32)  # finite sentinel: empty splits (-inf) weigh 0
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for s0 in range(0, num_splits, TILE):
        s = s0 + tl.arange(0, TILE)
        smask = s < num_splits
        lse = tl.load(mid_lse_ptr + row0 + s, mask=smask, other=float("-inf"))  # [TILE]
        o = tl.load(
            mid_o_ptr + (row0 + s)[:, None] * DV + dv[None, :],
            mask=smask[:, None] & (dv[None, :] < DV),
            other=0.0,
        )  # o: [TILE, BLOCK_DV]
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)  # [TILE]
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        l = l * alpha + tl.sum(w, 0)
        m = m_new
    out = acc / tl.where(l > 0.0, l, 1.0)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + dv
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int) -> None:
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(
            f"attention: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)} and v_cache "
            f"{tuple(v_cache.shape)} must be 3-D ([tokens, heads, dim], [slots, kv_heads, dim])."
        )
    hq, hkv = q.shape[1], k_cache.shape[1]
    if hq % hkv or v_cache.shape[1] != hkv or q.shape[2] != k_cache.shape[2]:
        raise ValueError(
            f"attention: q heads ({hq}) must be a multiple of kv heads ({hkv}), v_cache must have "
            f"{hkv} heads (has {v_cache.shape[1]}) and q/k head dims must agree "
            f"({q.shape[2]} vs {k_cache.shape[2]})."
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("attention: q, k_cache and v_cache need a contiguous last dimension.")
    if page_size < 1:
        raise ValueError(f"attention: page_size must be >= 1, got {page_size}.")


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    page_size: int,
    num_splits: int,
    sliding_window: int = -1,
    logit_cap: float = 0.0,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Launch the Triton kernels (shapes as in the module docstring); ``config`` overrides the
    block size and launch parameters (benchmarks sweep it)."""
    _check(q, k_cache, v_cache, page_size)
    if num_splits < 0:
        raise ValueError(f"decode_attention: num_splits must be >= 0 (0 = auto), got {num_splits}.")
    bsz, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    if num_splits == 0:  # auto: from the batch and the block table's context capacity
        num_splits = choose_num_splits(max(bsz, 1), block_table.shape[1] * page_size, hkv)
    group = hq // hkv
    cfg = config or default_config(d, dv)
    out = torch.empty(bsz, hq, dv, dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    direct = num_splits == 1
    if direct:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty(bsz, hq, num_splits, dv, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
    block_table = block_table.to(torch.int32)
    _decode_split_kernel[(bsz, hkv, num_splits)](
        q, k_cache, v_cache, block_table, req_rows, seq_lens, out, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), block_table.stride(0), out.stride(0), out.stride(1), hq, num_splits,
        float(sm_scale), float(logit_cap), int(sliding_window),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), D=d, BLOCK_D=max(16, next_pow2(d)),
        DV=dv, BLOCK_DV=max(16, next_pow2(dv)), PAGE=page_size, BLOCK_N=cfg.block_n,
        HAS_CAP=logit_cap > 0, HAS_WINDOW=sliding_window > 0, DIRECT=direct,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if not direct:
        block_dv = min(64, max(16, next_pow2(dv)))
        _decode_merge_kernel[(bsz, hq, triton.cdiv(dv, block_dv))](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), hq, num_splits,
            DV=dv, BLOCK_DV=block_dv, TILE=min(64, next_pow2(num_splits)), num_warps=4,
        )  # fmt: skip
    return out


def decode_attention_any(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    page_size: int,
    num_splits: int,
    sliding_window: int,
    logit_cap: float,
) -> torch.Tensor:
    """The op's body: the Triton kernels where ``use_triton`` says so, else the reference."""
    if use_triton(q):
        return decode_attention_triton(
            q,
            k_cache,
            v_cache,
            block_table,
            req_rows,
            seq_lens,
            sm_scale,
            page_size,
            num_splits,
            sliding_window,
            logit_cap,
        )
    _check(q, k_cache, v_cache, page_size)
    return decode_attention_ref(
        q, k_cache, v_cache, block_table, req_rows, seq_lens, sm_scale, page_size, sliding_window, logit_cap
    )


@kiln_op("decode_attention")
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    page_size: int,
    num_splits: int,
    sliding_window: int,
    logit_cap: float,
) -> torch.Tensor:
    """Paged decode attention (see the module docstring): ``[B, Hq, D] -> [B, Hq, Dv]``."""
    return decode_attention_any(
        q,
        k_cache,
        v_cache,
        block_table,
        req_rows,
        seq_lens,
        sm_scale,
        page_size,
        num_splits,
        sliding_window,
        logit_cap,
    )


@decode_attention.register_fake
def _(q, k_cache, v_cache, block_table, req_rows, seq_lens, sm_scale, page_size, num_splits,
      sliding_window, logit_cap):  # fmt: skip
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
