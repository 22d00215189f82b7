"""Triton FP8 GEMM (ops/linear/fp8_gemm.py): the kernel against plain torch (interpreter on CPU, compiled
on the GPU) over shapes that are not multiples of the blocks, M = 1, split-K, per-token and
per-tensor scales, bias and output dtypes; the configuration table; the ``fp8_linear`` backend
switch (ops/linear/fp8_linear.py)."""

import math

import pytest
import torch

from kiln.ops.common.quant import FP8_DTYPE, quantize_fp8_per_channel, quantize_fp8_per_token
from kiln.ops.linear import fp8_gemm as fg
from kiln.ops.linear import fp8_linear as fl

# Interpreter: e4m3 products are exact in float32, so only the summation order differs from torch.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
SMALL = dict(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)


def rel_err(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_case(m, n, k, device="cpu", seed=0, per_tensor=False, bias_dtype=torch.bfloat16):
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device) * torch.logspace(-1, 1, m, device=device)[:, None]
    w = torch.randn(n, k, generator=g, device=device) * torch.logspace(-1, 1, n, device=device)[:, None]
    bias = torch.randn(n, generator=g, device=device).to(bias_dtype) if bias_dtype is not None else None
    return (*quantize_activations(x, per_tensor), *quantize_fp8_per_channel(w), bias)


def quantize_activations(x, per_tensor=False):
    """``(xq, xs)``: ``x [M, K]`` in FP8 per token (``xs [M, 1]``) or per tensor (``xs [1]``)."""
    if per_tensor:
        xs = (x.abs().amax() / 448).reshape(1)
        return (x / xs).to(FP8_DTYPE), xs
    return quantize_fp8_per_token(x)


def check(
    m,
    n,
    k,
    out_dtype=torch.bfloat16,
    device="cpu",
    per_tensor=False,
    bias_dtype=torch.bfloat16,
    tol=None,
    **cfg,
):
    xq, xs, wq, ws, bias = make_case(m, n, k, device, per_tensor=per_tensor, bias_dtype=bias_dtype)
    y = fg.fp8_gemm(xq, xs, wq, ws, bias, out_dtype, **cfg)
    ref = fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32)
    assert y.dtype == out_dtype and y.shape == (m, n)
    assert not y.float().isnan().any()
    tol = TOL[out_dtype] if tol is None else tol
    assert rel_err(y, ref) < tol, f"relative error {rel_err(y, ref):.2e}"
    return y


# ---- CPU: the kernel through the interpreter ----------------------------------------------------------


@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (5, 40, 96), (19, 72, 100), (33, 16, 200)])
def test_kernel_matches_reference(kernel_on_cpu, m, n, k, split_k):
    # M = 1, M and N not multiples of the blocks, K not a multiple of BLOCK_K (masked steps), more
    # K slices than steps for some slices
    check(m, n, k, split_k=split_k, **SMALL)


@pytest.mark.parametrize("flags", ["t", "f", "tf"])
@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (19, 72, 80)])
def test_tma_and_fused_split_k(kernel_on_cpu, monkeypatch, m, n, k, split_k, flags):
    # TMA loads (K = 80: the last BLOCK_K step reads past K, which TMA fills with zeros) and the
    # last-arrival split-K reduction; the counters are left at zero for the next call
    made, reduces = [], []
    real_desc, real_reduce = fg.TensorDescriptor, fg._splitk_reduce_kernel

    class ReduceSpy:
        def __getitem__(self, grid):
            reduces.append(grid)
            return real_reduce[grid]

    monkeypatch.setattr(fg, "TensorDescriptor", lambda *a: made.append(a) or real_desc(*a))
    monkeypatch.setattr(fg, "_splitk_reduce_kernel", ReduceSpy())
    check(m, n, k, split_k=split_k, tma="t" in flags, fused="f" in flags, **SMALL)
    assert not any(buf.any() for buf in fg.COUNTERS.buffers.values())
    # the paths under test ran: descriptors made for both operands, no separate reduce when fused
    assert len(made) == (2 if "t" in flags else 0)
    assert len(reduces) == (1 if split_k > 1 and "f" not in flags else 0)


