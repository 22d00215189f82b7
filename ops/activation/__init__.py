"""Activations: SiLU-and-mul (the gated MLP's), optionally fused with FP8 quantization
(``silu_and_mul``), and dynamic per-token FP8 quantization of an activation
no fused kernel produced (``quantize``)."""

from kiln.ops.activation import quantize, silu_and_mul  # noqa: F401  (registers the ops)
