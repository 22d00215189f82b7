"""Skinny GEMM / GEMV (ops/linear/gemv.py): both kernels (CUDA-core FMA, tensor-core swap-AB) against the
float32 reference through the interpreter, with bias, split-K, the fused gate_up epilogue and shapes
that are not multiples of the blocks; the launch heuristic; the ``kiln::linear`` /
``kiln::linear_silu_mul`` dispatch and switches; torch.export; and a tiny compiled model whose decode
steps run the GEMV against Hugging Face."""

import pytest
import torch

from kiln.ops.activation.silu_and_mul import silu_and_mul_ref
from kiln.ops.common.launch import interpreting, next_pow2
from kiln.ops.linear import gemv as G

# Launch overrides per path. Blocks are small so the interpreter stays quick and every program
# sees several K steps, a ragged last step and (split-K) uneven slices.
PATHS = {
    "default": {},
    "fma": dict(use_dot=False, block_n=8, block_k=64, split_k=1),
    "fma_splitk": dict(use_dot=False, block_n=4, block_k=32, split_k=3),
    "dot": dict(use_dot=True, block_n=16, block_k=32, split_k=1, num_stages=2),
    "dot_splitk": dict(use_dot=True, block_n=32, block_k=16, split_k=4),
}


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    if not interpreting():
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (set by tests/conftest.py)")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")
    monkeypatch.setenv("KILN_GEMV", "1")


def make(m, n, k, dtype, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def check(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # one rounding of a float32 sum: at most a flip of the last bit against the reference
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-3)


def check_gate_up(out, ref):
    """silu(gate) * up with gate and up each rounded to bf16 first: a last-bit flip of the gate
    (another summation order) is amplified by silu's slope and adds to the product's rounding, so a
    few ulps. Measured on CPU: a float64-summed reference of the 14336 x 4096 shape breaks the
    one-ulp bound of ``check`` but stays within this one (rtol 2^-6, atol 4e-3)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=2**-6, atol=4e-3)


def skip_unsupported(m, path):
    if PATHS[path].get("use_dot") is False and next_pow2(m) > G.FMA_MAX_M:
        pytest.skip(f"the FMA kernel takes M <= {G.FMA_MAX_M}")


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_gemv_matches_reference(kernel_on_cpu, m, path, bias):
    skip_unsupported(m, path)
    x, w, b = make(m, 40, 200, torch.bfloat16, bias)  # N, K: not multiples of any block
    check(G.gemv(x, w, b, **PATHS[path]), G.gemv_ref(x, w, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("m", [1, 3])
def test_residual_epilogue_is_the_separate_add(kernel_on_cpu, m, path, dtype):
    """``residual``: every path (FMA, tensor cores, the split-K reduce) adds it to the rounded
    output and rounds again, bit for bit the linear followed by an add."""
    skip_unsupported(m, path)
    x, w, b = make(m, 40, 200, dtype, bias=True, seed=m)
    r = torch.randn(m, 56).to(dtype)[:, :40]  # a row stride of its own
    plain = G.gemv(x, w, b, **PATHS[path])
    out = G.gemv(x, w, b, residual=r, **PATHS[path])
    assert torch.equal(out, (plain.float() + r.float()).to(dtype))


def test_linear_op_residual(kernel_on_cpu, count_gemv, monkeypatch):
    """``kiln::linear(..., residual)``: the GEMV's epilogue at decode sizes, ``addmm`` (or linear +
    add with a bias) otherwise; a residual of the wrong shape is refused."""
    x, w, b = make(4, 40, 72, torch.float32, bias=True)
    r = torch.randn(4, 40)
    for t, bias in ((1, b), (4, None), (4, b)):
        out = torch.ops.kiln.linear(x[:t], w, bias, 1, r[:t])
        torch.testing.assert_close(out, r[:t] + G.gemv_ref(x[:t], w, bias), rtol=1e-5, atol=1e-5)
    assert count_gemv == [1]
    with pytest.raises(ValueError, match="residual must be"):
        torch.ops.kiln.linear(x, w, b, 1, r[:2])
    with pytest.raises(ValueError, match="residual must be"):
        G.gemv(x[:1], torch.cat([w, w]), gate_up=True, residual=r[:1])


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("path", ["default", "fma_splitk", "dot", "dot_splitk"])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_gate_up_matches_reference(kernel_on_cpu, m, path, bias):
    skip_unsupported(m, path)
    x, w, b = make(m, 2 * 24, 136, torch.bfloat16, bias)  # I = 24, K = 136
    out = G.gemv(x, w, b, gate_up=True, **PATHS[path])
    check(out, G.gate_up_ref(x, w, b))
    # the unfused chain: linear (rounded) then silu_and_mul with its roundings
    check(out, silu_and_mul_ref(G.gemv_ref(x, w, b)))


@pytest.mark.parametrize("gate_up", [False, True])
@pytest.mark.parametrize("path", ["fma", "dot_splitk"])
@pytest.mark.parametrize("m", [1, 3])
def test_float32(kernel_on_cpu, m, path, gate_up):
    skip_unsupported(m, path)
    x, w, b = make(m, 48, 100, torch.float32, bias=True)
    ref = G.gate_up_ref(x, w, b) if gate_up else G.gemv_ref(x, w, b)
    check(G.gemv(x, w, b, gate_up=gate_up, **PATHS[path]), ref)


def test_even_k_and_strided_x(kernel_on_cpu):
    """K a multiple of every split (no K masks), x a column slice of a wider tensor, an ``out=``."""
    x, w, b = make(2, 64, 256, torch.bfloat16, bias=True)
    wide = torch.cat([x, torch.ones(2, 16, dtype=x.dtype)], dim=1)[:, :256]
    out = torch.full((2, 64), float("nan"), dtype=torch.bfloat16)
    for kw in (dict(use_dot=False, block_n=16, block_k=64, split_k=2), dict(use_dot=True, block_k=64)):
        check(G.gemv(wide, w, b, out=out, **kw), G.gemv_ref(x, w, b))


def test_heuristic_defaults_run(kernel_on_cpu, monkeypatch):
    """The heuristic's own choices (split-K included), on a pretend 8-SM device."""
    monkeypatch.setattr(G, "DEFAULT_SMS", 8)
    for m in (1, 4):
        x, w, _ = make(m, 16, 16384, torch.bfloat16)
        cfg = G.gemv_config(m, 16, 16384, sms=8)
        assert cfg.split_k > 1, cfg  # 16 rows leave the SMs short: the heuristic splits K
        check(G.gemv(x, w), G.gemv_ref(x, w))


