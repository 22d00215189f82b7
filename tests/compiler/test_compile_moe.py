"""`kiln compile` on tiny random Qwen3-MoE and Mixtral checkpoints reproduces Hugging Face transformers.

float32 on CPU: a prefill of two prompts (32 and 20 tokens) and 4 greedy decode steps; logits max
relative error (max |kiln - hf| / max |hf|) <= 1e-4 at every step. The exported graph calls the
routing and fused-experts ops; the pack holds stacked expert weights under ``layers.{i}.moe.*``.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import check_against_hf, rel_err
from tiny_moe_models import MOE_CONFIGS, make_moe_checkpoint

from kiln.compiler.build import CompileOptions, compile_model
from kiln.runtime.direct import DirectRunner
from kiln.weights import load_pack

OPTS = dict(device="cpu", dtype="float32", max_batch_size=2, max_seq_len=128, chunk_size=64)


@pytest.fixture(scope="module", params=sorted(MOE_CONFIGS))
def compiled(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = make_moe_checkpoint(root / "hf", request.param)
    compile_model(root / "hf", root / "art", CompileOptions(**OPTS), verbose=False)
    return hf, root


def test_prefill_and_decode_match_hf(compiled):
    hf, root = compiled
    runner = DirectRunner(str(root / "art"), device="cpu", num_slots=512)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (32, 20)]
    check_against_hf(runner, hf, prompts, decode_steps=4)


def test_graph_calls_moe_ops_and_pack_stacks_experts(compiled):
    hf, root = compiled
    cfg = hf.config
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    pack = load_pack(root / "art" / "weights", 0, "cpu")
    assert pack["layers.0.moe.w13"].shape == (experts, 2 * inter, cfg.hidden_size)
    assert pack["layers.0.moe.w2"].shape == (experts, cfg.hidden_size, inter)
    assert pack["layers.0.moe.router.weight"].shape == (experts, cfg.hidden_size)
    dense = getattr(cfg, "mlp_only_layers", [])
    for i in dense:  # Qwen3-MoE mlp_only_layers keep the dense MLP
        assert f"layers.{i}.mlp.gate_up.weight" in pack and f"layers.{i}.moe.w13" not in pack
    ep = torch.export.load(root / "art" / "graphs" / "model.pt2")
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    moe_layers = cfg.num_hidden_layers - len(dense)
    assert targets.count("kiln.fused_moe.default") == moe_layers
    assert targets.count("kiln.moe_route.default") == moe_layers  # router linear + top-k, one op


def test_triton_kernels_in_the_graph_match_hf(compiled, monkeypatch):
    """The same artifact with every op running its Triton kernel (interpreter) for a prefill."""
    from kiln.ops.common.launch import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")
    hf, root = compiled
    runner = DirectRunner(str(root / "art"), device="cpu", num_slots=128)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 5)]
    logits = runner.prefill(prompts)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            err = rel_err(logits[i], hf(torch.tensor([p])).logits[0, -1])
            assert err <= 1e-4, f"seq {i}: max rel err {err:.2e}"


def test_triton_decode_gemv_matches_hf(compiled, monkeypatch):
    """One request decoding with every op's Triton kernel (interpreter): T = 1 token takes the
    MoE decode GEMV (no alignment) on these configs, the path a batch-1 decode runs on the GPU.
    One decode step: each interpreted step costs ~10 s here; later steps run the same kernels
    (a decode step reading KV that decode wrote: tests/ops/test_gemv.py)."""
    from kiln.ops.common.launch import interpreting
    from kiln.ops.moe import gemm as moe_gemm

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")
    hf, root = compiled
    c = hf.config
    inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    experts = getattr(c, "num_experts", None) or c.num_local_experts
    w13, w2 = moe_gemm.pick_configs("", experts, inter, c.hidden_size, 1, c.num_experts_per_tok)
    assert w13["BLOCK_M"] == 1 and w2["BLOCK_M"] == 1  # the decode GEMV
    runner = DirectRunner(str(root / "art"), device="cpu", num_slots=128)
    check_against_hf(runner, hf, [[7, 3, 11, 5, 2, 9]], decode_steps=1)


def _blocks():
    """(architecture, HF config, HF MoE block, state dict mapping our names to its tensors)."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    q = transformers.Qwen3MoeConfig(
        hidden_size=32, moe_intermediate_size=24, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    d = transformers.DeepseekV3Config(
        hidden_size=32, moe_intermediate_size=24, n_routed_experts=32, num_experts_per_tok=4, n_group=4,
        topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8,
    )  # fmt: skip
    out = []
    for arch, cfg, block in (
        ("Qwen3MoeForCausalLM", q, Qwen3MoeSparseMoeBlock(q)),
        ("DeepseekV3ForCausalLM", d, DeepseekV3MoE(d)),
    ):
        torch.manual_seed(0)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.2)
        sd = {
            "router.weight": block.gate.weight,
            "w13": block.experts.gate_up_proj,
            "w2": block.experts.down_proj,
        }
        if arch.startswith("Deepseek"):
            block.gate.e_score_correction_bias.copy_(0.1 * torch.randn(32))
            sh = block.shared_experts
            sd |= {
                "router.bias": block.gate.e_score_correction_bias,
                "shared.gate_up.weight": torch.cat([sh.gate_proj.weight, sh.up_proj.weight]),
                "shared.down.weight": sh.down_proj.weight,
            }
        out.append((arch, cfg, block.eval(), sd))
    return out


