"""RMSNorm ops (ops/norm/rmsnorm.py): the Triton kernel against the torch reference (interpreter on CPU,
compiled on the GPU), the reference against Hugging Face, in-place residual, quantization modes,
edge cases, and torch.export."""

import io

import pytest
import torch

from kiln.ops.common.launch import interpreting
from kiln.ops.common.quant import FP8_DTYPE, FP8_MIN_SCALE, dequantize_fp8, quantize_fp8
from kiln.ops.norm import rmsnorm as norm

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
FP8_TOL = 1e-2  # dequantized FP8 outputs: a rounding flip moves one element by one e4m3 ulp
EPS = 1e-6
MODES = {"none": norm.QUANT_NONE, "static": norm.QUANT_STATIC, "dynamic": norm.QUANT_DYNAMIC}


def assert_rel(out, ref, tol, what="output"):
    """||out - ref|| / ||ref|| < tol; NaN (unwritten, poisoned elements) never passes."""
    out, ref = out.float(), ref.float()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < tol, f"{what}: relative error {err:.3e} (limit {tol:.0e})"


def make_inputs(t, h, dtype, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(t, h, generator=g, device=device).to(dtype)
    r = (2 * torch.randn(t, h, generator=g, device=device)).to(dtype)
    w = (1 + 0.2 * torch.randn(h, generator=g, device=device)).to(dtype)
    return x, r, w


def run_kernel(x, residual, w, scale, quant, max_block=norm.MAX_BLOCK, **launch):
    """The launcher into NaN-poisoned outputs, so unwritten elements show. ``launch``:
    ``launch_config``'s overrides (rows_per_program, num_warps, persistent, programs_per_sm, ...)."""
    t, h = x.shape
    y = torch.full((t, h), float("nan"), dtype=FP8_DTYPE if quant else x.dtype, device=x.device)
    s = None
    if quant:
        s = torch.full((t, 1) if quant == norm.QUANT_DYNAMIC else (1,), float("nan"), device=x.device)
    norm.rmsnorm_launch(x, residual, w, EPS, scale, quant, y, s, max_block=max_block, **launch)
    return y, s


def check_case(t, h, dtype, mode, with_residual, device="cpu", max_block=norm.MAX_BLOCK, seed=0, **launch):
    """The kernel against the torch reference; returns its outputs ``(y, s, residual)``."""
    quant = MODES[mode]
    x, r, w = make_inputs(t, h, dtype, device, seed)
    scale = torch.tensor([0.02], device=device) if mode == "static" else None
    r_kernel, r_ref = (r.clone(), r.clone()) if with_residual else (None, None)
    y, s = run_kernel(x, r_kernel, w, scale, quant, max_block, **launch)
    if with_residual:
        ref = norm.fused_add_rmsnorm_ref(x, r_ref, w, EPS)
        assert_rel(r_kernel, r_ref, TOL[dtype], "residual")
    else:
        ref = norm.rmsnorm_ref(x, w, EPS)
    if quant == norm.QUANT_NONE:
        assert y.dtype == dtype
        assert_rel(y, ref, TOL[dtype])
    else:
        ref_y, ref_s = quantize_fp8(ref, scale)
        assert y.dtype == FP8_DTYPE and s.shape == ref_s.shape
        assert_rel(s, ref_s, TOL[dtype], "scale")
        assert_rel(dequantize_fp8(y, s), dequantize_fp8(ref_y, ref_s), FP8_TOL, "dequantized fp8")
    return y, s, r_kernel


# ---- CPU: reference vs Hugging Face, kernel (interpreter) vs reference ---------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_hf_llama_rmsnorm_bitwise(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, r, w = make_inputs(4, 96, dtype)
    hf = LlamaRMSNorm(96, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
        assert torch.equal(norm.rmsnorm_ref(x, w, EPS), hf(x))
        r_ref = r.clone()
        assert torch.equal(norm.fused_add_rmsnorm_ref(x, r_ref, w, EPS), hf(r + x))
    assert torch.equal(r_ref, r + x)


@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("t,h", [(1, 4096), (4, 100), (2, 7168)])
def test_kernel_matches_reference(kernel_on_cpu, t, h, dtype, mode, with_residual):
    check_case(t, h, dtype, mode, with_residual)


@pytest.mark.parametrize("mode", ["none", "dynamic"])
def test_chunked_rows_match_reference(kernel_on_cpu, mode):
    # max_block=64 walks a 300-wide row in 5 chunks (the last one partial): the path rows wider
    # than MAX_BLOCK take on the GPU.
    assert norm.launch_config(300, 64)[:2] == (64, 5)
    check_case(3, 300, torch.bfloat16, mode, with_residual=True, max_block=64)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("rows,warps", [(2, 2), (4, 1), (8, 4)])
@pytest.mark.parametrize("t,h,max_block", [(5, 96, norm.MAX_BLOCK), (7, 300, 64), (1, 128, norm.MAX_BLOCK)])
def test_rows_per_program_match_reference(kernel_on_cpu, t, h, max_block, rows, warps, mode):
    # several rows per program, the last program partly past T (5 and 7 rows), single-block and
    # chunked rows, H equal to the block (no column mask) and not
    check_case(t, h, torch.bfloat16, mode, True, max_block=max_block, rows_per_program=rows, num_warps=warps)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    "launch",
    [dict(rows_per_program=8), dict(persistent=True, programs_per_sm=1, rows_per_program=2, prefetch=True)],
    ids=["rows8", "persistent-rows2-prefetch"],
)
def test_partial_last_program_writes_nothing_past_the_last_row(kernel_on_cpu, launch, mode):
    # the outputs are views of longer, poisoned buffers: rows past T must stay untouched
    quant = MODES[mode]
    t, h = 3, 64
    x, r, w = make_inputs(t + 5, h, torch.bfloat16, seed=4)
    r_buf, y_buf = r.clone(), torch.full((t + 5, h), float("nan"), dtype=FP8_DTYPE if quant else x.dtype)
    s_buf = torch.full((t + 5, 1), float("nan"))
    scale = torch.tensor([0.02]) if mode == "static" else None
    s = s_buf[:t] if quant == norm.QUANT_DYNAMIC else (torch.empty(1) if quant else None)
    norm.rmsnorm_launch(x[:t], r_buf[:t], w, EPS, scale, quant, y_buf[:t], s, **launch)
    assert torch.equal(r_buf[t:], r[t:])
    assert y_buf[t:].float().isnan().all() and s_buf[t:].isnan().all()
    assert not y_buf[:t].float().isnan().any()
    r_ref = r[:t].clone()
    ref = norm.fused_add_rmsnorm_ref(x[:t], r_ref, w, EPS)
    assert torch.equal(r_buf[:t], r_ref)
    if quant:
        ref_y, ref_s = quantize_fp8(ref, scale)
        s_out = s_buf[:t] if quant == norm.QUANT_DYNAMIC else s
        assert_rel(dequantize_fp8(y_buf[:t], s_out), dequantize_fp8(ref_y, ref_s), FP8_TOL)


def test_launch_config_defaults_and_overrides():
    # (block, chunks, warps, rows per program); ~16 elements per thread, one row per program
    assert norm.launch_config(4096) == (4096, 1, 8, 1, False, 0, 1, False)
    for quant in MODES.values():
        assert norm.launch_config(4096, quant=quant)[:4] == (4096, 1, 8, 1)  # the quant variants alike
        assert not norm.launch_config(4096, quant=quant).persistent  # until a GPU sweep says otherwise
    assert norm.launch_config(4096, rows_per_program=4, num_warps=16)[:4] == (4096, 1, 16, 4)
    assert norm.launch_config(20000)[:4] == (4096, 5, 8, 1)  # chunked
    with pytest.raises(ValueError, match="power of two"):
        norm.launch_config(4096, rows_per_program=3)


def test_launch_config_persistent():
    cfg = norm.launch_config(4096, persistent=True, programs_per_sm=2, stages=3, num_warps=4)
    assert cfg == (4096, 1, 4, 1, True, 2, 3, False)
    assert norm.launch_config(4096, persistent=True)[4:] == (True, 4, 3, False)  # unmeasured placeholders
    cfg = norm.launch_config(4096, persistent=True, prefetch=True)  # prefetch: stages default to 1
    assert cfg.persistent and cfg.prefetch and cfg.stages == 1
    # chunked rows loop plainly; a launch that is not persistent drops the persistent fields
    assert norm.launch_config(20000, persistent=True, stages=3, prefetch=False)[4:] == (True, 4, 1, False)
    assert norm.launch_config(4096, stages=3, prefetch=True, programs_per_sm=8)[4:] == (False, 0, 1, False)
    with pytest.raises(ValueError, match="exclude each other"):
        norm.launch_config(4096, persistent=True, stages=2, prefetch=True)
    with pytest.raises(ValueError, match=">= 1"):
        norm.launch_config(4096, persistent=True, programs_per_sm=0)
    with pytest.raises(ValueError, match=r"stages 1\.\.3"):
        norm.launch_config(4096, persistent=True, stages=4)  # failed its bitwise check on the H200
    # grid: min(blocks, programs_per_sm * SMs); INTERPRETER_SMS off the GPU
    cpu = torch.device("cpu")
    cfg = norm.launch_config(4096, persistent=True, programs_per_sm=2, rows_per_program=2)
    assert norm.launch_grid(5, cfg, cpu) == 3 and norm.launch_grid(100, cfg, cpu) == 2 * norm.INTERPRETER_SMS
    assert norm.launch_grid(100, norm.launch_config(4096, rows_per_program=2), cpu) == 50
    assert len({launch.label for launch in norm.PERSISTENT_SWEEP}) == len(norm.PERSISTENT_SWEEP)


def _bits(t):
    """``t``'s bits as integers, so NaN-poisoned (unwritten) elements compare too."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def check_persistent_bitwise(
    t, h, mode, with_residual, launch, device="cpu", max_block=norm.MAX_BLOCK, seed=0, exact=True
):
    """The persistent launch ``launch`` against the torch reference (check_case) and, bit for bit
    (output, scales, residual), against one row per program, each into NaN-poisoned outputs.
    ``exact`` False: the FP8 output only within one e4m3 step of one row per program's."""
    got = check_case(t, h, torch.bfloat16, mode, with_residual, device, max_block, seed, **launch)
    x, r, w = make_inputs(t, h, torch.bfloat16, device, seed)
    scale = torch.tensor([0.02], device=device) if mode == "static" else None
    res = r.clone() if with_residual else None
    want = (*run_kernel(x, res, w, scale, MODES[mode], max_block), res)
    for a, b, what in zip(got, want, ("output", "scale", "residual")):
        if b is None:
            continue
        if exact or what != "output":
            assert torch.equal(_bits(a), _bits(b)), f"{what} differs from one row per program"
        else:  # neighbouring e4m3 codes of one sign differ by 1 in their bits
            step = (_bits(a).int() - _bits(b).int()).abs()
            assert step.max() <= 1 and step.float().mean() < 1e-3, f"{what}: up to {step.max()} codes apart"


def _persistent(pps, stages=1, prefetch=False, rows=1, warps=None):
    return dict(
        persistent=True,
        programs_per_sm=pps,
        stages=stages,
        prefetch=prefetch,
        rows_per_program=rows,
        num_warps=warps,
    )


# (T, H, max_block, launch); grid = min(blocks, programs_per_sm * INTERPRETER_SMS (3))
PERSISTENT_CASES = {
    "T1": (1, 128, norm.MAX_BLOCK, _persistent(1)),  # one program, one row, unmasked
    "T<grid-masked": (4, 96, norm.MAX_BLOCK, _persistent(2, stages=2)),  # grid 4 < 6, one row each
    "grid3-stages3": (4, 128, norm.MAX_BLOCK, _persistent(1, stages=3)),  # grid 3: 2, 1, 1 rows
    "grid3-prefetch-masked": (4, 96, norm.MAX_BLOCK, _persistent(1, prefetch=True)),
    "grid6-prefetch": (7, 128, norm.MAX_BLOCK, _persistent(2, prefetch=True)),  # 2, 1, 1, 1, 1, 1 rows
    "rows2-partial-masked": (7, 96, norm.MAX_BLOCK, _persistent(1, stages=2, rows=2)),  # 4 blocks, grid 3
    "rows4-prefetch-partial": (6, 128, norm.MAX_BLOCK, _persistent(1, prefetch=True, rows=4)),  # 2 blocks
    "chunked": (4, 100, 64, _persistent(1, stages=2)),  # 2 chunks (the second partial), grid 3
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(PERSISTENT_CASES))
def test_persistent_matches_one_row_per_program(kernel_on_cpu, case, mode):
    t, h, max_block, launch = PERSISTENT_CASES[case]
    check_persistent_bitwise(t, h, mode, True, launch, max_block=max_block)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", ["grid3-prefetch-masked"])
def test_persistent_without_residual(kernel_on_cpu, case, mode):
    t, h, max_block, launch = PERSISTENT_CASES[case]
    check_persistent_bitwise(t, h, mode, False, launch, max_block=max_block)


@pytest.mark.parametrize("triton_on_cpu", [True, False], ids=["kernel", "reference"])
def test_ops_update_residual_in_place(monkeypatch, triton_on_cpu):
    if triton_on_cpu and not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1" if triton_on_cpu else "0")
    x, r, w = make_inputs(3, 256, torch.bfloat16, seed=1)
    expected = (r.float() + x.float()).to(torch.bfloat16)
    r1, r2 = r.clone(), r.clone()
    ptr = r1.data_ptr()
    y = torch.ops.kiln.fused_add_rmsnorm(x, r1, w, EPS)
    assert r1.data_ptr() == ptr and torch.equal(r1, expected)
    assert_rel(y, norm.rmsnorm_ref(expected, w, EPS), TOL[torch.bfloat16])
    q, s = torch.ops.kiln.fused_add_rmsnorm_quant(x, r2, w, EPS, None)
    assert torch.equal(r2, expected) and q.dtype == FP8_DTYPE and s.shape == (3, 1)


def test_dynamic_quant_all_zero_row(kernel_on_cpu):
    x, _, w = make_inputs(3, 200, torch.bfloat16, seed=2)
    x[1] = 0
    q, s = torch.ops.kiln.rmsnorm_quant(x, w, EPS, None)
    assert s[1, 0].item() == pytest.approx(FP8_MIN_SCALE) and torch.all(q[1].float() == 0)
    ref_q, ref_s = norm.rmsnorm_quant_ref(x, w, EPS, None)
    assert_rel(dequantize_fp8(q, s), dequantize_fp8(ref_q, ref_s), FP8_TOL)


def test_static_scale_is_returned_as_a_copy(kernel_on_cpu):
    x, _, w = make_inputs(2, 64, torch.float32)
    scale = torch.tensor([0.05])
    _, s = torch.ops.kiln.rmsnorm_quant(x, w, EPS, scale)
    assert torch.equal(s, scale) and s.data_ptr() != scale.data_ptr()


@pytest.mark.parametrize("triton_on_cpu", ["1", "0"], ids=["kernel", "reference"])
def test_zero_tokens(monkeypatch, triton_on_cpu):
    monkeypatch.setenv("KILN_TRITON_ON_CPU", triton_on_cpu)
    x, r, w = make_inputs(0, 64, torch.bfloat16)
    scale = torch.tensor([0.5])
    assert torch.ops.kiln.rmsnorm(x, w, EPS).shape == (0, 64)
    assert torch.ops.kiln.fused_add_rmsnorm(x, r, w, EPS).shape == (0, 64)
    q, s = torch.ops.kiln.rmsnorm_quant(x, w, EPS, None)
    assert q.shape == (0, 64) and s.shape == (0, 1)
    q, s = torch.ops.kiln.fused_add_rmsnorm_quant(x, r, w, EPS, scale)
    assert q.shape == (0, 64) and torch.equal(s, scale)


def test_bad_inputs_name_the_argument():
    x, r, w = make_inputs(2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="w must be"):
        torch.ops.kiln.rmsnorm(x, w[:10], EPS)
    with pytest.raises(ValueError, match="residual must match"):
        torch.ops.kiln.fused_add_rmsnorm(x, r.float(), w, EPS)
    with pytest.raises(ValueError, match="scale must be"):
        torch.ops.kiln.rmsnorm_quant(x, w, EPS, torch.ones(2))


class _Block(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(h) * 0.1 + 1)
        self.w2 = torch.nn.Parameter(torch.randn(h) * 0.1 + 1)

    def forward(self, x, residual):
        y = torch.ops.kiln.fused_add_rmsnorm(x, residual, self.w1, EPS)
        q, s = torch.ops.kiln.rmsnorm_quant(y, self.w2, EPS, None)
        return y, q, s


def test_export_keeps_residual_update_in_place(kernel_on_cpu):
    h = 64
    mod = _Block(h)
    x, r, _ = make_inputs(3, h, torch.float32)
    t = torch.export.Dim("T", min=1, max=64)
    ep = torch.export.export(mod, (x, r.clone()), dynamic_shapes=({0: t}, {0: t}), strict=False)
    nodes = list(ep.graph.nodes)
    placeholders = {n.name: n for n in nodes if n.op == "placeholder"}
    (call,) = [n for n in nodes if n.target is torch.ops.kiln.fused_add_rmsnorm.default]
    assert call.args[1] is placeholders["residual"], "the op must mutate the graph input itself"
    copies = [
        n for n in nodes if n.op == "call_function" and ("copy" in str(n.target) or "clone" in str(n.target))
    ]
    assert not copies, f"unexpected copies in the graph: {copies}"

    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    for prog in (ep, loaded):
        x, r, _ = make_inputs(5, h, torch.float32, seed=3)  # another T than traced
        r_run, r_ref = r.clone(), r.clone()
        y, q, s = prog.module()(x, r_run)
        y_ref = norm.fused_add_rmsnorm_ref(x, r_ref, mod.w1.detach(), EPS)
        assert torch.equal(r_run, r_ref), "residual update lost through export"
        assert_rel(y, y_ref, TOL[torch.float32])
        ref_q, ref_s = norm.rmsnorm_quant_ref(y_ref, mod.w2.detach(), EPS, None)
        assert_rel(dequantize_fp8(q, s), dequantize_fp8(ref_q, ref_s), FP8_TOL)


# ---- GPU: compiled kernels at model sizes -------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("h", [4096, 5120, 3584, 2048, 7168, 100])
@pytest.mark.parametrize("t", [1, 300])
def test_gpu_matches_reference(compiled_gpu, t, h, dtype, mode, with_residual):
    check_case(t, h, dtype, mode, with_residual, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_large_batch_and_chunked_rows(compiled_gpu, mode):
    check_case(4096, 4096, torch.bfloat16, mode, True, device="cuda")
    check_case(64, 20000, torch.bfloat16, mode, True, device="cuda")  # > MAX_BLOCK: chunked


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("warps", [4, 8, 16])
def test_gpu_launch_overrides(compiled_gpu, warps, rows, mode):
    # every launch shape bench/test_bench_norm.py's sweep times compiles and is correct
    check_case(333, 4096, torch.bfloat16, mode, True, device="cuda", rows_per_program=rows, num_warps=warps)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("launch", norm.PERSISTENT_SWEEP, ids=lambda launch: launch.label)
def test_gpu_persistent_matches_one_row_per_program(compiled_gpu, launch, mode):
    # every persistent launch the sweep times, compiled (pipelined loads included), bit for bit:
    # T just past a multiple of the grid, T below the grid, T = 1; one kernel for all of them
    for t in (4096 + 5, 100, 1):
        check_persistent_bitwise(t, 4096, mode, True, launch.overrides(), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    "launch",
    [
        _persistent(2, stages=3, warps=8),
        _persistent(2, stages=3, rows=2, warps=8),
        _persistent(2, prefetch=True),
    ],
    ids=["s3", "s3-rows2", "prefetch"],
)
def test_gpu_persistent_masked_and_chunked_rows(compiled_gpu, launch, mode):
    # Compiled, the persistent loop's dynamic FP8 output differed from one row per program's on the
    # H200 with and without the software pipeliner (3 stages, and 1:
    # bench/results/2026-11-29_h200_gpu_tests_s5.log), so that output is held to one e4m3 code (the
    # scales and the residual still to the bits).
    exact = mode != "dynamic"
    for with_residual in (True, False):
        check_persistent_bitwise(1000, 5120, mode, with_residual, launch, device="cuda", exact=exact)
    check_persistent_bitwise(300, 20000, mode, True, launch, device="cuda", exact=exact)  # chunked


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(compiled_gpu):
    x, r, w = make_inputs(64, 4096, torch.bfloat16, device="cuda")
    sx, sr = x.clone(), r.clone()
    torch.ops.kiln.fused_add_rmsnorm_quant(sx, sr.clone(), w, EPS, None)  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, s = torch.ops.kiln.fused_add_rmsnorm_quant(sx, sr, w, EPS, None)
    for seed in (5, 6):
        x, r, _ = make_inputs(64, 4096, torch.bfloat16, device="cuda", seed=seed)
        sx.copy_(x)
        sr.copy_(r)
        g.replay()
        ref_q, ref_s = norm.fused_add_rmsnorm_quant_ref(x, r, w, EPS, None)  # r becomes r + x
        assert_rel(sr, r, TOL[torch.bfloat16], "residual")
        assert_rel(dequantize_fp8(q, s), dequantize_fp8(ref_q, ref_s), FP8_TOL)


def test_row_strided_input(kernel_on_cpu):
    x, r, w = make_inputs(3, 96, torch.bfloat16, seed=8)
    wide = torch.cat([x, torch.full_like(x, float("nan"))], dim=1)  # x as a view with row stride 192
    r_ref = r.clone()
    y = torch.ops.kiln.fused_add_rmsnorm(wide[:, :96], r, w, EPS)
    assert_rel(y, norm.fused_add_rmsnorm_ref(x, r_ref, w, EPS), TOL[torch.bfloat16])
    assert torch.equal(r, r_ref)