def test_fused_reduction_gives_the_reduce_kernels_bits(kernel_on_cpu):
    # both sum the slices in order 0..S-1, whichever slice arrives last
    xq, xs, wq, ws, bias = make_case(21, 72, 256, seed=5)
    for split in (2, 3, 4):
        two = fg.fp8_gemm(xq, xs, wq, ws, bias, torch.float32, split_k=split, **SMALL)
        one = fg.fp8_gemm(xq, xs, wq, ws, bias, torch.float32, split_k=split, fused=True, **SMALL)
        assert torch.equal(one, two), f"split {split}"


def test_tma_falls_back_on_unaligned_rows(kernel_on_cpu, monkeypatch):
    # a row stride that is not a multiple of 16 bytes cannot be a TMA descriptor: pointer loads
    xq, xs, wq, ws, bias = make_case(5, 40, 72, seed=6)
    assert not fg.tma_ok(xq, wq)
    made = []
    monkeypatch.setattr(fg, "TensorDescriptor", lambda *a: made.append(a))
    y = fg.fp8_gemm(xq, xs, wq, ws, bias, torch.float32, tma=True, **SMALL)
    assert made == [] and rel_err(y, fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32)) < 1e-5


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("per_tensor", [False, True], ids=["per_token", "per_tensor"])
def test_scales_bias_and_out_dtypes(kernel_on_cpu, out_dtype, bias_dtype, per_tensor):
    check(7, 40, 64, out_dtype, per_tensor=per_tensor, bias_dtype=bias_dtype, **SMALL)
    check(7, 40, 64, out_dtype, per_tensor=per_tensor, bias_dtype=bias_dtype, split_k=2, **SMALL)


@pytest.mark.parametrize("m", [1, 3, 70])
def test_default_configs(kernel_on_cpu, m):
    # the table's own (GPU-sized) blocks: 64/128-wide tiles over a small problem, automatic split-K
    cfg = fg.fp8_gemm_config(m, 96, 512)
    assert cfg.block_k == 128 and cfg.split_k >= 1
    check(m, 96, 512)


def test_split_k_only_reorders_the_sum(kernel_on_cpu):
    xq, xs, wq, ws, bias = make_case(9, 40, 256, seed=3)
    ys = [fg.fp8_gemm(xq, xs, wq, ws, bias, torch.float32, split_k=s, **SMALL) for s in (1, 2, 4, 8)]
    for y in ys[1:]:
        torch.testing.assert_close(y, ys[0], rtol=1e-6, atol=1e-5)


def test_strided_rows_and_column_view_scales(kernel_on_cpu):
    xq, xs, wq, ws, bias = make_case(6, 48, 64, seed=4)
    wide = torch.zeros(6, 96, dtype=torch.uint8).view(FP8_DTYPE)
    wide[:, :64] = xq  # x as a view with row stride 96
    xs_view = torch.cat([xs, torch.full_like(xs, float("nan"))], dim=1)[:, :1]  # [M, 1] stride 2
    y = fg.fp8_gemm(wide[:, :64], xs_view, wq, ws, bias, torch.float32, **SMALL)
    assert rel_err(y, fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32)) < 1e-5


def test_empty_and_zero_k(kernel_on_cpu):
    xq, xs, wq, ws, bias = make_case(0, 32, 32)
    assert fg.fp8_gemm(xq, xs, wq, ws, bias, torch.bfloat16).shape == (0, 32)
    xq, wq = torch.empty(3, 0, dtype=FP8_DTYPE), torch.empty(32, 0, dtype=FP8_DTYPE)
    y = fg.fp8_gemm(xq, torch.ones(3, 1), wq, ws, bias, torch.float32)
    torch.testing.assert_close(y, bias.float().expand(3, 32))
    assert torch.equal(fg.fp8_gemm(xq, torch.ones(3, 1), wq, ws, None, torch.float32), torch.zeros(3, 32))


