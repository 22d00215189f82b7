"""FP8 linear (``kiln::fp8_linear``) against bf16 ``F.linear`` at Llama-3.1-8B shapes.

(N, K): qkv (6144, 4096), o (4096, 4096), gate_up-sized (14336, 4096), down (4096, 14336); M tokens
from decode (1, 16) to prefill (256, 1024, 4096). Each FP8 row records ``bf16_ms`` and
``speedup_vs_bf16`` (target: >= 1.5 at M >= 256); ``frac_mm`` is against the bf16 matmul ceiling,
``frac_bw`` counts weight + activation + output bytes (what bounds small M). Baselines: bf16
F.linear, and the dequantizing reference eager and through torch.compile. Rows (impl):

* ``fp8``: the op as models run it (``KILN_FP8_GEMM``, default ``auto``: the Triton kernel where
  ``fp8_gemm.TABLE`` has the shape, else cuBLAS; accumulation per ``KILN_FP8_FAST_ACCUM``);
* ``fp8_fast_accum``: cuBLAS ``_scaled_mm`` with fast accumulation;
* ``fp8_triton``: ops/linear/fp8_gemm.py's kernel (``KILN_FP8_GEMM=triton``) with its table's configuration
  and the default accumulation (fast, under ``auto``), so equal to ``fp8_triton_fast_accum`` then;
* ``fp8_cutlass``: ops/linear/fp8_cutlass.py's CUTLASS kernels (``KILN_FP8_GEMM=cutlass``, the instantiation
  ``fp8_cutlass.config_for`` picks), when ``KILN_CUTLASS_FP8_LIB`` names the built library (it is
  loaded at import, so ``fp8`` runs it too where ``auto`` picks it); skipped otherwise.

(Before 2026-11-29's fifth session ``fp8`` was cuBLAS with precise accumulation and ``fp8_triton``
precise: older result files are not comparable row for row.) On a GPU every variant is captured in
a CUDA graph and replayed.

``test_fp8_gemm_sweep`` (GPU only) times the Triton kernel at M = 256 and 512 over
``fp8_gemm.SWEEP_CONFIGS``, with precise and fast accumulation, each row carrying ``config``,
``bf16_ms``, ``cublas_ms`` and the speedups over both: the data for ``fp8_gemm.TABLE``; with
``KILN_FP8_SWEEP_CHAIN`` also the same per launch in a chain of distinct weights (see below).
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import SMOKE, _median_ms, graphed, pick
from triton.runtime.errors import OutOfResources

from kiln import settings
from kiln.ops.common.quant import quantize_fp8_per_channel, quantize_fp8_per_token
from kiln.ops.linear import fp8_cutlass as fc
from kiln.ops.linear import fp8_gemm as fg
from kiln.ops.linear import fp8_linear as fl

MS = pick([1, 16, 256, 1024, 4096], [2])
SHAPES = pick([(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)], [(32, 64)])
DEV = "cpu" if SMOKE else "cuda"
IMPLS = ["fp8", "fp8_fast_accum", "fp8_triton", "fp8_triton_fast_accum", "fp8_cutlass", "bf16", "ref_eager",
         "ref_compile"]  # fmt: skip
SMOKE_SKIPS = ("ref_compile", "fp8_fast_accum", "fp8_triton_fast_accum", "fp8_cutlass")
if not SMOKE and settings.value("cutlass_fp8_lib"):  # KILN_CUTLASS_FP8_LIB
    fc.load_library(settings.value("cutlass_fp8_lib"))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("m", MS)
def test_fp8_linear(measure, monkeypatch, m, n, k, impl):
    if SMOKE and impl in SMOKE_SKIPS:
        pytest.skip(f"{impl} runs only on a GPU (smoke mode skips it)")
    if impl == "fp8_cutlass" and not fc.loaded():
        pytest.skip("fp8_cutlass: set KILN_CUTLASS_FP8_LIB to the built library (compiler/cutlass_build.py)")
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
        "fp8_cutlass": lambda: fl.fp8_linear_forward(xq, xs, wq, ws, bias, out, backend="cutlass"),
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
    if impl in ("fp8", "fp8_cutlass") and not SMOKE:
        info["backend"] = fl.auto_backend(xq, wq, out) if impl == "fp8" else "cutlass"
        info["config"] = fc.resolve_config(m, n, k) if info["backend"] == "cutlass" else info.get("config")
    measure(fn, flops=2.0 * m * n * k, bytes=moved, m=m, n=n, k=k, impl=impl, **info)


# KILN_FP8_SWEEP_CHAIN=MB: also time each candidate over distinct weight copies of at least MB
# megabytes of FP8 weights, back to back in one graph (as a prefill step runs its linears: cold
# weights, no launch gap between kernels); ``chain_*`` fields are per launch.
CHAIN_MB = settings.value("fp8_sweep_chain")
_BASELINES: dict[tuple[int, int, int], dict[str, float]] = {}


def _case(m, n, k, copies=1):
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    xq, xs = quantize_fp8_per_token(x)
    ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    return x, xq, xs, ws, [quantize_fp8_per_channel(w) for w in ws]


def _per_launch_ms(fns) -> float:
    """One graph replaying ``fns`` back to back; median ms per launch."""
    return _median_ms(graphed(lambda: [f() for f in fns])) / len(fns)


@pytest.mark.skipif(SMOKE, reason="configuration sweep: GPU only")
@pytest.mark.parametrize("accum", settings.value("fp8_sweep_accum"))  # KILN_SWEEP_ACCUM
@pytest.mark.parametrize("cfg", fg.SWEEP_CONFIGS)
@pytest.mark.parametrize("n,k", [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)], ids=str)
@pytest.mark.parametrize("m", settings.value("fp8_sweep_m"))  # KILN_SWEEP_M
def test_fp8_gemm_sweep(measure, m, n, k, cfg, accum):
    copies = max(1, -(-CHAIN_MB * 10**6 // (n * k))) if CHAIN_MB else 1
    x, xq, xs, ws, qs = _case(m, n, k, copies)
    out = torch.bfloat16
    base = _BASELINES.get((m, n, k))
    if base is None:  # bf16 F.linear and cuBLAS FP8 once per shape
        bf16 = [lambda w=w: F.linear(x, w) for w in ws]
        cublas = [lambda q=q: fl.scaled_mm_rowwise(xq, xs, q[0], q[1], None, out) for q in qs]
        base = {"bf16_ms": _median_ms(graphed(bf16[0])), "cublas_ms": _median_ms(graphed(cublas[0]))}
        if CHAIN_MB:
            base.update(chain_bf16_ms=_per_launch_ms(bf16), chain_cublas_ms=_per_launch_ms(cublas))
        _BASELINES[(m, n, k)] = base
    config = fg.Fp8GemmConfig.parse(cfg)
    runs = [
        lambda q=q: fg.fp8_gemm(xq, xs, q[0], q[1], None, out, fast_accum=accum == "fast", config=config)
        for q in qs
    ]
    try:
        y = runs[0]()  # compiles
    except OutOfResources as e:
        pytest.skip(f"{cfg} does not fit on this GPU: {e}")
    ref = fl.fp8_linear_ref(xq, xs, qs[0][0], qs[0][1], None, torch.float32)  # exact products, f32 sums
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"{cfg} ({accum}): relative error {err:.2e} against the float32 reference"
    fn = graphed(runs[0])
    ms = _median_ms(fn)
    info = dict(base, speedup_vs_bf16=base["bf16_ms"] / ms, speedup_vs_cublas=base["cublas_ms"] / ms)
    if CHAIN_MB:
        chain = _per_launch_ms(runs)
        info.update(
            chain_copies=copies, chain_ms=chain, chain_speedup_vs_bf16=base["chain_bf16_ms"] / chain,
            chain_speedup_vs_cublas=base["chain_cublas_ms"] / chain,
        )  # fmt: skip
    moved = n * k + m * k + m * n * 2
    measure(
        fn, flops=2.0 * m * n * k, bytes=moved, m=m, n=n, k=k, config=cfg, accum=accum, rel_err=err, **info
    )