@pytest.mark.parametrize("which", [0, 1], ids=["qwen3-moe", "deepseek-v3-routing+shared"])
@pytest.mark.parametrize("triton_on_cpu", ["1", "0"], ids=["kernels", "reference"])
def test_moe_layer_exports_and_matches_hf_block(monkeypatch, which, triton_on_cpu):
    from kiln.compiler.config import normalize_config
    from kiln.compiler.moe_layer import FusedMoE
    from kiln.ops.common.launch import interpreting

    if triton_on_cpu == "1" and not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", triton_on_cpu)
    arch, hf_cfg, block, sd = _blocks()[which]
    # as DeepSeek-V3's config.json (transformers' config class leaves these out)
    extra = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"} if arch.startswith("Deepseek") else {}
    cfg = normalize_config(hf_cfg.to_dict() | {"architectures": [arch]} | extra)
    layer = FusedMoE(cfg, torch.float32)
    layer.load_state_dict({k: v.detach() for k, v in sd.items()}, strict=True)
    t = torch.export.Dim("T", min=1, max=512)
    ep = torch.export.export(layer, (torch.randn(3, 32),), dynamic_shapes=({0: t},), strict=False)
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert {torch.ops.kiln.moe_route.default, torch.ops.kiln.fused_moe.default} <= targets
    for t in (11, 1):  # 1 token: the decode router (the router GEMV, then the top-k kernel)
        x = torch.randn(t, 32)
        with torch.no_grad():
            ref = block(x[None])[0]
            out = ep.module()(x)
        assert rel_err(out, ref) <= 1e-5, t


def test_fp8_artifact_kernels_match_reference_path(tmp_path, monkeypatch):
    """``--quant fp8``: FP8 experts with per-channel scales in the pack; the graph's Triton kernels
    (interpreter) agree with the ops' reference path, and both stay near the float32 model."""
    from kiln.ops.common.launch import interpreting
    from kiln.ops.common.quant import FP8_DTYPE

    hf = make_moe_checkpoint(tmp_path / "hf", "qwen3-moe")
    compile_model(tmp_path / "hf", tmp_path / "art", CompileOptions(**OPTS, quant="fp8"), verbose=False)
    pack = load_pack(tmp_path / "art" / "weights", 0, "cpu")
    assert pack["layers.0.moe.w13"].dtype == FP8_DTYPE and pack["layers.0.moe.w13_scale"].shape == (16, 96)
    assert pack["layers.0.moe.w2_scale"].shape == (16, 64)
    prompts = [list(range(5, 10)), list(range(40, 43))]  # short: the interpreter runs every kernel below
    ref_path = DirectRunner(str(tmp_path / "art"), device="cpu", num_slots=128).prefill(prompts)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            assert rel_err(ref_path[i], hf(torch.tensor([p])).logits[0, -1]) < 0.3  # FP8 vs float32
    if not interpreting():
        return
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")
    kernels = DirectRunner(str(tmp_path / "art"), device="cpu", num_slots=128).prefill(prompts)
    assert rel_err(kernels, ref_path) < 2e-2


def test_artifact_records_the_moe_table_its_graphs_use(compiled):
    import ast
    import json

    from kiln.ops.moe import gemm as mg

    hf, root = compiled
    manifest = json.loads((root / "art" / "manifest.json").read_text())
    moe = manifest["kernel_choices"]["moe"]
    assert moe["backend"] == "triton" and moe["method"] == "default"  # CPU: nothing to time
    cfg = hf.config
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    table = json.dumps(moe["table"])
    assert moe["table"] == json.loads(
        mg.moe_tuning_table(experts, inter, cfg.hidden_size, cfg.num_experts_per_tok, OPTS["chunk_size"])
    )
    for t in (1, 5, 64):  # the recorded table gives the op's own choice at every size
        assert mg.pick_configs(table, experts, inter, cfg.hidden_size, t, cfg.num_experts_per_tok) == (
            mg.pick_configs("", experts, inter, cfg.hidden_size, t, cfg.num_experts_per_tok)
        )
    src = (root / "art" / "graphs" / "model.py").read_text()
    calls = [ln for ln in src.splitlines() if "torch.ops.kiln.fused_moe.default(" in ln]
    assert calls
    for ln in calls:  # the recorded table, as the call's constant tuning argument
        call = ast.parse(ln.strip().split(";")[0]).body[0].value
        assert json.loads(call.args[8].value) == moe["table"]


def test_tuner_records_the_fastest_candidate_per_rung():
    from kiln.compiler.moe_tune import MoEShape, candidates, tune
    from kiln.ops.moe import gemm as mg

    s = MoEShape(num_experts=16, inter=64, hidden=128, top_k=2)
    picked = {}

    def fake_time(tokens, pair):  # the last candidate is fastest; one candidate cannot run
        cands = candidates(s, tokens)
        i = cands.index(pair)
        if i == 1:
            raise RuntimeError("out of shared memory")
        picked[tokens] = cands[-1]
        return 1.0 - 0.01 * i

    table, report = tune(s, 40, fake_time, ladder=(1, 4, 16, 64))
    parsed = mg.parse_tuning(table)
    assert [m for m, _ in parsed] == [1, 4, 16, 40]  # rungs below max_tokens, then max_tokens
    for m, entry in parsed:
        assert (entry["w13"], entry["w2"]) == picked[m]
        c1, c2 = mg.pick_configs(table, 16, 64, 128, m, 2)
        assert c1["BLOCK_M"] == c2["BLOCK_M"] == candidates(s, m)[0][0]["BLOCK_M"]
    assert any("skipped" in r for r in report) and all(len(candidates(s, t)) > 2 for t in (1, 40))
    with pytest.raises(RuntimeError, match="no candidate"):
        tune(s, 4, lambda t, p: (_ for _ in ()).throw(RuntimeError("x")), ladder=(1,))
