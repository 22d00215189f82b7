"""RMSNorm fused into the GEMV (ops/linear/norm_linear.py, ``gemv(norm=...)``): the kernel through the
interpreter against float32 references (with and without residual, bias, gate_up, the normalized
row out, ragged N and K), the op's unfused paths against the two-launch computation, its checks,
and torch.export."""

import pytest
import torch

from kiln.ops.common.launch import interpreting
from kiln.ops.linear import gemv as G
from kiln.ops.linear import norm_linear as NL
from kiln.ops.norm.rmsnorm import rmsnorm_ref

EPS = 1e-6


def make(n, k, dtype, residual=True, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(dtype)
    r = torch.randn(1, k, generator=g).to(dtype) if residual else None
    nw = (1.0 + 0.3 * torch.randn(k, generator=g)).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, r, nw, w, b


def fused_ref(x, r, nw, w, b, gate_up=False):
    """What the kernel computes: ``h`` rounded, then ``W @ (nw * h) * rstd`` in float32 (the
    normalized row is not rounded before the product), rounded once (then SiLU-and-mul)."""
    h = x if r is None else (x.float() + r.float()).to(x.dtype)
    hf = h.float()
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)
    y = (hf * nw.float()) @ w.float().t() * rstd
    if b is not None:
        y = y + b.float()
    if not gate_up:
        return y.to(x.dtype)
    gate, up = y.chunk(2, dim=-1)
    gate, up = gate.to(x.dtype).float(), up.to(x.dtype).float()
    return ((gate * torch.sigmoid(gate)).to(x.dtype).float() * up).to(x.dtype)


def close(out, ref, ulps=1):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=ulps * 2**-7, atol=ulps * 1e-3)


LAUNCHES = {"default": {}, "ragged": dict(block_n=4, block_k=64), "wide": dict(block_n=16, block_k=32)}


