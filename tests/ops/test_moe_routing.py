"""MoE routing (ops/moe/topk.py): the reference against Hugging Face's Qwen3-MoE, Mixtral and
DeepSeek-V3 routers, the Triton kernel against the reference (interpreter on CPU, compiled on the
GPU), ties and NaN rows, argument checks and torch.export."""

import pytest
import torch
import transformers

from kiln.ops.common.launch import interpreting
from kiln.ops.moe import topk as mr


def by_id(w, ids):
    """Rows sorted by expert id, so two routings that pick the same set in another order compare equal."""
    order = ids.long().argsort(dim=-1)
    return w.gather(1, order), ids.long().gather(1, order)


def run_kernel(logits, bias, k, renorm, scoring, groups=1, topk_groups=1, scale=1.0, group_score="top2_sum"):
    t = logits.shape[0]
    w = torch.full((t, k), float("nan"), device=logits.device)
    ids = torch.full((t, k), -7, dtype=torch.int32, device=logits.device)
    return mr.moe_topk_triton(
        logits, bias, k, renorm, scoring, groups, topk_groups, scale, "", group_score, out=(w, ids)
    )


# ---- reference vs Hugging Face --------------------------------------------------------------------


def qwen3_moe_router(norm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm
    )
    return Qwen3MoeTopKRouter(cfg), 4, norm


def mixtral_router(_norm):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = transformers.MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
    return MixtralTopKRouter(cfg), 2, True  # Mixtral always renormalizes


@pytest.mark.parametrize(
    "make, norm",
    [(qwen3_moe_router, True), (qwen3_moe_router, False), (mixtral_router, True)],
    ids=["qwen3-norm", "qwen3", "mixtral"],
)
def test_reference_matches_hf_softmax_routers(make, norm):
    router, k, renorm = make(norm)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(7, 32)
    _, hw, hid = router(x)
    w, ids = mr.moe_topk_ref(x @ router.weight.t(), None, k, renorm, "softmax", 1, 1, 1.0)
    torch.testing.assert_close(by_id(w, ids), by_id(hw, hid))


