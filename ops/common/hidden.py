"""``torch.ops.kiln.save_hidden(dst, src, col)``: ``dst[:T, col:col + H] = src`` for ``src [T, H]``,
in place: how a graph hands hidden states out (speculative decoding's EAGLE-3 and MTP drafts read
the target's residual stream at chosen layers; docs/speculative.md section 4). ``dst`` is a graph
input written in place, as the KV cache is; a custom op, so the export keeps the write as one call
instead of an input mutation."""

from __future__ import annotations

import torch

from kiln.ops.common.op import kiln_op


def save_hidden_ref(dst: torch.Tensor, src: torch.Tensor, col: int) -> None:
    dst[: src.shape[0], col : col + src.shape[1]].copy_(src)


def _check(dst: torch.Tensor, src: torch.Tensor, col: int) -> None:
    if dst.dim() != 2 or src.dim() != 2 or src.shape[0] > dst.shape[0] or col + src.shape[1] > dst.shape[1]:
        raise ValueError(
            f"save_hidden: src {tuple(src.shape)} does not fit dst {tuple(dst.shape)} at column {col}"
        )


@kiln_op("save_hidden", ref=save_hidden_ref, check=_check, mutates_args=("dst",))
def save_hidden_forward(dst: torch.Tensor, src: torch.Tensor, col: int) -> None:
    """The same copy on any device (one strided copy kernel; CUDA-graph safe)."""
    save_hidden_ref(dst, src, col)