LLAMA8B = [
    (6144, 4096, False),
    (4096, 4096, False),
    (14336, 4096, True),
    (4096, 14336, False),
    (128256, 4096, False),
]


@pytest.mark.parametrize("n,k,gate_up", LLAMA8B)
def test_heuristic_is_valid_and_depends_on_m_class_only(n, k, gate_up):
    """Launchable choices, and the same one for every M of a power-of-two class (so the compile
    warm-up of the decode buckets 1, 2, 4, 8 compiles every kernel a T <= 8 launch needs)."""
    for m in range(1, 9):
        cfg = G.heuristic_config(m, n, k, gate_up, 2, 132)
        assert cfg == G.heuristic_config(next_pow2(m), n, k, gate_up, 2, 132)
        assert cfg.use_dot == (next_pow2(m) > 2)
        for v in (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.split_k):
            assert v & (v - 1) == 0, cfg
        assert cfg.block_k >= 8 and (not cfg.use_dot or cfg.block_n >= 16)
        programs = -(-n // cfg.block_n) * cfg.split_k
        assert programs >= 2 * 132, cfg  # the grid covers the GPU at least twice


def test_gemv_rejects_bad_input():
    x, w, _ = make(2, 8, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="share"):
        G.gemv(x, w.float())
    with pytest.raises(ValueError, match="gate_up"):
        G.gemv(x, w[:7], gate_up=True)
    with pytest.raises(ValueError, match="FMA"):
        G.gemv(torch.randn(8, 16).bfloat16(), w, use_dot=False)
    with pytest.raises(ValueError, match="bias"):
        G.gemv(x, w, torch.zeros(3, dtype=x.dtype))


# ---- the ops: dispatch, switches, export ---------------------------------------------------------


@pytest.fixture
def count_gemv(monkeypatch):
    calls = []
    real = G.gemv

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(G, "gemv", spy)
    return calls


def test_linear_dispatch(kernel_on_cpu, count_gemv, monkeypatch):
    x, w, b = make(9, 40, 72, torch.bfloat16, bias=True)
    for t in (1, 3, 8, 9):
        out = torch.ops.kiln.linear(x[:t], w, b, 8)
        check(out, G.gemv_ref(x[:t], w, b))
    assert count_gemv == [1, 3, 8]  # T = 9 > max_m took F.linear
    torch.ops.kiln.linear(x[:3], w, b, 2)  # the call site's max_m: F.linear
    torch.ops.kiln.linear(x[:1], w, b, 0)
    monkeypatch.setenv("KILN_GEMV", "0")  # the run-time kill switch
    torch.ops.kiln.linear(x[:1], w, b, 8)
    gu = torch.ops.kiln.linear_silu_mul(x[:2], w, b, 8)
    check(gu, G.gate_up_ref(x[:2], w, b))
    assert count_gemv == [1, 3, 8]  # nothing more reached the kernel
    monkeypatch.delenv("KILN_GEMV")  # unset at run time: the graph's max_m decides
    torch.ops.kiln.linear(x[:1], w, b, 1)
    assert count_gemv == [1, 3, 8, 1]
    check(torch.ops.kiln.linear_silu_mul(x[:2], w, b, 2), G.gate_up_ref(x[:2], w, b))
    check(torch.ops.kiln.linear_silu_mul(x, w, b, 8), G.gate_up_ref(x, w, b))  # F.linear + silu_and_mul
    assert count_gemv == [1, 3, 8, 1, 2]


@pytest.mark.parametrize(
    "spec, plan",
    [
        ("", {}),
        ("0", {}),
        ("1", {"attn": 8, "mlp": 8, "router": 8, "latent": 8}),
        ("all", {"attn": 8, "mlp": 8, "router": 8, "latent": 8}),
        ("attn:1,latent:16", {"attn": 1, "latent": 16}),
        ("attn", {"attn": 8}),
        ("attn:1", {"attn": 1}),
        ("attn:1, mlp:4", {"attn": 1, "mlp": 4}),
        ("attn:1,mlp:0", {"attn": 1}),
    ],
)
def test_gemv_plan(spec, plan):
    assert G.gemv_plan(spec) == plan


@pytest.mark.parametrize("spec", ["qkv", "attn:x", "attn:-1", "attn;mlp", "attn:1,norm:1"])
def test_gemv_plan_rejects_bad_specs(spec):
    with pytest.raises(ValueError, match="--gemv-plan: bad entry"):
        G.gemv_plan(spec)


def test_ops_without_triton_are_the_torch_ops(monkeypatch):
    """On CPU without the interpreter switch the ops are exactly what Linear/MLP ran before."""
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "0")
    x, w, b = make(3, 40, 72, torch.float32, bias=True)
    lin = torch.nn.functional.linear(x, w, b)
    assert torch.equal(torch.ops.kiln.linear(x, w, b, 8), lin)
    assert torch.equal(torch.ops.kiln.linear_silu_mul(x, w, b, 8), silu_and_mul_ref(lin))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_zero_tokens(monkeypatch, device):
    """No tokens: the CPU path (the references) and, on meta tensors, the shape rule export uses."""
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "0")
    x, w, b = (t.to(device) for t in make(0, 40, 72, torch.bfloat16, bias=True))
    assert torch.ops.kiln.linear(x, w, b, 8).shape == (0, 40)
    assert torch.ops.kiln.linear_silu_mul(x, w, b, 8).shape == (0, 20)


