"""Tracing: a decode graph (dynamic batch; or one per batch bucket) and an extend graph with
dynamic token and request dimensions (chunked prefill).

Graphs never embed weights: the model is built on the meta device and called through
``torch.func.functional_call`` with the weights as a dict input, and the stored example inputs
are dropped before saving. The only copy of the weights is the pack.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from kiln.compiler.context import DECODE_INPUTS, EXTEND_INPUTS, ForwardContext, Mode


class GraphModule(nn.Module):
    """Wraps a model so the exported graph's inputs are (weights, *per-batch tensors)."""

    def __init__(self, model: nn.Module, mode: Mode, page_size: int, num_splits: int = 1):
        super().__init__()
        self.model = model
        self.mode: Mode = mode
        self.page_size = page_size
        self.num_splits = num_splits

    def forward(
        self,
        weights: dict[str, torch.Tensor],
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        block_table: torch.Tensor,
        req_rows: torch.Tensor,
        seq_lens: torch.Tensor,
        qo_indptr: torch.Tensor | None = None,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ctx = ForwardContext(
            mode=self.mode,
            positions=positions,
            out_slots=out_slots,
            cos_sin=cos_sin,
            k_cache=k_cache,
            v_cache=v_cache,
            block_table=block_table,
            req_rows=req_rows,
            seq_lens=seq_lens,
            qo_indptr=qo_indptr,
            logits_indices=logits_indices,
            page_size=self.page_size,
            num_splits=self.num_splits,
        )
        return torch.func.functional_call(self.model, weights, (input_ids, ctx), strict=True)


@dataclass(frozen=True)
class CacheSpec:
    """Shapes of the KV pool and block table used for tracing (sizes are dynamic at run time
    only through the metadata; the pool tensors are whatever the runtime allocates)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    page_size: int = 1


def example_inputs(
    mode: Mode,
    batch: int,
    tokens: int,
    cache: CacheSpec,
    rotary_dim: int,
    device: torch.device | str,
    num_slots: int = 64,
    max_blocks: int = 16,
    rows: int = 8,
) -> dict[str, torch.Tensor]:
    """Small, valid per-batch inputs (everything but the weights) for tracing and warm-up."""
    dev = torch.device(device)
    i32, i64 = torch.int32, torch.int64
    per_req = tokens // batch
    t = {
        "cos_sin": torch.zeros(max_blocks * cache.page_size, rotary_dim, dtype=torch.float32, device=dev),
        "k_cache": torch.zeros(
            cache.num_layers, num_slots, cache.num_kv_heads, cache.head_dim, dtype=cache.dtype, device=dev
        ),
        "v_cache": torch.zeros(
            cache.num_layers, num_slots, cache.num_kv_heads, cache.v_head_dim, dtype=cache.dtype, device=dev
        ),
        "input_ids": torch.zeros(tokens, dtype=i64, device=dev),
        "positions": torch.arange(tokens, dtype=i64, device=dev) % per_req,
        "out_slots": torch.zeros(tokens, dtype=i64, device=dev),
        "block_table": torch.zeros(rows, max_blocks, dtype=i32, device=dev),
        "req_rows": torch.arange(batch, dtype=i32, device=dev) % rows,
        "seq_lens": torch.full((batch,), per_req, dtype=i32, device=dev),
    }
    if mode == "extend":
        t["qo_indptr"] = torch.arange(batch + 1, dtype=i32, device=dev) * per_req
        t["logits_indices"] = torch.arange(1, batch + 1, dtype=i64, device=dev) * per_req - 1
    return t


def input_names(mode: Mode) -> tuple[str, ...]:
    return EXTEND_INPUTS if mode == "extend" else DECODE_INPUTS


def export_graph(
    model: nn.Module,
    mode: Mode,
    weights: Mapping[str, torch.Tensor],
    inputs: Mapping[str, torch.Tensor],
    page_size: int,
    num_splits: int = 0,
    max_tokens: int = 1 << 16,
    max_batch: int = 1024,
    dynamic_batch: bool = True,
) -> ExportedProgram:
    """Export ``model`` for one mode.

    Extend: dynamic token (T) and request (B) dimensions. Decode: a dynamic batch dimension by
    default (one graph serves every bucket; the runtime captures one CUDA graph per bucket from
    it), or static shapes (``dynamic_batch=False``, one graph per bucket). ``num_splits=0`` lets
    decode attention pick its split-KV factor from the batch at capture time.
    """
    gm = GraphModule(model, mode, page_size, num_splits)
    names = input_names(mode)
    args = (dict(weights), *(inputs[n] for n in names))
    # The pool, rope table and block table are sized by the runtime: dynamic in every graph.
    S, P, R, M = Dim("S", min=2), Dim("P", min=2), Dim("R", min=2), Dim("M", min=2)
    per_input: dict[str, dict[int, Dim] | None] = {
        "cos_sin": {0: P},
        "k_cache": {1: S},
        "v_cache": {1: S},
        "block_table": {0: R, 1: M},
    }
    B = Dim("B", min=1, max=max_batch)
    if mode == "extend":
        T = Dim("T", min=1, max=max_tokens)
        per_input |= {
            "input_ids": {0: T},
            "positions": {0: T},
            "out_slots": {0: T},
            "req_rows": {0: B},
            "seq_lens": {0: B},
            "qo_indptr": {0: B + 1},
            "logits_indices": {0: B},
        }
    elif dynamic_batch:
        per_input |= {n: {0: B} for n in ("input_ids", "positions", "out_slots", "req_rows", "seq_lens")}
    dynamic = ({k: None for k in weights}, *(per_input.get(n) for n in names))
    with torch.no_grad():
        ep = torch.export.export(gm, args, dynamic_shapes=dynamic, strict=False)
    return ep


def strip_example_inputs(ep: ExportedProgram) -> ExportedProgram:
    """Drop the stored example inputs (they would embed a copy of the weights in the file)."""
    ep._example_inputs = None  # no public API for this as of torch 2.13
    return ep
