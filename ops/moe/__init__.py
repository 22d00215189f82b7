"""Mixture of experts: ``topk`` (top-k routing), ``router`` (router linear + top-k as one node),
``align`` (tokens sorted into expert blocks), ``permute`` (gather and combine), ``gemm`` (the
grouped Triton GEMMs), ``cutlass`` (the CUTLASS grouped GEMM backend), ``fused`` (the
``fused_moe`` op running them) and ``expert_map`` (an expert-parallel rank's local-expert map)."""

from kiln.ops.moe import align, expert_map, fused, router, topk  # noqa: F401  (registers the ops)