class _Block(torch.nn.Module):
    def __init__(self, w1, b1, w2):
        super().__init__()
        self.register_buffer("w1", w1)
        self.register_buffer("b1", b1)
        self.register_buffer("w2", w2)

    def forward(self, x):
        return torch.ops.kiln.linear(torch.ops.kiln.linear_silu_mul(x, self.w1, self.b1, 8), self.w2, None, 8)


def test_export_dynamic_tokens(kernel_on_cpu, count_gemv):
    """One exported graph (dynamic T) runs the GEMV at T <= 8 and F.linear beyond: the choice is
    made in the op body, not at trace time."""
    g = torch.Generator().manual_seed(3)
    w1 = (torch.randn(48, 32, generator=g) / 6).bfloat16()
    b1 = torch.randn(48, generator=g).bfloat16()
    w2 = (torch.randn(16, 24, generator=g) / 5).bfloat16()
    block = _Block(w1, b1, w2)
    t = torch.export.Dim("T", min=1, max=64)
    ep = torch.export.export(block, (torch.randn(4, 32).bfloat16(),), dynamic_shapes=({0: t},), strict=False)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("kiln.linear.default") == 1 and targets.count("kiln.linear_silu_mul.default") == 1
    count_gemv.clear()
    for tokens in (1, 5, 20):
        x = torch.randn(tokens, 32, generator=g).bfloat16()
        ref = G.gemv_ref(G.gate_up_ref(x, w1, b1), w2)
        check(ep.module()(x), ref)
    assert count_gemv == [1, 1, 5, 5]


