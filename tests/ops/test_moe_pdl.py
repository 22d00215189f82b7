"""Programmatic dependent launch (ops/common/launch.py) in the MoE, its input quantization and the
sampling kernels: on CPU every launch site passes ``PDL=False`` and no ``launch_pdl`` (the
interpreter takes none), and every kernel triggers, then waits before any store, early return or load other than a weight's. The GPU
tests (``gpu``) check the results with PDL on."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import triton

from kiln.ops.activation import quantize as quant_rows
from kiln.ops.moe import align as ma
from kiln.ops.moe import fused as moe
from kiln.ops.moe import gemm as mg
from kiln.ops.moe import topk as mr
from kiln.ops.sampling import gumbel as sampling

MODULES = (ma, mg, moe, mr, sampling, quant_rows)  # quant_rows: the experts' input quantization
# loads allowed before the wait: weights only (no kernel of a step writes them)
WEIGHT_LOADS: dict[str, tuple[str, ...]] = {}  # none in these modules (the bias is cast each step)


def kernels():
    return [
        (mod, name, fn)
        for mod in MODULES
        for name, fn in vars(mod).items()
        if isinstance(fn, triton.runtime.jit.KernelInterface) and name.endswith("_kernel")
    ]


def test_all_kernels_found():
    assert len(kernels()) == 11  # align 4, GEMM 2, quantize + combine, top-k, sampling 2


@pytest.mark.parametrize("name", [n for _, n, _ in kernels()])
def test_kernel_waits_before_reading_activations_or_writing(name):
    fn = next(f for _, n, f in kernels() if n == name)
    assert "PDL" in fn.arg_names
    body = inspect.getsource(fn.fn).split("):", 1)[1]  # past the signature
    trigger, wait = body.find("pdl_trigger(PDL)"), body.find("pdl_wait(PDL)")
    assert 0 <= trigger < wait, f"{name}: pdl_trigger(PDL) then pdl_wait(PDL)"
    before = body[:wait]
    assert not re.search(r"tl\.(store|atomic_\w+)\(|\breturn\b", before), f"{name}: writes before the wait"
    for ptr in re.findall(r"tl\.load\((\w+)", before):
        assert ptr in WEIGHT_LOADS.get(name, ()), f"{name}: loads {ptr} before the wait"


def test_cpu_launch_sites_pass_pdl_off(kernel_on_cpu, monkeypatch):
    """Every kernel launched through the ops on CPU tensors gets ``PDL=False`` and no
    ``launch_pdl`` (the launches are recorded, not run: no result is read on the host)."""
    seen: dict[str, list[dict]] = {}

    class Spy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: seen.setdefault(self.name, []).append(kw)

    names = {n for _, n, _ in kernels()}
    for mod, name, _ in kernels():
        monkeypatch.setattr(mod, name, Spy(name))
    t, h, i, e, k = 2, 32, 16, 8, 2
    logits = torch.randn(t, e)
    w, ids = torch.ops.kiln.moe_topk(logits, torch.zeros(e), k, True, "sigmoid", 2, 2, 1.0)
    torch.ops.kiln.moe_topk(logits, None, k, True, "softmax", 1, 1, 1.0)
    ma.moe_align_run(torch.randint(0, e, (200, k), dtype=torch.int32), None, e, 16)  # chunked
    x = torch.randn(t, h)
    w13, w2 = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    w13q, s13 = torch.zeros(e, 2 * i, h).to(mg.FP8_DTYPE), torch.ones(e, 2 * i)
    w2q, s2 = torch.zeros(e, h, i).to(mg.FP8_DTYPE), torch.ones(e, h)
    monkeypatch.setattr(moe.activation, "silu_and_mul_launch", lambda *args: None)  # not ours
    grouped = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
    gemv = dict(grouped, BLOCK_M=1)
    for cfg in (grouped, gemv, dict(gemv, GROUP_M=2)):
        moe.fused_moe_forward(x, w13, w2, w, ids, None, None, None, "", configs=(cfg, cfg))
        moe.fused_moe_forward(x, w13q, w2q, w, ids, None, s13, s2, "", configs=(cfg, cfg))
    sampling.argmax_rows(torch.randn(t, 5000))
    sampling.gumbel_argmax(torch.randn(t, 5000), torch.zeros(t, 2, dtype=torch.int64))
    assert set(seen) == names
    for name, launches in seen.items():
        for kw in launches:
            assert kw.get("PDL") is False and "launch_pdl" not in kw, (name, kw)
