"""The fused decode router (ops/moe_route.py): router GEMV + top-k in one kernel against the router
linear + ``moe_topk`` reference (interpreter on CPU, compiled on the GPU), the op's dispatch and
switch, and the compiled MoE layer calling it."""

import pytest
import torch
from test_moe_routing import by_id

from kiln.ops import moe_route as mrt
from kiln.ops import moe_routing as mr
from kiln.ops.common import ArrivalCounters

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


@pytest.mark.parametrize("blocks", [(2, 1024), (1, 16), (8, 32)], ids=["default", "e1-k16", "e8-k32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fused_kernel_matches_reference(kernel_on_cpu, case, dtype, blocks):
    x, w, bias = make(case, dtype, seed=len(case) + case[2])
    counters = torch.zeros(8, dtype=torch.int32)
    got_w, got_ids = mrt.moe_route_launch(
        x, w, bias, *case[3:], counters, block_e=blocks[0], block_k=blocks[1]
    )
    ref_w, ref_ids = reference(x, w, bias, case)
    if dtype == torch.bfloat16:  # rounded logits tie: the kernel takes the lower id, torch.topk either
        (got_w, got_ids), (ref_w, ref_ids) = by_id(got_w, got_ids), by_id(ref_w, ref_ids)
    assert torch.equal(got_ids.long(), ref_ids.long())
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)
    assert not counters.any(), "the last arrival resets its counter"


def test_op_runs_fused_kernel_up_to_max_t(kernel_on_cpu, monkeypatch):
    monkeypatch.setenv("KILN_MOE_ROUTE", "fused")  # opt-in (default: separate)
    case = CASES[0]
    launched = []
    real = mrt.moe_route_launch
    monkeypatch.setattr(
        mrt, "moe_route_launch", lambda *a, **kw: launched.append(a[0].shape[0]) or real(*a, **kw)
    )
    for t in (1, 2, 3):
        x, w, _ = make((t, *case[1:]), torch.float32, seed=t)
        got = torch.ops.kiln.moe_route(x, w, None, *case[3:], 2)
        ref = reference(x, w, None, case)
        assert torch.equal(got[1], ref[1])
        torch.testing.assert_close(got[0], ref[0])
    assert launched == [1, 2], "T <= max_t: the fused kernel; above: the linear, then moe_topk"
    monkeypatch.setenv("KILN_MOE_ROUTE", "separate")  # router GEMV, then the top-k kernel
    x, w, _ = make(case, torch.float32, seed=1)
    assert torch.equal(torch.ops.kiln.moe_route(x, w, None, *case[3:], 2)[1], reference(x, w, None, case)[1])
    assert launched == [1, 2]
    monkeypatch.setenv("KILN_MOE_ROUTE", "both")
    with pytest.raises(ValueError, match="KILN_MOE_ROUTE"):
        torch.ops.kiln.moe_route(x, w, None, *case[3:], 2)


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
    with pytest.raises(ValueError, match="arrival counters"):
        mrt.moe_route_launch(x, w, None, *CASES[0][3:], torch.zeros(0, dtype=torch.int32))


def test_counters_not_allocated_inside_a_capture_fall_back(kernel_on_cpu, monkeypatch):
    """A capture that would have to allocate the counters takes the two-kernel path (CPU stand-in:
    a counter pool that reports a capture)."""
    monkeypatch.setenv("KILN_MOE_ROUTE", "fused")
    capturing = type("Capturing", (ArrivalCounters,), {"_capturing": staticmethod(lambda device: True)})
    monkeypatch.setattr(mrt, "COUNTERS", capturing(1, "moe_route", "the router GEMV and the top-k kernel"))
    monkeypatch.setattr(
        mrt, "moe_route_launch", lambda *a, **kw: pytest.fail("fused kernel without counters")
    )
    x, w, _ = make(CASES[0], torch.float32, seed=3)
    with pytest.warns(UserWarning, match="inside a CUDA-graph capture"):
        got = torch.ops.kiln.moe_route(x, w, None, *CASES[0][3:], 1)
    assert torch.equal(got[1], reference(x, w, None, CASES[0])[1])


# ---- GPU: compiled at Qwen3-30B-A3B's router, graph replay ----------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 4])
def test_gpu_fused_router_under_replay(compiled_gpu, monkeypatch, t):
    case = (t, 2048, 128, 8, True, "softmax", 1, 1, 1.0, "bfloat16")
    x, w, _ = make(case, torch.bfloat16, device="cuda", seed=t)
    monkeypatch.setenv("KILN_MOE_ROUTE", "separate")
    sep = torch.ops.kiln.moe_route(x, w, None, *case[3:], 4)
    monkeypatch.setenv("KILN_MOE_ROUTE", "fused")
    torch.ops.kiln.moe_route(x, w, None, *case[3:], 4)  # counters and compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_w, out_ids = torch.ops.kiln.moe_route(x, w, None, *case[3:], 4)
    for i in range(50):  # new tokens each replay: a stale logit would pick other experts
        x.copy_(make(case, torch.bfloat16, device="cuda", seed=100 + i)[0])
        monkeypatch.setenv("KILN_MOE_ROUTE", "separate")
        sep = torch.ops.kiln.moe_route(x, w, None, *case[3:], 4)  # eager, the two-kernel path
        out_ids.fill_(-1)
        g.replay()
        assert torch.equal(out_ids, sep[1]), f"replay {i}: the fused and separate routers disagree"
    ref_w, ref_ids = reference(x, w, None, case)
    (out_w, out_ids), (ref_w, ref_ids) = by_id(out_w, out_ids), by_id(ref_w, ref_ids)  # bf16 ties
    assert torch.equal(out_ids, ref_ids)
    torch.testing.assert_close(out_w, ref_w, rtol=1e-2, atol=1e-6)
