"""Sparse-MoE decoders with Llama-style attention: Qwen3-MoE (QK-norm) and Mixtral.

Attention is the dense family's (QK-norm, head_dim and sliding window come from the normalized
ModelConfig); the MLP of a MoE layer is :class:`~kiln.compiler.moe_layer.FusedMoE`, and layers the
config keeps dense (Qwen3-MoE ``mlp_only_layers`` / ``decoder_sparse_step``) get the dense MLP.

With expert parallelism (``ep > 1``) the forward first builds the rank's local-expert map
(``kiln::ep_expert_map``, from the process's rank when the graph runs) and hands it to every MoE
layer through ``ForwardContext.expert_map``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kiln.compiler.context import ForwardContext
from kiln.compiler.models.base import DecoderLayer, DecoderOnlyLM, llama_attention
from kiln.compiler.moe_layer import FusedMoE, MoEDecoderLayer


class MoEForCausalLM(DecoderOnlyLM):
    def make_layer(self, i: int, dtype: torch.dtype, tp: int, quant: str | None) -> DecoderLayer:
        """A MoE layer (``cfg.is_moe_layer``) gets :class:`FusedMoE`, the others the dense MLP."""
        cfg = self.cfg
        if not cfg.is_moe_layer(i):
            return super().make_layer(i, dtype, tp, quant)
        # Hugging Face's Qwen3-MoE router rounds its weights to the activation dtype; Mixtral's does not.
        round_weights = cfg.architecture.startswith("Qwen3Moe")
        attn = llama_attention(cfg, i, dtype, tp, quant)
        moe = FusedMoE(cfg, dtype, tp, quant, round_weights=round_weights, ep=self.ep)
        return MoEDecoderLayer(cfg, attn, moe, dtype, quant)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """DecoderOnlyLM's, with the rank's local-expert map in ``ctx`` when ``ep > 1``."""
        if self.ep > 1:
            m = self.cfg.moe
            assert m is not None
            emap = torch.ops.kiln.ep_expert_map(
                input_ids, m.num_experts, m.num_experts // self.ep, self.tp // self.ep
            )
            ctx = replace(ctx, expert_map=emap)  # [E] int32
        return super().forward(input_ids, ctx)
