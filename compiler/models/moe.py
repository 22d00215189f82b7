"""Sparse-MoE decoders with Llama-style attention: Qwen3-MoE (QK-norm) and Mixtral.

Attention is the dense family's (QK-norm, head_dim and sliding window come from the normalized
ModelConfig); the MLP of a MoE layer is :class:`~kiln.compiler.moe_layer.FusedMoE`, and layers the
config keeps dense (Qwen3-MoE ``mlp_only_layers`` / ``decoder_sparse_step``) get the dense MLP.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kiln.compiler.config import ModelConfig
from kiln.compiler.models.base import DecoderLayer, DecoderOnlyLM, dense_mlp, llama_attention
from kiln.compiler.moe_layer import FusedMoE, MoEDecoderLayer


class MoEForCausalLM(DecoderOnlyLM):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: int = 1,
        quant: str | None = None,
        gemv_plan: Mapping[str, int] | None = None,
    ):
        # Hugging Face's Qwen3-MoE router rounds its weights to the activation dtype; Mixtral's does not.
        round_weights = cfg.architecture.startswith("Qwen3Moe")

        def make_layer(i: int) -> DecoderLayer:
            attn = llama_attention(cfg, i, dtype, tp, quant)
            if cfg.is_moe_layer(i):
                moe = FusedMoE(cfg, dtype, tp, quant, round_weights=round_weights)
                return MoEDecoderLayer(cfg, attn, moe, dtype, quant)
            return DecoderLayer(cfg, attn, dense_mlp(cfg, dtype, tp, quant), dtype, quant)

        super().__init__(cfg, make_layer, dtype, tp, gemv_plan)
