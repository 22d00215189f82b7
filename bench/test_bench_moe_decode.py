"""Decode-sized MoE pieces as a decode step runs them: chained over distinct layers' weights.

At batch 1 a MoE layer's router and experts are a handful of short kernels; timed alone (one graph
replay per call, L2 flushed) each pays the replay's launch latency (a few microseconds on a 25 us
op). Here ``LAYERS`` copies with distinct weights run back to back in one CUDA graph, as the layers
of a decode step do, and every figure is per layer (``ms`` and ``bytes`` are for the chain, so
``frac_bw`` is the per-layer fraction of read bandwidth).

* ``test_moe_decode_chain[T]``: ``kiln.fused_moe`` at Qwen3-30B-A3B shapes (E=128, top-8,
  H=2048, I=768) for ``T`` tokens (the w2 GEMV's top-k sum by the last arrival), with the default
  launch table or ``KILN_MOE_TUNING``'s (as bench/test_bench_moe.py reads it). Bytes: the hit
  experts' weights and the activations.
* ``test_moe_route_chain``: the router (``[128, 2048]`` weights) and top-k at batch 1
  (``kiln.moe_route``: the router GEMV, then the top-k kernel).
* ``test_float_router_chain[max_t]``: DeepSeek's float32 router at batch 1 (``kiln.router_linear``,
  then ``kiln.moe_topk``): ``max_t=1`` the GEMV with float32 output, ``0`` the reference (both
  operands cast to float32, cuBLAS's float32 GEMV) — the A/B of ops/moe/router.py in one call.

Smoke mode (CPU): tiny shapes through the interpreter, two layers, one round.
"""

import functools

import pytest
import torch
from conftest import graphed, pick
from test_bench_moe import DEV, TUNING, E, H, I, K, random_experts

pytestmark = pytest.mark.usefixtures("kernels_on_cpu")

LAYERS = pick(8, 2)  # the shapes: bench/test_bench_moe.py's (Qwen3-30B-A3B on a GPU)


@functools.lru_cache(maxsize=1)
def _layers():
    """``LAYERS`` sets of (w13, w2, router) with distinct values."""
    g = torch.Generator(DEV).manual_seed(0)
    return [random_experts(g) for _ in range(LAYERS)]


def _route(x, router, max_t=1):
    return torch.ops.kiln.moe_route(x, router, None, K, True, "softmax", 1, 1, 1.0, "bfloat16", max_t)


@pytest.mark.parametrize("t", pick([1, 2, 4], [2]))
def test_moe_decode_chain(measure, t):
    layers = _layers()
    x = torch.randn(t, H, device=DEV).to(torch.bfloat16)
    routes = [_route(x, r, max_t=0) for _, _, r in layers]  # per layer: (weights, ids)
    hit = sum(int(torch.unique(ids).numel()) for _, ids in routes)

    def chain():
        for (w13, w2, _), (w, ids) in zip(layers, routes, strict=True):
            torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, TUNING)

    info = dict(t=t, layers=LAYERS, E=E, top_k=K, H=H, I=I, experts_hit_per_layer=hit / LAYERS)
    info["tuning"] = "KILN_MOE_TUNING" if TUNING else "default"
    measure(graphed(chain), bytes=hit * 3 * H * I * 2 + LAYERS * 2 * t * H * 2, **info)


def test_moe_route_chain(measure):
    layers = _layers()
    x = torch.randn(1, H, device=DEV).to(torch.bfloat16)
    ref = _route(x, layers[0][2], max_t=0)  # router linear + top-k kernel (or reference)
    assert torch.equal(torch.sort(_route(x, layers[0][2])[1]).values, torch.sort(ref[1]).values)

    def chain():
        for _, _, r in layers:
            _route(x, r)

    measure(graphed(chain), bytes=LAYERS * E * H * 2, layers=LAYERS, E=E, H=H, top_k=K)


@pytest.mark.parametrize("max_t", [1, 0])
def test_float_router_chain(measure, max_t):
    layers = _layers()
    x = torch.randn(1, H, device=DEV).to(torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), layers[0][2].float())
    torch.testing.assert_close(
        torch.ops.kiln.router_linear(x, layers[0][2], max_t), ref, rtol=1e-4, atol=1e-4
    )

    def chain():
        for _, _, r in layers:
            logits = torch.ops.kiln.router_linear(x, r, max_t)
            torch.ops.kiln.moe_topk(logits, None, K, True, "softmax", 1, 1, 1.0, "", "max")

    measure(graphed(chain), bytes=LAYERS * E * H * 2, layers=LAYERS, E=E, H=H, top_k=K, max_t=max_t)
