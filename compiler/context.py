"""ForwardContext: the per-batch inputs every layer sees, passed explicitly (never a global).

The same tensors are the inputs of the exported graph; see docs/internals.md for their layout.
One graph serves every step: a decode step is an extend step in which each of the B requests
brings one token (T == B), which the attention op dispatches to its split-KV decode kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.ops.attention.reference import FP8_KV_DTYPE


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64, KV slot each new token writes (0 = padding sink)
    cos_sin: torch.Tensor  # [max_pos, rotary_dim] f32
    k_cache: torch.Tensor  # [L, S, H_kv, D]
    v_cache: torch.Tensor  # [L, S, H_kv, Dv]
    block_table: torch.Tensor  # [R, max_blocks] int32
    req_rows: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32, KV length including this step's tokens
    qo_indptr: torch.Tensor  # [B + 1] int32, request b's tokens are rows qo_indptr[b]:qo_indptr[b+1]
    logits_indices: torch.Tensor  # [N] int64, the rows whose logits are computed (N: B, or T for every token)
    page_size: int = 1
    num_splits: int = 0  # decode split-KV factor (0: chosen from the batch at capture)
    # FP8 caches only: one float32 scale per cached head row (runtime/kv_pool.py), [L, S, H_kv]
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    # Expert-parallel MoE only (``kiln compile --ep M``, M > 1): global expert -> this rank's slot, or -1
    # for another rank's expert, [E] int32. Not a graph input: the model builds it once per forward
    # (kiln::ep_expert_map, compiler/models/moe.py) and its MoE layers pass it to kiln::fused_moe.
    expert_map: torch.Tensor | None = None
    # Artifacts whose model hands hidden states out (``manifest.aux_layers``: speculative drafts that
    # read the target's residual stream): [>= T, len(aux_layers) * H], row t's block j the stream at
    # the input of layer aux_layers[j] (kiln::save_hidden; layer L: before the final norm)
    aux_hidden: torch.Tensor | None = None
    # Graphs traced for token trees (speculative tree verification, runtime/spec_tree.py): [T] int64,
    # token t's ancestor-or-self bitmask over its request's chunk (ops/attention/extend.py), which every
    # attention layer passes to kiln::paged_attention (always its extend path then). None: causal chunks.
    tree_mask: torch.Tensor | None = None


# Names and order of the graph inputs after the weights dict. The runtime binds by these names.
GRAPH_INPUTS = (
    "cos_sin",
    "k_cache",
    "v_cache",
    "input_ids",
    "positions",
    "out_slots",
    "block_table",
    "req_rows",
    "seq_lens",
    "qo_indptr",
    "logits_indices",
)
# After GRAPH_INPUTS in the graphs of an artifact with an FP8 KV cache (``kiln compile --kv-dtype fp8``).
KV_SCALE_INPUTS = ("k_scale", "v_scale")
# Next, in graphs traced for token trees (tree verification): ``[T]`` int64 ancestor bitmasks.
TREE_INPUTS = ("tree_mask",)
# Last, in the graphs of an artifact whose model hands hidden states out (``manifest.aux_layers``).
AUX_INPUTS = ("aux_hidden",)


def graph_inputs(kv_dtype: torch.dtype, aux: bool = False, tree: bool = False) -> tuple[str, ...]:
    """Names and order of a graph's inputs after the weights dict: GRAPH_INPUTS, then KV_SCALE_INPUTS
    for caches of ``kv_dtype`` FP8, then TREE_INPUTS (``tree``: a graph for token trees), then
    AUX_INPUTS (``aux``: the model hands hidden states out). Tree before aux: aux stays last."""
    return (
        GRAPH_INPUTS
        + (KV_SCALE_INPUTS if kv_dtype == FP8_KV_DTYPE else ())
        + (TREE_INPUTS if tree else ())
        + (AUX_INPUTS if aux else ())
    )
