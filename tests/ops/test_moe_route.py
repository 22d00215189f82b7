"""The decode router op (ops/moe/router.py): router GEMV (or linear) + top-k kernel against the router
linear + ``moe_topk`` reference (interpreter on CPU, compiled on the GPU), its argument checks, and
its capture under a CUDA graph."""

import pytest
import torch
from test_moe_routing import by_id

from kiln.ops.moe import router as mrt
from kiln.ops.moe import topk as mr

# (T, H, E, k, renormalize, scoring, groups, topk_groups, scale, round_to)
CASES = [
    (1, 64, 128, 8, True, "softmax", 1, 1, 1.0, "bfloat16"),  # Qwen3-30B-A3B's E and top-8
    (3, 48, 8, 2, True, "softmax", 1, 1, 1.0, ""),  # Mixtral's top-2, H not a power of two
    (4, 64, 60, 4, False, "softmax", 1, 1, 1.0, ""),  # E not a multiple of the program's rows
    (2, 32, 64, 6, True, "sigmoid", 8, 4, 2.5, ""),  # DeepSeek-V3 style: groups, bias, scale
]
IDS = ["qwen3", "mixtral", "odd-E", "deepseek"]


def make(case, dtype, device="cpu", seed=0):
    t, h, e = case[:3]
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(t, h, generator=g, device=device).to(dtype)
    w = (torch.randn(e, h, generator=g, device=device) / h**0.5).to(dtype)
    bias = 0.1 * torch.randn(e, generator=g, device=device) if case[5] == "sigmoid" else None
    return x, w, bias


def reference(x, w, bias, case):
    k, renorm, scoring, groups, topk_groups, scale, round_to = case[3:]
    logits = mrt.router_logits_ref(x.float(), w.float(), scoring)  # f32 sums, rounded as the linear
    if scoring == "softmax":
        logits = logits.to(x.dtype)
    return mr.moe_topk_ref(logits, bias, k, renorm, scoring, groups, topk_groups, scale, round_to)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_op_matches_reference(kernel_on_cpu, case, dtype):
    """At ``T <= max_t`` the router GEMV (ops/linear/gemv.py; sigmoid: the float32 linear), then the top-k
    kernel; above it the linear, then the top-k kernel."""
    x, w, bias = make(case, dtype, seed=len(case) + case[2])
    ref_w, ref_ids = reference(x, w, bias, case)
    if dtype == torch.bfloat16:  # rounded logits tie: the kernel takes the lower id, torch.topk either
        ref_w, ref_ids = by_id(ref_w, ref_ids)
    for max_t in (case[0], 0):
        got_w, got_ids = torch.ops.kiln.moe_route(x, w, bias, *case[3:], max_t)
        if dtype == torch.bfloat16:
            got_w, got_ids = by_id(got_w, got_ids)
        assert torch.equal(got_ids.long(), ref_ids.long()), max_t
        torch.testing.assert_close(got_w, ref_w, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


@pytest.mark.parametrize("t", [1, 3])
def test_router_linear_is_the_float32_linear(kernel_on_cpu, t):
    """``kiln.router_linear`` at ``T <= max_t`` (the GEMV with float32 output): the float32 sums of the
    bf16 operands, as ``F.linear(x.float(), w.float())`` within float32 rounding (a bf16-rounded
    output would be far outside it); above ``max_t`` the reference itself."""
    x, w, _ = make((t, 96, 64, 6, True, "softmax"), torch.bfloat16, seed=t)
    ref = torch.nn.functional.linear(x.float(), w.float())
    got = torch.ops.kiln.router_linear(x, w, t)
    assert got.dtype == torch.float32 and got.shape == (t, 64)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ref.to(torch.bfloat16).float(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.ops.kiln.router_linear(x, w, 0), ref)


def test_router_linear_follows_the_gemv_setting(kernel_on_cpu, monkeypatch):
    """The run-time ``gemv`` setting off (``KILN_GEMV=0``) sends ``kiln.router_linear`` to the
    reference at every T, as it does ``kiln.linear``."""
    x, w, _ = make((1, 96, 64, 6, True, "softmax"), torch.bfloat16, seed=3)
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert not torch.equal(torch.ops.kiln.router_linear(x, w, 1), ref)  # the GEMV's order of sums
    monkeypatch.setenv("KILN_GEMV", "0")
    assert torch.equal(torch.ops.kiln.router_linear(x, w, 1), ref)


def test_router_linear_and_gemv_refuse_what_they_cannot_do():
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="router_linear: need x"):
        torch.ops.kiln.router_linear(x, torch.randn(8, 16, dtype=torch.bfloat16), 4)
    from kiln.ops.linear.gemv import gemv

    w = torch.randn(8, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype must be"):
        gemv(x, w, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out_dtype must be"):
        gemv(x, w, gate_up=True, out_dtype=torch.float32)


def test_op_on_plain_cpu_is_the_reference():
    case = CASES[3]
    x, w, bias = make(case, torch.float32, seed=2)
    got = torch.ops.kiln.moe_route(x, w, bias, *case[3:], 8)
    ref = reference(x, w, bias, case)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])


def test_bad_arguments_name_the_problem():
    x, w, _ = make(CASES[0], torch.float32)
    with pytest.raises(ValueError, match="weight \\[E, H\\] of one dtype"):
        torch.ops.kiln.moe_route(x, w.to(torch.bfloat16), None, *CASES[0][3:], 1)
    with pytest.raises(ValueError, match="top_k"):
        torch.ops.kiln.moe_route(x, w, None, 129, True, "softmax", 1, 1, 1.0, "", 1)


# ---- GPU: compiled at Qwen3-30B-A3B's router, graph replay ----------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 4])
def test_gpu_router_under_replay(compiled_gpu, t):
    case = (t, 2048, 128, 8, True, "softmax", 1, 1, 1.0, "bfloat16")
    x, w, _ = make(case, torch.bfloat16, device="cuda", seed=t)
    torch.ops.kiln.moe_route(x, w, None, *case[3:], 4)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_w, out_ids = torch.ops.kiln.moe_route(x, w, None, *case[3:], 4)
    for i in range(50):  # new tokens each replay: a stale logit would pick other experts
        x.copy_(make(case, torch.bfloat16, device="cuda", seed=100 + i)[0])
        eager = torch.ops.kiln.moe_route(x, w, None, *case[3:], 4)
        out_ids.fill_(-1)
        g.replay()
        assert torch.equal(out_ids, eager[1]), f"replay {i}: the replay and an eager call disagree"
    ref_w, ref_ids = reference(x, w, None, case)
    (out_w, out_ids), (ref_w, ref_ids) = by_id(out_w, out_ids), by_id(ref_w, ref_ids)  # bf16 ties
    assert torch.equal(out_ids, ref_ids)
    torch.testing.assert_close(out_w, ref_w, rtol=1e-2, atol=1e-6)
