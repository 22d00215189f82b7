"""Grouped GEMM, decode GEMV and the fused MoE op (ops/moe/gemm.py, ops/moe/fused.py): kernels against the
references (interpreter on CPU, compiled on the GPU) in bf16/fp16/fp32 and FP8, the reference
against Hugging Face's expert block, expert maps, the launch table and recorded tuning tables."""

import contextlib
import json

import pytest
import torch

from kiln.ops.common.launch import ArrivalCounters, interpreting
from kiln.ops.common.quant import FP8_DTYPE, quantize_fp8_per_channel
from kiln.ops.moe import align as ma
from kiln.ops.moe import fused as moe
from kiln.ops.moe import gemm as mg

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
FP8_TOL = 1e-2
SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2)
GEMV = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)  # decode variant
GEMV_SUM = dict(GEMV, GROUP_M=8)  # w2: the top-k sum in the GEMV (no combine kernel)
VARIANTS = {"grouped": SMALL, "gemv": GEMV, "gemv_sum": GEMV_SUM}


def assert_rel(out, ref, tol, what="output"):
    """||out - ref|| / ||ref|| < tol; NaN (unwritten, poisoned elements) never passes."""
    out, ref = out.float(), ref.float()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < tol, f"{what}: relative error {err:.3e} (limit {tol:.0e})"


