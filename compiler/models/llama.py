"""Llama-family dense decoders: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (QK-norm).

The four differ only in config flags (bias, QK-norm, head_dim, sliding window), which the
normalized ModelConfig already carries, so the base decoder's dense layer serves all of them.
"""

from __future__ import annotations

from kiln.compiler.models.base import DecoderOnlyLM


class LlamaForCausalLM(DecoderOnlyLM):
    """Every layer: Llama-style attention and the dense gated MLP (``DecoderOnlyLM.make_layer``)."""
