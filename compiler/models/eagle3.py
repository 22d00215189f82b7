"""The EAGLE-3 draft head (its published layout, ``LlamaForCausalLMEagle3``) as kiln layers: the
draft side of EAGLE-3 speculative decoding (docs/speculative.md section 4), compiled by
``kiln compile TARGET --eagle3 HEAD`` (compiler/eagle3.py) as :class:`Eagle3ForCausalLM`'s graphs
and run by runtime/spec_eagle.py.

One step over T tokens (``forward(input_ids, hidden, ctx)``):

* ``hidden`` is the target's residual streams at three layers, ``[T, 3 H_target]`` (the first draft
  step after a verify step: ``h = fc(hidden)``), or the head's own previous output ``[T, H]``;
* ``residual = h``; ``x = cat(input_norm(embed(ids)), hidden_norm(h))`` ``[T, 2H]`` into the one
  decoder layer's q/k/v (``Attention(in_features=2H)``, its own one-layer KV cache);
  ``post_attn_norm`` adds the attention output to the residual; the MLP; ``h_out = mlp + residual``;
* logits ``lm_head(norm(h_out))`` over the draft vocabulary at ``ctx.logits_indices``, float32;
  ``h_out`` (pre-norm: what the next draft step takes) is returned beside them. Draft id ``i`` is
  target id ``i + d2t[i]`` (the checkpoint's ``d2t``: the drafter maps, not the graph).

Checkpoint names (:data:`CHECKPOINT_NAMES`): ``fc.weight``, ``midlayer.{input_layernorm,
hidden_norm, post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``,
and ``embed_tokens.weight`` when the head has its own (else the target's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.compiler.config import ModelConfig
from kiln.compiler.context import ForwardContext
from kiln.compiler.layers import MLP, Attention, Embedding, Linear, RMSNorm

# kiln parameter -> the published checkpoint's tensor names (fused ones listed in order)
CHECKPOINT_NAMES = {
    "embed.weight": ("embed_tokens.weight",),
    "fc.weight": ("fc.weight",),
    "input_norm.weight": ("midlayer.input_layernorm.weight",),
    "hidden_norm.weight": ("midlayer.hidden_norm.weight",),
    "attn.qkv.weight": tuple(f"midlayer.self_attn.{p}_proj.weight" for p in "qkv"),
    "attn.o.weight": ("midlayer.self_attn.o_proj.weight",),
    "post_attn_norm.weight": ("midlayer.post_attention_layernorm.weight",),
    "mlp.gate_up.weight": ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"),
    "mlp.down.weight": ("midlayer.mlp.down_proj.weight",),
    "norm.weight": ("norm.weight",),
    "lm_head.weight": ("lm_head.weight",),
}


class Eagle3Head(nn.Module):
    """The head (module docstring) for a draft config ``cfg`` (its ``hidden_size``, heads,
    ``intermediate_size``, RoPE), the target's hidden size ``target_hidden`` and ``draft_vocab``
    LM-head rows; one layer, its KV cache layer 0 of ``ctx``."""

    def __init__(self, cfg: ModelConfig, target_hidden: int, draft_vocab: int, dtype: torch.dtype):
        super().__init__()
        h = cfg.hidden_size
        self.hidden = h
        self.embed = Embedding(cfg.vocab_size, h, dtype)
        self.fc = Linear(h, 3 * target_hidden, dtype, False, None)
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.attn = Attention(
            0,
            h,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rotary_dim,
            cfg.rope_is_neox,
            dtype,
            eps=cfg.rms_norm_eps,
            in_features=2 * h,
        )
        self.post_attn_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(h, cfg.intermediate_size, dtype, None)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.lm_head = Linear(draft_vocab, h, dtype, False, None)

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [N, draft_vocab] f32 at ctx.logits_indices, h_out [T, H])``."""
        return self.layer(input_ids, self.fc(hidden) if hidden.shape[-1] != self.hidden else hidden, ctx)

    def layer(
        self, input_ids: torch.Tensor, h: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` from the layer's hidden input ``h [T, H]`` (after ``fc``, or fed back)."""
        residual = h.clone()  # fused_add_rmsnorm updates it in place to attn + h
        x = torch.cat([self.input_norm(self.embed(input_ids)), self.hidden_norm(h)], dim=-1)
        a = self.attn(x, ctx)
        y = self.mlp(self.post_attn_norm(a, residual))
        h_out = y + residual
        logits = self.lm_head(self.norm(h_out).index_select(0, ctx.logits_indices))
        return logits.float(), h_out


class AuxHeadGraph(nn.Module):
    """A draft head as its graphs run it, over the hidden-state buffer ``ctx.aux_hidden`` (``[rows,
    W]`` float32; runtime/spec_eagle.py): ``forward(input_ids, ctx)`` reads its hidden input there:
    with :attr:`fused` (the shared graph: a catch-up over the target's streams) the first
    :attr:`width` columns of rows ``0 .. T - 1`` through :meth:`fuse`, else (the decode graphs: a
    chain step) the first :attr:`hidden` columns, the head's own previous output; runs
    :meth:`layer`; writes its output into the first :attr:`hidden` columns of rows ``0 .. T - 1``
    (kiln::save_hidden, after the read) and returns :meth:`place` of its logits. The EAGLE-3 head
    (:class:`Eagle3ForCausalLM`) and DeepSeek's MTP layer (compiler/models/mtp.py) are two."""

    hidden: int  # H: the head's output columns
    width: int  # the fused input's columns (the target's streams)
    dtype: torch.dtype
    fused: bool = True  # the compiler sets it per graph

    def fuse(self, x: torch.Tensor) -> torch.Tensor:
        """The target's streams ``[T, width]`` -> the layer's hidden input ``[T, H]``."""
        return x

    if TYPE_CHECKING:  # each head's own (a base method here would come first in a mixed-in MRO)

        def layer(
            self, input_ids: torch.Tensor, h: torch.Tensor, ctx: ForwardContext
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """``(logits [N, V] f32 at ctx.logits_indices, h_out [T, H])`` from the hidden input."""
            ...

    def place(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits over the target's ids."""
        return logits

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        aux = ctx.aux_hidden
        assert aux is not None, "a draft head's graphs take the aux_hidden buffer"
        # rows 0 .. T - 1 gathered, not sliced: a slice would guard the buffer's (dynamic) rows
        rows = torch.arange(input_ids.shape[0], device=aux.device)
        if self.fused:
            h = self.fuse(aux[:, : self.width].index_select(0, rows).to(self.dtype))
        else:
            h = aux[:, : self.hidden].index_select(0, rows).to(self.dtype)
        logits, h_out = self.layer(input_ids, h, ctx)
        torch.ops.kiln.save_hidden(aux, h_out.float(), 0)
        return self.place(logits)


class Eagle3ForCausalLM(AuxHeadGraph, Eagle3Head):  # type: ignore[misc]
    """The head as its graphs run it (compiler/eagle3.py; the artifact's ``manifest.eagle3``;
    :class:`AuxHeadGraph`): the fused input is the target's three streams, ``3 target_hidden``
    columns, through ``fc``. Its logits are over the target's ``target_vocab`` ids, float32: draft
    id ``i``'s at target id ``i + d2t[i]`` (``d2t`` packed as float32: exact below 2^24), ``-inf``
    at the ids the head cannot draft. Without ``d2t`` (a head over the whole vocabulary) the draft
    ids are the target's."""

    def __init__(
        self,
        cfg: ModelConfig,
        target_hidden: int,
        draft_vocab: int,
        target_vocab: int,
        dtype: torch.dtype,
        d2t: bool,
    ):
        super().__init__(cfg, target_hidden, draft_vocab, dtype)  # Eagle3Head's
        self.dtype = dtype
        self.width = 3 * target_hidden
        self.target_vocab = target_vocab
        self.fused = True
        self.d2t = nn.Parameter(torch.empty(draft_vocab), requires_grad=False) if d2t else None

    def fuse(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def place(self, logits: torch.Tensor) -> torch.Tensor:
        if self.d2t is None and logits.shape[1] == self.target_vocab:
            return logits
        ids = torch.arange(logits.shape[1], device=logits.device)
        if self.d2t is not None:
            ids = ids + self.d2t.to(torch.int64)
        out = logits.new_full((logits.shape[0], self.target_vocab), float("-inf"))
        return out.index_copy(1, ids, logits)
