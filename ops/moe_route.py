"""The MoE router for decode sizes: router GEMV and top-k routing in one kernel.

Op ``torch.ops.kiln.moe_route(x, weight, bias, top_k, renormalize, scoring, num_groups,
topk_groups, scale, round_to, max_t) -> (weights [T, k] float32, ids [T, k] int32)``:

* ``x [T, H]`` bf16/fp16/fp32 (the normed activations), ``weight [E, H]`` (the router linear, in
  ``x``'s dtype), the other arguments as ``kiln.moe_topk`` takes them (ops/moe_routing.py);
* the logits are what the model's router linear gives: ``F.linear(x, weight)`` rounded to ``x``'s
  dtype for softmax scoring (Qwen3-MoE, Mixtral), float32 for sigmoid scoring (DeepSeek-V3 routes
  on ``F.linear(x.float(), weight.float())``);
* ``max_t``: a constant of the call site (the compile's GEMV plan, role ``router``): at
  ``1 <= T <= max_t`` on a device that runs Triton the router linear is ``kiln.linear``'s GEMV
  (ops/gemv.py; sigmoid scoring: the float32 linear) and then ``moe_topk``'s kernel, or with
  ``KILN_MOE_ROUTE=fused`` the fused kernel below; otherwise the router linear (cuBLAS), then
  ``moe_topk``'s kernel.

Kernel (grid ``(T, cdiv(E, BLOCK_E))``): program ``(t, b)`` computes ``BLOCK_E`` logits of token
``t``, a float32 dot of whole weight rows with ``x[t]`` (``BLOCK_K`` columns per step), rounds them
and stores them to a ``[T, E]`` scratch; then it bumps token ``t``'s arrival counter (ops/common.py
``ArrivalCounters``), and the last of the token's programs to arrive reads the ``E`` logits back and
runs the top-k (ops/moe_routing.py ``_topk_row``). It saves the top-k kernel's launch, but on the
H200 it measured slower than the two kernels it replaces: chained over 8 layers' routers at
Qwen3-30B-A3B's shape (``[128, 2048]``, batch 1), 4.9 us per layer with the defaults below
(4.6-6.6 us with other block shapes and warps) against 3.8-4.2 us for the GEMV + top-k, and
819.5 vs 830.6 tok/s in Qwen3-30B-A3B-shaped batch-1 decode (bench/results/README.md, seventh
session; those runs also prefetched the router rows into L2 before the PDL wait, since removed):
the last program arrives only after every row is done, then runs the top-k serially, where the
separate top-k kernel is already launched (PDL) and waiting. So it is opt-in.

Switch: ``KILN_MOE_ROUTE=fused|separate`` (read at call time, so at capture for decode graphs;
default ``separate``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kiln.ops.common import (
    DIRECT,
    ArrivalCounters,
    interpreting,
    kiln_op,
    next_pow2,
    pdl_args,
    pdl_trigger,
    pdl_wait,
    use_triton,
)
from kiln.ops.moe_routing import (
    _topk_row,
    check_routing,
    moe_topk_launch,
    moe_topk_ref,
    routing_outputs,
    topk_meta,
)
from kiln.ops.quant import tl_round

ROUTE_MODES = ("separate", "fused")
COUNTERS = ArrivalCounters(1 << 8, "moe_route's fused kernel", "the router GEMV and the top-k kernel")
# Launch defaults: one warp (the last arrival's top-k is ~3 reductions per expert picked; across
# warps each goes through shared memory and a barrier: 6.4 us per call at Qwen3-30B-A3B's router
# with 4 warps in the decode profile), 2 router rows per program ([128, 2048] -> 64 programs of
# 8 KiB at batch 1), 1024 columns per step. bench/test_bench_moe_decode.py
# ``test_moe_route_chain`` measures the alternatives.
BLOCK_E = 2
BLOCK_K = 1024
NUM_WARPS = 1


def route_mode() -> str:
    """``KILN_MOE_ROUTE`` (read at call time): ``"separate"`` (default) or ``"fused"``."""
    mode = os.environ.get("KILN_MOE_ROUTE") or "separate"
    if mode not in ROUTE_MODES:
        raise ValueError(f"KILN_MOE_ROUTE must be one of {ROUTE_MODES}, got {mode!r}")
    return mode


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor, scoring: str) -> torch.Tensor:
    """The model's router linear: ``x``'s dtype for softmax scoring, float32 for sigmoid."""
    if scoring == "sigmoid":
        return torch.nn.functional.linear(x.float(), weight.float())
    return torch.nn.functional.linear(x, weight)


@triton.jit
def _route_kernel(
    X, W, LOGITS, CNT, BIAS, W_OUT, ID_OUT,
    E, H, stride_x, stride_w, scale,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
    TOPK_G: tl.constexpr, ROUND: tl.constexpr, ROUND_IN_F32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # X: [T, H]; W: [E, H]; LOGITS: [T, E] scratch (x's dtype, or f32 for sigmoid); CNT: [T] int32
    pdl_trigger(PDL)
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    rmask = rows < E
    offs_k = tl.arange(0, BLOCK_K)
    w_ptr = W + rows[:, None].to(tl.int64) * stride_w + offs_k[None, :]  # [BE, BK]
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kmask = offs_k < H - k0
        xv = tl.load(X + t * stride_x + k0 + offs_k, mask=kmask, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + k0, mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        acc += wv * xv[None, :]
    out_ty = LOGITS.dtype.element_ty
    logit = tl_round(tl.sum(acc, axis=1), out_ty, ROUND_IN_F32)  # [BE], as the router linear rounds
    tl.store(LOGITS + t * E + rows, logit.to(out_ty), mask=rmask)
    # last arrival (ordering as ops/decode_attention.py's fused merge): the barrier puts every
    # thread's logit stores before the scalar acq_rel atomic; the last program acquires them all
    tl.debug_barrier()
    old = tl.atomic_add(CNT + t, 1, sem="acq_rel", scope="gpu")
    if old == tl.num_programs(1) - 1:
        tl.atomic_xchg(CNT + t, 0, sem="relaxed", scope="gpu")
        offs = tl.arange(0, E_PAD)
        valid = offs < E
        x = tl.load(LOGITS + t * E + offs, mask=valid, other=float("-inf"), cache_modifier=".cg")
        _topk_row(
            x.to(tl.float32), offs, valid, BIAS, W_OUT, ID_OUT, t, E, scale,
            K, K_PAD, E_PAD, SIGMOID, HAS_BIAS, RENORM, G, G_PAD, TOPK_G, ROUND,
        )  # fmt: skip


def moe_route_launch(
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
    counters: torch.Tensor,
    block_e: int = BLOCK_E,
    block_k: int = BLOCK_K,
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the fused kernel; ``counters``: zeroed int32, at least ``T`` long. Returns ``(w, ids)``."""
    t, h = x.shape
    e = weight.shape[0]
    w_out, ids_out = routing_outputs(x, t, top_k)
    if t == 0:
        return w_out, ids_out
    if counters.numel() < t:
        raise ValueError(f"moe_route: need {t} arrival counters, got {counters.numel()}")
    logits = x.new_empty((t, e), dtype=torch.float32 if scoring == "sigmoid" else x.dtype)
    block_k = min(block_k, next_pow2(h))
    pdl = pdl_args(x)
    _route_kernel[(t, triton.cdiv(e, block_e))](
        x, weight, logits, counters, bias if bias is not None else logits, w_out, ids_out,
        e, h, x.stride(0), weight.stride(0), float(scale),
        BLOCK_E=block_e, BLOCK_K=block_k,
        **topk_meta(e, bias, top_k, renormalize, scoring, num_groups, topk_groups, round_to),
        ROUND_IN_F32=interpreting(), num_warps=num_warps, **pdl,
    )  # fmt: skip
    return w_out, ids_out


