"""FP8 linear (row-wise scaled ``torch._scaled_mm``) against bf16 ``F.linear`` at Llama-3.1-8B shapes.

(N, K): qkv (6144, 4096), o (4096, 4096), gate_up-sized (14336, 4096), down (4096, 14336); M tokens
from decode (1, 16) to prefill (256, 1024, 4096). Each FP8 row records ``bf16_ms`` and
``speedup_vs_bf16`` (target: >= 1.5 at M >= 256); ``frac_mm`` is against the bf16 matmul ceiling,
``frac_bw`` counts weight + activation + output bytes (what bounds small M). Baselines: bf16
F.linear, and the dequantizing reference eager and through torch.compile. On a GPU every variant
is captured in a CUDA graph and replayed.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import SMOKE, _median_ms, graphed, pick

from kiln.ops import fp8_linear as fl
from kiln.ops.quant import quantize_fp8_per_channel, quantize_fp8_per_token

MS = pick([1, 16, 256, 1024, 4096], [2])
SHAPES = pick([(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)], [(32, 64)])
DEV = "cpu" if SMOKE else "cuda"
IMPLS = ["fp8", "fp8_fast_accum", "bf16", "ref_eager", "ref_compile"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("m", MS)
def test_fp8_linear(measure, m, n, k, impl):
    if SMOKE and impl in ("ref_compile", "fp8_fast_accum"):
        pytest.skip(f"{impl} runs only on a GPU (smoke mode skips it)")
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
    bias = None
    xq, xs = quantize_fp8_per_token(x)
    wq, ws = quantize_fp8_per_channel(w)
    out = torch.bfloat16
    fns = {
        "fp8": lambda: torch.ops.kiln.fp8_linear(xq, xs, wq, ws, bias, out),
        "fp8_fast_accum": lambda: fl.scaled_mm_rowwise(xq, xs, wq, ws, bias, out, fast_accum=True),
        "bf16": lambda: F.linear(x, w, bias),
        "ref_eager": lambda: fl.fp8_linear_ref(xq, xs, wq, ws, bias, out),
    }
    if impl == "ref_compile":
        torch._dynamo.reset()
        ref = torch.compile(fl.fp8_linear_ref, dynamic=False)
        fns[impl] = lambda: ref(xq, xs, wq, ws, bias, out)
    fn = graphed(fns[impl])
    info = {}
    if impl.startswith("fp8") and not SMOKE:
        fp8_ms, bf16_ms = _median_ms(fn), _median_ms(graphed(fns["bf16"]))
        info = {"bf16_ms": bf16_ms, "speedup_vs_bf16": bf16_ms / fp8_ms}
    wbytes = n * k * (2 if impl == "bf16" else 1)
    moved = wbytes + m * k * (2 if impl == "bf16" else 1) + m * n * 2
    measure(fn, flops=2.0 * m * n * k, bytes=moved, m=m, n=n, k=k, impl=impl, **info)
