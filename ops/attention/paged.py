"""Paged attention for any step: ``torch.ops.kiln.paged_attention``.

One op serves decode and extend so that one exported graph serves both (start-up loads one graph;
the runtime captures that graph once per decode bucket). The signature is extend attention's plus
decode's ``num_splits``:

    paged_attention(q[T, Hq, D], k_cache[S, Hkv, D], v_cache[S, Hkv, Dv], block_table[R, M] i32,
                    req_rows[B] i32, seq_lens[B] i32, qo_indptr[B + 1] i32, sm_scale, page_size,
                    num_splits, sliding_window, logit_cap) -> [T, Hq, Dv]

Dispatch is on shapes only (capture-safe): ``T == B`` is a decode step (every request of a batch
brings at least one new token, so ``T == B`` means exactly one each) and runs split-KV decode
attention with ``num_splits`` (0 = chosen from the batch and the block table's width); otherwise
extend attention (``num_splits`` unused).
"""

from __future__ import annotations

import torch

from kiln.ops.attention.decode import decode_attention_any
from kiln.ops.attention.extend import extend_attention_any
from kiln.ops.common.op import kiln_op


@kiln_op("paged_attention")
def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    sm_scale: float,
    page_size: int,
    num_splits: int,
    sliding_window: int,
    logit_cap: float,
) -> torch.Tensor:
    """Decode attention when ``T == B``, extend attention otherwise (see the module docstring)."""
    if q.shape[0] == req_rows.shape[0]:
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
    return extend_attention_any(
        q,
        k_cache,
        v_cache,
        block_table,
        req_rows,
        seq_lens,
        qo_indptr,
        sm_scale,
        page_size,
        sliding_window,
        logit_cap,
    )


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale, page_size, num_splits,
      sliding_window, logit_cap):  # fmt: skip
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
