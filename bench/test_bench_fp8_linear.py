"""FP8 linear (row-wise scaled ``torch._scaled_mm``) against bf16 ``F.linear`` at Llama-3.1-8B shapes.

(N, K): qkv (6144, 4096), o (4096, 4096), gate_up-sized (14336, 4096), down (4096, 14336); M tokens
from decode (1, 16) to prefill (256, 1024, 4096). Each FP8 row records ``bf16_ms`` and
``speedup_vs_bf16`` (target: >= 1.5 at M >= 256); ``frac_mm`` is against the bf16 matmul ceiling,
``frac_bw`` counts weight + activation + output bytes (what bounds small M). Baselines: bf16
F.linear, and the dequantizing reference eager and through torch.compile. ``fp8_triton`` is
ops/fp8_gemm.py's kernel (``KILN_FP8_GEMM=triton``) with its table's configuration. On a GPU every
variant is captured in a CUDA graph and replayed.

``test_fp8_gemm_sweep`` (GPU only) times the Triton kernel at M = 256 and 512 over
``fp8_gemm.SWEEP_CONFIGS``, with precise and fast accumulation, each row carrying ``config``,
``bf16_ms``, ``cublas_ms`` and the speedups over both: the data for ``fp8_gemm.TABLE``.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import SMOKE, _median_ms, graphed, pick
from triton.runtime.errors import OutOfResources

from kiln.ops import fp8_gemm as fg
from kiln.ops import fp8_linear as fl
from kiln.ops.quant import quantize_fp8_per_channel, quantize_fp8_per_token

MS = pick([1, 16, 256, 1024, 4096], [2])
SHAPES = pick([(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)], [(32, 64)])
DEV = "cpu" if SMOKE else "cuda"
IMPLS = ["fp8", "fp8_fast_accum", "fp8_triton", "fp8_triton_fast_accum", "bf16", "ref_eager", "ref_compile"]
SMOKE_SKIPS = ("ref_compile", "fp8_fast_accum", "fp8_triton_fast_accum")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("m", MS)
def test_fp8_linear(measure, monkeypatch, m, n, k, impl):
    if SMOKE and impl in SMOKE_SKIPS:
        pytest.skip(f"{impl} runs only on a GPU (smoke mode skips it)")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")  # smoke: fp8_triton through the interpreter
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
    bias = None
    xq, xs = quantize_fp8_per_token(x)
    wq, ws = quantize_fp8_per_channel(w)
    out = torch.bfloat16
    fns = {
        "fp8": lambda: torch.ops.kiln.fp8_linear(xq, xs, wq, ws, bias, out),
        "fp8_fast_accum": lambda: fl.scaled_mm_rowwise(xq, xs, wq, ws, bias, out, fast_accum=True),
        "fp8_triton": lambda: fl.fp8_linear_forward(xq, xs, wq, ws, bias, out, backend="triton"),
        "fp8_triton_fast_accum": lambda: fg.fp8_gemm(xq, xs, wq, ws, bias, out, fast_accum=True),
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
    if impl.startswith("fp8_triton"):
        info["config"] = str(fg.fp8_gemm_config(m, n, k, fg.num_sms(xq.device)))
    measure(fn, flops=2.0 * m * n * k, bytes=moved, m=m, n=n, k=k, impl=impl, **info)


_BASELINES: dict[tuple[int, int, int], tuple[float, float]] = {}


def _case(m, n, k):
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
    return (x, w, *quantize_fp8_per_token(x), *quantize_fp8_per_channel(w))


@pytest.mark.skipif(SMOKE, reason="configuration sweep: GPU only")
@pytest.mark.parametrize("accum", ["precise", "fast"])
@pytest.mark.parametrize("cfg", fg.SWEEP_CONFIGS)
@pytest.mark.parametrize("n,k", [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)], ids=str)
@pytest.mark.parametrize("m", [int(x) for x in os.environ.get("KILN_SWEEP_M", "256,512").split(",")])
def test_fp8_gemm_sweep(measure, m, n, k, cfg, accum):
    x, w, xq, xs, wq, ws = _case(m, n, k)
    out = torch.bfloat16
    if (m, n, k) not in _BASELINES:  # bf16 F.linear and cuBLAS FP8 once per shape
        bf16 = _median_ms(graphed(lambda: F.linear(x, w)))
        cublas = _median_ms(graphed(lambda: fl.scaled_mm_rowwise(xq, xs, wq, ws, None, out)))
        _BASELINES[(m, n, k)] = (bf16, cublas)
    bf16_ms, cublas_ms = _BASELINES[(m, n, k)]
    config = fg.Fp8GemmConfig.parse(cfg)
    run = lambda: fg.fp8_gemm(xq, xs, wq, ws, None, out, fast_accum=accum == "fast", config=config)
    try:
        y = run()  # compiles
    except OutOfResources as e:
        pytest.skip(f"{cfg} does not fit on this GPU: {e}")
    ref = fl.scaled_mm_rowwise(xq, xs, wq, ws, None, torch.float32)
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"{cfg} ({accum}): relative error {err:.2e} against cuBLAS"
    fn = graphed(run)
    ms = _median_ms(fn)
    info = dict(
        bf16_ms=bf16_ms, cublas_ms=cublas_ms, speedup_vs_bf16=bf16_ms / ms, speedup_vs_cublas=cublas_ms / ms
    )
    moved = n * k + m * k + m * n * 2
    measure(
        fn, flops=2.0 * m * n * k, bytes=moved, m=m, n=n, k=k, config=cfg, accum=accum, rel_err=err, **info
    )
