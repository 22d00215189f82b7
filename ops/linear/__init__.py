"""Linear layers: the decode ``gemv`` (bf16 and FP8 weights, fused epilogues), ``norm_linear``
(RMSNorm feeding a GEMV), the FP8 GEMMs (``fp8_gemm`` in Triton, ``fp8_cutlass``) and
``fp8_linear``, the op choosing among them."""

from kiln.ops.linear import fp8_linear, gemv, norm_linear  # noqa: F401  (registers the ops)