def test_compiled_model_decode_runs_gemv_and_matches_hf(tmp_path, monkeypatch):
    """A tiny Llama compiled for the CPU; decode steps (T = 2 <= 8) with every op running its
    Triton kernel through the interpreter, so qkv/o/gate_up/down are the GEMV (gate_up fused).
    One layer (each interpreted GEMV program costs ~0.1 s); two decode steps, so the second reads
    the KV the first decode step wrote."""
    from tiny_models import check_against_hf, make_checkpoint

    from kiln.compiler.build import CompileOptions, compile_model
    from kiln.runtime.direct import DirectRunner

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    # qkv bias: the GEMV's bias path too
    hf = make_checkpoint(tmp_path / "hf", "qwen2-bias", num_hidden_layers=1, layer_types=["full_attention"])
    opts = CompileOptions(
        device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64, chunk_size=32, gemv_plan="attn,mlp"
    )
    compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    ep = torch.export.load(tmp_path / "art" / "graphs" / "model.pt2")
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    layers = hf.config.num_hidden_layers
    assert targets.count("kiln.linear.default") == 3 * layers  # qkv, o, down
    assert targets.count("kiln.linear_silu_mul.default") == layers
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")
    calls = []
    real = G.gemv
    monkeypatch.setattr(G, "gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    runner = DirectRunner(str(tmp_path / "art"), device="cpu", num_slots=128)
    check_against_hf(runner, hf, [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24]], decode_steps=2)
    assert calls and set(calls) == {2}  # decode only: the 14-token prefill took F.linear


# ---- GPU: compiled kernels at model sizes -------------------------------------------------------------


