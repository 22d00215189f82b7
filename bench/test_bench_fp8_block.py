"""Block-scaled FP8 linear (``kiln::fp8_block_linear``, ops/linear/fp8_block.py) against bf16
``F.linear`` and the per-channel FP8 linear, at Llama-3.1-8B and DeepSeek-V3 shapes.

(N, K): Llama-3.1-8B qkv (6144, 4096), o (4096, 4096), gate_up (28672, 4096), down (4096, 14336);
DeepSeek-V3 kv_a (576, 7168), q_b (24576, 1536), o (7168, 16384), a dense layer's down (7168, 18432).
M tokens from decode (1, 16, 64) to prefill (256, 1024, 4096). Rows (impl):

* ``block``: the op as models run it (``BUCKETS``: on-the-fly activation quantization up to 64
  tokens, pre-quantized from 65, split-K for small M);
* ``block_on_the_fly`` / ``block_prequant``: the same launch config with the other way of
  quantizing the activation forced: the data for ``PREQUANT_MIN_M`` (module docstring);
* ``fp8_rowwise``: ``kiln::fp8_linear`` on a per-channel quantization of the same weight with the
  activation's per-token quantization (``quantize_fp8_rows``) in front, as ``--quant fp8`` linears
  without a fused producer run;
* ``bf16``: ``F.linear``; ``ref_eager``: the op's dequantizing reference (smoke mode only).

FP8 rows record ``bf16_ms`` and ``speedup_vs_bf16``, ``config`` the launch configuration;
``frac_bw`` counts weight + scales + activation + output bytes (what bounds small M). On a GPU every
variant is captured in a CUDA graph and replayed; in smoke mode tiny shapes run the kernels in the
interpreter.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import SMOKE, _median_ms, graphed, pick

from kiln.ops.common.launch import sm_count
from kiln.ops.common.quant import quantize_fp8_per_channel
from kiln.ops.linear import fp8_block as fb

pytestmark = pytest.mark.usefixtures("kernels_on_cpu")

MS = pick([1, 16, 64, 256, 1024, 4096], [3, 70])
SHAPES = pick(
    [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (576, 7168), (24576, 1536), (7168, 16384),
     (7168, 18432)],
    [(200, 300)],
)  # fmt: skip
DEV = "cpu" if SMOKE else "cuda"
IMPLS = ["block", "block_on_the_fly", "block_prequant", "fp8_rowwise", "bf16", "ref_eager"]
GPU_SKIPS = ("ref_eager",)  # seconds per call at these sizes
SMOKE_SKIPS = ("fp8_rowwise",)  # cuBLAS FP8 (the reference otherwise: nothing to learn)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("m", MS)
def test_fp8_block_linear(measure, m, n, k, impl):
    if (SMOKE and impl in SMOKE_SKIPS) or (not SMOKE and impl in GPU_SKIPS):
        pytest.skip(f"{impl} is not measured {'in smoke mode' if SMOKE else 'on a GPU'}")
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
    wq, ws = fb.quantize_fp8_block(w)
    cfg = fb.block_config(m, n, k, sm_count(x.device, fb.DEFAULT_SMS))
    forced = {"block_on_the_fly": False, "block_prequant": True}
    if impl in forced:
        cfg = dataclasses.replace(cfg, prequant=forced[impl])
    fns = {
        "block": lambda: torch.ops.kiln.fp8_block_linear(x, wq, ws, None),
        "block_on_the_fly": lambda: fb.fp8_block_linear_triton(x, wq, ws, None, config=cfg),
        "block_prequant": lambda: fb.fp8_block_linear_triton(x, wq, ws, None, config=cfg),
        "bf16": lambda: F.linear(x, w),
        "ref_eager": lambda: fb.fp8_block_linear_ref(x, wq, ws, None),
    }
    if impl == "fp8_rowwise":
        cq, cs = quantize_fp8_per_channel(w)

        def rowwise() -> torch.Tensor:
            xq, xs = torch.ops.kiln.quantize_fp8_rows(x)
            return torch.ops.kiln.fp8_linear(xq, xs, cq, cs, None, torch.bfloat16)

        fns[impl] = rowwise
    fn = graphed(fns[impl])
    info: dict[str, object] = {}
    if impl != "bf16" and impl != "ref_eager":
        info["config"] = str(cfg) if impl.startswith("block") else "fp8_linear auto"
        if not SMOKE:
            ms, bf16_ms = _median_ms(fn), _median_ms(graphed(fns["bf16"]))
            info.update(bf16_ms=bf16_ms, speedup_vs_bf16=bf16_ms / ms)
    wbytes = n * k * (2 if impl == "bf16" else 1) + (ws.numel() * 4 if impl.startswith("block") else 0)
    moved = wbytes + m * k * 2 + m * n * 2
    measure(fn, flops=2.0 * m * n * k, bytes=moved, m=m, n=n, k=k, impl=impl, **info)
