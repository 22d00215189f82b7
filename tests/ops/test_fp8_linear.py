"""fp8_linear (ops/linear/fp8_linear.py): the reference on CPU (the dequantized product), argument checks,
export, and on the GPU ``torch._scaled_mm`` against the reference."""

import warnings

import pytest
import torch
from test_fp8_gemm import quantize_activations, rel_err

from kiln.ops.common.quant import dequantize_fp8, quantize_fp8_per_channel
from kiln.ops.linear import fp8_linear as fl


def make_case(t, n, k, device="cpu", seed=0, per_tensor=False, with_bias=True):
    """``(x, w, bias, xq, xs, wq, ws)``: activations, weights with rows of spread magnitudes, and
    their FP8 forms."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(t, k, generator=g, device=device)
    w = torch.randn(n, k, generator=g, device=device) * torch.logspace(-1, 1, n, device=device)[:, None]
    bias = torch.randn(n, generator=g, device=device).to(torch.bfloat16) if with_bias else None
    return (x, w, bias, *quantize_activations(x, per_tensor), *quantize_fp8_per_channel(w))


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per_token", "per_tensor"])
def test_reference_is_the_dequantized_product(per_tensor):
    x, w, bias, xq, xs, wq, ws = make_case(5, 48, 64, per_tensor=per_tensor)
    y = torch.ops.kiln.fp8_linear(xq, xs, wq, ws, bias, torch.float32)
    exact = dequantize_fp8(xq, xs) @ dequantize_fp8(wq, ws).t() + bias.float()
    assert y.dtype == torch.float32 and y.shape == (5, 48)
    assert rel_err(y, exact) < 1e-6
    # and close to the unquantized product: each operand carries at most 2**-4 relative error
    assert rel_err(y, x @ w.t() + bias.float()) < 0.08


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_out_dtype_and_no_bias(out_dtype):
    _, _, _, xq, xs, wq, ws = make_case(3, 32, 32, with_bias=False)
    y = torch.ops.kiln.fp8_linear(xq, xs, wq, ws, None, out_dtype)
    assert y.dtype == out_dtype
    assert rel_err(y, fl.fp8_linear_ref(xq, xs, wq, ws, None, torch.float32)) < 1e-2


def test_zero_tokens():
    _, _, bias, xq, xs, wq, ws = make_case(0, 32, 16)
    assert torch.ops.kiln.fp8_linear(xq, xs, wq, ws, bias, torch.bfloat16).shape == (0, 32)


def test_bad_inputs_name_the_argument():
    _, _, bias, xq, xs, wq, ws = make_case(4, 32, 16)
    with pytest.raises(ValueError, match="w_scale must be"):
        torch.ops.kiln.fp8_linear(xq, xs, wq, ws[:5], bias, torch.bfloat16)
    with pytest.raises(ValueError, match="x_scale must be"):
        torch.ops.kiln.fp8_linear(xq, xs[:2], wq, ws, bias, torch.bfloat16)
    with pytest.raises(ValueError, match=r"must be torch\.float8_e4m3fn"):
        torch.ops.kiln.fp8_linear(xq.float(), xs, wq, ws, bias, torch.bfloat16)
    with pytest.raises(ValueError, match=r"need x \[T, K\] and w \[N, K\]"):
        torch.ops.kiln.fp8_linear(xq, xs, wq[:, :8], ws, bias, torch.bfloat16)


class _Linear(torch.nn.Module):
    def __init__(self, wq, ws, bias):
        super().__init__()
        self.register_buffer("w", wq)
        self.register_buffer("w_scale", ws)
        self.register_buffer("bias", bias)

    def forward(self, xq, xs):
        return torch.ops.kiln.fp8_linear(xq, xs, self.w, self.w_scale, self.bias, torch.bfloat16)


def test_export_runs_the_op():
    _, _, bias, xq, xs, wq, ws = make_case(3, 32, 16)
    mod = _Linear(wq, ws, bias)
    t = torch.export.Dim("T", min=1, max=64)
    ep = torch.export.export(mod, (xq, xs), dynamic_shapes=({0: t}, {0: t}), strict=False)
    assert any(n.target is torch.ops.kiln.fp8_linear.default for n in ep.graph.nodes)
    _, _, _, xq, xs, _, _ = make_case(9, 32, 16, seed=1)
    assert torch.equal(ep.module()(xq, xs), fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.bfloat16))


# ---- GPU: torch._scaled_mm vs the dequantized reference ------------------------------------------------


SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("per_tensor", [False, True], ids=["per_token", "per_tensor"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("t", [1, 7, 256, 4096])
def test_gpu_scaled_mm_matches_reference(t, n, k, per_tensor):
    _, _, bias, xq, xs, wq, ws = make_case(t, n, k, device="cuda", per_tensor=per_tensor)
    assert fl.scaled_mm_supported(xq, wq) is None, "this GPU should take the _scaled_mm path"
    y = torch.ops.kiln.fp8_linear(xq, xs, wq, ws, bias, torch.bfloat16)
    ref = fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32)
    assert y.dtype == torch.bfloat16 and y.shape == (t, n)
    assert rel_err(y, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fast_accum", [False, True])
def test_gpu_out_dtypes_and_fast_accum(out_dtype, fast_accum):
    _, _, bias, xq, xs, wq, ws = make_case(300, 1024, 2048, device="cuda")
    y = fl.scaled_mm_rowwise(xq, xs, wq, ws, bias, out_dtype, fast_accum=fast_accum)
    assert y.dtype == out_dtype
    assert rel_err(y, fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32)) < 1e-2


@pytest.mark.gpu
def test_gpu_unaligned_shapes_fall_back_with_a_warning():
    _, _, bias, xq, xs, wq, ws = make_case(5, 40, 24, device="cuda")  # N, K not multiples of 16
    assert "divisible by 16" in fl.scaled_mm_supported(xq, wq)
    fl._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = torch.ops.kiln.fp8_linear(xq, xs, wq, ws, bias, torch.bfloat16)
    assert any("Pad the weight" in str(c.message) for c in caught)
    assert rel_err(y, fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32)) < 1e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    _, _, bias, xq, xs, wq, ws = make_case(64, 4096, 4096, device="cuda")
    sx, ss = xq.clone(), xs.clone()
    torch.ops.kiln.fp8_linear(sx, ss, wq, ws, bias, torch.bfloat16)  # warm up outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = torch.ops.kiln.fp8_linear(sx, ss, wq, ws, bias, torch.bfloat16)
    _, _, _, xq2, xs2, _, _ = make_case(64, 4096, 4096, device="cuda", seed=7)
    sx.copy_(xq2)
    ss.copy_(xs2)
    g.replay()
    assert rel_err(y, fl.fp8_linear_ref(xq2, xs2, wq, ws, bias, torch.float32)) < 1e-2
