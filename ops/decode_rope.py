"""QK-norm + RoPE + KV write inside decode attention: ``kiln::decode_rope_attention``.

``decode_rope_attention(qkv, positions, cos_sin, k_cache, v_cache, out_slots, block_table, req_rows,
seq_lens, num_q_heads, num_kv_heads, head_dim, rotary_dim, is_neox, q_norm_w, k_norm_w, eps, sm_scale,
page_size, num_splits, sliding_window, logit_cap) -> out [B, Hq, D]`` is
``kiln::qkv_rope_kvwrite`` (ops/qkv_rope.py) followed by ``kiln::decode_attention``
(ops/decode_attention.py) for a decode step (``T == B``: one new token per request), in one
launch of the split kernel (plus its merge): each program computes its GQA group's q rows from the
projection (the per-head norm and the rotation, rounded as ``qkv_rope_kvwrite`` stores q), and the
last active split of each ``(request, kv head)`` (the one whose keys end at the new token) first
writes the token's k and v to the caches, then reads them back with the others. The separate rope
kernel and its launch go away: 1.7 us of a 51.5 us batch-1 layer of Qwen3-30B-A3B on the H200
(docs/decode_budget.md).

Same arguments and dtypes as the two ops; the caches are mutated in place. ``v`` heads have ``D``
dims (the fused projection's layout). ``out_slots[b]`` must be the pool row of position
``seq_lens[b] - 1`` (the token's own key is read back from there); a padding request
(``seq_lens[b] == 0``) writes nothing, where ``qkv_rope_kvwrite`` writes its row to the sink slot 0.
Off the GPU (and under the interpreter without ``KILN_TRITON_ON_CPU``) the body runs the two
references in turn.

Opt-in: ``KILN_ROPE_IN_ATTN=1`` (read when tracing) makes the batch-1 decode graph's
residual-stream layers (compiler/models/base.py) call it instead of the two ops. Measured on the
H200 (L16 Qwen3-30B-A3B shape): the step bench (bench/test_bench_decode_step.py) gave 1014 -> 1003
us per batch-1 step (``bench/results/2026-11-30_h200_s10b_*``), but end to end it is slower, 938.9
vs 951.9 tok/s at batch 1 (``..._s10c_*``): the split kernel grew from 4.9 to 6.5 us, as much as
the rope kernel it removes, and its programs now wait on the position -> cos/sin loads and the last
split on its k / v store. A second version that loaded the tables before the PDL wait and took the
new k / v from registers was slower still (split kernel 8 us, 904 vs 956 tok/s, ``..._s10d_*``),
so that version was not kept.
"""

from __future__ import annotations

import os

import torch

from kiln.ops.attention_ref import decode_attention_ref
from kiln.ops.common import interpreting, kiln_op, use_triton
from kiln.ops.decode_attention import decode_attention_triton
from kiln.ops.qkv_rope import _check as _check_rope
from kiln.ops.qkv_rope import qkv_rope_kvwrite_ref


def rope_in_attention() -> bool:
    """``KILN_ROPE_IN_ATTN`` (read when tracing the batch-1 decode graph): ``1`` on, ``0`` off
    (default: measured slower end to end, module docstring)."""
    value = os.environ.get("KILN_ROPE_IN_ATTN", "0")
    if value not in ("0", "1"):
        raise ValueError(f"KILN_ROPE_IN_ATTN must be 0 or 1, got {value!r}")
    return value == "1"


@kiln_op("decode_rope_attention", mutates_args=("k_cache", "v_cache"))
def decode_rope_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    block_table: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    is_neox: bool,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    eps: float,
    sm_scale: float,
    page_size: int,
    num_splits: int,
    sliding_window: int,
    logit_cap: float,
) -> torch.Tensor:
    """See the module docstring: ``qkv [B, (Hq + 2 Hkv) D] -> [B, Hq, D]``; writes the caches."""
    rope = (qkv, positions, cos_sin, k_cache, v_cache, out_slots, num_q_heads, num_kv_heads, head_dim)
    _check_rope(*rope, rotary_dim)
    if qkv.shape[0] != req_rows.shape[0]:
        raise ValueError(
            f"decode_rope_attention: needs a decode step, one token per request (qkv has {qkv.shape[0]} "
            f"rows for {req_rows.shape[0]} requests); use qkv_rope_kvwrite + paged_attention otherwise."
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"decode_rope_attention: num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads})."
        )
    if page_size < 1 or cos_sin.stride(-1) != 1:
        raise ValueError(
            f"decode_rope_attention: page_size must be >= 1 (got {page_size}) and cos_sin needs unit "
            f"stride on its last dim (got {cos_sin.stride(-1)}; pass cos_sin.contiguous())."
        )
    if not use_triton(qkv):
        q = qkv_rope_kvwrite_ref(*rope, rotary_dim, is_neox, q_norm_w, k_norm_w, eps)
        return decode_attention_ref(
            q, k_cache, v_cache, block_table, req_rows, seq_lens, sm_scale, page_size, sliding_window,
            logit_cap,
        )  # fmt: skip
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    bf16 = torch.bfloat16
    rne = interpreting() and not qkv.is_cuda  # the interpreter's bf16 casts truncate: round them
    rounds = lambda w: w is not None and torch.promote_types(qkv.dtype, w.dtype) == qkv.dtype
    args = dict(  # the split kernel's rope arguments (ops/decode_attention.py _decode_split_kernel)
        ROPE=True, pos_ptr=positions, cs_ptr=cos_sin, slot_ptr=out_slots,
        qw_ptr=q_norm_w if q_norm_w is not None else qkv, kw_ptr=k_norm_w if k_norm_w is not None else qkv,
        stride_cs=cos_sin.stride(0), eps=float(eps), HQ=num_q_heads, HKV=num_kv_heads, ROT=rotary_dim,
        IS_NEOX=bool(is_neox), HAS_QN=q_norm_w is not None, HAS_KN=k_norm_w is not None,
        ROUND_QN=rounds(q_norm_w), ROUND_KN=rounds(k_norm_w),
        RNE=rne and qkv.dtype == bf16, RNE_K=rne and k_cache.dtype == bf16,
        RNE_V=rne and v_cache.dtype == bf16,
    )  # fmt: skip
    return decode_attention_triton(
        qkv, k_cache, v_cache, block_table, req_rows, seq_lens, sm_scale, page_size, num_splits,
        sliding_window, logit_cap, rope=args,
    )  # fmt: skip


@decode_rope_attention.register_fake
def _(qkv, positions, cos_sin, k_cache, v_cache, out_slots, block_table, req_rows, seq_lens, num_q_heads,
      num_kv_heads, head_dim, *rest):  # fmt: skip
    return qkv.new_empty(qkv.shape[0], num_q_heads, head_dim)


__all__ = ["decode_rope_attention", "rope_in_attention"]
