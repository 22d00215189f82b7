"""SiLU-and-mul ops (ops/activation/silu_and_mul.py): the Triton kernel against the torch reference (interpreter
on CPU, compiled on the GPU), the reference against Hugging Face's MLP activation, quantization
modes, edge cases and torch.export."""

import pytest
import torch

from kiln.ops.activation import silu_and_mul as act
from kiln.ops.common.launch import interpreting
from kiln.ops.common.quant import FP8_DTYPE, FP8_MIN_SCALE, dequantize_fp8

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
FP8_TOL = 1e-2  # dequantized FP8 outputs: a rounding flip moves one element by one e4m3 ulp
MODES = {"none": act.QUANT_NONE, "static": act.QUANT_STATIC, "dynamic": act.QUANT_DYNAMIC}


def assert_rel(out, ref, tol, what="output"):
    """||out - ref|| / ||ref|| < tol; NaN (unwritten, poisoned elements) never passes."""
    out, ref = out.float(), ref.float()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < tol, f"{what}: relative error {err:.3e} (limit {tol:.0e})"


def make_x(t, i, dtype, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    return (3 * torch.randn(t, 2 * i, generator=g, device=device)).to(dtype)


def check_case(t, i, dtype, mode, device="cpu", max_block=act.MAX_BLOCK, seed=0):
    quant = MODES[mode]
    x = make_x(t, i, dtype, device, seed)
    scale = torch.tensor([0.01], device=device) if mode == "static" else None
    y = torch.full((t, i), float("nan"), dtype=FP8_DTYPE if quant else dtype, device=device)
    s = None
    if quant:
        s = torch.full((t, 1) if quant == act.QUANT_DYNAMIC else (1,), float("nan"), device=device)
    act.silu_and_mul_launch(x, scale, quant, y, s, max_block=max_block)
    if quant == act.QUANT_NONE:
        assert_rel(y, act.silu_and_mul_ref(x), TOL[dtype])
        return
    ref_y, ref_s = act.silu_and_mul_quant_ref(x, scale)
    assert s.shape == ref_s.shape
    assert_rel(s, ref_s, TOL[dtype], "scale")
    assert_rel(dequantize_fp8(y, s), dequantize_fp8(ref_y, ref_s), FP8_TOL, "dequantized fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_hf_mlp_activation_bitwise(dtype):
    from transformers.activations import ACT2FN

    x = make_x(4, 96, dtype)
    assert torch.equal(act.silu_and_mul_ref(x), ACT2FN["silu"](x[:, :96]) * x[:, 96:])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("t,i", [(1, 1792), (5, 100), (20, 300)])
def test_kernel_matches_reference(kernel_on_cpu, t, i, dtype, mode):
    check_case(t, i, dtype, mode)


def test_chunked_dynamic_rows_match_reference(kernel_on_cpu):
    # max_block=64 walks a 300-wide row in 5 chunks (the last partial), as I > MAX_BLOCK does on a GPU.
    check_case(3, 300, torch.bfloat16, "dynamic", max_block=64)


def test_launch_grid_covers_every_column():
    for t, i in [(1, 14336), (64, 14336), (3, 100)]:
        grid, block, chunks, _ = act.launch_config(t, i, act.QUANT_NONE)
        assert grid[0] == t and grid[1] * block >= i and chunks == 1
        grid, block, chunks, _ = act.launch_config(t, i, act.QUANT_DYNAMIC)
        assert grid == (t,) and block * chunks >= i


@pytest.mark.parametrize("triton_on_cpu", ["1", "0"], ids=["kernel", "reference"])
def test_ops_and_edge_cases(monkeypatch, triton_on_cpu):
    if triton_on_cpu == "1" and not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", triton_on_cpu)
    x = make_x(4, 64, torch.bfloat16, seed=1)
    x[2] = 0  # all-zero row: dynamic scale falls back to FP8_MIN_SCALE, values stay 0
    assert_rel(torch.ops.kiln.silu_and_mul(x), act.silu_and_mul_ref(x), TOL[torch.bfloat16])
    q, s = torch.ops.kiln.silu_and_mul_quant(x, None)
    assert q.shape == (4, 64) and q.dtype == FP8_DTYPE and s.shape == (4, 1)
    assert s[2, 0].item() == pytest.approx(FP8_MIN_SCALE) and torch.all(q[2].float() == 0)
    scale = torch.tensor([0.05])
    q, s = torch.ops.kiln.silu_and_mul_quant(x, scale)
    assert torch.equal(s, scale) and s.data_ptr() != scale.data_ptr()
    empty = x[:0]
    assert torch.ops.kiln.silu_and_mul(empty).shape == (0, 64)
    q, s = torch.ops.kiln.silu_and_mul_quant(empty, None)
    assert q.shape == (0, 64) and s.shape == (0, 1)
    assert torch.equal(torch.ops.kiln.silu_and_mul_quant(empty, scale)[1], scale)


def test_row_strided_input(kernel_on_cpu):
    x = make_x(3, 40, torch.bfloat16, seed=8)
    wide = torch.cat([x, torch.full_like(x, float("nan"))], dim=1)  # x as a view with row stride 160
    assert_rel(torch.ops.kiln.silu_and_mul(wide[:, :80]), act.silu_and_mul_ref(x), TOL[torch.bfloat16])


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match=r"x must be \[T, 2I\]"):
        torch.ops.kiln.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="scale must be"):
        torch.ops.kiln.silu_and_mul_quant(torch.randn(2, 8), torch.ones(1, dtype=torch.float64))


class _Mlp(torch.nn.Module):
    def forward(self, gu):
        q, s = torch.ops.kiln.silu_and_mul_quant(gu, None)
        return torch.ops.kiln.silu_and_mul(gu), q, s


def test_export_runs_the_ops(kernel_on_cpu):
    t = torch.export.Dim("T", min=1, max=64)
    ep = torch.export.export(_Mlp(), (make_x(3, 48, torch.float32),), dynamic_shapes=({0: t},), strict=False)
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert {torch.ops.kiln.silu_and_mul.default, torch.ops.kiln.silu_and_mul_quant.default} <= targets
    x = make_x(7, 48, torch.float32, seed=4)
    y, q, s = ep.module()(x)
    assert_rel(y, act.silu_and_mul_ref(x), TOL[torch.float32])
    ref_q, ref_s = act.silu_and_mul_quant_ref(x, None)
    assert_rel(dequantize_fp8(q, s), dequantize_fp8(ref_q, ref_s), FP8_TOL)


# ---- GPU: compiled kernels at model sizes -------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("i", [14336, 18944, 1536, 100])
@pytest.mark.parametrize("t", [1, 16, 300])
def test_gpu_matches_reference(compiled_gpu, t, i, dtype, mode):
    check_case(t, i, dtype, mode, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_large_batch_and_chunked_rows(compiled_gpu, mode):
    check_case(4096, 14336, torch.bfloat16, mode, device="cuda")
    check_case(32, 29568, torch.bfloat16, mode, device="cuda")  # > MAX_BLOCK: chunked when dynamic


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(compiled_gpu):
    sx = make_x(32, 14336, torch.bfloat16, device="cuda")
    torch.ops.kiln.silu_and_mul_quant(sx, None)  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, s = torch.ops.kiln.silu_and_mul_quant(sx, None)
    for seed in (5, 6):
        x = make_x(32, 14336, torch.bfloat16, device="cuda", seed=seed)
        sx.copy_(x)
        g.replay()
        ref_q, ref_s = act.silu_and_mul_quant_ref(x, None)
        assert_rel(dequantize_fp8(q, s), dequantize_fp8(ref_q, ref_s), FP8_TOL)
