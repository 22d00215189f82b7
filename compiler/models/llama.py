"""Llama-family dense decoders: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (QK-norm).

The four differ only in config flags (bias, QK-norm, head_dim, sliding window), which the
normalized ModelConfig already carries, so one thin definition serves all of them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kiln.compiler.config import ModelConfig
from kiln.compiler.models.base import DecoderLayer, DecoderOnlyLM, dense_mlp, llama_attention


class LlamaForCausalLM(DecoderOnlyLM):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: int = 1,
        quant: str | None = None,
        gemv_plan: Mapping[str, int] | None = None,
    ):
        def make_layer(i: int) -> DecoderLayer:
            attn = llama_attention(cfg, i, dtype, tp, quant)
            return DecoderLayer(cfg, attn, dense_mlp(cfg, dtype, tp, quant), dtype, quant)

        super().__init__(cfg, make_layer, dtype, tp, gemv_plan)
