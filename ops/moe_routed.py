"""Top-k routing inside the experts' first GEMV: a MoE layer from router logits, with no top-k kernel.

``torch.ops.kiln.fused_moe_routed(x, logits, w13, w2, top_k, renormalize, scale, round_to, tuning)
-> [T, H]``

This is ``moe_topk(logits, None, top_k, renormalize, "softmax", 1, 1, scale, round_to)`` followed by
``fused_moe(x, w13, w2, w, ids, None, None, None, tuning)``: Qwen3-MoE and Mixtral routing, with no
correction bias, no expert groups and no expert map.

Paths:

* **Decode GEMV** (``fused_moe``'s ``BLOCK_M`` 1 rungs, at most ``MAX_EXPERTS`` experts, bf16 /
  fp16 / fp32 experts, a device that runs Triton): there is no top-k launch.
  - Each w13 program works out its own pair's expert from the token's logits (ops/moe_routing.py
    ``rank_route``: each expert's rank in one comparison matrix). The expert comes from the
    logits, which the router GEMV just wrote, so like the id load it replaces this runs after the
    PDL wait.
  - The programs of column block 0 write the ids and weights the w2 GEMV reads.
  - The weights match ``moe_topk``'s up to float32 summation order. A near-tie in probability may
    pick the other expert.
* **Otherwise:** the top-k kernel, then ``fused_moe``.

A graph calls this op when the MoE layer is traced with ``KILN_MOE_TOPK_IN_W13=1``
(compiler/moe_layer.py). It is opt-in until measured end to end (bench/test_bench_decode_step.py
compares the step with and without it on random weights).
"""

from __future__ import annotations

import torch

from kiln.ops.common import DIRECT, kiln_op, use_triton
from kiln.ops.moe import _fused_moe_gemv
from kiln.ops.moe_gemm import RouteIn, pick_backend, pick_configs
from kiln.ops.moe_routing import _ROUND_CODE, check_routing, routing_outputs

MAX_EXPERTS = 256  # the rank matrix is E_PAD x E_PAD per program


def _gemv_routes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, tuning: str):
    """The decode GEMV's configs when this call routes inside it, else None."""
    t, h = x.shape
    e, i = w13.shape[0], w2.shape[2]
    if not use_triton(x) or t == 0 or e > MAX_EXPERTS or w13.dtype != x.dtype:
        return None
    if pick_backend(tuning, t) != "triton":
        return None
    c1, c2 = pick_configs(tuning, e, i, h, t, top_k)
    return (c1, c2) if c1["BLOCK_M"] == 1 else None


@kiln_op("fused_moe_routed")
def fused_moe_routed(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scale: float,
    round_to: str,
    tuning: str,
) -> torch.Tensor:
    """``moe_topk`` (softmax) then ``fused_moe``, ``x [T, H]`` -> ``[T, H]`` (see the module docstring)."""
    if logits.dim() != 2 or logits.shape[0] != x.shape[0] or logits.shape[1] != w13.shape[0]:
        raise ValueError(
            f"fused_moe_routed: logits must be [T={x.shape[0]}, E={w13.shape[0]}], got {tuple(logits.shape)}"
        )
    check_routing(w13.shape[0], None, top_k, "softmax", 1, 1, round_to)
    configs = _gemv_routes(x, w13, w2, top_k, tuning)
    if configs is None:
        w, ids = DIRECT["moe_topk"](logits, None, top_k, renormalize, "softmax", 1, 1, scale, round_to)
        return DIRECT["fused_moe"](x, w13, w2, w, ids, None, None, None, tuning)
    w, ids = routing_outputs(x, x.shape[0], top_k)
    lg = logits if logits.stride(1) == 1 else logits.contiguous()
    route = RouteIn(lg, renormalize, scale, _ROUND_CODE[round_to], w)
    x = x if x.stride(1) == 1 else x.contiguous()
    return _fused_moe_gemv(x, w13, w2, w, ids, None, None, None, *configs, None, route=route)


@fused_moe_routed.register_fake
def _(x, logits, w13, w2, top_k, renormalize, scale, round_to, tuning):
    return torch.empty_like(x)
