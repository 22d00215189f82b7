"""Top-k routing inside the w13 decode GEMV (ops/moe_routed.py, ``rank_route``): the ids and weights
it writes against the top-k kernel's, the op against ``moe_topk`` + ``fused_moe``, its fallback, and
a tiny Qwen3-MoE traced with ``KILN_MOE_TOPK_IN_W13=1`` against Hugging Face."""

import json

import pytest
import torch

from kiln.ops import moe_routed
from kiln.ops.common import interpreting

GEMV = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)  # decode variant
TABLE = json.dumps({"4": {"w13": GEMV, "w2": GEMV}})


def make(t, e, h, i, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    logits = torch.randn(t, e, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(torch.bfloat16)
    return x, logits, w13, w2


@pytest.mark.parametrize("select", ["rank", "rounds"])  # KILN_MOE_ROUTE_SELECT
@pytest.mark.parametrize("renorm,round_to", [(True, "bfloat16"), (False, ""), (True, "")])
@pytest.mark.parametrize("t,e,k", [(1, 16, 4), (3, 16, 4), (2, 12, 3)], ids=["t1", "t3", "odd-E"])
def test_routing_in_w13_matches_the_topk_kernel(
    kernel_on_cpu, monkeypatch, t, e, k, renorm, round_to, select
):
    monkeypatch.setenv("KILN_MOE_ROUTE_SELECT", select)
    x, logits, w13, w2 = make(t, e, 32, 24, seed=t + e)
    seen = {}
    real = moe_routed._fused_moe_gemv

    def spy(*a, **kw):  # keep the ids and weights the w13 GEMV wrote
        out = real(*a, **kw)
        seen["w"], seen["ids"] = a[3].clone(), a[4].clone()
        return out

    monkeypatch.setattr(moe_routed, "_fused_moe_gemv", spy)
    y = torch.ops.kiln.fused_moe_routed(x, logits, w13, w2, k, renorm, 1.0, round_to, TABLE)
    w_ref, ids_ref = torch.ops.kiln.moe_topk(logits, None, k, renorm, "softmax", 1, 1, 1.0, round_to)
    assert torch.equal(seen["ids"], ids_ref)
    torch.testing.assert_close(seen["w"], w_ref, rtol=2**-7 if round_to else 1e-6, atol=1e-6)
    y_ref = torch.ops.kiln.fused_moe(x, w13, w2, w_ref, ids_ref, None, None, None, TABLE)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2**-6, atol=2e-3)


def test_falls_back_off_the_gemv(monkeypatch):
    """Without Triton (and at grouped-GEMM sizes) the op is moe_topk then fused_moe, exactly; bad
    logits are refused."""
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "0")
    x, logits, w13, w2 = (a.float() for a in make(5, 8, 16, 8, seed=0))
    y = torch.ops.kiln.fused_moe_routed(x, logits, w13, w2, 2, True, 1.0, "", "")
    w, ids = torch.ops.kiln.moe_topk(logits, None, 2, True, "softmax", 1, 1, 1.0, "")
    assert torch.equal(y, torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, ""))
    with pytest.raises(ValueError, match="logits must be"):
        torch.ops.kiln.fused_moe_routed(x, logits[:, :4], w13, w2, 2, True, 1.0, "", "")


def test_compiled_moe_model_routes_in_w13_and_matches_hf(tmp_path, monkeypatch):
    """Tiny Qwen3-MoE traced with ``KILN_MOE_TOPK_IN_W13=1``: each MoE layer is the router linear
    then ``fused_moe_routed`` (no top-k node); one-sequence decode steps run the routing inside the
    w13 GEMV (interpreter) and match Hugging Face in float32."""
    from tiny_models import check_against_hf
    from tiny_moe_models import make_moe_checkpoint

    from kiln.compiler.build import CompileOptions, compile_model
    from kiln.runtime.direct import DirectRunner

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    monkeypatch.setenv("KILN_MOE_TOPK_IN_W13", "1")
    hf = make_moe_checkpoint(tmp_path / "hf", "qwen3-moe")
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64, chunk_size=32)
    compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    ep = torch.export.load(tmp_path / "art" / "graphs" / "model.pt2")
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    moe_layers = sum(1 for i in range(hf.config.num_hidden_layers) if i not in hf.config.mlp_only_layers)
    assert targets.count("kiln.fused_moe_routed.default") == moe_layers
    assert "kiln.moe_route.default" not in targets and "kiln.moe_topk.default" not in targets
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")
    routed = []
    real = moe_routed._fused_moe_gemv
    monkeypatch.setattr(moe_routed, "_fused_moe_gemv", lambda *a, **kw: routed.append(1) or real(*a, **kw))
    runner = DirectRunner(str(tmp_path / "art"), device="cpu", num_slots=128)
    check_against_hf(runner, hf, [[5, 6, 7, 8, 9, 10, 11]], decode_steps=2)
    assert len(routed) == 2 * moe_layers  # the two decode steps; the prefill took the top-k kernel


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
def test_gpu_routing_in_w13_under_replay(compiled_gpu, t):
    """Qwen3-30B-A3B shapes (E=128, top-8, renormalized, bf16-rounded weights) captured once and
    replayed with new logits: the output follows the routing of each replay."""
    e, k, h, i = 128, 8, 2048, 768
    x, logits, w13, w2 = (a.cuda() for a in make(t, e, h, i, seed=t))
    args = (k, True, 1.0, "bfloat16", "")
    torch.ops.kiln.fused_moe_routed(x, logits, w13, w2, *args)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.kiln.fused_moe_routed(x, logits, w13, w2, *args)
    for seed in range(20):
        _, new_logits, _, _ = make(t, e, h, i, seed=100 + seed)
        logits.copy_(new_logits)
        g.replay()
        w, ids = torch.ops.kiln.moe_topk(logits, None, k, True, "softmax", 1, 1, 1.0, "bfloat16")
        ref = torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, "")
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=2e-3)
