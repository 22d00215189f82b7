"""ForwardContext: the per-batch inputs every layer sees, passed explicitly (never a global).

The same tensors are the inputs of the exported graphs; see docs/internals.md for their layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Mode = Literal["decode", "extend"]


@dataclass
class ForwardContext:
    mode: Mode
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64, KV slot each new token writes (0 = padding sink)
    cos_sin: torch.Tensor  # [max_pos, rotary_dim] f32
    k_cache: torch.Tensor  # [L, S, H_kv, D]
    v_cache: torch.Tensor  # [L, S, H_kv, Dv]
    block_table: torch.Tensor  # [R, max_blocks] int32
    req_rows: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32, KV length including this step's tokens
    qo_indptr: torch.Tensor | None = None  # [B + 1] int32, extend only
    logits_indices: torch.Tensor | None = None  # [B] int64, extend only: rows to compute logits for
    page_size: int = 1
    num_splits: int = 1  # decode split-KV factor, fixed per decode bucket


# Names and order of the graph inputs after the weights dict. The runtime binds by these names.
DECODE_INPUTS = (
    "cos_sin",
    "k_cache",
    "v_cache",
    "input_ids",
    "positions",
    "out_slots",
    "block_table",
    "req_rows",
    "seq_lens",
)
EXTEND_INPUTS = (*DECODE_INPUTS, "qo_indptr", "logits_indices")