@pytest.mark.parametrize("launch", list(LAUNCHES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("residual", [True, False], ids=["res", "nores"])
def test_kernel_matches_reference(kernel_on_cpu, launch, dtype, residual):
    x, r, nw, w, _ = make(40, 200, dtype, residual)  # N, K: not multiples of the blocks
    k = x.shape[1]
    h = torch.full((1, k), float("nan"), dtype=dtype) if residual else None
    xn = torch.full((1, k), float("nan"), dtype=dtype)
    y = G.gemv(x, w, norm=G.NormIn(nw, EPS, r, h, xn), **LAUNCHES[launch])
    close(y, fused_ref(x, r, nw, w, None))
    hr = x if r is None else (x.float() + r.float()).to(dtype)
    if residual:
        assert torch.equal(h, hr)  # every chunk written, with the residual add's rounding
    # the normalized row with ops/norm/rmsnorm.py's roundings; rstd summed in another order: one ulp at most
    close(xn, rmsnorm_ref(hr, nw, EPS))


@pytest.mark.parametrize("gate_up", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_folded_weight_skips_the_norm_weight(kernel_on_cpu, dtype, gate_up):
    """``folded``: the norm weight is ones (its values are in ``w``'s columns); the one-token GEMV
    never reads it and gives what the unit-weight norm then the linear give, up to rounding; the
    normalized row it writes is the unit-weight norm's."""
    x, _, nw, w, b = make(40, 200, dtype, residual=False, bias=True)
    ones = torch.ones_like(nw)
    wf = (w.float() * nw.float()).to(dtype)  # what weights/fold.py does at load time
    y, _, xn = torch.ops.kiln.rmsnorm_linear(x, None, ones, EPS, wf, b, 1, gate_up, True, True)
    ref = fused_ref(x, None, ones, wf, b, gate_up)
    close(y, ref, ulps=4 if gate_up else 1)
    close(xn, rmsnorm_ref(x, ones, EPS))
    poisoned = torch.full_like(nw, float("nan"))  # a folded call must not load the weight
    y2, _, _ = torch.ops.kiln.rmsnorm_linear(x, None, poisoned, EPS, wf, b, 1, gate_up, False, True)
    assert torch.equal(y2, y)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_kernel_gate_up_and_bias(kernel_on_cpu, bias):
    x, r, nw, w, b = make(2 * 24, 136, torch.bfloat16, True, bias)
    y = G.gemv(x, w, b, gate_up=True, norm=G.NormIn(nw, EPS, r), block_n=4, block_k=32)
    close(y, fused_ref(x, r, nw, w, b, gate_up=True), ulps=4)  # silu's slope, as test_gemv's gate_up


def test_norm_launch_never_splits_k(kernel_on_cpu, monkeypatch):
    """A table entry (``TUNED``) asking for split-K or the tensor-core path still launches one
    CUDA-core program per row block over all of K: rstd needs the whole row."""
    x, r, nw, w, _ = make(40, 200, torch.bfloat16)
    monkeypatch.setitem(G.TUNED, (1, 40, 200, False, 2), G.GemvConfig(8, 64, 4, 1, 4, True))
    close(G.gemv(x, w, norm=G.NormIn(nw, EPS, r)), fused_ref(x, r, nw, w, None))
    monkeypatch.setitem(G.TUNED, (1, 40, 200, False, 2), G.GemvConfig(4, 32, 4, 1, 3, False))
    close(G.gemv(x, w, norm=G.NormIn(nw, EPS, r)), fused_ref(x, r, nw, w, None))


@pytest.mark.parametrize("normed", [True, False])
@pytest.mark.parametrize("residual", [True, False], ids=["res", "nores"])
def test_op_fused_path(kernel_on_cpu, normed, residual):
    x, r, nw, w, b = make(48, 256, torch.bfloat16, residual, bias=True)
    y, h, xn = torch.ops.kiln.rmsnorm_linear(x, r, nw, EPS, w, b, 1, False, normed)
    yr, hr, xnr = NL.rmsnorm_linear_ref(x, r, nw, EPS, w, b, 1, False, True)
    close(y, fused_ref(x, r, nw, w, b))
    # against the two-launch path: the normalized row's bf16 rounding (2^-9 relative per element)
    # adds about 2^-9 * |y| spread over K, a few 1e-3 at these magnitudes
    close(y, yr, ulps=4)
    assert h.shape == ((1, 256) if residual else (0, 256))
    if residual:
        assert torch.equal(h, hr)
    assert xn.shape == ((1, 256) if normed else (0, 256))
    if normed:
        close(xn, xnr)
    assert torch.equal(x, make(48, 256, torch.bfloat16, residual, bias=True)[0])  # inputs untouched
    if residual:
        assert torch.equal(r, make(48, 256, torch.bfloat16, residual, bias=True)[1])


@pytest.mark.parametrize("case", ["two_rows", "max_m_0", "gemv_off", "cpu"])
def test_op_unfused_paths_are_the_two_launches(monkeypatch, case):
    """Off the fused kernel the op is the norm then ``kiln::linear`` (here their CPU bodies): the
    same values as the reference, bit for bit, and the residual is not updated in place."""
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "0" if case == "cpu" else "1")
    monkeypatch.setenv("KILN_GEMV", "0" if case == "gemv_off" else "1")
    if case != "cpu" and not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py)")
    t = 2 if case == "two_rows" else 1
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(t, 64, generator=g), torch.randn(t, 64, generator=g)
    nw, w = torch.rand(64, generator=g) + 0.5, torch.randn(32, 64, generator=g) / 8
    r0 = r.clone()
    y, h, xn = torch.ops.kiln.rmsnorm_linear(
        x, r, nw, EPS, w, None, 0 if case == "max_m_0" else 1, True, True
    )
    yr, hr, xnr = NL.rmsnorm_linear_ref(x, r, nw, EPS, w, None, 1, True, True)
    torch.testing.assert_close(y, yr, rtol=1e-6, atol=1e-6)
    assert torch.equal(h, hr) and torch.equal(xn, xnr) and torch.equal(r, r0)


def test_rejects_bad_input():
    x, r, nw, w, _ = make(16, 32, torch.float32)
    op = torch.ops.kiln.rmsnorm_linear
    with pytest.raises(ValueError, match="norm_w"):
        op(x, r, nw[:8], EPS, w, None, 1, False, False)
    with pytest.raises(ValueError, match="residual must match"):
        op(x, r[:, :8], nw, EPS, w, None, 1, False, False)
    with pytest.raises(ValueError, match="gate_up needs 2I"):
        op(x, r, nw, EPS, w[:15], None, 1, True, False)
    with pytest.raises(ValueError, match="need x"):
        op(x, r, nw, EPS, w[:, :8], None, 1, False, False)
    with pytest.raises(ValueError, match="one bf16/fp16/fp32 row"):
        G.gemv(torch.cat([x, x]), w, norm=G.NormIn(nw, EPS))
    with pytest.raises(ValueError, match="without split-K"):
        G.gemv(x, w, norm=G.NormIn(nw, EPS), split_k=2)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_zero_tokens(monkeypatch, device):
    """No tokens: the CPU path (the reference) and, on meta tensors, the shape rule export uses."""
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "0")
    x, r, nw, w = torch.zeros(0, 32), torch.zeros(0, 32), torch.ones(32), torch.zeros(16, 32)
    y, h, xn = torch.ops.kiln.rmsnorm_linear(
        *(t.to(device) for t in (x, r, nw)), EPS, w.to(device), None, 1, True, True
    )
    assert (y.shape, h.shape, xn.shape) == ((0, 8), (0, 32), (0, 32))


