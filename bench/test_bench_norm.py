"""Fused residual-add + RMSNorm (+ FP8 quant) at Llama-3.1-8B's hidden size (H = 4096).

Bytes moved per call: read x, residual and w; write the output (bf16, or fp8 + scales) and the
updated residual. ``frac_bw`` is that over the measured read bandwidth (target: >= 0.8 at 4096
tokens). Each kernel sits beside the torch reference run eagerly and through torch.compile. On a
GPU every variant is captured in a CUDA graph and replayed, as the runtime serves it, so small
token counts measure the kernel rather than Python and launch overhead.

``test_fused_add_rmsnorm_sweep`` (GPU only) times the kernel's launch shapes for every variant: the
data for ``norm.LAUNCH_DEFAULTS``. At 4096 tokens, one row per program at 4, 8 and 16 warps (ids
``4096-{variant}-1-{warps}``; 2 and 4 rows per program lost everywhere in
bench/results/2026-11-29_h200_norm_sweep.json) beside the persistent launches of
``norm.PERSISTENT_SWEEP`` (ids ``4096-{variant}-persistent-p{programs per SM}-{s{stages}|prefetch}-
{warps}``): 57 cases, ``-k 'sweep and 4096'``. At 256 tokens, rows per program 1/2/4 x warps 4/8/16
(``256-{variant}-{rows}-{warps}``). Each case records its launch fields and ``grid`` (programs).
"""

import pytest
import torch
from conftest import SMOKE, graphed, pick

from kiln.ops.common.quant import FP8_DTYPE
from kiln.ops.norm import rmsnorm as norm

H = pick(4096, 256)
TOKENS = pick([1, 8, 64, 256, 4096], [3])
DEV = "cpu" if SMOKE else "cuda"
EPS = 1e-5
DTYPE = torch.bfloat16
VARIANTS = {  # name -> scale argument of the quant op (None = dynamic), or "bf16" for no quant
    "add_rmsnorm": "bf16",
    "add_rmsnorm_fp8_dynamic": None,
    "add_rmsnorm_fp8_static": "static",
}


def _call(variant, impl):
    """The function to time: the kiln op, or the reference (eager or torch.compile)."""
    quant = VARIANTS[variant]
    if impl == "kiln":
        if quant == "bf16":
            return torch.ops.kiln.fused_add_rmsnorm
        return torch.ops.kiln.fused_add_rmsnorm_quant
    ref = norm.fused_add_rmsnorm_ref if quant == "bf16" else norm.fused_add_rmsnorm_quant_ref
    if impl == "compile":
        torch._dynamo.reset()
        return torch.compile(ref, dynamic=False)
    return ref


@pytest.mark.parametrize("impl", ["kiln", "eager", "compile"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_add_rmsnorm(measure, monkeypatch, tokens, variant, impl):
    if impl == "compile" and SMOKE:
        pytest.skip("torch.compile baselines run only on a GPU (smoke mode skips them)")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")  # smoke: the kernel through the interpreter
    x = torch.randn(tokens, H, device=DEV, dtype=DTYPE)
    residual = torch.randn(tokens, H, device=DEV, dtype=DTYPE)
    w = torch.randn(H, device=DEV, dtype=DTYPE)
    quant = VARIANTS[variant]
    scale = torch.tensor([0.05], device=DEV) if quant == "static" else None
    fn = _call(variant, impl)
    if quant == "bf16":
        out = graphed(lambda: fn(x, residual, w, EPS))
    else:
        out = graphed(lambda: fn(x, residual, w, EPS, scale))
    measure(out, bytes=_moved(tokens, quant), tokens=tokens, hidden=H, variant=variant, impl=impl)


def _moved(tokens: int, quant) -> int:
    """x, residual in and out, w, y (bf16, or fp8 (+ the dynamic scales))."""
    es = DTYPE.itemsize
    out_bytes = tokens * H * (es if quant == "bf16" else 1) + (tokens * 4 if quant is None else 0)
    return 3 * tokens * H * es + H * es + out_bytes


def _sweep_cases() -> list:
    cases = []
    for tokens in (4096, 256):
        for variant in VARIANTS:
            rows_options = (1,) if tokens == 4096 else (1, 2, 4)
            launches = [norm.Launch(rows=rows, num_warps=w) for rows in rows_options for w in (4, 8, 16)]
            if tokens == 4096:
                launches += norm.PERSISTENT_SWEEP
            cases += [
                pytest.param(tokens, variant, launch, id=f"{tokens}-{variant}-{launch.label}")
                for launch in launches
            ]
    return cases


@pytest.mark.skipif(SMOKE, reason="launch sweep: GPU only")
@pytest.mark.parametrize("tokens,variant,launch", _sweep_cases())
def test_fused_add_rmsnorm_sweep(measure, tokens, variant, launch):
    x = torch.randn(tokens, H, device=DEV, dtype=DTYPE)
    residual = torch.randn(tokens, H, device=DEV, dtype=DTYPE)
    w = torch.randn(H, device=DEV, dtype=DTYPE)
    quant = VARIANTS[variant]
    mode = {"bf16": norm.QUANT_NONE, None: norm.QUANT_DYNAMIC, "static": norm.QUANT_STATIC}[quant]
    scale = torch.tensor([0.05], device=DEV) if quant == "static" else None
    y = torch.empty(tokens, H, device=DEV, dtype=DTYPE if quant == "bf16" else FP8_DTYPE)
    s = None if quant == "bf16" else torch.empty((tokens, 1) if quant is None else (1,), device=DEV)
    kw = launch.overrides()
    grid = norm.launch_grid(tokens, norm.launch_config(H, quant=mode, **kw), x.device)
    fn = lambda: norm.rmsnorm_launch(x, residual, w, EPS, scale, mode, y, s, **kw)
    measure(
        graphed(fn), bytes=_moved(tokens, quant), tokens=tokens, hidden=H, variant=variant, grid=grid, **kw
    )
