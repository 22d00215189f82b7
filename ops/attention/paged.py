"""Paged attention for any step: ``torch.ops.kiln.paged_attention``.

One op serves decode and extend so that one exported graph serves both (start-up loads one graph;
the runtime captures that graph once per decode bucket). The signature is extend attention's plus
decode's ``num_splits``:

    paged_attention(q[T, Hq, D], k_cache[S, Hkv, D], v_cache[S, Hkv, Dv], block_table[R, M] i32,
                    req_rows[B] i32, seq_lens[B] i32, qo_indptr[B + 1] i32, sm_scale, page_size,
                    num_splits, sliding_window, logit_cap, k_scale=None, v_scale=None,
                    tree_mask=None) -> [T, Hq, Dv]

(``k_scale``/``v_scale``: ``[S, Hkv]`` float32 per-row scales of ``float8_e4m3fn`` caches, else
None; passed through to both. ``tree_mask``: ``[T]`` int64 ancestor bitmasks of token trees,
speculative verification, as extend attention takes them (ops/attention/extend.py), else None.)

Dispatch is on shapes only (capture-safe): ``T == B`` is a decode step (every request of a batch
brings at least one new token, so ``T == B`` means exactly one each) and runs split-KV decode
attention with ``num_splits`` (0 = chosen from the batch and the block table's width); a step of at
most ``FEW_TOKENS`` tokens per request on average and ``MAX_TOKENS`` in all (speculative
verification: ``k + 1`` each) on a 16-bit cache without a sliding window runs ``kiln::verify_attention`` (ops/attention/verify.py: the
same split plan, a program per tile of a request's tokens; token trees too); otherwise extend
attention (``num_splits`` unused). With a ``tree_mask`` (a graph traced with the tree input,
compiler/context.py) it is never decode attention: a tree step of one node per request (the roots
alone) is still a tree chunk. Without one, the calls are exactly those of a plain step. The op's
launch, reference and check are :func:`by_step` over decode's and extend's (ops/common/op.py
``kiln_op``); its fake is their shape rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.ops.attention.decode import check_decode, decode_attention_triton
from kiln.ops.attention.extend import check_extend, extend_attention_triton
from kiln.ops.attention.reference import decode_attention_ref, empty_attention_out, extend_attention_ref
from kiln.ops.attention.verify import FEW_TOKENS, MAX_TOKENS, verify_attention_triton
from kiln.ops.common.op import kiln_op


def by_step(
    decode: Callable[..., Any], extend: Callable[..., Any], few: Callable[..., Any] | None = None
) -> Callable[..., Any]:
    """Paged attention's parameters over a decode and an extend function that take their ops'
    (``kiln::decode_attention``'s, ``kiln::extend_attention``'s): ``decode`` when ``T == B`` and
    there is no tree mask, else ``few`` (``kiln::verify_attention``'s parameters, the tree mask
    passed on) for a step of at most ``FEW_TOKENS`` tokens per request on average and ``MAX_TOKENS``
    in all without a sliding window or an FP8 cache, else ``extend`` (with the tree mask when there
    is one). The op's launch, reference and
    check are this over the ops' launches, references and checks (extend's stand for ``few``'s)."""

    def paged_attention(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
        req_rows: torch.Tensor, seq_lens: torch.Tensor, qo_indptr: torch.Tensor, sm_scale: float,
        page_size: int, num_splits: int, sliding_window: int, logit_cap: float,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Decode attention when ``T == B`` without a tree mask, verify attention for few tokens per
        request, extend attention otherwise (see the module docstring)."""
        if q.shape[0] == req_rows.shape[0] and tree_mask is None:
            return decode(q, k_cache, v_cache, block_table, req_rows, seq_lens, sm_scale, page_size,
                          num_splits, sliding_window, logit_cap, k_scale, v_scale)  # fmt: skip
        if (
            few is not None
            and k_scale is None
            and sliding_window <= 0
            and q.shape[0] <= min(FEW_TOKENS * req_rows.shape[0], MAX_TOKENS)
        ):
            return few(q, k_cache, v_cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale, page_size,
                       num_splits, logit_cap, tree_mask)  # fmt: skip
        if tree_mask is not None:
            return extend(q, k_cache, v_cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale,
                          page_size, sliding_window, logit_cap, k_scale, v_scale, tree_mask)  # fmt: skip
        return extend(q, k_cache, v_cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale, page_size,
                      sliding_window, logit_cap, k_scale, v_scale)  # fmt: skip

    return paged_attention


paged_attention_ref = by_step(decode_attention_ref, extend_attention_ref)
paged_attention_forward = kiln_op(
    "paged_attention",
    ref=paged_attention_ref,
    check=by_step(check_decode, check_extend),
    fake=empty_attention_out,
)(by_step(decode_attention_triton, extend_attention_triton, verify_attention_triton))
