"""Llama-family dense decoders: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (QK-norm).

The four differ only in config flags (bias, QK-norm, head_dim, sliding window), which the
normalized ModelConfig already carries, so one thin definition serves all of them.
"""

from __future__ import annotations

import torch

from kiln.compiler.config import ModelConfig
from kiln.compiler.layers import MLP, Attention
from kiln.compiler.models.base import DecoderLayer, DecoderOnlyLM


class LlamaForCausalLM(DecoderOnlyLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: int = 1, quant: str | None = None):
        hq, hkv = cfg.num_heads // tp, cfg.kv_heads_per_rank(tp)
        inter = -(-cfg.intermediate_size // tp)

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
            return DecoderLayer(cfg, attn, MLP(cfg.hidden_size, inter, dtype, quant), dtype, quant)

        super().__init__(cfg, make_layer, dtype, tp)
