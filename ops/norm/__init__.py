"""RMSNorm and its fusions (residual add, FP8 quantization): ``rmsnorm``."""

from kiln.ops.norm import rmsnorm  # noqa: F401  (registers the ops)
