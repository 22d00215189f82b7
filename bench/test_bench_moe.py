"""Fused MoE (routing, alignment, grouped GEMMs, combine) at Qwen3-30B-A3B shapes: E=128 experts,
top-8, H=2048, I=768, for 1 to 4096 tokens.

Rows (``impl``):

* ``triton`` / ``triton_fp8``: ``kiln.fused_moe`` (bf16 / FP8 experts), captured in a CUDA graph;
* ``eager``: the torch baseline Hugging Face's expert loop amounts to (per hit expert: gather,
  gate_up, SiLU-and-mul, down, weight, index_add; bf16, not capturable: it reads the routing on the
  host);
* ``routing`` / ``align``: ``kiln.moe_topk`` and ``kiln.moe_align`` alone.

``bytes`` counts the weights of the experts the batch actually hits plus the activations read and
written (``frac_bw`` is what bounds few tokens; target >= 0.7); ``flops`` counts ``2 * T * k * 3 * H * I``
(``frac_mm`` against the measured bf16 matmul rate; target >= 0.5 at 4096 tokens). Routing is
random (uniform over experts), as a trained router's load is close to balanced. Smoke mode (CPU):
tiny shapes through the interpreter, one round.
"""

import pytest
import torch
from conftest import SMOKE, graphed, pick

from kiln.ops.moe_gemm import moe_block_m
from kiln.ops.quant import quantize_fp8_per_channel

H, I, E, K = pick((2048, 768, 128, 8), (64, 32, 8, 2))
TOKENS = pick([1, 8, 64, 256, 1024, 4096], [3])
DEV = "cpu" if SMOKE else "cuda"
IMPLS = ["triton", "triton_fp8", "eager", "routing", "align"]


@pytest.fixture(autouse=True)
def _kernels_on_cpu(monkeypatch):
    if SMOKE:
        monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")


def eager_moe(x, w13, w2, weights, ids):
    """The torch baseline: one expert at a time, as Hugging Face's eager experts run."""
    out = torch.zeros_like(x)
    i = w2.shape[2]
    for e in torch.unique(ids).tolist():
        tok, j = torch.where(ids == e)
        gu = x[tok] @ w13[e].t()  # [n, 2I]
        h = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        y = (h @ w2[e].t()) * weights[tok, j, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t", TOKENS)
def test_fused_moe(measure, t, impl):
    g = torch.Generator(DEV).manual_seed(t)
    x = torch.randn(t, H, device=DEV, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, device=DEV, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=DEV, generator=g) / I**0.5).to(torch.bfloat16)
    router = (torch.randn(E, H, device=DEV, generator=g) / H**0.5).to(torch.bfloat16)
    logits = x @ router.t()  # [T, E]
    weights, ids = torch.ops.kiln.moe_topk(logits, None, K, True, "softmax", 1, 1, 1.0)
    hit = int(torch.unique(ids).numel())
    wbytes = 1 if impl == "triton_fp8" else 2
    act = 2 * t * H * 2  # x in, y out (bf16)
    moved = hit * 3 * H * I * wbytes + act
    flops = 2.0 * t * K * 3 * H * I
    info = dict(t=t, impl=impl, experts_hit=hit, E=E, top_k=K, H=H, I=I, block_m=moe_block_m(E, t, K))
    if impl == "routing":
        fn = graphed(lambda: torch.ops.kiln.moe_topk(logits, None, K, True, "softmax", 1, 1, 1.0))
        measure(fn, bytes=t * E * 2 + t * K * 8, **info)
        return
    if impl == "align":
        fn = graphed(lambda: torch.ops.kiln.moe_align(ids, None, E, moe_block_m(E, t, K)))
        measure(fn, bytes=t * K * 4, **info)
        return
    if impl == "eager":
        fn = lambda: eager_moe(x, w13, w2, weights, ids)
    else:
        if impl == "triton_fp8":
            w13, s13 = quantize_fp8_per_channel(w13)
            w2, s2 = quantize_fp8_per_channel(w2)
        else:
            s13 = s2 = None
        fn = graphed(lambda: torch.ops.kiln.fused_moe(x, w13, w2, weights, ids, None, s13, s2, ""))
    measure(fn, bytes=moved, flops=flops, **info)
    if impl == "triton":  # the benchmark also checks what it measured
        out = torch.ops.kiln.fused_moe(x, w13, w2, weights, ids, None, None, None, "")
        ref = eager_moe(x.float(), w13.float(), w2.float(), weights, ids)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, f"fused_moe vs eager float32: relative error {err:.2e}"
