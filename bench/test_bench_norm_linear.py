"""RMSNorm fused into the GEMV behind it (ops/linear/norm_linear.py), as the folded batch-1 decode graph
runs it (the norm weight folded into the linear's, compiler/models/base.py), against two launches.

Batch 1, chained over ``LAYERS`` distinct weights in one CUDA graph as a decode step runs them;
figures per layer (``frac_bw``: the weight and activation bytes of one layer over its time).

* ``test_norm_linear_chain[SHAPE-VARIANT]``: ``separate`` = ``rmsnorm`` (unit weight) then
  ``kiln::linear`` / ``kiln::linear_silu_mul``; ``fused`` = ``kiln::rmsnorm_linear`` (``folded``)
  with its default launch; ``nBLOCK_N-kBLOCK_K-wWARPS`` = the fused GEMV with that launch (what
  ``gemv(norm=..., block_n=...)`` overrides would give). Shapes: Qwen3-30B-A3B's qkv (5120 x 2048)
  and router (128 x 2048, the normalized row written for the experts), Llama-3.1-8B's qkv
  (6144 x 4096) and gate_up + SiLU (2 x 14336 x 4096).

Smoke mode (CPU): tiny shapes through the interpreter, one layer, one round; ``BLOCK_K`` capped at 32, so
the variants that differ only in ``BLOCK_K`` above it are one launch there, run once.
"""

import functools

import pytest
import torch
from conftest import SMOKE, graphed, pick

from kiln.ops.linear import gemv as G

DEV = "cpu" if SMOKE else "cuda"
LAYERS = pick(8, 1)
EPS = 1e-6
# name: (N, K, gate_up, normed)
SHAPES = {
    "qwen3_qkv": pick((5120, 2048, False, False), (40, 64, False, False)),
    "qwen3_router": pick((128, 2048, False, True), (16, 64, False, True)),
    "llama_qkv": pick((6144, 4096, False, False), (48, 96, False, False)),
    "llama_gate_up": pick((2 * 14336, 4096, True, False), (2 * 24, 64, True, False)),
}
VARIANTS = {
    "separate": None,
    "fused": {},
    "n2-k1024-w4": dict(block_n=2, block_k=1024, num_warps=4),
    "n4-k512-w4": dict(block_n=4, block_k=512, num_warps=4),
    "n4-k1024-w4": dict(block_n=4, block_k=1024, num_warps=4),
    "n8-k256-w4": dict(block_n=8, block_k=256, num_warps=4),
    "n8-k512-w4": dict(block_n=8, block_k=512, num_warps=4),
}


def _launch(variant: str) -> dict | None:
    """The variant's ``gemv`` overrides as this run launches them (smoke: ``BLOCK_K`` <= 32)."""
    kw = VARIANTS[variant]
    return dict(kw, block_k=min(kw["block_k"], 32)) if SMOKE and kw else kw


RUN_VARIANTS = [
    v for i, v in enumerate(VARIANTS) if _launch(v) not in [_launch(u) for u in list(VARIANTS)[:i]]
]


@pytest.fixture(autouse=True)
def _gemv_on(kernels_on_cpu, monkeypatch):
    monkeypatch.setenv("KILN_GEMV", "1")


@functools.lru_cache(maxsize=4)
def _layers(n, k):
    g = torch.Generator(DEV).manual_seed(0)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=DEV) * scale).to(torch.bfloat16)
    return [rnd(n, k, scale=k**-0.5) for _ in range(LAYERS)]  # the norm weight folded in


@pytest.mark.parametrize("variant", RUN_VARIANTS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_norm_linear_chain(measure, shape, variant):
    n, k, gate_up, normed = SHAPES[shape]
    kw = _launch(variant)
    layers = _layers(n, k)
    x = torch.randn(1, k, device=DEV).to(torch.bfloat16)
    ones, xn = torch.ones(k, device=DEV, dtype=x.dtype), torch.empty_like(x)
    lin = torch.ops.kiln.linear_silu_mul if gate_up else torch.ops.kiln.linear

    def one(w):
        if kw is None:
            return lin(torch.ops.kiln.rmsnorm(x, ones, EPS), w, None, 1)
        if not kw:
            return torch.ops.kiln.rmsnorm_linear(x, None, ones, EPS, w, None, 1, gate_up, normed, True)[0]
        spec = G.NormIn(None, EPS, xn_out=xn if normed else None)
        return G.gemv(x, w, gate_up=gate_up, norm=spec, **kw)

    ref = lin(torch.ops.kiln.rmsnorm(x, ones, EPS), layers[0], None, 1)
    if kw is not None:  # the fused result against the two launches
        torch.testing.assert_close(one(layers[0]).float(), ref.float(), rtol=2**-5, atol=2e-2)

    def chain():
        for w in layers:
            one(w)

    nbytes = LAYERS * (n * k * 2 + 2 * k * 2 + (n // 2 if gate_up else n) * 2)
    measure(graphed(chain), bytes=nbytes, shape=shape, variant=variant, layers=LAYERS, N=n, K=k)
