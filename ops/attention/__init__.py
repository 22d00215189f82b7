"""Attention: the paged ``attention`` op (``paged``) choosing between ``decode`` (split-K decode
attention) and ``extend`` (prefill chunks against the paged cache), their torch ``reference``,
``rope`` and the fused QKV+RoPE+KV-write (``qkv_rope``)."""

from kiln.ops.attention import decode, extend, mla, paged, qkv_rope  # noqa: F401  (registers the ops)
