"""Tracing with ``torch.export``.

By default one graph serves every step, with dynamic token (T) and request (B) dimensions: chunked
prefill runs it directly and the runtime captures it once per decode bucket as a CUDA graph (a
decode step is T == B; the attention op then runs its split-KV decode kernel). Alternatively
(``static_batch``) one graph per decode bucket with static shapes.

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

from kiln.compiler.context import GRAPH_INPUTS, KV_SCALE_INPUTS, ForwardContext, graph_inputs
from kiln.ops.attention.reference import FP8_KV_DTYPE


class GraphModule(nn.Module):
    """Wraps a model so the exported graph's inputs are (weights, *per-batch tensors): GRAPH_INPUTS,
    then the optional ones ``tail`` names (compiler/context.py ``graph_inputs``: an FP8 cache's
    scales, the token-tree mask, the aux hidden-state buffer), in that order."""

    def __init__(self, model: nn.Module, page_size: int, num_splits: int = 0, tail: tuple[str, ...] = ()):
        super().__init__()
        self.model = model
        self.page_size = page_size
        self.num_splits = num_splits
        self.tail = tail

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
        qo_indptr: torch.Tensor,
        logits_indices: torch.Tensor,
        *tail: torch.Tensor,
    ) -> torch.Tensor:
        named = dict(zip(self.tail, tail, strict=True))
        ctx = ForwardContext(
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
            k_scale=named.get("k_scale"),
            v_scale=named.get("v_scale"),
            aux_hidden=named.get("aux_hidden"),
            tree_mask=named.get("tree_mask"),
        )
        return torch.func.functional_call(self.model, weights, (input_ids, ctx), strict=True)


@dataclass(frozen=True)
class CacheSpec:
    """KV-pool layout the graphs are traced for (the pool's size is dynamic)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    page_size: int = 1
    aux_width: int = 0  # > 0: the graphs take the aux hidden-state buffer [rows, aux_width] (last input)


def example_inputs(
    batch: int,
    tokens: int,
    cache: CacheSpec,
    rotary_dim: int,
    device: torch.device | str,
    num_slots: int = 64,
    max_blocks: int = 16,
    rows: int = 8,
    every_token: bool = False,
    tree: bool = False,
) -> dict[str, torch.Tensor]:
    """Small, valid per-batch inputs (everything but the weights) for tracing and warm-up:
    ``batch`` requests sharing ``tokens`` new tokens (tokens == batch: a decode step), logits at
    each request's last token (``every_token``: at every token, as a verify step). ``tree``: with
    a ``tree_mask`` ``[T]`` int64, each request's chunk a chain (every earlier token an ancestor,
    which is causal attention; chunks of at most 64 tokens)."""
    dev = torch.device(device)
    i32, i64 = torch.int32, torch.int64
    per_req = tokens // batch
    lens = [per_req] * batch
    lens[-1] += tokens - per_req * batch
    indptr = torch.tensor([0, *lens], dtype=i32).cumsum(0).to(i32)
    out = {
        "cos_sin": torch.zeros(
            max(max_blocks * cache.page_size, 2), rotary_dim, dtype=torch.float32, device=dev
        ),
        "k_cache": torch.zeros(
            cache.num_layers, num_slots, cache.num_kv_heads, cache.head_dim, dtype=cache.dtype, device=dev
        ),
        "v_cache": torch.zeros(
            cache.num_layers, num_slots, cache.num_kv_heads, cache.v_head_dim, dtype=cache.dtype, device=dev
        ),
        "input_ids": torch.zeros(tokens, dtype=i64, device=dev),
        "positions": torch.cat([torch.arange(n, dtype=i64) for n in lens]).to(dev),
        "out_slots": torch.zeros(tokens, dtype=i64, device=dev),
        "block_table": torch.zeros(rows, max_blocks, dtype=i32, device=dev),
        "req_rows": torch.arange(batch, dtype=i32, device=dev) % rows,
        "seq_lens": torch.tensor(lens, dtype=i32, device=dev),
        "qo_indptr": indptr.to(dev),
        "logits_indices": (torch.arange(tokens) if every_token else indptr[1:] - 1).to(i64).to(dev),
    }
    if cache.dtype == FP8_KV_DTYPE:  # one float32 scale per cached head row
        for name in KV_SCALE_INPUTS:
            out[name] = torch.zeros(cache.num_layers, num_slots, cache.num_kv_heads, device=dev)
    if tree:
        if max(lens) > 64:
            raise ValueError(f"example_inputs: tree chunks hold at most 64 tokens, got {max(lens)}")
        # token j of a chunk: bits 0..j (bit 63 of a 64-token chunk's last is the sign bit: -1)
        chain = [(1 << (j + 1)) - 1 if j < 63 else -1 for n in lens for j in range(n)]
        out["tree_mask"] = torch.tensor(chain, dtype=i64, device=dev)
    if cache.aux_width:
        out["aux_hidden"] = torch.zeros(max(tokens, 2), cache.aux_width, dtype=torch.float32, device=dev)
    return out


def export_graph(
    model: nn.Module,
    weights: Mapping[str, torch.Tensor],
    inputs: Mapping[str, torch.Tensor],
    page_size: int,
    max_tokens: int = 1 << 16,
    max_batch: int = 1024,
    static_batch: bool = False,
) -> ExportedProgram:
    """Export ``model`` with dynamic T and B (default) or with the example's static shapes; with the
    token-tree mask input when ``inputs`` has one (``tree_mask``, example_inputs ``tree``: its T
    is the input ids'), and the aux hidden-state input when it has one (``aux_hidden``)."""
    names = graph_inputs(inputs["k_cache"].dtype, aux="aux_hidden" in inputs, tree="tree_mask" in inputs)
    gm = GraphModule(model, page_size, tail=names[len(GRAPH_INPUTS) :])
    args = (dict(weights), *(inputs[n] for n in names))
    # The pool, rope table and block table (and the aux buffer) are sized by the runtime: dynamic.
    S, P, R, M = Dim("S", min=2), Dim("P", min=2), Dim("R", min=2), Dim("M", min=2)
    per_input: dict[str, dict[int, Dim] | None] = {
        "cos_sin": {0: P},
        "k_cache": {1: S},
        "v_cache": {1: S},
        "k_scale": {1: S},
        "v_scale": {1: S},
        "block_table": {0: R, 1: M},
        # at least a step's tokens (a static graph's T is a number, which its slices guard on)
        "aux_hidden": {0: Dim("X", min=max(2, inputs["input_ids"].shape[0]) if static_batch else 2)},
    }
    if not static_batch:
        T, B = Dim("T", min=1, max=max_tokens), Dim("B", min=1, max=max_batch)
        # the rows whose logits the graph returns: each request's last token (N == B), or every new
        # token (N == T: teacher-forced accuracy, a speculative verify step; docs/speculative.md)
        N = Dim("N", min=1, max=max_tokens)
        per_input |= {
            "input_ids": {0: T},
            "positions": {0: T},
            "out_slots": {0: T},
            "tree_mask": {0: T},
            "req_rows": {0: B},
            "seq_lens": {0: B},
            "qo_indptr": {0: B + 1},
            "logits_indices": {0: N},
        }
    fixed = len(GRAPH_INPUTS)
    dynamic = (
        {k: None for k in weights},
        *(per_input.get(n) for n in names[:fixed]),
        *((tuple(per_input.get(n) for n in names[fixed:]),) if len(names) > fixed else ()),
    )
    with torch.no_grad():
        return torch.export.export(gm, args, dynamic_shapes=dynamic, strict=False)


def strip_example_inputs(ep: ExportedProgram) -> ExportedProgram:
    """Drop the stored example inputs (they would embed a copy of the weights in the file)."""
    ep._example_inputs = None  # no public API for this as of torch 2.13
    return ep
