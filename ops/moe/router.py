"""The MoE router for decode sizes: the router linear, then top-k routing, as one graph node.

Op ``torch.ops.kiln.moe_route(x, weight, bias, top_k, renormalize, scoring, num_groups,
topk_groups, scale, round_to, max_t) -> (weights [T, k] float32, ids [T, k] int32)``:

* ``x [T, H]`` bf16/fp16/fp32 (the normed activations), ``weight [E, H]`` (the router linear, in
  ``x``'s dtype), the other arguments as ``kiln.moe_topk`` takes them (ops/moe/topk.py);
* the logits are what the model's router linear gives: ``F.linear(x, weight)`` rounded to ``x``'s
  dtype for softmax scoring (Qwen3-MoE, Mixtral), float32 for sigmoid scoring (DeepSeek-V3 routes
  on ``F.linear(x.float(), weight.float())``);
* ``max_t``: a constant of the call site (the compile's GEMV plan, role ``router``): at
  ``1 <= T <= max_t`` on a device that runs Triton the router linear is ``kiln.linear``'s GEMV
  (ops/linear/gemv.py; sigmoid scoring: ``kiln.router_linear``), then ``moe_topk``'s kernel;
  otherwise the router linear (cuBLAS), then ``moe_topk``'s kernel.

(A kernel that ran the router GEMV and the top-k in one launch measured slower on the H200 and was
removed: docs/decode_budget.md, "Removed variants".)

Op ``torch.ops.kiln.router_linear(x, weight, max_t) -> [T, E] float32``: the float32 router linear
``F.linear(x.float(), weight.float())`` alone (DeepSeek-V2's routers, whose group scoring
``kiln.moe_topk`` takes from the logits, and the sigmoid path above): at ``1 <= T <= max_t`` on a
device that runs Triton the GEMV with float32 output straight from the bf16 operands (their products
are exact in float32, so the sums differ from the reference's only in their order), one launch where
the reference casts ``x`` and ``weight`` (two copies) and runs cuBLAS's float32 GEMV (two kernels).
"""

from __future__ import annotations

import torch

from kiln.ops.common.op import DIRECT, kiln_op
from kiln.ops.linear.gemv import gemv, gemv_enabled
from kiln.ops.moe.topk import check_routing, moe_topk_ref, moe_topk_triton


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor, scoring: str) -> torch.Tensor:
    """The model's router linear: ``x``'s dtype for softmax scoring, float32 for sigmoid."""
    if scoring == "sigmoid":
        return router_linear_ref(x, weight, 0)
    return torch.nn.functional.linear(x, weight)


def router_linear_ref(x: torch.Tensor, weight: torch.Tensor, max_t: int) -> torch.Tensor:
    """``F.linear(x.float(), weight.float())``: ``[T, E]`` float32."""
    return torch.nn.functional.linear(x.float(), weight.float())


def _check_router_linear(x: torch.Tensor, weight: torch.Tensor, *_) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.dtype != x.dtype:
        raise ValueError(
            f"router_linear: need x [T, H] and weight [E, H] of one dtype, got {tuple(x.shape)} "
            f"{x.dtype} and {tuple(weight.shape)} {weight.dtype}"
        )


@kiln_op("router_linear", ref=router_linear_ref, check=_check_router_linear)
def router_linear_forward(x: torch.Tensor, weight: torch.Tensor, max_t: int) -> torch.Tensor:
    """The float32 router linear (module docstring): the GEMV at ``1 <= T <= max_t`` (unless the
    run-time ``gemv`` setting is off, as for ``kiln::linear``)."""
    if 1 <= x.shape[0] <= max_t and x.dtype != torch.float32 and gemv_enabled():
        return gemv(x, weight, out_dtype=torch.float32)
    return router_linear_ref(x, weight, max_t)


def moe_route_ref(
    x, weight, bias, top_k, renormalize, scoring, num_groups, topk_groups, scale, round_to, max_t
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router linear, then ``moe_topk_ref`` (the op's parameters, typed on ``moe_route_forward``)."""
    logits = router_logits_ref(x, weight, scoring)  # [T, E]
    return moe_topk_ref(logits, bias, top_k, renormalize, scoring, num_groups, topk_groups, scale, round_to)


def _check(x: torch.Tensor, weight: torch.Tensor, *routing_and_max_t) -> None:
    if (
        x.dim() != 2
        or weight.dim() != 2
        or weight.shape[1] != x.shape[1]
        or weight.dtype != x.dtype
        or x.dtype not in (torch.bfloat16, torch.float16, torch.float32)
    ):
        raise ValueError(
            f"moe_route: need x [T, H] and weight [E, H] of one dtype (bf16/fp16/fp32), got "
            f"{tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}"
        )
    check_routing(weight.shape[0], *routing_and_max_t[:-1])


@kiln_op("moe_route", ref=moe_route_ref, check=_check)
def moe_route_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scoring: str,
    num_groups: int,
    topk_groups: int,
    scale: float,
    round_to: str,
    max_t: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router linear + top-k routing, ``x [T, H] -> (weights [T, k] f32, ids [T, k] int32)``."""
    if 1 <= x.shape[0] <= max_t:
        x = x if x.stride(1) == 1 else x.contiguous()
        weight = weight if weight.stride(1) == 1 else weight.contiguous()
        if scoring == "sigmoid":  # float32 logits
            logits = DIRECT["router_linear"](x, weight, max_t)
        else:
            logits = DIRECT["linear"](x, weight, None, max_t)
    else:
        logits = router_logits_ref(x, weight, scoring)  # [T, E]
    return moe_topk_triton(
        logits, bias, top_k, renormalize, scoring, num_groups, topk_groups, scale, round_to
    )
