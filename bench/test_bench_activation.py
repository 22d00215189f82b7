"""SiLU-and-mul (+ FP8 quant) at Llama-3.1-8B's intermediate size (I = 14336).

Bytes moved per call: read ``x [T, 2I]``, write ``y [T, I]`` (bf16, or fp8 + per-token scales);
``frac_bw`` is that over the measured read bandwidth. Beside each kernel: the torch reference eager
and through torch.compile. On a GPU every variant is captured in a CUDA graph and replayed.
"""

import pytest
import torch
from conftest import SMOKE, graphed, pick

from kiln.ops.activation import silu_and_mul as activation

I = pick(14336, 256)
TOKENS = pick([1, 8, 64, 256, 4096], [3])
DEV = "cpu" if SMOKE else "cuda"
DTYPE = torch.bfloat16
VARIANTS = ["silu_and_mul", "silu_and_mul_fp8_dynamic"]


@pytest.mark.parametrize("impl", ["kiln", "eager", "compile"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul(measure, monkeypatch, tokens, variant, impl):
    if impl == "compile" and SMOKE:
        pytest.skip("torch.compile baselines run only on a GPU (smoke mode skips them)")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")  # smoke: the kernel through the interpreter
    x = torch.randn(tokens, 2 * I, device=DEV, dtype=DTYPE)
    quant = variant.endswith("dynamic")
    if impl == "kiln":
        fn = (
            (lambda: torch.ops.kiln.silu_and_mul_quant(x, None))
            if quant
            else (lambda: torch.ops.kiln.silu_and_mul(x))
        )
    else:
        ref = activation.silu_and_mul_quant_ref if quant else activation.silu_and_mul_ref
        if impl == "compile":
            torch._dynamo.reset()
            ref = torch.compile(ref, dynamic=False)
        fn = (lambda: ref(x, None)) if quant else (lambda: ref(x))
    out_bytes = tokens * I * 1 + tokens * 4 if quant else tokens * I * x.element_size()
    moved = x.numel() * x.element_size() + out_bytes
    measure(graphed(fn), bytes=moved, tokens=tokens, intermediate=I, variant=variant, impl=impl)
