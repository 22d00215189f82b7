"""Sparse-MoE decoders with Llama-style attention: Qwen3-MoE (QK-norm) and Mixtral.

Attention is the dense family's (QK-norm, head_dim and sliding window come from the normalized
ModelConfig); the MLP of a MoE layer is :class:`~kiln.compiler.moe_layer.FusedMoE`, and layers the
config keeps dense (Qwen3-MoE ``mlp_only_layers`` / ``decoder_sparse_step``) get the dense MLP.
"""

from __future__ import annotations

import torch

from kiln.compiler.config import ModelConfig
from kiln.compiler.layers import MLP, Attention
from kiln.compiler.models.base import DecoderLayer, DecoderOnlyLM
from kiln.compiler.moe_layer import FusedMoE, MoEDecoderLayer


class MoEForCausalLM(DecoderOnlyLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: int = 1, quant: str | None = None):
        hq, hkv = cfg.num_heads // tp, cfg.kv_heads_per_rank(tp)
        # Hugging Face's Qwen3-MoE router rounds its weights to the activation dtype; Mixtral's does not.
        round_weights = cfg.architecture.startswith("Qwen3Moe")

        def make_layer(i: int) -> DecoderLayer:
            attn = Attention(
                i,
                cfg.hidden_size,
                hq,
                hkv,
                cfg.head_dim,
                cfg.rotary_dim,
                cfg.rope_is_neox,
                dtype,
                qkv_bias=cfg.qkv_bias,
                qk_norm=cfg.qk_norm,
                eps=cfg.rms_norm_eps,
                sliding_window=cfg.sliding_window,
                quant=quant,
            )
            if cfg.is_moe_layer(i):
                moe = FusedMoE(cfg, dtype, tp, quant, round_weights=round_weights)
                return MoEDecoderLayer(cfg, attn, moe, dtype, quant)
            mlp = MLP(cfg.hidden_size, -(-cfg.intermediate_size // tp), dtype, quant)
            return DecoderLayer(cfg, attn, mlp, dtype, quant)

        super().__init__(cfg, make_layer, dtype, tp)
