"""Activations: SiLU-and-mul (the gated MLP's), optionally fused with FP8 quantization
(``silu_and_mul``)."""

from kiln.ops.activation import silu_and_mul  # noqa: F401  (registers the ops)