def make_moe(t, h, i, e, k, dtype, fp8=False, device="cpu", seed=0, hot=None):
    """Random activations, experts and routing (distinct experts per token; ``hot``: every token's
    first choice is that expert). Returns the fused_moe arguments after ``x``."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(t, h, generator=g, device=device).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g, device=device) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g, device=device) / i**0.5).to(dtype)
    s13 = s2 = None
    if fp8:
        w13, s13 = quantize_fp8_per_channel(w13)
        w2, s2 = quantize_fp8_per_channel(w2)
    scores = torch.rand(t, e, generator=g, device=device)
    if hot is not None:
        scores[:, hot] = 2.0
    w, ids = torch.topk(scores, k, dim=-1)
    return x, w13, w2, (w / w.sum(-1, keepdim=True)).float(), ids.to(torch.int32), s13, s2


def run_fused(x, w13, w2, w, ids, s13, s2, expert_map=None, cfg=SMALL):
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)  # poisoned
    moe.fused_moe_forward(x, w13, w2, w, ids, expert_map, s13, s2, "", configs=(cfg, cfg), out=out)
    return out


# ---- the grouped GEMM alone -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["plain", "fused_silu", "mul_weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_grouped_gemm_matches_per_pair_reference(kernel_on_cpu, dtype, mode):
    t, h, i, e, k = 7, 48, 40, 8, 3  # H, I not multiples of the blocks
    x, w13, w2, w, ids, _, _ = make_moe(t, h, i, e, k, dtype, seed=3)
    align = ma.moe_align_ref(ids, None, e, SMALL["BLOCK_M"])
    flat = ids.reshape(-1).long()
    if mode == "mul_weight":
        a = torch.randn(t * k, i).to(dtype)
        c = torch.full((t * k, h), float("nan"), dtype=dtype)
        mg.moe_gemm_launch(a, None, w2, None, c, w, *align, SMALL, a_div=1)
        ref = torch.stack([(a[p].float() @ w2[flat[p]].float().t()).to(dtype).float() for p in range(t * k)])
        ref = ref * w.reshape(-1, 1)
    else:
        fuse = mode == "fused_silu"
        c = torch.full((t * k, i if fuse else 2 * i), float("nan"), dtype=dtype)
        mg.moe_gemm_launch(x, None, w13, None, c, None, *align, SMALL, a_div=k, fuse_silu=fuse)
        ref = torch.stack([(x[p // k].float() @ w13[flat[p]].float().t()).to(dtype) for p in range(t * k)])
        if fuse:
            from kiln.ops.activation.silu_and_mul import silu_and_mul_ref

            ref = silu_and_mul_ref(ref)
    assert_rel(c, ref, TOL[dtype])


@pytest.mark.parametrize("mode", ["plain", "fused_silu", "mul_weight", "combine", "sum_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gemv_matches_per_pair_reference(kernel_on_cpu, dtype, mode):
    t, h, i, e, k = 5, 48, 40, 8, 3  # H, I not multiples of the blocks
    x, w13, w2, w, ids, _, _ = make_moe(t, h, i, e, k, dtype, seed=5)
    flat = ids.reshape(-1).long()
    cfg = dict(GEMV, BLOCK_N=8)
    if mode in ("mul_weight", "combine", "sum_last"):
        a = torch.randn(t * k, i).to(dtype)
        rows = t if mode == "combine" else t * k
        c = torch.full((rows, h), float("nan"), dtype=dtype)
        out = torch.full((t, h), float("nan"), dtype=dtype) if mode == "sum_last" else None
        cnt = torch.zeros(t * 6 + 1, dtype=torch.int32) if mode == "sum_last" else None  # 6 = cdiv(48, 8)
        mg.moe_gemv_launch(
            a,
            None,
            w2,
            None,
            c,
            w,
            ids,
            None,
            cfg,
            a_div=1,
            combine=mode == "combine",
            sum_out=out,
            counters=cnt,
        )
        ref = torch.stack([(a[p].float() @ w2[flat[p]].float().t()).to(dtype).float() for p in range(t * k)])
        ref = (ref * w.reshape(-1, 1)).to(dtype)
        if mode == "sum_last":  # per-pair rows as mul_weight, their sum as the combine kernel writes it
            assert_rel(c, ref, TOL[dtype], "per-pair rows")
            assert torch.equal(out, moe.moe_combine(c, ids, None)), "sum_last differs from the combine kernel"
            assert not cnt.any(), "the counters are reset to zero for the next call"
            c = out
        if mode in ("combine", "sum_last"):  # the top-k sum of the rounded pair outputs, f32, rounded once
            ref = ref.float().reshape(t, k, h).sum(1).to(dtype)
    else:
        fuse = mode == "fused_silu"
        c = torch.full((t * k, i if fuse else 2 * i), float("nan"), dtype=dtype)
        mg.moe_gemv_launch(x, None, w13, None, c, None, ids, None, cfg, a_div=k, fuse_silu=fuse)
        ref = torch.stack([(x[p // k].float() @ w13[flat[p]].float().t()).to(dtype) for p in range(t * k)])
        if fuse:
            from kiln.ops.activation.silu_and_mul import silu_and_mul_ref

            ref = silu_and_mul_ref(ref)
    assert_rel(c, ref, TOL[dtype])


def test_gemv_sum_out_is_checked(kernel_on_cpu):
    t, h, i, e, k = 2, 32, 16, 4, 2
    _, _, w2, w, ids, _, _ = make_moe(t, h, i, e, k, torch.float32, seed=8)
    a, y2 = torch.randn(t * k, i), torch.empty(t * k, h)
    cnt = torch.zeros(t * 2, dtype=torch.int32)  # cdiv(32, 16) column blocks per token
    for bad in (
        dict(sum_out=torch.empty(t, h + 1), counters=cnt),  # wrong shape
        dict(sum_out=torch.empty(t, h), counters=cnt[:3]),  # too few counters
        dict(sum_out=torch.empty(t, h), counters=cnt.long()),  # not int32
        dict(sum_out=torch.empty(t, h), counters=cnt, combine=True),  # not one pair per program
    ):
        with pytest.raises(ValueError, match="sum_out must be"):
            mg.moe_gemv_launch(a, None, w2, None, y2, w, ids, None, GEMV, 1, **bad)


def test_gemv_skips_other_ranks_experts(kernel_on_cpu):
    t, h, i, k = 4, 32, 24, 3
    x, w13, w2, w, ids, _, _ = make_moe(t, h, i, 16, k, torch.float32, seed=6)
    ids[0] = torch.tensor([9, 10, 11], dtype=torch.int32)  # token 0: no local expert at all
    emap = torch.full((16,), -1, dtype=torch.int32)
    emap[:8] = torch.arange(8, dtype=torch.int32)  # this rank holds global experts 0..7
    w13, w2 = w13[:8].contiguous(), w2[:8].contiguous()
    hid = torch.full((t * k, i), -5.0)
    mg.moe_gemv_launch(x, None, w13, None, hid, None, ids, emap, GEMV, a_div=k, fuse_silu=True)
    local = (ids.reshape(-1) < 8).tolist()
    assert all((hid[p] == -5.0).all() != local[p] for p in range(t * k))  # other ranks' pairs untouched
    hid[~torch.tensor(local)] = float("nan")  # never read: the combine masks them
    out = torch.full((t, h), float("nan"))
    mg.moe_gemv_launch(hid, None, w2, None, out, w, ids, emap, GEMV, a_div=1, combine=True)
    assert (out[0] == 0).all()  # no local expert: zeros, as the combine writes
    masked = torch.where(ids < 8, w, 0.0)
    assert_rel(out, moe.fused_moe_ref(x, w13, w2, masked, torch.where(ids < 8, ids, 0)), TOL[torch.float32])
    # one pair per program with the last arrival's sum: other ranks' pairs still arrive, never write
    y2, summed = torch.full((t * k, h), -7.0), torch.full((t, h), float("nan"))
    cnt = torch.zeros(t, dtype=torch.int32)
    mg.moe_gemv_launch(
        hid, None, w2, None, y2, w, ids, emap, dict(GEMV, BLOCK_N=32), 1, sum_out=summed, counters=cnt
    )
    assert all((y2[p] == -7.0).all() != local[p] for p in range(t * k))
    assert torch.equal(summed, out) and not cnt.any()


# ---- the fused op -----------------------------------------------------------------------------------

CASES = [  # (T, H, I, E, k, hot expert or None)
    (5, 64, 32, 8, 2, None),  # Mixtral-like top-2
    (3, 32, 32, 128, 8, None),  # Qwen3-30B-A3B's E and top-8, few tokens: most experts get none
    (6, 32, 48, 16, 1, None),  # top-1
    (9, 48, 32, 8, 3, 5),  # every token on expert 5
    (1, 64, 32, 4, 4, None),  # k = E: every expert gets the one token
]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-I{c[2]}-E{c[3]}-k{c[4]}-hot{c[5]}")
def test_fused_moe_matches_reference(kernel_on_cpu, case, dtype, variant):
    t, h, i, e, k, hot = case
    args = make_moe(t, h, i, e, k, dtype, seed=t + e, hot=hot)
    out = run_fused(*args, cfg=VARIANTS[variant])
    assert_rel(out, moe.fused_moe_ref(*args[:5], None, *args[5:]), TOL[dtype])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"T{c[0]}-E{c[3]}-k{c[4]}")
def test_fused_moe_fp8_matches_reference(kernel_on_cpu, case, variant):
    t, h, i, e, k, hot = case
    args = make_moe(t, h, i, e, k, torch.bfloat16, fp8=True, seed=t + e + 1, hot=hot)
    assert args[1].dtype == FP8_DTYPE
    out = run_fused(*args, cfg=VARIANTS[variant])
    assert_rel(out, moe.fused_moe_ref(*args[:5], None, *args[5:]), FP8_TOL)


def _capturing_counters() -> ArrivalCounters:
    """A counter pool that reports a CUDA-graph capture (CPU stand-in): the one-pair-per-program
    w2 GEMV then leaves the top-k sum to the combine kernel."""
    capturing = type("Capturing", (ArrivalCounters,), {"_capturing": staticmethod(lambda device: True)})
    return capturing(1, "fused_moe", "the combine kernel")


@pytest.mark.parametrize(
    "variant, no_counters", [("grouped", False), ("gemv", False), ("gemv", True), ("gemv_sum", False)]
)  # the counters matter to the one-pair-per-program GEMV only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_residual_is_added_by_the_last_kernel(kernel_on_cpu, monkeypatch, dtype, variant, no_counters):
    """``residual``: the op's output plus the residual, rounded again, exactly as a separate add
    after it (every path that writes the top-k sum: last arrival, token group, combine kernel)."""
    if no_counters:
        monkeypatch.setattr(moe, "COUNTERS", _capturing_counters())
    t, h, i, e, k = 3, 64, 32, 16, 4
    args = make_moe(t, h, i, e, k, dtype, seed=11)
    res = torch.randn(t, h + 16, dtype=torch.float32).to(dtype)[:, :h]  # a row stride of its own
    out = torch.full(res.shape, float("nan"), dtype=dtype)
    with pytest.warns(UserWarning, match="the combine kernel") if no_counters else contextlib.nullcontext():
        plain = run_fused(*args, cfg=VARIANTS[variant])
        moe.fused_moe_forward(
            *args[:5], None, *args[5:], "", configs=(VARIANTS[variant],) * 2, out=out, residual=res
        )
    assert torch.equal(out, moe.add_rounded(plain, res))


def test_op_residual_on_the_torch_path():
    args = make_moe(2, 32, 16, 8, 2, torch.float32, seed=3)
    res = torch.randn(2, 32)
    y = torch.ops.kiln.fused_moe(*args[:5], None, *args[5:], "", res)
    assert torch.equal(y, moe.add_rounded(moe.fused_moe_ref(*args[:5], None, *args[5:]), res))
    with pytest.raises(ValueError, match="residual must be"):
        torch.ops.kiln.fused_moe(*args[:5], None, *args[5:], "", res[:1])


def test_decode_sizes_run_the_gemv_by_default(kernel_on_cpu, monkeypatch):
    t, h, i, e, k = 2, 64, 32, 128, 8  # Qwen3-30B-A3B's E and top-8: 2 tokens -> the decode GEMV
    assert mg.pick_configs("", e, i, h, t, k)[0]["BLOCK_M"] == 1
    args = make_moe(t, h, i, e, k, torch.bfloat16, seed=11)
    launched = []
    for name in ("moe_gemv_launch", "moe_gemm_launch", "moe_align_run", "moe_combine"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, _n=name, _f=real, **kw: launched.append(_n) or _f(*a, **kw))
    out = torch.ops.kiln.fused_moe(*args[:5], None, *args[5:], "")
    assert launched == ["moe_gemv_launch", "moe_gemv_launch"]  # no alignment, the sum in the w2 GEMV
    ref = moe.fused_moe_ref(*args[:5], None, *args[5:])
    assert_rel(out, ref, TOL[torch.bfloat16])
    launched.clear()  # counters that would be allocated inside a capture: the combine kernel, warned
    real_counters = moe.COUNTERS
    monkeypatch.setattr(moe, "COUNTERS", _capturing_counters())
    with pytest.warns(UserWarning, match="inside a CUDA-graph capture"):
        assert torch.equal(torch.ops.kiln.fused_moe(*args[:5], None, *args[5:], ""), out)  # same bits
    assert launched == ["moe_gemv_launch", "moe_gemv_launch", "moe_combine"]
    monkeypatch.setattr(moe, "COUNTERS", real_counters)
    launched.clear()  # a w2 GROUP_M above 1: the top-k sum in the GEMV, no combine kernel either
    table = json.dumps({"4": {"w13": GEMV, "w2": GEMV_SUM}})
    assert torch.equal(torch.ops.kiln.fused_moe(*args[:5], None, *args[5:], table), out)
    assert launched == ["moe_gemv_launch", "moe_gemv_launch"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_expert_map_sums_only_local_experts(kernel_on_cpu, variant):
    x, w13, w2, w, ids, _, _ = make_moe(6, 32, 32, 16, 4, torch.float32, seed=9)
    emap = torch.full((16,), -1, dtype=torch.int32)
    emap[4:12] = torch.arange(8, dtype=torch.int32)  # this rank holds global experts 4..11
    local13, local2 = w13[4:12].contiguous(), w2[4:12].contiguous()
    out = run_fused(x, local13, local2, w, ids, None, None, expert_map=emap, cfg=VARIANTS[variant])
    ref = moe.fused_moe_ref(x, local13, local2, w, ids, emap)
    assert_rel(out, ref, TOL[torch.float32])
    masked = torch.where(
        (ids >= 4) & (ids < 12), w, 0.0
    )  # the global reference with other experts' weights zeroed
    assert_rel(out, moe.fused_moe_ref(x, w13, w2, masked, ids), TOL[torch.float32])


def test_reference_matches_hf_qwen3_moe_experts():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, 10, 32)
    with torch.no_grad():
        ref = block(x)[0]
        logits = x[0] @ block.gate.weight.t()
        w, ids = torch.ops.kiln.moe_topk(logits, None, 2, False, "softmax", 1, 1, 1.0)
        out = moe.fused_moe_ref(x[0], block.experts.gate_up_proj, block.experts.down_proj, w, ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_op_dispatch_and_bad_arguments(monkeypatch):
    args = make_moe(4, 32, 16, 8, 2, torch.float32, seed=2)
    for triton_on_cpu in ["1", "0"] if interpreting() else ["0"]:
        monkeypatch.setenv("KILN_TRITON_ON_CPU", triton_on_cpu)
        out = torch.ops.kiln.fused_moe(*args[:5], None, *args[5:], "")
        assert_rel(out, moe.fused_moe_ref(*args[:5], None, *args[5:]), TOL[torch.float32])
    x, w13, w2, w, ids, _, _ = args
    with pytest.raises(ValueError, match="topk_ids must be"):
        torch.ops.kiln.fused_moe(x, w13, w2, w, ids.long(), None, None, None, "")
    with pytest.raises(ValueError, match="disagree"):
        torch.ops.kiln.fused_moe(x, w13[:, :30], w2, w, ids, None, None, None, "")
    with pytest.raises(ValueError, match="w13_scale"):
        q13, q2 = w13.to(FP8_DTYPE), w2.to(FP8_DTYPE)
        torch.ops.kiln.fused_moe(x, q13, q2, w, ids, None, None, None, "")
    with pytest.raises(ValueError, match="share BLOCK_M"):
        moe.fused_moe_forward(x, w13, w2, w, ids, None, None, None, "", configs=(SMALL, GEMV))
    with pytest.raises(ValueError, match=r"BLOCK_M 1 or 16\.\.256"):
        moe.fused_moe_forward(x, w13, w2, w, ids, None, None, None, "", configs=(dict(SMALL, BLOCK_M=8),) * 2)
    with pytest.raises(ValueError, match="positive ints"):
        moe.fused_moe_forward(x, w13, w2, w, ids, None, None, None, "", configs=(dict(GEMV, SPLIT_K=2),) * 2)


# ---- block sizes ------------------------------------------------------------------------------------


def test_moe_config_table():
    e, i, h, k = 128, 768, 2048, 8
    seen = []
    for t in (1, 2, 4, 5, 8, 32, 128, 256, 512, 1024, 4096, 16384):
        c1, c2 = mg.pick_configs("", e, i, h, t, k)
        assert tuple(c1) == tuple(c2) == mg.CONFIG_KEYS
        mg.check_config(c1), mg.check_config(c2)
        assert c1["BLOCK_M"] == c2["BLOCK_M"] == mg.moe_block_m(e, t, k)
        assert c1 == mg.moe_config(e, 2 * i, h, t, k, "w13") and c2 == mg.moe_config(e, h, i, t, k, "w2")
        seen.append(c1["BLOCK_M"])
    assert seen == sorted(seen) and seen[:3] == [1, 1, 1] and seen[3] == 16 and seen[-1] == 128
    assert mg.moe_block_m(8, 1, 2) == 1 and mg.moe_block_m(8, 2, 2) == 16  # Mixtral: one token is decode
    assert mg.moe_config(8, 64, 32, 5, 2)["BLOCK_K"] == 32  # never wider than the (padded) K
    assert mg.moe_config(8, 8, 8, 1, 2)["BLOCK_N"] == 8  # the GEMV's tile is clipped too
    rows = [r.max_rows for r in mg.DEFAULT_TABLE]
    assert rows == sorted(rows) and rows[-1] == float("inf")
    # the 1-token rung's unpipelined w2 only where its K loop is as short as where it was measured
    assert mg.moe_config(128, 2048, 768, 1, 8, "w2")["num_stages"] == 1  # Qwen3-30B-A3B: 3 K steps
    assert mg.moe_config(256, 7168, 2048, 1, 8, "w2")["num_stages"] == 3  # DeepSeek-V3: 8 K steps
    assert mg.moe_config(128, 2048, 768, 2, 8, "w2")["num_stages"] == 3  # 2 tokens: the next rung
    with pytest.raises(ValueError, match="gemm must be"):
        mg.moe_config(e, h, i, 1, k, "w3")


@pytest.mark.parametrize("shape", [(128, 768, 2048, 8), (8, 1792, 4096, 2), (64, 1408, 2048, 6)])
def test_tuning_table_records_the_default_table(shape):
    e, i, h, k = shape
    recorded = mg.moe_tuning_table(e, i, h, k, 2048)
    keys = [m for m, _ in mg.parse_tuning(recorded)]
    assert keys[-1] == 2048 and len(keys) <= 2 * len(mg.DEFAULT_TABLE)  # rows, and auto BLOCK_M steps
    for t in range(1, 2049):
        assert mg.pick_configs(recorded, e, i, h, t, k) == mg.pick_configs("", e, i, h, t, k), t
    assert json.loads(recorded)[str(keys[0])]["w13"]["BLOCK_M"] == (1 if 0.25 * e / k >= 1 else 16)


def test_warmup_tokens_cover_every_specialization():
    def signature(t, e, i, h, k, tuning=""):
        return mg.specialization(*mg.pick_configs(tuning, e, i, h, t, k), t, k)

    gemv_table = json.dumps({"3": {"w13": GEMV, "w2": GEMV}, "40": {"w13": SMALL, "w2": SMALL}})
    for e, i, h, k, n, tuning in (
        (128, 768, 2048, 8, 4096, ""),
        (8, 1792, 4096, 2, 256, ""),
        (16, 32, 32, 4, 100, gemv_table),
    ):
        warm = mg.moe_warmup_tokens(e, i, h, k, n, tuning)
        assert warm[0] == 1 and warm == sorted(warm) and warm[-1] <= n
        sigs = [signature(t, e, i, h, k, tuning) for t in warm]
        assert len(set(sigs)) == len(sigs)  # no redundant warm-up run
        assert {signature(t, e, i, h, k, tuning) for t in range(1, n + 1)} == set(sigs)
    assert mg.moe_warmup_tokens(16, 32, 32, 4, 100, gemv_table) == [1, 4, 33]  # GEMV; one / chunked align


def test_recorded_tuning_table_is_used(kernel_on_cpu):
    big = dict(SMALL, BLOCK_M=32, BLOCK_N=64)
    table = json.dumps(
        {"2": {"w13": GEMV, "w2": GEMV}, "4": {"w13": SMALL, "w2": SMALL}, "64": {"w13": big, "w2": big}}
    )
    assert mg.pick_configs(table, 8, 32, 32, 2, 2) == (GEMV, GEMV)
    assert mg.pick_configs(table, 8, 32, 32, 3, 2) == (SMALL, SMALL)
    assert mg.pick_configs(table, 8, 32, 32, 5, 2) == (big, big)
    assert mg.pick_configs(table, 8, 32, 32, 999, 2) == (big, big)  # past the last entry: the last
    for t in (2, 5):  # the GEMV entry, then the grouped GEMM's
        args = make_moe(t, 32, 32, 8, 2, torch.float32, seed=4)
        out = torch.ops.kiln.fused_moe(*args[:5], None, *args[5:], table)
        assert_rel(out, moe.fused_moe_ref(*args[:5], None, *args[5:]), TOL[torch.float32])
    with pytest.raises(ValueError, match="one BLOCK_M"):
        mg.parse_tuning(json.dumps({"4": {"w13": SMALL, "w2": big}}))
    with pytest.raises(ValueError, match="powers of two"):
        mg.parse_tuning(json.dumps({"4": {"w13": dict(GEMV, BLOCK_K=48), "w2": GEMV}}))


# ---- GPU: compiled kernels at Qwen3-30B-A3B and Mixtral sizes -----------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "shape,t",
    [((2048, 768, 128, 8), t) for t in (1, 4, 8, 64, 4096)] + [((4096, 1792, 8, 2), t) for t in (1, 7, 300)],
    ids=[
        "qwen3-30b-a3b-T1",  # decode GEMV
        "qwen3-30b-a3b-T4",  # decode GEMV, some experts hit twice
        "qwen3-30b-a3b-T8",
        "qwen3-30b-a3b-T64",
        "qwen3-30b-a3b-T4096",
        "mixtral-tp8-T1",  # decode GEMV
        "mixtral-tp8-T7",
        "mixtral-tp8-T300",
    ],
)
def test_gpu_fused_moe_matches_reference(compiled_gpu, shape, t, fp8):
    h, i, e, k = shape
    args = make_moe(t, h, i, e, k, torch.bfloat16, fp8=fp8, device="cuda", seed=t)
    cfg = mg.pick_configs("", e, i, h, t, k)
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe.fused_moe_forward(*args[:5], None, *args[5:], "", configs=cfg, out=out)
    assert_rel(out, moe.fused_moe_ref(*args[:5], None, *args[5:]), FP8_TOL if fp8 else TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("w2_group", [1, 8], ids=["w2-per-pair", "w2-topk-sum"])
@pytest.mark.parametrize("t", [1, 3])
def test_gpu_gemv_variants(compiled_gpu, t, w2_group, fp8):
    h, i, e, k = 2048, 768, 128, 8
    args = make_moe(t, h, i, e, k, torch.bfloat16, fp8=fp8, device="cuda", seed=t + w2_group)
    c1 = mg.moe_config(e, 2 * i, h, 1, k, "w13")
    c2 = dict(mg.moe_config(e, h, i, 1, k, "w2"), GROUP_M=w2_group, BLOCK_N=8 if w2_group > 1 else 32)
    assert c1["BLOCK_M"] == c2["BLOCK_M"] == 1
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe.fused_moe_forward(*args[:5], None, *args[5:], "", configs=(c1, c2), out=out)
    assert_rel(out, moe.fused_moe_ref(*args[:5], None, *args[5:]), FP8_TOL if fp8 else TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64])
def test_gpu_residual_matches_a_separate_add(compiled_gpu, t):
    h, i, e, k = 2048, 768, 128, 8
    args = make_moe(t, h, i, e, k, torch.bfloat16, device="cuda", seed=t + 5)
    cfg = mg.pick_configs("", e, i, h, t, k)
    res = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    plain = moe.fused_moe_forward(*args[:5], None, *args[5:], "", configs=cfg)
    out = moe.fused_moe_forward(*args[:5], None, *args[5:], "", configs=cfg, residual=res)
    assert torch.equal(out, moe.add_rounded(plain, res))


@pytest.mark.gpu
def test_gpu_float32_and_cuda_graph_replay(compiled_gpu):
    args = make_moe(16, 256, 128, 32, 4, torch.float32, device="cuda", seed=1)
    assert_rel(
        torch.ops.kiln.fused_moe(*args[:5], None, *args[5:], ""),
        moe.fused_moe_ref(*args[:5], None, *args[5:]),
        TOL[torch.float32],
    )
    for t in (32, 2):  # grouped GEMM, decode GEMV
        x, w13, w2, w, ids, _, _ = make_moe(t, 2048, 768, 128, 8, torch.bfloat16, device="cuda", seed=2)
        torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, "")  # compile outside capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, "")
        for seed in (3, 4):
            nx, _, _, nw, nids, _, _ = make_moe(
                t, 2048, 768, 128, 8, torch.bfloat16, device="cuda", seed=seed
            )
            x.copy_(nx), w.copy_(nw), ids.copy_(nids)
            g.replay()
            assert_rel(out, moe.fused_moe_ref(x, w13, w2, w, ids), TOL[torch.bfloat16])


def _captured_decode_moe(t: int):
    """Qwen3-30B-A3B-shaped decode inputs for ``t`` tokens on the GPU, ``fused_moe`` run once (its
    kernels and counters made outside the capture), then captured: ``(inputs, graph, out)``."""
    x, w13, w2, w, ids, _, _ = make_moe(t, 2048, 768, 128, 8, torch.bfloat16, device="cuda", seed=t)
    torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, "")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, "")
    return (x, w13, w2, w, ids), g, out


def _new_inputs(t: int, seed: int, x, w, ids) -> None:
    """New activations and routing, in place (the captured graph's inputs)."""
    nx, _, _, nw, nids, _, _ = make_moe(t, 2048, 768, 128, 8, torch.bfloat16, device="cuda", seed=seed)
    x.copy_(nx), w.copy_(nw), ids.copy_(nids)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
def test_gpu_sum_last_equals_combine_kernel_under_replay(compiled_gpu, monkeypatch, t):
    """The w2 GEMV's last-arrival top-k sum against the combine kernel, bit for bit, over many
    replays of one captured graph with new inputs each time (an ordering bug would show as a stale
    or partial sum)."""
    counters, no_counters = moe.COUNTERS, _capturing_counters()
    (x, w13, w2, w, ids), g, out = _captured_decode_moe(t)
    for i in range(60):
        _new_inputs(t, 100 + i, x, w, ids)
        monkeypatch.setattr(moe, "COUNTERS", no_counters)  # eager, the combine kernel
        with pytest.warns(UserWarning, match="the combine kernel"):
            ref = torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, "")
        monkeypatch.setattr(moe, "COUNTERS", counters)
        out.fill_(float("nan"))
        g.replay()
        assert torch.equal(out, ref), f"replay {i}"
    assert not counters.buffers[x.device].any(), "the counters are back at zero"