@kiln_op("moe_route")
def moe_route(
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
    t, e = x.shape[0], weight.shape[0]
    check_routing(e, bias, top_k, scoring, num_groups, topk_groups, round_to)
    args = (bias, top_k, renormalize, scoring, num_groups, topk_groups, scale, round_to)
    mode = route_mode()  # a bad KILN_MOE_ROUTE fails on every path
    on_triton = use_triton(x)
    if on_triton and 1 <= t <= max_t:
        x = x if x.stride(1) == 1 else x.contiguous()
        weight = weight if weight.stride(1) == 1 else weight.contiguous()
        if mode == "fused":
            counters = COUNTERS.get(x.device, t)  # None inside a capture that would allocate them
            if counters is not None:
                return moe_route_launch(x, weight, *args, counters)
        gemv = scoring != "sigmoid"  # sigmoid routes on float32 logits
        logits = DIRECT["linear"](x, weight, None, max_t) if gemv else router_logits_ref(x, weight, scoring)
    else:
        logits = router_logits_ref(x, weight, scoring)  # [T, E]
    if not on_triton:
        return moe_topk_ref(logits, *args)
    w, ids = routing_outputs(x, t, top_k)
    moe_topk_launch(
        logits, bias, top_k, renormalize, scoring, num_groups, topk_groups, scale, w, ids, round_to
    )
    return w, ids


@moe_route.register_fake
def _(x, weight, bias, top_k, renormalize, scoring, num_groups, topk_groups, scale, round_to, max_t):
    return routing_outputs(x, x.shape[0], top_k)
