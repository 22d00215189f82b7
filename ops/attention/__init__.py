"""Attention: the paged ``attention`` op (``paged``) choosing between ``decode`` (split-K decode
attention) and ``extend`` (prefill chunks against the paged cache), their torch ``reference``,
``rope``, the fused QKV+RoPE+KV-write (``qkv_rope``), and MLA's latent attention (``mla``) and
its fused norm+RoPE+latent write (``mla_rope``) and per-head latent maps (``mla_heads``)."""

from kiln.ops.attention import decode, extend, mla, mla_heads, mla_rope, paged, qkv_rope, verify  # noqa: F401  (registers the ops)
