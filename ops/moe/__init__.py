"""Mixture of experts: ``topk`` (top-k routing), ``router`` (router linear + top-k as one node),
``align`` (tokens sorted into expert blocks), ``permute`` (gather and combine), ``gemm`` (the
grouped Triton GEMMs), ``cutlass`` (the CUTLASS grouped GEMM backend) and ``fused`` (the
``fused_moe`` op running them)."""

from kiln.ops.moe import align, fused, router, topk  # noqa: F401  (registers the ops)