@pytest.mark.parametrize("norm", [True, False])
def test_reference_matches_hf_deepseek_v3_router(norm):
    """DeepSeek-V3's published gate: sigmoid scores, correction bias for the choice only, groups
    scored by their two best experts, top groups, top-k, routed scaling factor."""
    cfg = transformers.DeepseekV3Config(
        hidden_size=32, n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=3,
        routed_scaling_factor=2.5, norm_topk_prob=norm,
    )  # fmt: skip
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    router = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.copy_(0.3 * torch.randn(64))
    x = torch.randn(11, 32)
    _, hw, hid = router(x)
    w, ids = mr.moe_topk_ref(
        x @ router.weight.t(), router.e_score_correction_bias, 6, norm, "sigmoid", 8, 3, 2.5
    )
    torch.testing.assert_close(by_id(w, ids), by_id(hw, hid))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_reference_matches_hf_deepseek_v2_router(method):
    """DeepSeek-V2's gate: softmax over float32 logits, V2-Lite ``greedy`` top-k, V2
    ``group_limited_greedy`` (a group's score is its best expert's; top groups, then top-k), no
    renormalization, routed scaling factor."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    torch.manual_seed(0)
    groups = (8, 3) if method == "group_limited_greedy" else (1, 1)
    cfg = transformers.DeepseekV2Config(
        hidden_size=32, n_routed_experts=64, num_experts_per_tok=6, n_group=groups[0], topk_group=groups[1],
        routed_scaling_factor=16.0, topk_method=method,
    )  # fmt: skip
    router = DeepseekV2TopkRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(11, 32)
    _, hw, hid = router(x)
    w, ids = mr.moe_topk_ref(x @ router.weight.t(), None, 6, False, "softmax", *groups, 16.0, "", "max")
    torch.testing.assert_close(by_id(w, ids), by_id(hw, hid))
    if method == "group_limited_greedy":  # the group score matters here: the sum of two differs
        w2, ids2 = mr.moe_topk_ref(x @ router.weight.t(), None, 6, False, "softmax", *groups, 16.0)
        assert not torch.equal(by_id(w2, ids2)[1], by_id(hw, hid)[1])


# ---- kernel vs reference --------------------------------------------------------------------------

CASES = [  # (T, E, k, scoring, groups, topk_groups, renormalize, bias, scale)
    (5, 8, 2, "softmax", 1, 1, True, False, 1.0),  # Mixtral
    (3, 128, 8, "softmax", 1, 1, True, False, 1.0),  # Qwen3-30B-A3B
    (4, 128, 8, "softmax", 1, 1, False, False, 1.0),
    (6, 16, 1, "softmax", 1, 1, False, False, 1.0),  # top-1
    (3, 256, 8, "sigmoid", 8, 4, True, True, 2.5),  # DeepSeek-V3
    (4, 60, 6, "sigmoid", 6, 3, True, True, 1.0),  # groups of 10 (not a power of two)
    (3, 64, 8, "sigmoid", 1, 1, False, False, 1.0),  # sigmoid, no groups, no bias
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}-{c[3]}-g{c[4]}")
def test_kernel_matches_reference(kernel_on_cpu, case, dtype, device="cpu"):
    t, e, k, scoring, g, tg, renorm, has_bias, scale = case
    gen = torch.Generator(device).manual_seed(t * e + k)
    # distinct logits (multiples of 1/8, exact in bf16): no ties, so the order of ids is defined
    perm = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]).to(device)
    logits = ((perm - e / 2) / 8).to(dtype)
    bias = 0.2 * torch.randn(e, generator=gen, device=device) if has_bias else None
    w, ids = run_kernel(logits, bias, k, renorm, scoring, g, tg, scale)
    rw, rids = mr.moe_topk_ref(logits, bias, k, renorm, scoring, g, tg, scale)
    assert torch.equal(ids, rids)  # same experts in the same (descending) order
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


GROUPED = [  # (T, E, k, scoring, groups, topk_groups, renormalize, bias, scale, group_score)
    (4, 160, 6, "softmax", 8, 3, False, False, 16.0, "max"),  # DeepSeek-V2 group_limited_greedy
    (5, 64, 6, "softmax", 8, 3, True, False, 1.0, "top2_sum"),
    (3, 60, 6, "sigmoid", 6, 3, True, True, 2.5, "max"),
    (6, 16, 4, "softmax", 8, 2, False, False, 1.0, "max"),  # groups of 2, top-k = all their experts
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", GROUPED, ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}-{c[3]}-g{c[4]}-{c[9]}")
def test_group_scores_kernel_matches_reference(kernel_on_cpu, case, dtype):
    t, e, k, scoring, g, tg, renorm, has_bias, scale, group_score = case
    gen = torch.Generator().manual_seed(t * e + k)
    perm = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)])
    logits = ((perm - e / 2) / 8).to(dtype)  # distinct, exact in bf16
    bias = 0.2 * torch.randn(e, generator=gen) if has_bias else None
    w, ids = run_kernel(logits, bias, k, renorm, scoring, g, tg, scale, group_score)
    rw, rids = mr.moe_topk_ref(logits, bias, k, renorm, scoring, g, tg, scale, "", group_score)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    assert all(len(set((row // (e // g)).tolist())) <= tg for row in ids.long())  # from tg groups at most


def test_negative_and_infinite_choices_keep_their_order(kernel_on_cpu):
    """Negative choices (a sigmoid score plus a negative bias), -inf and ties are ordered as the
    float comparison orders them, ties to the lower index."""
    e = 48
    perm = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(r)) for r in range(3)])
    logits = ((perm - e / 2) / 4).float()
    bias = -3.0 + torch.linspace(0, 1, e)  # every choice negative, orders crossing the logits'
    logits[2, :10] = float("-inf")  # sigmoid 0: row 2's choices there are the bias, tied at 0 ...
    bias[:10] = 0.0  # ... above every other choice (<= -1): its top 6 are experts 0..5
    w, ids = run_kernel(logits, bias, 6, True, "sigmoid")
    rw, rids = mr.moe_topk_ref(logits, bias, 6, True, "sigmoid", 1, 1, 1.0)
    assert torch.equal(ids[:2], rids[:2])
    torch.testing.assert_close(w[:2], rw[:2], rtol=1e-5, atol=1e-6)
    assert ids[2].tolist() == [0, 1, 2, 3, 4, 5] and torch.equal(w[2], torch.zeros(6))
    w, ids = run_kernel(torch.full((1, 16), float("-inf")), None, 3, False, "sigmoid")
    assert ids.tolist() == [[0, 1, 2]]  # all -inf: the lowest indices


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN row, by design
def test_ties_and_nan_rows_give_distinct_experts(kernel_on_cpu):
    logits = torch.zeros(3, 32)
    logits[1] = float("nan")
    logits[2, 5] = 1.0  # one clear winner, the rest tied
    for scoring, g, tg in (("softmax", 1, 1), ("sigmoid", 4, 2)):
        w, ids = run_kernel(logits, None, 8, True, scoring, g, tg)
        assert all(len(set(r)) == 8 for r in ids.tolist()), ids
        assert ids.min() >= 0 and ids.max() < 32
        assert ids[2, 0] == 5
        if scoring == "softmax":
            torch.testing.assert_close(w[0], torch.full((8,), 1 / 8))  # all tied: equal weights
    w, ids = run_kernel(torch.zeros(1, 16), None, 4, False, "softmax")
    assert ids.tolist() == [[0, 1, 2, 3]]  # ties go to the lower expert index


@pytest.mark.parametrize("triton_on_cpu", ["1", "0"], ids=["kernel", "reference"])
def test_op_dispatch_and_strided_logits(monkeypatch, triton_on_cpu):
    if triton_on_cpu == "1" and not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", triton_on_cpu)
    wide = torch.randn(4, 40)
    logits = wide[:, :32]  # row stride 40
    w, ids = torch.ops.kiln.moe_topk(logits, None, 4, True, "softmax", 1, 1, 1.0)
    rw, rids = mr.moe_topk_ref(logits, None, 4, True, "softmax", 1, 1, 1.0)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw)
    w, ids = torch.ops.kiln.moe_topk(logits[:0], None, 4, True, "softmax", 1, 1, 1.0)
    assert w.shape == (0, 4) and ids.shape == (0, 4)


def test_bad_arguments_name_the_field():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="top_k"):
        torch.ops.kiln.moe_topk(x, None, 17, True, "softmax", 1, 1, 1.0)
    with pytest.raises(ValueError, match="scoring"):
        torch.ops.kiln.moe_topk(x, None, 2, True, "relu", 1, 1, 1.0)
    with pytest.raises(ValueError, match="num_groups"):
        torch.ops.kiln.moe_topk(x, None, 2, True, "sigmoid", 3, 1, 1.0)
    with pytest.raises(ValueError, match="bias"):
        torch.ops.kiln.moe_topk(x, torch.zeros(8), 2, True, "sigmoid", 1, 1, 1.0)
    with pytest.raises(ValueError, match="topk_groups"):
        torch.ops.kiln.moe_topk(x, None, 8, True, "sigmoid", 8, 1, 1.0)  # 1 group of 2 < top-8
    with pytest.raises(ValueError, match="group_score must be one of"):
        torch.ops.kiln.moe_topk(x, None, 2, True, "softmax", 4, 2, 1.0, "", "mean")
    with pytest.raises(ValueError, match="softmax scoring takes no bias"):
        torch.ops.kiln.moe_topk(x, torch.zeros(16), 2, True, "softmax", 1, 1, 1.0)


class _Route(torch.nn.Module):
    def forward(self, logits, bias):
        return torch.ops.kiln.moe_topk(logits, bias, 4, True, "sigmoid", 4, 2, 2.0)


def test_export_with_dynamic_tokens(kernel_on_cpu):
    t = torch.export.Dim("T", min=1, max=256)
    bias = torch.randn(32)
    ep = torch.export.export(
        _Route(), (torch.randn(3, 32), bias), dynamic_shapes=({0: t}, None), strict=False
    )
    assert torch.ops.kiln.moe_topk.default in {n.target for n in ep.graph.nodes}
    logits = torch.randn(9, 32)
    w, ids = ep.module()(logits, bias)
    rw, rids = mr.moe_topk_ref(logits, bias, 4, True, "sigmoid", 4, 2, 2.0)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw)


# ---- GPU: compiled kernel at model sizes ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 37, 4096])
@pytest.mark.parametrize("case", [c[1:] for c in CASES[:2] + CASES[4:5]], ids=["mixtral", "qwen3", "dsv3"])
def test_gpu_matches_reference(compiled_gpu, t, case):
    e, k, scoring, g, tg, renorm, has_bias, scale = case
    gen = torch.Generator("cuda").manual_seed(t + e)
    logits = (2 * torch.randn(t, e, generator=gen, device="cuda")).to(torch.float32)
    bias = 0.2 * torch.randn(e, generator=gen, device="cuda") if has_bias else None
    w, ids = run_kernel(logits, bias, k, renorm, scoring, g, tg, scale)
    rw, rids = mr.moe_topk_ref(logits, bias, k, renorm, scoring, g, tg, scale)
    # exp/sigmoid differ in the last ulp between CUDA and torch: compare the chosen sets and weights
    # where both picked the same experts (near-ties may swap order).
    same = (by_id(w, ids)[1] == by_id(rw, rids)[1]).all(dim=1)
    assert same.float().mean() > 0.99
    torch.testing.assert_close(by_id(w, ids)[0][same], by_id(rw, rids)[0][same], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4096])
def test_gpu_group_max_matches_reference(compiled_gpu, t):
    """DeepSeek-V2's group_limited_greedy (softmax, groups scored by their best) compiled."""
    _, e, k, scoring, g, tg, renorm, _, scale, group_score = GROUPED[0]
    logits = 2 * torch.randn(t, e, generator=torch.Generator("cuda").manual_seed(t), device="cuda")
    w, ids = run_kernel(logits, None, k, renorm, scoring, g, tg, scale, group_score)
    rw, rids = mr.moe_topk_ref(logits, None, k, renorm, scoring, g, tg, scale, "", group_score)
    same = (by_id(w, ids)[1] == by_id(rw, rids)[1]).all(dim=1)  # near-ties may swap (exp's last ulp)
    assert same.float().mean() > 0.99
    torch.testing.assert_close(by_id(w, ids)[0][same], by_id(rw, rids)[0][same], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("round_to", ["bfloat16", "float16"])
def test_rounded_weights_equal_the_cast_of_the_reference(kernel_on_cpu, round_to):
    # HF's Qwen3-MoE casts the routing weights to the activation dtype: fused into the kernel
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(9, 64, generator=g)
    w, ids = torch.ops.kiln.moe_topk(logits, None, 8, True, "softmax", 1, 1, 1.0, round_to)
    rw, rids = mr.moe_topk_ref(logits, None, 8, True, "softmax", 1, 1, 1.0)
    assert torch.equal(ids, rids)
    assert torch.equal(w, rw.to(getattr(torch, round_to)).float())
    assert not torch.equal(w, rw)  # the rounding did something
    with pytest.raises(ValueError, match="round_to"):
        torch.ops.kiln.moe_topk(logits, None, 8, True, "softmax", 1, 1, 1.0, "float8")


@pytest.mark.gpu
@pytest.mark.parametrize("round_to", ["bfloat16", "float16"])
def test_gpu_rounded_weights_equal_the_cast_of_the_unrounded(compiled_gpu, round_to):
    g = torch.Generator("cuda").manual_seed(11)
    logits = torch.randn(300, 128, generator=g, device="cuda").to(torch.bfloat16)
    w, ids = torch.ops.kiln.moe_topk(logits, None, 8, True, "softmax", 1, 1, 1.0, "")
    rw, rids = torch.ops.kiln.moe_topk(logits, None, 8, True, "softmax", 1, 1, 1.0, round_to)
    assert torch.equal(ids, rids)
    assert torch.equal(rw, w.to(getattr(torch, round_to)).float())