def test_bad_inputs():
    xq, xs, wq, ws, bias = make_case(4, 32, 64)
    with pytest.raises(ValueError, match="need x"):
        fg.fp8_gemm(xq, xs, wq[:, :32], ws, bias, torch.bfloat16)
    with pytest.raises(ValueError, match=r"must be torch\.float8_e4m3fn"):
        fg.fp8_gemm(xq.float(), xs, wq, ws, bias, torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        fg.fp8_gemm(xq, xs, wq, ws, bias, torch.bfloat16, block_n=48)
    with pytest.raises(ValueError, match="block_k must be >= 32"):
        fg.fp8_gemm(xq, xs, wq, ws, bias, torch.bfloat16, block_k=16)
    with pytest.raises(ValueError, match="TMA tile is at most 256"):
        fg.fp8_gemm(xq, xs, wq, ws, bias, torch.bfloat16, block_n=512, tma=True)


# ---- configuration table ------------------------------------------------------------------------------


def test_config_strings_round_trip():
    cfg = fg.Fp8GemmConfig(64, 128, 128, 8, 4, 5, 2)
    assert str(cfg) == "m64n128k128g8w4s5k2"
    assert fg.Fp8GemmConfig.parse(str(cfg)) == cfg
    flagged = fg.Fp8GemmConfig(128, 128, 128, 8, 8, 4, 2, tma=True, fused=True)
    assert str(flagged) == "m128n128k128g8w8s4k2tf" and fg.Fp8GemmConfig.parse(str(flagged)) == flagged
    assert fg.Fp8GemmConfig.parse("m64n64k128g8w4s4k2f") == fg.Fp8GemmConfig(
        64, 64, 128, 8, 4, 4, 2, fused=True
    )
    with pytest.raises(ValueError, match="bad config string"):
        fg.Fp8GemmConfig.parse("m64n128")


def test_buckets_table_and_overrides(monkeypatch):
    assert [fg.m_bucket(m) for m in (1, 16, 17, 256, 257, 512, 1024, 5000)] == [
        16, 16, 64, 256, 512, 512, 1024, math.inf,
    ]  # fmt: skip
    assert set(fg.BUCKET_DEFAULTS) == set(fg.M_BUCKETS)
    for cfg in fg.BUCKET_DEFAULTS.values():
        cfg.check()
    # a measured entry wins over the bucket default, for that (bucket, N, K) only
    monkeypatch.setitem(fg.TABLE, (256, 4096, 4096), "m128n256k128g8w8s3k1")
    assert str(fg.fp8_gemm_config(200, 4096, 4096)) == "m128n256k128g8w8s3k1"
    assert fg.fp8_gemm_config(200, 4096, 14336).block_n == fg.BUCKET_DEFAULTS[256].block_n
    # keyword overrides and an explicit config
    assert fg.fp8_gemm_config(200, 4096, 4096, split_k=4, num_stages=5).split_k == 4
    explicit = fg.Fp8GemmConfig(64, 64, 128, 8, 4, 3, 1)
    assert fg.fp8_gemm_config(200, 4096, 4096, config=explicit) == explicit
    with pytest.raises(TypeError):
        fg.fp8_gemm_config(200, 4096, 4096, blockm=64)


def test_auto_split_k_fills_the_gpu():
    cfg = fg.Fp8GemmConfig(64, 64, 128, 8, 4, 4, 0)
    assert fg.auto_split_k(1, 4096, 4096, cfg, sms=132) == 2  # 64 tiles -> 128 programs
    assert fg.auto_split_k(1, 1024, 4096, cfg, sms=132) == 8  # 16 tiles, capped at 8 slices
    assert fg.auto_split_k(1, 1024, 512, cfg, sms=132) == 1  # 4 steps of K: nothing to split
    assert fg.auto_split_k(256, 14336, 4096, cfg, sms=132) == 1  # 896 tiles already
    assert fg.fp8_gemm_config(1, 4096, 4096, sms=132).split_k == 2


# ---- fp8_linear backend switch --------------------------------------------------------------------------


def test_backend_switch(kernel_on_cpu, monkeypatch):
    xq, xs, wq, ws, bias = make_case(5, 40, 64, seed=5)  # N = 40: not a multiple of 16
    ref = fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32)
    calls = []
    real = fl.fp8_gemm
    monkeypatch.setattr(fl, "fp8_gemm", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    y = fl.fp8_linear_forward(xq, xs, wq, ws, bias, torch.float32, backend="triton")
    assert len(calls) == 1 and rel_err(y, ref) < 1e-5
    fl.fp8_linear_forward(xq, xs, wq, ws, bias, torch.float32, backend="cublas")  # CPU: the reference
    assert len(calls) == 1
    monkeypatch.setenv("KILN_FP8_GEMM", "triton")  # the op follows the environment, read per call
    y = torch.ops.kiln.fp8_linear(xq, xs, wq, ws, bias, torch.bfloat16)
    assert len(calls) == 2 and rel_err(y, ref) < 1e-2
    monkeypatch.setenv("KILN_FP8_GEMM", "cublas")
    torch.ops.kiln.fp8_linear(xq, xs, wq, ws, bias, torch.bfloat16)
    assert len(calls) == 2
    monkeypatch.setenv("KILN_FP8_GEMM", "cutlass")  # no library, CPU: the reference
    assert rel_err(torch.ops.kiln.fp8_linear(xq, xs, wq, ws, bias, torch.float32), ref) < 1e-5
    assert len(calls) == 2
    monkeypatch.setenv("KILN_FP8_GEMM", "cutlas")
    with pytest.raises(ValueError, match="KILN_FP8_GEMM"):
        torch.ops.kiln.fp8_linear(xq, xs, wq, ws, bias, torch.bfloat16)


def test_fast_accumulation_modes(monkeypatch):
    monkeypatch.delenv("KILN_FP8_FAST_ACCUM", raising=False)  # auto: fast in Triton, precise in cuBLAS
    assert fl.use_fast_accum("triton") and not fl.use_fast_accum("cublas")
    monkeypatch.setenv("KILN_FP8_FAST_ACCUM", "1")
    assert fl.use_fast_accum("triton") and fl.use_fast_accum("cublas")
    monkeypatch.setenv("KILN_FP8_FAST_ACCUM", "0")
    assert not fl.use_fast_accum("triton") and not fl.use_fast_accum("cublas")
    monkeypatch.setenv("KILN_FP8_FAST_ACCUM", "yes")
    with pytest.raises(ValueError, match="KILN_FP8_FAST_ACCUM is 'yes'; it takes auto, 0, 1"):
        fl.use_fast_accum("triton")


def test_default_backend_is_auto(monkeypatch):
    monkeypatch.delenv("KILN_FP8_GEMM", raising=False)
    assert fl.fp8_backend() == "auto"
    assert fl.fp8_backend("triton") == "triton"


def test_auto_backend_runs_triton_where_the_table_has_the_shape(kernel_on_cpu, monkeypatch):
    calls = []
    real = fl.fp8_gemm
    monkeypatch.setattr(fl, "fp8_gemm", lambda *a, **kw: calls.append(a[2].shape) or real(*a, **kw))
    monkeypatch.setattr(fg, "TABLE", {(16, 48, 64): "m16n32k32g2w4s2k1"})
    for m, n, ran in ((5, 48, 1), (5, 32, 1), (20, 48, 1), (9, 48, 2)):  # bucket 16, N = 48 only
        xq, xs, wq, ws, bias = make_case(m, n, 64)
        y = fl.fp8_linear_forward(xq, xs, wq, ws, bias, torch.float32, backend="auto")
        assert len(calls) == ran and rel_err(y, fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32)) < 1e-5
    assert fg.tuned(9, 48, 64) and not fg.tuned(9, 48, 80) and not fg.tuned(17, 48, 64)


