"""Structured outputs' token masks on the logits: ``apply_token_bitmask_(logits, bitmask, rows)``.

A grammar engine (runtime/grammar.py) fills, on the host, one packed mask per constrained request:
``bitmask [n, ceil(V / 32)] int32``, bit ``j`` of word ``w`` set when token ``32 * w + j`` may come
next (the layout xgrammar and llguidance write). This sets ``logits[rows[i], t] = -inf`` for every
token ``t < V`` whose bit is clear in ``bitmask[i]``, in place; rows not in ``rows`` are untouched
(requests without a grammar pay nothing). Words past ``V`` are ignored.

The Triton kernel runs one program per (masked row, 4096-token block): a word load per 32 tokens and
a masked store of ``-inf`` where a bit is clear, so an allowed token's logit is never rewritten. CPU
tensors take the plain-torch reference (the kernel under the interpreter with
``KILN_TRITON_ON_CPU=1``). No host sync, a grid fixed by the shapes. Not an op: the sampler calls it
outside the graphs, like ``gumbel.py``'s entry points.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.common.launch import use_triton

BLOCK = 4096  # tokens per program


@triton.jit
def _bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, stride_l, stride_b, V, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    words = tl.load(bitmask_ptr + i * stride_b + offs // 32, mask=inside, other=-1)
    allowed = ((words >> (offs % 32)) & 1) != 0
    row = tl.load(rows_ptr + i).to(tl.int64)
    tl.store(logits_ptr + row * stride_l + offs, float("-inf"), mask=inside & ~allowed)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Plain torch: the kernel's contract (module docstring)."""
    if rows.numel() == 0:
        return
    v = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = ((bitmask.to(torch.int32)[:, :, None] >> shifts) & 1).flatten(1)[:, :v]  # [n, V]
    rows = rows.to(torch.int64)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(bits == 0, float("-inf")))


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"apply_token_bitmask_: logits must be [B, V] with unit stride, got {list(logits.shape)}"
        )
    words = triton.cdiv(logits.shape[1], 32)
    if (
        bitmask.dtype != torch.int32
        or bitmask.dim() != 2
        or bitmask.shape[1] < words
        or bitmask.stride(1) != 1
    ):
        raise ValueError(
            f"apply_token_bitmask_: bitmask must be int32 [n, >= ceil(V/32) = {words}] with unit stride, "
            f"got {bitmask.dtype} {list(bitmask.shape)}"
        )
    if rows.dim() != 1 or rows.shape[0] != bitmask.shape[0]:
        raise ValueError(
            f"apply_token_bitmask_: rows must be [n] = [{bitmask.shape[0]}], got {list(rows.shape)}"
        )
    if bitmask.device != logits.device or rows.device != logits.device:
        raise ValueError("apply_token_bitmask_: logits, bitmask and rows must be on one device")


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """``logits [B, V]`` float, in place: rows ``rows [n]`` keep the tokens ``bitmask [n, W]``
    allows, the others become ``-inf`` (module docstring)."""
    _check(logits, bitmask, rows)
    if rows.numel() == 0:
        return
    if not use_triton(logits):
        apply_token_bitmask_ref(logits, bitmask, rows)
        return
    v = logits.shape[1]
    _bitmask_kernel[(rows.shape[0], triton.cdiv(v, BLOCK))](
        logits, bitmask, rows, logits.stride(0), bitmask.stride(0), v, BLOCK=BLOCK
    )
