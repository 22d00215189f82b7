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

``test_fp8_block_moe``: the routed experts of one DeepSeek-V3 MoE layer (E=256, top-8, H=7168,
I=2048; random uniform routing) through ``kiln.fused_moe`` for 1 to 4096 tokens: ``block`` (e4m3
experts with 128 x 128 block scales, x and the SiLU-and-mul output quantized per token and group),
``fp8_channel`` (the same weights quantized per output channel, ``--quant fp8``'s path) and
``bf16``; ``bytes`` counts the weights of the experts the batch hits (and their scales) plus the
activations, ``flops`` ``2 * T * k * 3 * H * I``. What it answers: whether the block path's
128-step K loop (BLOCK_K forced to 128) and its two group-quantization kernels cost more than the
per-channel path at decode sizes, and the block mode's share of the bf16 matmul rate at 4096.

FP8 rows record ``bf16_ms`` and ``speedup_vs_bf16``, ``config`` the launch configuration;
``frac_bw`` counts weight + scales + activation + output bytes (what bounds small M). On a GPU every
variant is captured in a CUDA graph and replayed; in smoke mode tiny shapes run the kernels in the
interpreter.
"""

import dataclasses
import functools

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


MOE_TOKENS = pick([1, 8, 64, 512, 4096], [3])
MOE_SHAPE = pick((7168, 2048, 256, 8), (200, 128, 8, 2))  # H, I, E, top-k
MOE_CHUNK = 16  # experts made and quantized at a time: bf16 w13 alone is 15 GB, its float32 copy 30


@functools.lru_cache(maxsize=1)
def _moe_weights(impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One MoE layer's experts for ``impl`` (``w13, w2, s13, s2``), made ``MOE_CHUNK`` experts at a
    time so that the quantization's float32 temporaries stay small, and kept for every token count
    (``impl`` is the outer parameter: one layer's weights alive at a time, so the run fits an H100)."""
    h, i, e, _ = MOE_SHAPE
    g = torch.Generator(DEV).manual_seed(0)
    quant = {"block": fb.quantize_fp8_block, "fp8_channel": quantize_fp8_per_channel}.get(impl)
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    for e0 in range(0, e, MOE_CHUNK):
        n = min(MOE_CHUNK, e - e0)
        w13 = torch.randn(n, 2 * i, h, device=DEV, generator=g, dtype=torch.bfloat16) / h**0.5
        w2 = torch.randn(n, h, i, device=DEV, generator=g, dtype=torch.bfloat16) / i**0.5
        made = [w13, w2] if quant is None else [*quant(w13), *quant(w2)]
        for slot, t in zip((0, 2, 1, 3) if quant else (0, 1), made, strict=True):
            parts[slot].append(t)
        del w13, w2, made
    w13, w2, s13, s2 = (torch.cat(p) if p else None for p in parts)
    return w13, w2, s13, s2


@pytest.mark.parametrize("t", MOE_TOKENS)
@pytest.mark.parametrize("impl", ["block", "fp8_channel", "bf16"])
def test_fp8_block_moe(measure, t, impl):
    h, i, e, k = MOE_SHAPE
    w13, w2, s13, s2 = _moe_weights(impl)
    g = torch.Generator(DEV).manual_seed(t)
    x = torch.randn(t, h, device=DEV, generator=g).to(torch.bfloat16)
    w, ids = torch.topk(torch.rand(t, e, device=DEV, generator=g), k, dim=-1)
    w, ids = (w / w.sum(-1, keepdim=True)).float(), ids.to(torch.int32)
    fn = graphed(lambda: torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, s13, s2, ""))
    hit = int(torch.unique(ids).numel())
    scales = [s for s in (s13, s2) if s is not None]
    wbytes = hit * 3 * h * i * (2 if impl == "bf16" else 1) + sum(s[0].numel() * 4 * hit for s in scales)
    measure(fn, flops=2.0 * t * k * 3 * h * i, bytes=wbytes + 4 * t * h, m=t, impl=impl, hit_experts=hit)