def test_table_entries_parse_and_cover_llama_shapes():
    for (bucket, _, _), cfg in fg.TABLE.items():
        assert bucket in fg.M_BUCKETS and str(fg.Fp8GemmConfig.parse(cfg)) == cfg
    assert all(fg.tuned(m, n, k) for m in (129, 256, 300, 512) for n, k in SHAPES)


def test_triton_backend_without_the_interpreter_uses_the_reference(monkeypatch):
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "0")
    xq, xs, wq, ws, bias = make_case(3, 32, 32)
    assert fl.triton_fp8_supported(xq) is not None
    y = fl.fp8_linear_forward(xq, xs, wq, ws, bias, torch.float32, backend="triton")
    assert torch.equal(y, fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32))


# ---- GPU: compiled kernels at Llama-3.1-8B shapes ---------------------------------------------------------


SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("per_tensor", [False, True], ids=["per_token", "per_tensor"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 256, 300, 512, 4096])
def test_gpu_default_configs_match_reference(compiled_gpu, m, n, k, per_tensor):
    xq, xs, wq, ws, bias = make_case(m, n, k, "cuda", per_tensor=per_tensor)
    y = fl.fp8_linear_forward(xq, xs, wq, ws, bias, torch.bfloat16, backend="triton")
    ref = fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32)
    assert y.dtype == torch.bfloat16 and rel_err(y, ref) < 1e-2
    # as accurate as cuBLAS (both accumulate in float32, rounded once to bf16)
    cublas = fl.scaled_mm_rowwise(xq, xs, wq, ws, bias, torch.bfloat16)
    assert rel_err(y, ref) < 1.5 * rel_err(cublas, ref) + 1e-3


