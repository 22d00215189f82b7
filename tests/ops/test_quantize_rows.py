"""Per-token FP8 quantization op (ops/activation/quantize.py): the Triton kernel bit for bit against
its reference ``quantize_fp8_per_token`` (interpreter on CPU, compiled on the GPU), edge cases, the
op on both paths, torch.export, and the FP8 linear's graph using it."""

import pytest
import torch

from kiln.ops.activation import quantize as qr
from kiln.ops.common.quant import FP8_DTYPE, FP8_MIN_SCALE, quantize_fp8_per_token

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_x(t, k, dtype, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    return (4 * torch.randn(t, k, generator=g, device=device)).to(dtype)


def assert_bitwise(got, want):
    (q, s), (ref_q, ref_s) = got, want
    assert q.dtype == FP8_DTYPE and q.shape == ref_q.shape and s.shape == ref_s.shape == (q.shape[0], 1)
    assert torch.equal(s, ref_s), "scales differ"
    diff = (q.view(torch.uint8) != ref_q.view(torch.uint8)).sum().item()
    assert diff == 0, f"{diff} FP8 values differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,k", [(1, 64), (3, 100), (2, qr.MAX_BLOCK), (2, qr.MAX_BLOCK + 904)])
def test_kernel_matches_reference_bitwise(kernel_on_cpu, t, k, dtype):
    x = make_x(t, k, dtype, seed=t + k)
    assert_bitwise(qr.quantize_fp8_rows_triton(x), quantize_fp8_per_token(x))


def test_edge_rows(kernel_on_cpu):
    x = make_x(4, 96, torch.bfloat16)
    x[1] = 0  # all-zero row: the smallest scale, zeros out
    x[2, 5] = 1e4  # one large value sets the row's scale, saturating nothing
    q, s = qr.quantize_fp8_rows_triton(x)
    assert s[1].item() == pytest.approx(FP8_MIN_SCALE) and not q[1].float().any()
    assert q[2, 5].float().item() == 448.0
    assert_bitwise((q, s), quantize_fp8_per_token(x))
    wide = make_x(3, 160, torch.float32)
    assert_bitwise(
        qr.quantize_fp8_rows_triton(wide[:, :96]), quantize_fp8_per_token(wide[:, :96])
    )  # row stride
    q0, s0 = qr.quantize_fp8_rows_triton(make_x(0, 96, torch.bfloat16))
    assert q0.shape == (0, 96) and s0.shape == (0, 1)


@pytest.mark.parametrize("triton_on_cpu", ["1", "0"], ids=["kernel", "reference"])
def test_op_on_both_paths(monkeypatch, triton_on_cpu):
    monkeypatch.setenv("KILN_TRITON_ON_CPU", triton_on_cpu)
    x = make_x(5, 200, torch.bfloat16, seed=3)
    assert_bitwise(torch.ops.kiln.quantize_fp8_rows(x), quantize_fp8_per_token(x))
    with pytest.raises(ValueError, match=r"quantize_fp8_rows: x must be \[T, K\]"):
        torch.ops.kiln.quantize_fp8_rows(x[0])
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        torch.ops.kiln.quantize_fp8_rows(x.to(torch.int32))


class _Quant(torch.nn.Module):
    def forward(self, x):
        return torch.ops.kiln.quantize_fp8_rows(x)


def test_export_runs_the_op(kernel_on_cpu):
    t = torch.export.Dim("T", min=1, max=64)
    ep = torch.export.export(
        _Quant(), (make_x(3, 48, torch.bfloat16),), dynamic_shapes=({0: t},), strict=False
    )
    assert torch.ops.kiln.quantize_fp8_rows.default in {n.target for n in ep.graph.nodes}
    x = make_x(9, 48, torch.bfloat16, seed=7)
    assert_bitwise(ep.module()(x), quantize_fp8_per_token(x))


def test_fp8_linear_quantizes_its_input_with_the_op():
    """A ``--quant fp8`` Linear fed a plain activation (the attention output before ``o``) traces one
    ``kiln::quantize_fp8_rows``, not the abs / amax / divide / clamp / cast of the torch ops."""
    from kiln.compiler.layers import Linear

    lin = Linear(32, 64, torch.bfloat16, False, "fp8")
    t = torch.export.Dim("T", min=1, max=64)
    ep = torch.export.export(lin, (make_x(3, 64, torch.bfloat16),), dynamic_shapes=({0: t},), strict=False)
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.kiln.quantize_fp8_rows.default in targets
    assert torch.ops.aten.amax.default not in targets and torch.ops.aten.abs.default not in targets


# ---- GPU: compiled kernel at model sizes ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,k", [(1, 4096), (64, 4096), (300, 14336), (8, 7168)])
def test_gpu_matches_reference_bitwise(compiled_gpu, t, k, dtype):
    x = make_x(t, k, dtype, device="cuda", seed=t)
    assert_bitwise(torch.ops.kiln.quantize_fp8_rows(x), quantize_fp8_per_token(x))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(compiled_gpu):
    sx = make_x(32, 4096, torch.bfloat16, device="cuda")
    torch.ops.kiln.quantize_fp8_rows(sx)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, s = torch.ops.kiln.quantize_fp8_rows(sx)
    for seed in (5, 6):
        x = make_x(32, 4096, torch.bfloat16, device="cuda", seed=seed)
        sx.copy_(x)
        g.replay()
        assert_bitwise((q, s), quantize_fp8_per_token(x))