def test_export_records_one_node():
    class M(torch.nn.Module):
        def forward(self, x, r, nw, w):
            y, h, _ = torch.ops.kiln.rmsnorm_linear(x, r, nw, EPS, w, None, 1, False, False)
            return y, h

    x, r, nw, w, _ = make(16, 32, torch.float32)
    x, r = x.repeat(2, 1), r.repeat(2, 1)  # an example T of 1 would be specialized
    t = torch.export.Dim("t", min=1, max=64)
    ep = torch.export.export(M(), (x, r, nw, w), dynamic_shapes=({0: t}, {0: t}, None, None))
    calls = [n for n in ep.graph.nodes if n.op == "call_function" and "rmsnorm_linear" in str(n.target)]
    assert len(calls) == 1
    y, h = ep.module()(x[:1], r[:1], nw, w)
    assert y.shape == (1, 16) and h.shape == (1, 32)
    torch.testing.assert_close(y, NL.rmsnorm_linear_ref(x[:1], r[:1], nw, EPS, w, None, 1, False, False)[0])


# ---- GPU: the compiled kernel at model sizes ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,k,gate_up,normed",
    [
        (5120, 2048, False, False),
        (128, 2048, False, True),
        (6144, 4096, False, True),
        (2 * 14336, 4096, True, False),
    ],
    ids=["qwen3-qkv", "qwen3-router", "llama-qkv", "llama-gate_up"],
)
@pytest.mark.parametrize("residual", [True, False], ids=["res", "nores"])
def test_gpu_matches_reference(compiled_gpu, n, k, gate_up, normed, residual):
    x, r, nw, w, _ = (t.cuda() if t is not None else None for t in make(n, k, torch.bfloat16, residual))
    y, h, xn = torch.ops.kiln.rmsnorm_linear(x, r, nw, EPS, w, None, 1, gate_up, normed)
    close(y, fused_ref(x, r, nw, w, None, gate_up), ulps=4 if gate_up else 1)
    _, hr, xnr = NL.rmsnorm_linear_ref(x, r, nw, EPS, w, None, 1, gate_up, True)
    if residual:
        assert torch.equal(h, hr)
    if normed:
        close(xn, xnr)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,k,gate_up,normed",
    [(5120, 2048, False, False), (128, 2048, False, True), (2 * 768, 2048, True, False)],
    ids=["qwen3-qkv", "qwen3-router", "gate_up"],
)
def test_gpu_folded(compiled_gpu, n, k, gate_up, normed):
    """The folded norm (weight in ``w``, never loaded): the unit-weight norm then the linear."""
    x, _, nw, w, _ = (t.cuda() if t is not None else None for t in make(n, k, torch.bfloat16, residual=False))
    wf = (w.float() * nw.float()).to(torch.bfloat16)
    poisoned = torch.full_like(nw, float("nan"))
    y, _, xn = torch.ops.kiln.rmsnorm_linear(x, None, poisoned, EPS, wf, None, 1, gate_up, normed, True)
    ones = torch.ones_like(nw)
    close(y, fused_ref(x, None, ones, wf, None, gate_up), ulps=4 if gate_up else 1)
    if normed:
        close(xn, rmsnorm_ref(x, ones, EPS))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(compiled_gpu, monkeypatch):
    """The op inside a captured graph, with PDL: replays follow new inputs and match plain calls."""
    x, r, nw, w, _ = (t.cuda() if t is not None else None for t in make(5120, 2048, torch.bfloat16))
    args = lambda: (x, r, nw, EPS, w, None, 1, False, True)
    ref = [t.clone() for t in torch.ops.kiln.rmsnorm_linear(*args())]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.ops.kiln.rmsnorm_linear(*args())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.kiln.rmsnorm_linear(*args())
    x.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    new = torch.ops.kiln.rmsnorm_linear(*args())
    for a, b in zip(out, new, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(out[0], ref[0])