# The bucket defaults compile on sm_90 and are right on aligned and unaligned shapes (masked K steps,
# partial tiles), with split-K forced where the default has none. (The sweep's candidates are checked
# against cuBLAS by the sweep itself, bench/test_bench_fp8_linear.py.)
@pytest.mark.gpu
@pytest.mark.parametrize("fast_accum", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize("cfg", sorted({str(c) for c in fg.BUCKET_DEFAULTS.values()}))
def test_gpu_bucket_defaults_compile_and_match(compiled_gpu, cfg, fast_accum):
    config = fg.Fp8GemmConfig.parse(cfg)
    for m, n, k in ((256, 4096, 4096), (37, 200, 272)):
        check(m, n, k, device="cuda", config=config, fast_accum=fast_accum)
        check(m, n, k, device="cuda", config=config, fast_accum=fast_accum, split_k=2)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_out_dtypes(compiled_gpu, out_dtype):
    # FP8 tensor cores add up to BLOCK_K products below float32 precision before the promotion, so
    # a float32 output is good to about 1e-4 (1.3e-4 measured on the H200), not 1e-5
    tol = 5e-4 if out_dtype == torch.float32 else None
    check(300, 1024, 2048, out_dtype, device="cuda", tol=tol)
    check(3, 1024, 2048, out_dtype, device="cuda", split_k=4, tol=tol)


def check_graph_replay(m, n, k, fn):
    """``fn(xq, xs, wq, ws, bias) -> y`` run once (compiles), captured in a CUDA graph, replayed after
    new activations are copied into the captured ones: ``y`` must be the new product."""
    xq, xs, wq, ws, bias = make_case(m, n, k, "cuda")
    fn(xq, xs, wq, ws, bias)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fn(xq, xs, wq, ws, bias)
    new_x, new_s, *_ = make_case(m, n, k, "cuda", seed=7)
    xq.copy_(new_x)
    xs.copy_(new_s)
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(y, fl.fp8_linear_ref(xq, xs, wq, ws, bias, torch.float32)) < 1e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(compiled_gpu, monkeypatch):
    monkeypatch.setenv("KILN_FP8_GEMM", "triton")
    check_graph_replay(64, 4096, 4096, lambda *a: torch.ops.kiln.fp8_linear(*a, torch.bfloat16))


# TMA loads and the fused (last-arrival) split-K reduction, compiled: right on aligned and unaligned
# shapes, bitwise equal to the two-kernel split-K, counters left at zero, and replayable in a graph.
GPU_VARIANTS = [
    "m64n128k128g8w4s4k1t",
    "m128n64k128g8w4s4k2tf",
    "m128n128k128g8w8s4k2tf",
    "m128n128k128g8w8s4k2f",
]


@pytest.mark.gpu
@pytest.mark.parametrize("fast_accum", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize("cfg", GPU_VARIANTS)
def test_gpu_tma_and_fused_variants(compiled_gpu, cfg, fast_accum):
    config = fg.Fp8GemmConfig.parse(cfg)
    for m, n, k in ((256, 4096, 4096), (37, 200, 272), (300, 1024, 2048)):
        y = check(m, n, k, device="cuda", config=config, fast_accum=fast_accum)
        if config.split_k > 1:
            xq, xs, wq, ws, bias = make_case(m, n, k, "cuda")
            two = fg.fp8_gemm(
                xq, xs, wq, ws, bias, torch.bfloat16, fast_accum=fast_accum, config=config, fused=False
            )
            assert torch.equal(y, two), f"{cfg} {m}x{n}x{k}: fused and two-kernel split-K differ"
    torch.cuda.synchronize()
    assert not any(buf.any().item() for buf in fg.COUNTERS.buffers.values())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ["m128n128k128g8w8s4k2tf", "m64n128k128g8w4s4k2tf"])
def test_gpu_fused_split_k_graph_replay(compiled_gpu, cfg):
    config = fg.Fp8GemmConfig.parse(cfg)
    xq, xs, wq, ws, bias = make_case(256, 4096, 4096, "cuda")
    sx, ss = xq.clone(), xs.clone()
    fg.fp8_gemm(sx, ss, wq, ws, bias, torch.bfloat16, config=config)  # compile, counters outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fg.fp8_gemm(sx, ss, wq, ws, bias, torch.bfloat16, config=config)
    for seed in (7, 8):  # twice: the first replay must leave the counters at zero for the second
        xq2, xs2, *_ = make_case(256, 4096, 4096, "cuda", seed=seed)
        sx.copy_(xq2)
        ss.copy_(xs2)
        y.fill_(float("nan"))
        g.replay()
        ref = fl.fp8_linear_ref(xq2, xs2, wq, ws, bias, torch.float32)
        assert not y.isnan().any() and rel_err(y, ref) < 1e-2, f"seed {seed}"


def test_table_entries_are_sweep_candidates():
    # a re-run of the sweep can reproduce (or replace) every entry
    assert set(fg.TABLE.values()) <= set(fg.SWEEP_CONFIGS)


@pytest.mark.parametrize("chunk", [1, 100, 300, 2048])
def test_warmup_tokens_reach_every_bucket(chunk):
    # compiler/build.py runs an FP8 model once per count, so every config a prefill chunk can pick
    # is compiled into the artifact
    tokens = fg.warmup_tokens(chunk)
    assert max(tokens) == chunk and all(1 <= t <= chunk for t in tokens)
    assert {fg.m_bucket(t) for t in tokens} == {fg.m_bucket(m) for m in range(1, chunk + 1)}
    assert fg.warmup_tokens(2048) == [16, 64, 128, 256, 512, 1024, 2048]