GPU_SHAPES = [*LLAMA8B, (1000, 1000, False), (1000, 1000, True)]  # the last two: K, N not multiples of 16


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gate_up", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gpu_matches_reference(compiled_gpu, m, n, k, gate_up):
    x, w, b = (
        t.cuda() if t is not None else None for t in make(m, 2 * n if gate_up else n, k, torch.bfloat16)
    )
    ref = G.gate_up_ref(x, w, b) if gate_up else G.gemv_ref(x, w, b)
    (check_gate_up if gate_up else check)(G.gemv(x, w, b, gate_up=gate_up), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_up", [False, True])
@pytest.mark.parametrize(
    "m, over",
    [
        (1, dict(use_dot=True)),
        (4, dict(use_dot=False)),
        (1, dict(use_dot=False, block_n=8, block_k=512, split_k=4)),
        (8, dict(use_dot=True, block_n=64, block_k=128, split_k=8, num_stages=4)),
    ],
    ids=["m1-dot", "m4-fma", "m1-fma-split4", "m8-dot64-split8"],
)
def test_gpu_other_paths(compiled_gpu, m, over, gate_up):
    x, w, b = (t.cuda() for t in make(m, 2 * 4096 if gate_up else 4096, 4096, torch.bfloat16, bias=True))
    ref = G.gate_up_ref(x, w, b) if gate_up else G.gemv_ref(x, w, b)
    (check_gate_up if gate_up else check)(G.gemv(x, w, b, gate_up=gate_up, **over), ref)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, over",
    [(1, {}), (2, {}), (1, dict(split_k=4, block_n=8, block_k=512)), (8, dict(use_dot=True))],
    ids=["m1", "m2", "m1-split4", "m8-dot"],
)
def test_gpu_residual_epilogue(compiled_gpu, m, over):
    """Qwen3-30B-A3B's o projection (2048 x 4096) adding the residual: bit for bit the linear, then an add."""
    x, w, _ = (t.cuda() if t is not None else None for t in make(m, 2048, 4096, torch.bfloat16))
    r = torch.randn(m, 2048, device="cuda").to(torch.bfloat16)
    plain = G.gemv(x, w, **over)
    assert torch.equal(G.gemv(x, w, residual=r, **over), (plain.float() + r.float()).to(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(compiled_gpu, monkeypatch):
    """The ops inside a captured graph, split-K workspace included (allocated in the graph's pool)."""
    monkeypatch.delenv("KILN_GEMV", raising=False)
    x0, w, b = (t.cuda() for t in make(2, 4096, 4096, torch.bfloat16, bias=True))
    sx = x0.clone()

    def run():
        split = G.gemv(sx, w, b, gate_up=True, split_k=4)
        return torch.ops.kiln.linear(sx, w, b, 8), torch.ops.kiln.linear_silu_mul(sx, w, b, 8), split

    run()  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y, a, s = run()
    for seed in (5, 6):
        x = make(2, 4096, 4096, torch.bfloat16, seed=seed)[0].cuda()
        sx.copy_(x)
        g.replay()
        check(y, G.gemv_ref(x, w, b))
        check(a, G.gate_up_ref(x, w, b))
        check(s, G.gate_up_ref(x, w, b))


# ---- programmatic dependent launch ------------------------------------------------------------------


def test_pdl_is_off_without_a_gpu(monkeypatch):
    from kiln.ops.common.launch import pdl_args, pdl_enabled

    monkeypatch.delenv("KILN_PDL", raising=False)
    assert not pdl_enabled(torch.zeros(1))
    assert pdl_args(torch.zeros(1)) == {"PDL": False}  # no launch_pdl: the interpreter takes none


@pytest.mark.gpu
def test_gpu_pdl_chain_in_a_graph_matches_plain_launches(compiled_gpu, monkeypatch):
    """A decode-like chain (add+RMSNorm -> GEMV -> GEMV + SiLU -> GEMV, 8 layers) captured in a CUDA
    graph with PDL gives exactly the outputs of the same chain without PDL."""
    g = torch.Generator().manual_seed(11)
    h, i, layers = 4096, 2048, 8
    ws = [
        tuple(
            (torch.randn(n, k, generator=g) / k**0.5).bfloat16().cuda()
            for n, k in ((h, h), (2 * i, h), (h, i))
        )
        for _ in range(layers)
    ]
    nw = (torch.rand(h, generator=g) + 0.5).bfloat16().cuda()
    x0 = torch.randn(1, h, generator=g).bfloat16().cuda()

    def run(mode):
        monkeypatch.setenv("KILN_PDL", mode)
        x, res = x0.clone(), torch.zeros_like(x0)

        def step():
            y = x
            for wo, wgu, wd in ws:
                y = torch.ops.kiln.fused_add_rmsnorm(y, res, nw, 1e-6)
                y = G.gemv(G.gemv(y, wo), wgu, gate_up=True)  # [1, I]
                y = G.gemv(y, wd)
            return y

        step()
        graph = torch.cuda.CUDAGraph()
        res.zero_()
        with torch.cuda.graph(graph):
            out = step()
        res.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return out.clone(), res.clone()

    plain, pdl = run("0"), run("1")
    assert torch.equal(plain[0], pdl[0]) and torch.equal(plain[1], pdl[1])
