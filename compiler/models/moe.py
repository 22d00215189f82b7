"""Sparse-MoE decoders with Llama-style attention: Qwen3-MoE (QK-norm) and Mixtral.

Attention is the dense family's (QK-norm, head_dim and sliding window come from the normalized
ModelConfig); the MLP of a MoE layer is :class:`~kiln.compiler.moe_layer.FusedMoE`, and layers the
config keeps dense (Qwen3-MoE ``mlp_only_layers`` / ``decoder_sparse_step``) get the dense MLP.
"""

from __future__ import annotations

import torch

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
        moe = FusedMoE(cfg, dtype, tp, quant, round_weights=round_weights)
        return MoEDecoderLayer(cfg, attn, moe, dtype, quant)
