"""Linear layers: the decode ``gemv`` (bf16 and FP8 weights, fused epilogues), ``norm_linear``
(RMSNorm feeding a GEMV), the FP8 GEMMs (``fp8_gemm`` in Triton, ``fp8_cutlass``),
``fp8_linear``, the op choosing among them, and ``fp8_block`` (128 x 128 block-scaled FP8 weights,
activations quantized per token and 128-column group)."""

from kiln.ops.linear import fp8_block, fp8_linear, gemv, norm_linear  # noqa: F401  (registers the ops)
